"""Tensor parallelism end to end on the CPU: `LLM(tensor_parallel_size=2)` runs two worker
processes (gloo) and must give the same greedy tokens as one rank, token for token.

Tiny random Llama (2 KV heads: one per rank), Qwen3 with one KV head (replicated on both
ranks, q/k norms on sharded heads) and Qwen2-MoE (experts sharded on their intermediate
dimension, plus the tensor-parallel shared expert), synchronous and async scheduling; a worker
killed mid-run takes the engine down with a clear error; a model that cannot be split is refused
up front.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pyorch import LLM, SamplingParams
from pyorch.engine.arg_utils import EngineArgs
from pyorch.executor.multiproc_executor import MultiprocExecutor, WorkerDiedError
from tests.pyorch.entrypoints.test_llm import _prompts, _tiny_config

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
PROMPT_LENS = [1, 7, 17, 40]
DEADLINE_S = 120.0  # any call that takes longer has hung


_MODELS: dict[str, tuple[str, int]] = {}


def _tiny_model(arch: str, tmp_path_factory) -> tuple[str, int]:
    """(checkpoint folder, vocab size), saved once per test session."""
    if arch in _MODELS:
        return _MODELS[arch]
    torch.manual_seed(0)
    config = _tiny_config("qwen3" if arch == "qwen3_kv1" else arch)
    if arch == "qwen3_kv1":
        config.num_key_value_heads = 1  # fewer KV heads than ranks: replicated
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    path = tmp_path_factory.mktemp(f"tp_{arch}")
    model.save_pretrained(path, safe_serialization=True)
    _MODELS[arch] = (str(path), config.vocab_size)
    return _MODELS[arch]


@pytest.fixture
def tiny_llama(tmp_path_factory) -> tuple[str, int]:
    return _tiny_model("llama", tmp_path_factory)


def _llm(path: str, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, dtype=torch.float32, max_model_len=256, seed=0,
                device="cpu", kv_cache_memory_bytes=8 << 20)
    args.update(kwargs)
    return LLM(path, **args)


def _greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _call_with_deadline(fn, *args):
    """fn(*args) in a thread: a hang fails the test instead of stalling CI."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"{fn.__name__} hung for {DEADLINE_S} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


# Each TP=2 engine costs two worker start-ups (seconds each on the CI machine): one scheduling
# mode per model keeps the suite short while covering both.
@pytest.mark.parametrize("arch, async_scheduling",
                         [("llama", False), ("qwen3_kv1", True), ("qwen2_moe", False)],
                         ids=["llama-sync", "qwen3_kv1-async", "qwen2_moe-sync"])

def test_tp2_greedy_equals_tp1(arch, async_scheduling, tmp_path_factory):
    path, vocab = _tiny_model(arch, tmp_path_factory)
    prompts = _prompts(vocab, PROMPT_LENS)
    one = _llm(path)
    expected = _greedy_tokens(one, prompts)
    one.llm_engine.shutdown()
    two = _llm(path, tensor_parallel_size=2, async_scheduling=async_scheduling)
    try:
        executor = two.llm_engine.engine_core.model_executor
        assert isinstance(executor, MultiprocExecutor) and len(executor.procs) == 2
        # The KV pool is sized per rank: each holds its share of the KV heads.
        assert _call_with_deadline(_greedy_tokens, two, prompts) == expected
        sched = two.llm_engine.scheduler
        assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
    finally:
        two.llm_engine.shutdown()
    assert all(p.poll() is not None for p in executor.procs)


