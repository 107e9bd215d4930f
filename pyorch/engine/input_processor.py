"""InputProcessor: turns a user prompt + SamplingParams into prompt token ids, or raises.

Both front ends (the in-process `LLMEngine` and the serving `AsyncLLM`) validate a request here,
before anything is queued, so that a bad request raises ValueError/TypeError in the caller and
never reaches the engine core. `check_prompt` is the one home of the prompt rules: the OpenAI
server calls it too (turning its ValueError into a 400), and the scheduler only asserts them.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pyorch.config import EngineConfig
from pyorch.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def check_token_ids(token_ids: list[int], vocab_size: int, what: str = "prompt token ids") -> None:
    """Raises ValueError unless every id is in [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} out of range [0, {vocab_size}): {bad[:5]}")


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
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")

    def process(self, prompt: PromptType, params: Optional[SamplingParams],
                priority: int = 0) -> tuple[Optional[str], list[int], SamplingParams]:
        """Validates a request; returns (prompt text, prompt token ids, params)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {priority!r}")
        prompt_text, token_ids = self.tokenize(prompt)
        vocab = self.config.model_config.vocab_size
        check_prompt(token_ids, vocab, self.config.scheduler_config.max_model_len)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name}={value} is outside [0, {MAX_LOGPROBS}] (max_logprobs)")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True)")
        if self.config.scheduler_config.policy != "priority" and priority != 0:
            raise ValueError("priority is only supported with scheduling_policy='priority'")
        params.validate_token_ids(vocab)
        return prompt_text, token_ids, params

    def eos_token_id(self) -> Optional[int]:
        """The tokenizer's EOS id, else the model config's (first one if it lists several)."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.config.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos
