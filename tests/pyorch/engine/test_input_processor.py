"""The prompt rules (pyorch.engine.input_processor.check_prompt), the one place every front end
takes them from, and InputProcessor.process's use of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pyorch.engine.input_processor import (
    InputProcessor,
    check_num_logprobs,
    check_prompt,
    check_token_ids,
)
from pyorch.sampling_params import SamplingParams


def test_check_prompt_rules():
    check_prompt([0, 5, 99], vocab_size=100, max_model_len=3)
    with pytest.raises(ValueError, match="the prompt is empty"):
        check_prompt([], vocab_size=100, max_model_len=3)
    with pytest.raises(ValueError, match=r"prompt token ids out of range \[0, 100\): \[100, -1\]"):
        check_prompt([1, 100, -1], vocab_size=100, max_model_len=8)
    with pytest.raises(ValueError, match="maximum context length is 3 tokens. However, your "
                                         "prompt is 4 tokens long"):
        check_prompt([1, 2, 3, 4], vocab_size=100, max_model_len=3)
    with pytest.raises(ValueError, match=r"token ids out of range \[0, 10\): \[10\]"):
        check_token_ids([10], 10, "token ids")


def _processor(max_model_len: int = 4, vocab_size: int = 50) -> InputProcessor:
    config = SimpleNamespace(
        model_config=SimpleNamespace(vocab_size=vocab_size, hf_config=None, max_logprobs=20,
                                     is_pooling=False),
        scheduler_config=SimpleNamespace(max_model_len=max_model_len, policy="fcfs"))
    return InputProcessor(config, tokenizer=None)  # type: ignore[arg-type]


def test_process_applies_the_prompt_rules():
    proc = _processor()
    text, ids, params = proc.process([1, 2, 3], SamplingParams(max_tokens=1))
    assert (text, ids, params.max_tokens) == (None, [1, 2, 3], 1)
    for prompt, match in (([], "empty"), ([1, 50], "out of range"),
                          ([1, 2, 3, 4, 5], "maximum context length is 4")):
        with pytest.raises(ValueError, match=match):
            proc.process(prompt, SamplingParams())


def test_check_num_logprobs_follows_max_logprobs():
    check_num_logprobs(SamplingParams(logprobs=5, prompt_logprobs=5), 5, vocab_size=50)
    for params in (SamplingParams(logprobs=6), SamplingParams(prompt_logprobs=6),
                   SamplingParams(logprobs=-1)):  # -1: the whole vocabulary, 50 > 5
        with pytest.raises(ValueError, match="greater than max allowed: 5"):
            check_num_logprobs(params, 5, vocab_size=50)
    check_num_logprobs(SamplingParams(logprobs=-1, prompt_logprobs=50), -1, vocab_size=50)
    with pytest.raises(ValueError, match="greater than max allowed: 50"):
        check_num_logprobs(SamplingParams(logprobs=51), -1, vocab_size=50)
    with pytest.raises(ValueError, match=r"max allowed: 20 \(max_logprobs"):
        _processor().process([1], SamplingParams(logprobs=21))
