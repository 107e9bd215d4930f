"""Incremental detokenization and stop-string checks, one `IncrementalDetokenizer` per sequence.

Text is produced the way TGI and vLLM's slow path do it: each new token is decoded together with
a few tokens before it, and only the text beyond what those earlier tokens decode to is emitted:

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])            # after appending the new token
    emit new_text[len(prefix_text):]; prefix_offset, read_offset = read_offset, len(ids)

Decoding a window rather than one token keeps what depends on context right (a leading space
that SentencePiece decoders drop at the start of a text, bytes of one UTF-8 character spread
over several byte-level tokens). While `new_text` ends in U+FFFD the character may still be
incomplete, so nothing is emitted and the offsets stay, until a later token completes it.
This works with any transformers tokenizer, since it only calls `decode`.
"""

from __future__ import annotations

import weakref
from typing import Any

from pyorch.sampling_params import SamplingParams

# Tokens of the prompt's tail decoded as context before the first output token (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"

_added_token_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _get_added_token_ids(tokenizer: Any) -> frozenset[int]:
    try:
        return _added_token_ids[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = frozenset(tokenizer.get_added_vocab().values())
    try:
        _added_token_ids[tokenizer] = ids
    except TypeError:  # not weak-referenceable: just don't cache
        pass
    return ids


_one_token_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _get_one_token_texts(tokenizer: Any, skip_special_tokens: bool) -> dict[int, str]:
    """token id -> decode([token id]) of a tokenizer (one dict per skip_special_tokens), shared
    by its detokenizers; a tokenizer that cannot be weakly referenced gets a private dict."""
    try:
        per_flag = _one_token_texts.setdefault(tokenizer, {})
    except TypeError:
        return {}
    return per_flag.setdefault(skip_special_tokens, {})


def _backend_decoder(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast transformers tokenizer, or None.

    With clean_up_tokenization_spaces=False a fast tokenizer's `decode` is exactly the backend's
    `decode` after argument normalisation that costs several times the decode itself; calling the
    backend directly keeps detokenization (two decodes per generated token) off the step's
    critical path. Slow (Python) tokenizers keep going through `decode`.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers requires tokenizers
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends within the last `new_char_count` characters.

    Returns (stop string, length to truncate the text to; -1 = keep it all), or None. When
    several match, the one that starts first wins (ties: the first listed).
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        # Only the new text and the len(stop_str) - 1 characters before it can hold a new match.
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    if include_in_output:
        index += len(stop_str)
        if index >= len(output_text):
            return stop_str, -1
    return stop_str, index


class IncrementalDetokenizer:
    """Detokenizes one output sequence step by step and checks its stop strings.

    Parameters
    ----------
    tokenizer: any transformers tokenizer; None (or params.detokenize=False) keeps ids only.
    prompt_token_ids: the request's prompt, used as decoding context for the first tokens.
    params: the request's SamplingParams (stop, include_stop_str_in_output, min_tokens,
        skip_special_tokens, spaces_between_special_tokens).

    `spaces_between_special_tokens`: True keeps the decoder's own output (vLLM's fast-tokenizer
    path); False decodes each added token apart from its neighbours and concatenates the pieces,
    so no separator a decoder (e.g. WordPiece) puts around them appears. Byte-level BPE and
    SentencePiece decoders put none, so for them the flag changes nothing, as in vLLM.
    """

    def __init__(
        self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_text = ""
        assert isinstance(params.stop, list)
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        # Skipped special tokens leave nothing to put spaces between (vLLM's rule).
        self.spaces_between_special_tokens = (
            params.skip_special_tokens or params.spaces_between_special_tokens
        )
        self.prefix_offset = max(
            self.num_prompt_tokens - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0
        )
        self.read_offset = self.num_prompt_tokens
        # While streaming, hold back text that could be the start of a stop string.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self._last_output_text_offset = 0
        self._added_ids: frozenset[int] = frozenset()
        if self.tokenizer is not None and not self.spaces_between_special_tokens:
            self._added_ids = _get_added_token_ids(self.tokenizer)
        self._backend = _backend_decoder(self.tokenizer)
        self._one_token_texts: dict[int, str] = (
            {} if self.tokenizer is None
            else _get_one_token_texts(self.tokenizer, self.skip_special_tokens)
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add one step's tokens; return the stop string matched, if any (then the text is
        already truncated and the caller finishes the request with stop_reason = it).

        stop_terminated: the last token is EOS or a stop token id; unless stop strings are kept
        in the output its text is not added, as in vLLM.
        """
        if not new_token_ids:
            return None
        if not self.stop and not stop_terminated and len(new_token_ids) == 1:
            # The usual step (one token, no stop strings to look for): the loop below, unrolled.
            self.token_ids.append(new_token_ids[0])
            if self.tokenizer is not None:
                self.output_text += self._decode_next()
            return None
        skipped_stop_token_id = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            if self.tokenizer is not None:
                self.output_text += self._decode_next()
            # Text made before min_tokens are reached cannot stop the sequence.
            if self.min_tokens and self.num_output_tokens() <= self.min_tokens:
                stop_check_offset = len(self.output_text)
        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)

        if not self.stop or self.num_output_tokens() <= self.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report: all of it, or (delta) what was not reported yet. Until the
        sequence finishes, the last `stop_buffer_length` characters are held back."""
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[:length] if buffer_length else self.output_text
        last_offset = self._last_output_text_offset
        if last_offset < length:
            self._last_output_text_offset = length
            return self.output_text[last_offset:length]
        return ""

    def _decode_next(self) -> str:
        ids, start, read = self.token_ids, self.prefix_offset, self.read_offset
        if self._added_ids:
            prefix_text = self._decode(ids[start:read])
            new_text = self._decode(ids[start:])
        else:  # what _decode does without added ids, minus its checks: once per token
            prefix_text = (self._decode_one(ids[start]) if read - start == 1
                           else self._decode_plain(ids[start:read]) if read > start else "")
            new_text = self._decode_plain(ids[start:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet, or a multi-byte character still incomplete: wait.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if not self._added_ids or self._added_ids.isdisjoint(token_ids):
            if len(token_ids) == 1:
                return self._decode_one(token_ids[0])
            return self._decode_plain(token_ids)
        # Decode runs of ordinary tokens and each added token separately, then concatenate.
        pieces: list[str] = []
        run: list[int] = []
        for token_id in [*token_ids, None]:
            if token_id is None or token_id in self._added_ids:
                if run:
                    pieces.append(self._decode_plain(run))
                    run = []
                if token_id is not None:
                    pieces.append(self._decode_plain([token_id]))
            else:
                run.append(token_id)
        return "".join(pieces)

    def _decode_one(self, token_id: int) -> str:
        # After each emitted token the prefix window is that one token: its text is cached.
        text = self._one_token_texts.get(token_id)
        if text is None:
            text = self._one_token_texts[token_id] = self._decode_plain([token_id])
        return text

    def _decode_plain(self, token_ids: list[int]) -> str:
        assert self.tokenizer is not None
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
