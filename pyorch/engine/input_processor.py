"""InputProcessor: turns a user prompt + SamplingParams into prompt token ids, or raises.

Both front ends (the in-process `LLMEngine` and the serving `AsyncLLM`) validate a request here,
before anything is queued, so that a bad request raises ValueError/TypeError in the caller and
never reaches the engine core. `check_prompt` is the one home of the prompt rules: the OpenAI
server calls it too (turning its ValueError into a 400), and the scheduler only asserts them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

from pyorch.config import EngineConfig
from pyorch.pooling_params import PoolingParams
from pyorch.sampling_params import SamplingParams
from pyorch.structured_output.backend_xgrammar import validate_structured_outputs

PromptType = Union[str, list[int], dict]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (ModelConfig.max_logprobs sets the cap)


def check_token_ids(token_ids: list[int], vocab_size: int, what: str = "prompt token ids") -> None:
    """Raises ValueError unless every id is in [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} out of range [0, {vocab_size}): {bad[:5]}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str = "prompt") -> None:
    """Raises ValueError if `text` cannot be encoded as UTF-8 (a lone UTF-16 surrogate such as
    JSON's "\\ud800"): no tokenizer can encode it and no model output can match it."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise ValueError(f"{what} contains a lone UTF-16 surrogate (U+{ord(match.group()):04X} "
                         f"at character {match.start()}), which is not valid Unicode text")


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """K, the most input characters one token can stand for, when the tokenizer guarantees it:
    then a text of more than `max_model_len * K` characters encodes to more than max_model_len
    tokens, and `check_prompt_text` can refuse it without encoding it.

    Proven only for fast tokenizers without a normalizer whose BPE model runs on a byte-level
    pre-tokenizer (GPT-2, Llama 3, SmolLM2, ...): every input character is at least one byte,
    every byte lands in exactly one token, a vocabulary token holds at most len(token) bytes,
    and an added (special) token matched in the text covers len(content) characters. Any
    other tokenizer (a normalizer may delete or merge characters, an [UNK] may swallow a word)
    gets None: its prompts are always tokenized in full."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return None
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if (spec.get("normalizer") is not None or spec.get("model", {}).get("type") != "BPE"
            or not any(p.get("type") == "ByteLevel" for p in pres)):
        return None
    longest = max((len(t) for t in spec["model"].get("vocab", {})), default=0)
    for added in spec.get("added_tokens") or []:
        longest = max(longest, len(added.get("content", "")))
    return longest or None


def check_prompt_text(text: str, max_model_len: int, chars_per_token: Optional[int],
                      what: str = "prompt") -> None:
    """The cheap rules for a prompt text, before it is tokenized: valid Unicode, and not so
    long that it cannot fit (`max_chars_per_token`). The length first: it costs O(1), while
    the Unicode check scans the text (in C, no encoding)."""
    if chars_per_token is not None and len(text) > max_model_len * chars_per_token:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, the text "
            f"of `{what}` is {len(text)} characters long, more than {max_model_len} tokens x "
            f"{chars_per_token} characters (the tokenizer's longest token) could hold.")
    check_text(text, what)


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The prompt rules, for every front end: not empty, ids in the vocabulary, not longer than
    max_model_len (OpenAI's wording, which clients parse). A prompt that passes also fits the KV
    cache: the scheduler refuses to start with a cache smaller than max_model_len."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    check_token_ids(token_ids, vocab_size)
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt is {len(token_ids)} tokens long.")


def check_num_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """vLLM's rule: logprobs and prompt_logprobs (-1 = the whole vocabulary) may not exceed
    max_logprobs (-1 = no cap)."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        if value < -1:
            raise ValueError(f"{name}={value} must be >= 0, or -1 for the whole vocabulary")
        asked = vocab_size if value == -1 else value
        if asked > cap:
            raise ValueError(f"Requested {name} of {asked}, which is greater than max allowed: "
                             f"{cap} (max_logprobs; the server's --max-logprobs)")


class InputProcessor:
    """Tokenizes and validates requests.

    Parameters
    ----------
    config: the engine config (vocab size, max_model_len, scheduling policy).
    tokenizer: None with skip_tokenizer_init (token-id prompts only).
    """

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.chars_per_token = None if tokenizer is None else max_chars_per_token(tokenizer)

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, prompt token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            check_prompt_text(prompt, self.config.scheduler_config.max_model_len,
                              self.chars_per_token)
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    def process(self, prompt: PromptType, params: Optional[SamplingParams],
                priority: int = 0) -> tuple[Optional[str], list[int], SamplingParams]:
        """Validates a request; returns (prompt text, prompt token ids, params)."""
        if self.config.model_config.is_pooling:
            raise ValueError("generation is only supported for generative models; this one "
                             "runs with runner='pooling' (use embed/encode/score, or serve it "
                             "with runner='generate')")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}")
        prompt_text, token_ids = self.tokenize(prompt)
        vocab = self.config.model_config.vocab_size
        check_prompt(token_ids, vocab, self.config.scheduler_config.max_model_len)
        check_num_logprobs(params, self.config.model_config.max_logprobs, vocab)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True)")
        if self.config.scheduler_config.policy != "priority" and priority != 0:
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        params.validate_token_ids(vocab)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True)")
            # A bad schema, regex or grammar fails here (xgrammar's reason), not in the core.
            validate_structured_outputs(params.structured_outputs)
        return prompt_text, token_ids, params

    def process_pooling(self, prompt: PromptType, params: Optional[PoolingParams],
                        priority: int = 0) -> tuple[Optional[str], list[int], PoolingParams]:
        """Validates a pooling request; returns (prompt text, prompt token ids, the params with
        every field resolved against the engine's PoolerConfig)."""
        mc = self.config.model_config
        if not mc.is_pooling or mc.pooler_config is None:
            raise ValueError("this model is a generative model (runner='generate'): embed, "
                             "encode and score need runner='pooling' (or convert='embed')")
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise TypeError("pooling_params must be a PoolingParams")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if self.config.scheduler_config.policy != "priority" and priority != 0:
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        resolved = params.resolve(mc.pooler_config, int(mc.hf_config.hidden_size), mc.hf_config)
        prompt_text, token_ids = self.tokenize(prompt)
        check_prompt(token_ids, mc.vocab_size, self.config.scheduler_config.max_model_len)
        return prompt_text, token_ids, resolved

    def eos_token_id(self) -> Optional[int]:
        """The tokenizer's EOS id, else the model config's (first one if it lists several)."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.config.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos
