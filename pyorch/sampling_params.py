"""Sampling parameters for text generation: vLLM's `SamplingParams` (names, defaults, meaning)."""

from __future__ import annotations

import copy
import enum
import logging
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger(__name__)

# Temperatures below this are greedy; a positive temperature below _MAX_TEMP is raised to it,
# because dividing logits by a tiny temperature overflows (vLLM's constants).
_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
# OpenAI clamps logit_bias values to this range; vLLM does the same.
_MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What a streaming front end yields per request (vLLM's names and values)."""

    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's `StructuredOutputsParams`): exactly one of

    json: a JSON schema (dict or JSON string) the output must match.
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: an EBNF (GBNF) grammar the output must match.
    json_object: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    structural_tag: xgrammar's structural tag (a JSON string).

    disable_any_whitespace: JSON without free whitespace between tokens.
    disable_additional_properties: JSON schemas without `additionalProperties` get it as false.
    whitespace_pattern: accepted for vLLM compatibility; only the default (None) is supported.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}."
            )
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (dict or string).")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported "
                             "(xgrammar has no custom whitespace pattern).")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class SamplingParams:
    """Sampling parameters for text generation.

    Follows the OpenAI text-completion API the way vLLM does. Validation happens in
    `__post_init__` and raises `ValueError` with a message naming the bad field.

    Parameters
    ----------
    n: number of output sequences for the prompt.
    presence_penalty: > 0 encourages new tokens, by whether they appear in the generated text.
    frequency_penalty: > 0 encourages new tokens, by how often they appear in the generated text.
    repetition_penalty: > 1 encourages new tokens, by whether they appear in the prompt or the
        generated text (positive logits are divided by it, negative ones multiplied).
    temperature: 0 means greedy sampling.
    top_p: cumulative probability of the top tokens kept, in (0, 1]; 1 keeps all.
    top_k: number of top tokens kept; 0 or -1 keeps all.
    min_p: minimum probability of a token, relative to the most likely one; 0 disables.
    seed: per-request random seed; the same seed gives the same output whatever the batch.
    stop: string(s) that stop generation; not included in the output unless
        `include_stop_str_in_output`.
    stop_token_ids: token ids that stop generation.
    bad_words: words whose last token is blocked when the earlier tokens match the output.
    ignore_eos: keep generating after the EOS token.
    max_tokens: maximum number of generated tokens per output sequence.
    min_tokens: minimum number of generated tokens before EOS / stop_token_ids may be produced.
    logprobs: number of log probabilities per output token, besides the sampled token's; -1 means
        the whole vocabulary.
    prompt_logprobs: number of log probabilities per prompt token; -1 means the whole vocabulary.
    detokenize: whether to detokenize the output.
    skip_special_tokens: whether to drop special tokens from the output text.
    spaces_between_special_tokens: whether to keep the spaces a tokenizer's decoder puts around
        added (special) tokens (see pyorch.engine.detokenizer).
    include_stop_str_in_output: whether to keep the matched stop string in the output text.
    logit_bias: token id -> bias added to its logit (clamped to [-100, 100]).
    allowed_token_ids: if set, only these tokens can be generated.
    structured_outputs: StructuredOutputsParams (or a dict of its fields) constraining the output.
    output_kind: RequestOutputKind: cumulative outputs (default), deltas, or only the final one.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    # Filled by the engine (update_from_generation_config / update_from_tokenizer).
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs mean nothing; reset them so the sampler can skip them.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        elif self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is below %s and is raised to it to avoid overflow",
                self.temperature,
                _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP
        self._all_stop_token_ids = set(self.stop_token_ids or [])

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop)}.")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.bad_words = [] if self.bad_words is None else list(self.bad_words)
        if self.seed == -1:  # OpenAI clients send -1 for "no seed"
            self.seed = None
        if isinstance(self.logprobs, bool):  # logprobs=True means one logprob, as in vLLM
            self.logprobs = 1 if self.logprobs else None
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        if self.logit_bias is not None:
            # Keys may be strings (OpenAI's JSON); values are clamped like OpenAI does.
            try:
                self.logit_bias = {
                    int(token_id): min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(bias)))
                    for token_id, bias in self.logit_bias.items()
                }
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}."
                ) from e
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError as e:
            raise ValueError(
                f"output_kind must be a RequestOutputKind (0, 1 or 2), got {self.output_kind!r}."
            ) from e

    def _verify_args(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or (value < 0 and value != -1)):
                raise ValueError(f"{name} must be non-negative or -1 (whole vocab), got {value!r}.")
        assert isinstance(self.stop, list)
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must contain only strings, got {self.stop!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True.")
        assert isinstance(self.stop_token_ids, list)
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                "stop_token_ids must contain only non-negative integers, "
                f"got {self.stop_token_ids}."
            )
        assert isinstance(self.bad_words, list)
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}.")
        if self.logit_bias is not None and any(t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias keys must be non-negative token ids.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty.")
            if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError(
                    "allowed_token_ids must contain only non-negative integers, "
                    f"got {self.allowed_token_ids}."
                )

    # ---- engine-side helpers ------------------------------------------------------------------

    def validate_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if a token id in the params is outside the model's vocabulary."""
        checks = {
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
            "stop_token_ids": self.stop_token_ids or [],
        }
        for name, ids in checks.items():
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has out-of-vocab token ids {bad} (vocab_size={vocab_size})."
                )

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Record EOS ids: the model's EOS and any extra `eos_token_id`s from generation_config.

        Extra EOS ids become stop_token_ids (unless ignore_eos), as in vLLM.
        """
        if model_eos_token_id is not None and not self.ignore_eos:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None or self.ignore_eos:
            return
        extra = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        extra.discard(model_eos_token_id)
        if extra:
            self._all_stop_token_ids.update(extra)
            assert self.stop_token_ids is not None
            self.stop_token_ids = sorted(extra | set(self.stop_token_ids))

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words`, each with and without a leading space (vLLM's rule)."""
        if not self.bad_words:
            return
        token_ids: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            token_ids.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            # Only a distinct word-start token of the same length is a separate bad word.
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        self._bad_words_token_ids = token_ids

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus EOS (unless ignore_eos): suppressed until min_tokens are made."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token-id sequences of bad_words; None until update_from_tokenizer ran."""
        return self._bad_words_token_ids

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (for the engine-core wire): the constructor's fields plus what the
        engine filled in (stop ids, bad-word ids). `from_dict` rebuilds an equal object."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        d["output_kind"] = int(self.output_kind)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        d["all_stop_token_ids"] = sorted(self._all_stop_token_ids)
        d["bad_words_token_ids"] = self._bad_words_token_ids
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Inverse of `to_dict` (validates the fields again, as the constructor always does)."""
        d = dict(d)
        all_stop_token_ids = d.pop("all_stop_token_ids")
        bad_words_token_ids = d.pop("bad_words_token_ids")
        params = cls(**d)
        params._all_stop_token_ids = set(all_stop_token_ids)
        params._bad_words_token_ids = bad_words_token_ids
        return params

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def clone(self) -> SamplingParams:
        """A deep copy (the engine mutates stop ids; callers may reuse one params object).

        Fields hold scalars or flat containers of scalars once normalized: those are copied by
        hand, anything else by copy.deepcopy. (A deepcopy of the whole object took most of the
        time of adding a request, and a request clones its params twice.)"""
        clone = copy.copy(self)
        for name, value in vars(self).items():
            if type(value) not in _SCALAR_TYPES:
                setattr(clone, name, _copy_value(value))
        return clone


_SCALAR_TYPES = frozenset({int, float, str, bool, type(None), RequestOutputKind})


def _copy_value(value: Any) -> Any:
    """A deep copy of a field's value: lists, sets and dicts of scalars directly."""
    kind = type(value)
    if kind in (list, set) and all(type(x) in _SCALAR_TYPES for x in value):
        return kind(value)
    if kind is dict and all(type(k) in _SCALAR_TYPES and type(v) in _SCALAR_TYPES
                            for k, v in value.items()):
        return dict(value)
    if kind is list and all(type(x) is list for x in value):  # token ids of bad words
        return [_copy_value(x) for x in value]
    return copy.deepcopy(value)
