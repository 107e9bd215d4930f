"""AsyncLLM against a real engine-core process (tiny random-weight Llama, CPU).

One engine per module serves the behaviour tests; the failure tests (SIGKILL, a step that
raises, shutdown, parent death) each start their own engine. Every await has a timeout, so a
hang fails the test instead of the CI job.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pyorch import LLM, SamplingParams
from pyorch.engine.arg_utils import EngineArgs
from pyorch.engine.async_llm import AsyncLLM
from pyorch.engine.exceptions import EngineDeadError
from pyorch.metrics.stats import StatLoggerBase
from pyorch.sampling_params import RequestOutputKind

transformers = pytest.importorskip("transformers")

TIMEOUT_S = 60.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3,",
           "Once upon a time, in a small village by the sea, there lived"]


def make_tiny_model(path, vocab_size: int = 512, tokenizer=None) -> str:
    """A 2-layer random Llama saved as safetensors (+ the tokenizer, when given)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


def engine_args(path: str, **kwargs) -> EngineArgs:
    args = dict(model=path, dtype=torch.float32, max_model_len=512, seed=0, device="cpu",
                kv_cache_memory_bytes=16 << 20)
    args.update(kwargs)
    return EngineArgs(**args)


class RecordingLogger(StatLoggerBase):
    def __init__(self) -> None:
        self.records: list = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


class RaisingLogger(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats) -> None:
        raise RuntimeError("broken stat logger")


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop, coro, timeout: float = TIMEOUT_S):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def shutdown(loop, engine: AsyncLLM) -> None:
    async def _shutdown():
        engine.shutdown()
        await asyncio.sleep(0)  # let the cancelled output handler finish

    run(loop, _shutdown())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """Tiny random weights with SmolLM2's real tokenizer (text in, text out)."""
    from pyorch.model_loader import default_model_path, get_tokenizer

    tokenizer = get_tokenizer(default_model_path())
    return make_tiny_model(tmp_path_factory.mktemp("tiny_tok"), len(tokenizer), tokenizer)


@pytest.fixture(scope="module")
def stats_logger() -> RecordingLogger:
    return RecordingLogger()


@pytest.fixture(scope="module")
def engine(model_path, loop, stats_logger):
    engine = AsyncLLM.from_engine_args(engine_args(model_path), stat_loggers=[stats_logger])
    yield engine
    shutdown(loop, engine)
    assert not engine.engine_core.proc.is_alive()


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(**vars(engine_args(model_path)))


async def collect(engine: AsyncLLM, prompt, params, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def assert_idle(engine: AsyncLLM) -> None:
    info = await engine.get_kv_cache_info()
    assert info["num_unfinished_requests"] == 0
    assert info["kv_cache_usage"] == 0.0
    assert info["num_free_blocks"] == info["num_usable_blocks"] == engine.num_kv_blocks - 1


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_ready_info(engine, loop):
    assert engine.block_size == 16 and engine.num_kv_blocks > 1
    assert engine.kv_cache_capacity_tokens == (engine.num_kv_blocks - 1) * 16
    assert engine.model_config.max_model_len == 512
    assert engine.get_tokenizer() is engine.tokenizer is not None
    assert not engine.errored and engine.dead_error is None
    run(loop, engine.check_health())


def test_concurrent_greedy_matches_llm_and_is_batched(engine, llm, loop, stats_logger):
    stats_logger.records.clear()
    params = greedy()

    async def main():
        return await asyncio.gather(
            *[collect(engine, p, params, f"greedy-{i}") for i, p in enumerate(PROMPTS)])

    streams = run(loop, main())
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    for outs, ref in zip(streams, expected):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final = outs[-1].outputs[0]
        assert final.token_ids == ref.outputs[0].token_ids and final.text == ref.outputs[0].text
        assert final.finish_reason == "length" and outs[-1].prompt_token_ids == ref.prompt_token_ids
    # One core step served every request at once.
    assert max(s.num_running_reqs for s, _ in stats_logger.records) == len(PROMPTS)
    iteration = [it for _, it in stats_logger.records]
    assert sum(it.num_generation_tokens for it in iteration) == len(PROMPTS) * 10
    assert sum(len(it.time_to_first_tokens) for it in iteration) == len(PROMPTS)
    assert sum(len(it.inter_token_latencies) for it in iteration) == len(PROMPTS) * 9
    finished = [f for it in iteration for f in it.finished_requests]
    assert sorted(f.finish_reason for f in finished) == ["length"] * len(PROMPTS)
    assert all(f.e2e_latency > 0 and f.num_generation_tokens == 10 for f in finished)
    run(loop, assert_idle(engine))


def test_delta_and_final_only_match_cumulative(engine, loop):
    def params(kind):
        return SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=12, ignore_eos=True,
                              output_kind=kind)

    async def main():
        return await asyncio.gather(*[
            collect(engine, PROMPTS[3], params(kind), f"kind-{kind.name}")
            for kind in RequestOutputKind])

    cumulative, delta, final_only = run(loop, main())
    assert len(final_only) == 1 and final_only[0].finished
    assert delta[-1].finished and cumulative[-1].finished
    for index in (0, 1):
        full = next(c for c in cumulative[-1].outputs if c.index == index)
        pieces = [c for out in delta for c in out.outputs if c.index == index]
        assert "".join(c.text for c in pieces) == full.text
        assert [t for c in pieces for t in c.token_ids] == full.token_ids
        assert len(full.token_ids) == 12
        assert next(c for c in final_only[0].outputs if c.index == index).text == full.text
    assert cumulative[-1].outputs[0].token_ids != cumulative[-1].outputs[1].token_ids
    run(loop, assert_idle(engine))