def _greedy_with_logprobs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_logprobs_close(expected: list, got: list, tol: float) -> None:
    """vLLM's check_logprobs_close, with a bound: while the runs agree, each chosen token's
    logprob differs by at most tol between them (a sharding bug moves logits by whole units);
    they may part only where both saw a near-tie, each run's token among the other's top
    logprobs at the first position they differ (half-precision sums in another order under
    tensor parallelism), and nothing is compared after it."""
    for i, ((want, want_lp), (have, have_lp)) in enumerate(zip(expected, got, strict=True)):
        for pos, (a, b) in enumerate(zip(want, have, strict=True)):
            if a != b:
                assert a in have_lp[pos] and b in want_lp[pos], (
                    f"prompt {i} position {pos}: TP=1 chose {a}, TP>1 chose {b}, not a near-tie "
                    f"(TP=1 top {sorted(want_lp[pos])}, TP>1 top {sorted(have_lp[pos])})")
                break
            diff = abs(want_lp[pos][a].logprob - have_lp[pos][a].logprob)
            assert diff <= tol, f"prompt {i} position {pos}: token {a}'s logprob differs by {diff}"


TOP_LOGPROBS = 5
# The CUDA attention takes half precision only; the logprob bound per dtype (bf16 has 8 bits
# of mantissa, fp16 11).
GPU_CASES = [(arch, dtype) for arch in ("llama", "qwen3_kv1", "qwen2_moe")
             for dtype in (torch.bfloat16, torch.float16)]
LOGPROB_TOL = {torch.bfloat16: 0.5, torch.float16: 0.1}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("arch, dtype", GPU_CASES,
                         ids=[f"{a}-{str(d).split('.')[1]}" for a, d in GPU_CASES])
@pytest.mark.parametrize("custom_all_reduce", [True, False], ids=["custom_ar", "nccl"])
def test_tp2_greedy_equals_tp1_on_two_gpus(arch, dtype, custom_all_reduce, tmp_path_factory):
    """2 GPUs with CUDA graphs (the custom all-reduce inside them) and async scheduling, against
    one GPU. bfloat16: one rank decodes with the fused skinny GEMMs (norm and residual add
    inside the GEMM, pyorch/layers/fused_linear.py) and two with row-parallel partial sums
    reduced in the fused all-reduce + RMSNorm; float16 takes the unfused path on both sides, so
    only the partial sums' rounding differs. Either way the runs may part at a near-tie, and
    the logprobs before that stay within LOGPROB_TOL (_assert_logprobs_close). qwen3_kv1
    failed the exact bf16 token comparison on 2 H100s: this tells a near-tie from a sharding
    bug."""
    path, vocab = _tiny_model(arch, tmp_path_factory)
    prompts = _prompts(vocab, PROMPT_LENS)
    gpu = dict(device="cuda", dtype=dtype, kv_cache_memory_bytes=None,
               gpu_memory_utilization=0.3)
    # The one-rank reference runs in a worker process too ("mp"): an in-process engine keeps its
    # GPU memory after shutdown, which the next test's engines would count as taken.
    one = _llm(path, distributed_executor_backend="mp", **gpu)
    expected = _greedy_with_logprobs(one, prompts)
    one.llm_engine.shutdown()
    del one
    two = _llm(path, tensor_parallel_size=2, disable_custom_all_reduce=not custom_all_reduce,
               **gpu)
    try:
        got = _call_with_deadline(_greedy_with_logprobs, two, prompts)
    finally:
        two.llm_engine.shutdown()
    _assert_logprobs_close(expected, got, LOGPROB_TOL[dtype])


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("arch", ["llama", "qwen3_kv1"])
def test_tp4_greedy_matches_tp1_on_four_gpus(arch, tmp_path_factory):
    """float16: 4 ranks of 1 query head each; llama's 2 KV heads and qwen3's one are replicated
    over 2 and 4 ranks (the 4-rank custom all-reduce and its fused norm)."""
    path, vocab = _tiny_model(arch, tmp_path_factory)
    prompts = _prompts(vocab, PROMPT_LENS)
    gpu = dict(device="cuda", dtype=torch.float16, kv_cache_memory_bytes=None,
               gpu_memory_utilization=0.3)
    one = _llm(path, distributed_executor_backend="mp", **gpu)
    expected = _greedy_with_logprobs(one, prompts)
    one.llm_engine.shutdown()
    del one
    four = _llm(path, tensor_parallel_size=4, **gpu)
    try:
        got = _call_with_deadline(_greedy_with_logprobs, four, prompts)
    finally:
        four.llm_engine.shutdown()
    _assert_logprobs_close(expected, got, LOGPROB_TOL[torch.float16])


