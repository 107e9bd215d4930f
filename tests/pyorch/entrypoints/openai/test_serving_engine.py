"""serving_engine.py helpers of the streaming hot path (issue 24) and request logging:
TextChunks writes exactly what sse() writes, the single-prompt generate_many aborts its engine
request when closed early, and --enable-log-requests / --max-log-len behave as vLLM's."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any, AsyncGenerator

import pytest

from pyorch.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServerContext,
    TextChunks,
    sse,
)
from pyorch.sampling_params import RequestOutputKind, SamplingParams

TEXTS = ["", " t1", "héllo wörld", 'quote " and \\ backslash', "new\nline\ttab\r",
         "\x00\x01\x1f control", "emoji \U0001f600 and \u2028 separator", "日本語", "\ud7ff"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 3, 17])
def test_completion_text_chunk_is_what_sse_writes(text, index):
    head = {"id": "cmpl-ä\"x", "object": "text_completion", "created": 1700000000,
            "model": "org/model \u00e9"}
    chunks = TextChunks(head, '{"index":{index},"text":',
                        ',"logprobs":null,"finish_reason":null,"stop_reason":null}')
    body = {**head, "choices": [{"index": index, "text": text, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}]}
    assert chunks.chunk(index, text) == sse(body)
    assert json.loads(chunks.chunk(index, text)[len("data: "):])["choices"][0]["text"] == text


@pytest.mark.parametrize("text", TEXTS)
def test_chat_text_chunk_is_what_sse_writes(text):
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
            "model": "m"}
    chunks = TextChunks(head, '{"index":{index},"delta":{"content":',
                        '},"logprobs":null,"finish_reason":null}')
    for index in (0, 1, 0):  # the per-choice prefix is made once, then reused
        body = {**head, "choices": [{"index": index, "delta": {"content": text},
                                     "logprobs": None, "finish_reason": None}]}
        assert chunks.chunk(index, text) == sse(body)


class _Engine:
    """generate() streams `n` outputs and records whether its generator was closed early."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.closed_early: list[str] = []
        self.errored = False

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncGenerator[Any, None]:
        finished = False
        try:
            for i in range(self.n):
                await asyncio.sleep(0)
                finished = i == self.n - 1
                yield SimpleNamespace(request_id=request_id, step=i)
        finally:
            if not finished:
                self.closed_early.append(request_id)


def _serving(engine: Any, **fields: Any) -> OpenAIServing:
    ctx = ServerContext(engine=engine, served_model_names=["m"], max_model_len=64,
                        vocab_size=100, tokenizer=None, **fields)
    return OpenAIServing(ctx)


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_generate_many_streams_all_and_closing_early_aborts(num_prompts):
    async def run() -> tuple[list, list, list]:
        engine = _Engine(4)
        serving = _serving(engine)
        prompts = [{"prompt_token_ids": [1, 2]}] * num_prompts
        full = [(i, o.step) async for i, o in serving.generate_many(prompts, SamplingParams(),
                                                                     "r")]
        gen = serving.generate_many(prompts, SamplingParams(), "s")
        first = await gen.__anext__()
        await gen.aclose()
        for _ in range(5):  # the multi-prompt path closes its pump tasks in the background
            await asyncio.sleep(0)
        return full, [first], engine.closed_early

    full, first, closed = asyncio.run(run())
    assert sorted(full) == [(i, s) for i in range(num_prompts) for s in range(4)]
    assert first[0][1].step == 0
    expected = ["s"] if num_prompts == 1 else [f"s-{i}" for i in range(num_prompts)]
    assert sorted(closed) == expected


def _params() -> SamplingParams:
    params = SamplingParams(max_tokens=7)
    params.output_kind = RequestOutputKind.DELTA
    return params


def test_requests_are_not_logged_by_default(caplog):
    serving = _serving(_Engine(1))
    with caplog.at_level(logging.DEBUG, logger="pyorch.entrypoints.openai"):
        serving.log_request("cmpl-1", "a secret prompt", 3, _params())
    assert not caplog.records


@pytest.mark.parametrize("max_log_len, prompt, shown", [
    (None, "a secret prompt", "'a secret prompt'"),
    (4, "a secret prompt", "'a se'"),
    (0, "a secret prompt", "''"),
    (2, [11, 12, 13], "[11, 12]"),
])
def test_enable_log_requests_logs_params_at_info_and_prompt_at_debug(caplog, max_log_len,
                                                                      prompt, shown):
    serving = _serving(_Engine(1), log_requests=True, max_log_len=max_log_len)
    with caplog.at_level(logging.INFO, logger="pyorch.entrypoints.openai"):
        serving.log_request("cmpl-1", prompt, 3, _params())
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    info = caplog.records[0].getMessage()
    assert "cmpl-1" in info and "max_tokens=7" in info and "stream=True" in info
    assert "secret" not in info and "11" not in info  # prompts only at DEBUG, as in vLLM
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="pyorch.entrypoints.openai"):
        serving.log_request("cmpl-1", prompt, 3, _params())
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]
    assert caplog.records[1].getMessage() == f"request cmpl-1: prompt: {shown}"