@pytest.mark.parametrize("how", ["aclose", "cancel", "abort"])
def test_abort_mid_stream_frees_all_blocks(engine, loop, how):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        gen = engine.generate(PROMPTS[3], params, f"abort-{how}")
        outs = [await gen.__anext__() for _ in range(3)]
        assert not outs[-1].finished
        info = await engine.get_kv_cache_info()
        assert info["num_unfinished_requests"] == 1 and info["kv_cache_usage"] > 0
        if how == "aclose":
            await gen.aclose()
        elif how == "cancel":
            async def consume():
                async for _ in gen:
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            await engine.abort(f"abort-{how}")
            rest = [o async for o in gen]
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        await assert_idle(engine)

    run(loop, main())


def test_bad_requests_raise_before_queueing(engine, loop):
    # Long enough to still be running when the duplicate id arrives, however fast steps are.
    good = greedy(max_tokens=200)

    async def main():
        good_task = asyncio.ensure_future(collect(engine, PROMPTS[0], good, "good"))
        await asyncio.sleep(0.05)
        bad = [
            ({"prompt_token_ids": [5] * 600}, greedy(), "too-long", ValueError),
            ({"prompt_token_ids": [10**7]}, greedy(), "out-of-vocab", ValueError),
            (PROMPTS[0], greedy(logprobs=500), "too-many-logprobs", ValueError),
            (PROMPTS[0], {"temperature": 0}, "not-params", TypeError),
            (PROMPTS[0], greedy(), "good", ValueError),  # duplicate id of a running request
        ]
        for prompt, params, request_id, exc in bad:
            gen = engine.generate(prompt, params, request_id)
            with pytest.raises(exc):
                await gen.__anext__()
        info = await engine.get_kv_cache_info()
        assert info["num_unfinished_requests"] <= 1  # only the good request ever got queued
        outs = await good_task
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 200

    run(loop, main())
    run(loop, assert_idle(engine))


def test_stop_string_finishes_request_in_core(engine, loop):
    async def main():
        ref = await collect(engine, PROMPTS[1], greedy(max_tokens=24), "stop-ref")
        text = ref[-1].outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        assert len(stop) == 3
        # With a long budget, the request ends only because the core was told to stop it.
        outs = await collect(engine, PROMPTS[1], greedy(max_tokens=400, stop=[stop]), "stop")
        final = outs[-1].outputs[0]
        assert final.finish_reason == "stop" and final.stop_reason == stop
        assert final.text == text[: text.index(stop)]
        assert len(final.token_ids) < 24
        await assert_idle(engine)

    run(loop, main())