def test_every_rank_profiles_itself(tiny_llama, tmp_path):
    """Worker.profile through collective_rpc (bench/profile_gpu.py under tensor parallelism):
    each rank's op table and its own Chrome trace; stopping twice is an error."""
    path, vocab = tiny_llama
    llm = _llm(path, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.model_executor
    try:
        assert executor.collective_rpc("profile", (True,)) == [None, None]
        _call_with_deadline(_greedy_tokens, llm, _prompts(vocab, [5]))
        pattern = str(tmp_path / "trace_{rank}.json")
        tables = executor.collective_rpc("profile", (False, pattern))
        assert len(tables) == 2 and all("aten::" in t for t in tables)
        assert (tmp_path / "trace_0.json").stat().st_size > 0
        assert (tmp_path / "trace_1.json").stat().st_size > 0
        with pytest.raises(RuntimeError, match="profiler was not started"):
            executor.collective_rpc("profile", (False,))
    finally:
        llm.llm_engine.shutdown()


def _engine_greedy_with_calls(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """bench/profile_gpu.py's sequence under TP: engine.step() by hand, with a collective_rpc
    (profile start, then stop) after every step, i.e. while the async core has a step in
    flight."""
    engine = llm.llm_engine
    executor = engine.engine_core.model_executor
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    tokens: dict[str, list[int]] = {}
    profiling = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        replies = executor.collective_rpc("profile", (not profiling,))
        assert len(replies) == 2
        assert all((r is None) if not profiling else "aten::" in r for r in replies), replies
        profiling = not profiling
    if profiling:
        executor.collective_rpc("profile", (False,))
    return [tokens[str(i)] for i in range(len(prompts))]


def test_calls_between_async_steps_keep_the_steps_outputs(tiny_llama):
    """A collective_rpc while a step is in flight (async scheduling) gets its own answers, and
    the step's output still reaches the scheduler: rank 0 answers the step first, and the
    executor keeps that output for resolve (profile_gpu.py --tensor-parallel-size 2 crashed on
    an H100 pair with update_from_output(None) before)."""
    path, vocab = tiny_llama
    prompts = _prompts(vocab, [5, 17])
    llm = _llm(path, tensor_parallel_size=2, async_scheduling=True)
    try:
        expected = _call_with_deadline(_greedy_tokens, llm, prompts)
        got = _call_with_deadline(_engine_greedy_with_calls, llm, prompts)
        assert got == expected
        assert all(len(t) == MAX_TOKENS for t in got)
        sched = llm.llm_engine.scheduler
        assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
    finally:
        llm.llm_engine.shutdown()


def _join_watchers(executor: MultiprocExecutor) -> None:
    for proc in executor.procs:
        proc.wait(30)
    for t in threading.enumerate():
        if t.name.startswith("pyorch-worker-") and t.name.endswith("-monitor"):
            t.join(10)


@pytest.mark.parametrize("how", ["shutdown", "finalizer"])
def test_an_exit_the_executor_causes_is_not_a_worker_death(tiny_llama, how, caplog):
    """shutdown(), and the finalizer that kills the workers when the executor is dropped or the
    interpreter exits without shutdown() (SIGKILL: exit code -9), are not reported as a worker
    dying."""
    path, vocab = tiny_llama
    llm = _llm(path, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.model_executor
    assert len(_call_with_deadline(_greedy_tokens, llm, _prompts(vocab, [5]))[0]) == MAX_TOKENS
    with caplog.at_level("ERROR", logger="pyorch.executor.multiproc_executor"):
        if how == "shutdown":
            llm.llm_engine.shutdown()
        else:
            executor._finalizer()  # what atexit runs when nobody called shutdown()
            assert [p.returncode for p in executor.procs] == [-signal.SIGKILL] * 2
        _join_watchers(executor)
    assert executor._failure is None
    assert "died" not in caplog.text
    executor.check_health()  # nothing to raise


def test_killed_worker_fails_the_engine_with_a_clear_error(tiny_llama):
    path, vocab = tiny_llama
    llm = _llm(path, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.model_executor
    try:
        prompts = _prompts(vocab, [5])
        assert len(_call_with_deadline(_greedy_tokens, llm, prompts)[0]) == MAX_TOKENS
        os.kill(executor.procs[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) died with exit code"):
            _call_with_deadline(_greedy_tokens, llm, prompts)
        # The other worker is stopped too, not left waiting in a collective.
        executor.procs[0].wait(30)
    finally:
        llm.llm_engine.shutdown()


def test_a_worker_error_reaches_the_caller(tiny_llama):
    """A failure inside a worker (its weights do not fit the config) is raised in the caller
    with the worker's message, and no worker is left behind."""
    path, _ = tiny_llama
    started: list[MultiprocExecutor] = []
    original_init = MultiprocExecutor.__init__

    def recording_init(self, config):
        started.append(self)
        original_init(self, config)

    MultiprocExecutor.__init__ = recording_init
    try:
        # The folder holds safetensors only: each worker fails to find *.bin files.
        with pytest.raises(RuntimeError, match=r"worker rank \d.*FileNotFoundError.*\*\.bin"):
            _call_with_deadline(lambda: _llm(path, tensor_parallel_size=2, load_format="pt"))
    finally:
        MultiprocExecutor.__init__ = original_init
    assert len(started) == 1
    for proc in started[0].procs:
        assert proc.wait(30) is not None


def test_unsplittable_models_and_bad_backends_are_refused(tiny_llama):
    path, _ = tiny_llama
    for kwargs, message in (
        (dict(tensor_parallel_size=3), r"attention heads \(4\) must be divisible by tensor "
                                       r"parallel size \(3\)"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'uni' runs one rank"),
        (dict(distributed_executor_backend="external_launcher"), "not supported"),
        (dict(pipeline_parallel_size=2), "tensor parallelism only"),
        (dict(tensor_parallel_size=0), "must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=path, device="cpu", max_model_len=256, **kwargs
                       ).create_engine_config()


def test_async_llm_serves_tp2_from_its_engine_core_process(tiny_llama):
    """The server's path: the engine-core process (a daemon) starts the two workers, the tokens
    match one rank's, and shutting the engine down leaves no worker behind."""
    import asyncio

    from pyorch.engine.async_llm import AsyncLLM

    path, vocab = tiny_llama
    prompts = _prompts(vocab, [7, 17])
    one = _llm(path)
    expected = _greedy_tokens(one, prompts)
    one.llm_engine.shutdown()
    args = EngineArgs(model=path, skip_tokenizer_init=True, dtype=torch.float32,
                      max_model_len=256, seed=0, device="cpu", kv_cache_memory_bytes=8 << 20,
                      tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def main() -> tuple[list[list[int]], list[int]]:
        engine = AsyncLLM.from_engine_args(args)
        try:
            workers = _children(engine.engine_core.proc.pid)

            async def one_request(i: int) -> list[int]:
                final = None
                async for out in engine.generate({"prompt_token_ids": prompts[i]}, params,
                                                 f"r{i}"):
                    final = out
                return final.outputs[0].token_ids

            tokens = await asyncio.gather(*(one_request(i) for i in range(len(prompts))))
            return list(tokens), workers
        finally:
            engine.shutdown()

    tokens, workers = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert tokens == expected
    assert len(workers) == 2
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, workers))


def _children(pid: int) -> list[int]:
    """Pids whose parent is pid (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (Linux /proc)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_worker_env_turns_off_the_nccl_dump_poll_unless_set():
    # The workers' environment: TORCH_NCCL_DUMP_ON_TIMEOUT=0 by default (its store polling printed
    # TCPStore tracebacks when rank 0 left first), the user's own value kept, nothing else touched.
    from pyorch.distributed.parallel_state import worker_env

    base = {"PATH": "/bin", "PYORCH_PDL": "0"}
    assert worker_env(base) == {**base, "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    user = worker_env({**base, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert user["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert base == {"PATH": "/bin", "PYORCH_PDL": "0"}  # the input is not modified