def test_reset_prefix_cache_and_raising_stat_logger(engine, loop):
    engine.stat_loggers.append(RaisingLogger())
    try:
        outs = run(loop, collect(engine, PROMPTS[0], greedy(max_tokens=3), "logger"))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    finally:
        engine.stat_loggers.pop()
    assert run(loop, engine.reset_prefix_cache()) is True
    stats = run(loop, engine.get_scheduler_stats())
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
    assert not engine.errored


# ---- failures: each test starts its own engine (token ids in/out, no tokenizer) ----------------
@pytest.fixture(scope="module")
def ids_model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_ids"))


def _ids_engine(path: str) -> AsyncLLM:
    return AsyncLLM.from_engine_args(engine_args(path, skip_tokenizer_init=True))


LONG = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
PROMPT_IDS = {"prompt_token_ids": [5, 6, 7, 8]}


def test_sigkill_makes_generate_raise_engine_dead(ids_model_path, loop):
    engine = _ids_engine(ids_model_path)
    try:
        async def main():
            gen = engine.generate(PROMPT_IDS, LONG, "doomed")
            await gen.__anext__()
            os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            assert time.monotonic() - start < 10
            assert engine.errored and isinstance(engine.dead_error, EngineDeadError)
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.generate(PROMPT_IDS, LONG, "after").__anext__()

        run(loop, main(), timeout=30)
    finally:
        shutdown(loop, engine)


def test_exception_in_step_is_reported(ids_model_path, loop, monkeypatch):
    monkeypatch.setenv("PYORCH_ENGINE_CORE_TEST_HOOKS", "1")  # read by the core process at start-up
    engine = _ids_engine(ids_model_path)
    try:
        async def main():
            assert await engine.call_utility("inject_step_error") is True
            with pytest.raises(EngineDeadError, match="injected failure in model_runner.execute"):
                await collect(engine, PROMPT_IDS, LONG, "fails")
            assert engine.errored

        run(loop, main(), timeout=30)
        engine.engine_core.proc.join(10)
        assert engine.engine_core.proc.exitcode == 1  # the core exits after reporting
    finally:
        shutdown(loop, engine)


def test_test_hooks_are_off_by_default(engine, loop):
    with pytest.raises(RuntimeError, match="unknown engine-core utility"):
        run(loop, engine.call_utility("inject_step_error"))
    assert not engine.errored


def test_shutdown_ends_in_flight_generators(ids_model_path, loop):
    engine = _ids_engine(ids_model_path)

    async def main():
        gens = [engine.generate(PROMPT_IDS, LONG, f"inflight-{i}") for i in range(3)]
        for gen in gens:
            await gen.__anext__()
        engine.shutdown()
        engine.shutdown()  # idempotent
        for gen in gens:
            rest = [o async for o in gen]
            assert rest[-1].finished
            assert rest[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await engine.generate(PROMPT_IDS, LONG, "late").__anext__()

    run(loop, main(), timeout=30)
    assert not engine.engine_core.proc.is_alive()


def test_startup_error_is_raised_with_its_text(ids_model_path):
    # 4 blocks of 16 tokens cannot hold one 512-token request: the core refuses to start.
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        AsyncLLM.from_engine_args(engine_args(ids_model_path, skip_tokenizer_init=True,
                                              num_gpu_blocks_override=5))


def test_core_process_dies_with_its_parent(ids_model_path):
    script = textwrap.dedent(f"""
        import os, sys, torch
        from pyorch.engine.async_llm import AsyncLLM
        from pyorch.engine.arg_utils import EngineArgs
        if __name__ == "__main__":
            engine = AsyncLLM.from_engine_args(EngineArgs(
                model={ids_model_path!r}, skip_tokenizer_init=True, dtype=torch.float32,
                max_model_len=512, device="cpu", kv_cache_memory_bytes=16 << 20))
            print(engine.engine_core.proc.pid, flush=True)
            os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=os.getcwd())
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    child_pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _pid_alive(child_pid):
        time.sleep(0.1)
    assert not _pid_alive(child_pid), "the engine-core process outlived its parent"


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# ---- pooling (runner="pooling") -----------------------------------------------------------------
def test_pooling_encode_matches_llm_frees_blocks_and_refuses_bad_requests(model_path, loop):
    from pyorch import PoolingParams

    args = engine_args(model_path, runner="pooling", pooler_config={"pooling_type": "MEAN"},
                       max_num_batched_tokens=8)
    engine = AsyncLLM.from_engine_args(args)
    try:
        async def encode(prompt, request_id: str, params=None):
            return [o async for o in engine.encode(prompt, params, request_id)]

        async def main():
            results = await asyncio.gather(*(encode(p, f"emb-{i}")
                                             for i, p in enumerate(PROMPTS)))
            assert all(len(r) == 1 and r[0].finished for r in results)
            # A long prompt (63 chunks of 8 tokens) cancelled part-way frees its blocks.
            task = asyncio.ensure_future(encode({"prompt_token_ids": [7] * 500}, "long"))
            while (await engine.get_kv_cache_info())["kv_cache_usage"] == 0:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_idle(engine)
            for gen, exc in [
                (engine.generate(PROMPTS[0], greedy(), "gen"), ValueError),
                (engine.encode(PROMPTS[0], PoolingParams(dimensions=8), "dims"), ValueError),
                (engine.encode({"prompt_token_ids": [10**7]}, None, "oov"), ValueError),
                (engine.encode(PROMPTS[0], SamplingParams(), "wrong"), TypeError),  # type: ignore[arg-type]
            ]:
                with pytest.raises(exc):
                    await gen.__anext__()
            await assert_idle(engine)
            return [r[0].outputs.data for r in results]

        got = run(loop, main())
    finally:
        shutdown(loop, engine)
    want = LLM(**vars(args)).embed(PROMPTS, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, torch.tensor(w.outputs.embedding), atol=1e-5, rtol=1e-5)


class _LetterTokenizer:
    """Token t decodes to one letter (1 -> "a"); no engine needed."""

    def decode(self, token_ids, **kwargs):
        return "".join(chr(ord("a") + (t - 1) % 26) for t in token_ids)

    def get_added_vocab(self):
        return {}


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_slow_consumer_gets_outputs_merged(kind):
    """A consumer that falls behind gets one output holding every step it missed: delta
    outputs concatenated (text, token ids, per child), cumulative ones replaced by the newest;
    an output taken early is not changed by later steps."""
    from pyorch.core_types import EngineCoreOutput
    from pyorch.engine.async_llm import _RequestStream
    from pyorch.engine.output_processor import OutputProcessor

    async def main():
        op = OutputProcessor(_LetterTokenizer())
        params = SamplingParams(n=2, output_kind=kind, max_tokens=50)
        child_ids = [cid for cid, _ in op.add_request("r", "p", [1, 2], params, None, 64)]
        stream = _RequestStream(kind)
        steps = [[1], [2, 3], [4], [5], [6]]
        taken = []
        for i, tokens in enumerate(steps):
            finish = "length" if i == len(steps) - 1 else None
            outs, _ = op.process_outputs([EngineCoreOutput(c, [t + j for t in tokens], finish)
                                          for j, c in enumerate(child_ids)])
            for out in outs:
                stream.put(out)
            if i == 0:  # one output taken early, then the consumer stalls for three steps
                taken.append(await stream.get())
            if i == 3:
                taken.append(await stream.get())
        taken.append(await stream.get())
        return taken

    first, middle, last = asyncio.run(main())
    texts = {0: "abcdef", 1: "bcdefg"}
    assert [c.text for c in first.outputs] == ["a", "b"] and not first.finished
    if kind == RequestOutputKind.DELTA:
        assert [c.text for c in middle.outputs] == ["bcde", "cdef"]
        assert [c.token_ids for c in middle.outputs] == [[2, 3, 4, 5], [3, 4, 5, 6]]
        assert [c.text for c in last.outputs] == ["f", "g"]
        for index, text in texts.items():
            pieces = [out.outputs[index] for out in (first, middle, last)]
            assert "".join(c.text for c in pieces) == text
            assert [t for c in pieces for t in c.token_ids] == [ord(ch) - 96 for ch in text]
    else:
        assert [c.text for c in middle.outputs] == ["abcde", "bcdef"]
        assert [c.text for c in last.outputs] == list(texts.values())
        assert last.outputs[0].token_ids == [1, 2, 3, 4, 5, 6]
    assert first.outputs[0].token_ids == [1] and first.outputs[0].text == "a"  # unchanged
    assert last.finished and [c.finish_reason for c in last.outputs] == ["length"] * 2
