"""The ray backend on 2 GPUs of one host: TP=2 as two Ray actors (one GPU each, NCCL) gives the
greedy tokens of one GPU (float16; they may part only at a near-tie, logprobs close before),
and its start-up time is reported next to the mp backend's. Skipped without 2 GPUs or without
ray."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.pyorch.entrypoints.test_llm import _prompts
from tests.pyorch.executor.test_multiproc_executor import (
    LOGPROB_TOL,
    PROMPT_LENS,
    _assert_logprobs_close,
    _call_with_deadline,
    _greedy_with_logprobs,
    _llm,
    _tiny_model,
)

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_gpu_ray():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 p for p in (os.path.abspath(root), os.environ.get("PYTHONPATH")) if p)}})
    yield
    ray.shutdown()


def test_ray_tp2_on_two_gpus_equals_one_gpu(local_gpu_ray, tmp_path_factory):
    from pyorch.executor.ray_executor import RayDistributedExecutor

    path, vocab = _tiny_model("llama", tmp_path_factory)
    prompts = _prompts(vocab, PROMPT_LENS)
    gpu = dict(device="cuda", dtype=torch.float16, kv_cache_memory_bytes=None,
               gpu_memory_utilization=0.3)
    start = time.perf_counter()
    one = _llm(path, distributed_executor_backend="mp", **gpu)
    one_s = time.perf_counter() - start
    expected = _greedy_with_logprobs(one, prompts)
    one.llm_engine.shutdown()
    del one
    times = {"mp_tp1_startup_s": one_s}
    for backend in ("mp", "ray"):
        start = time.perf_counter()
        llm = _llm(path, tensor_parallel_size=2, distributed_executor_backend=backend, **gpu)
        times[f"{backend}_tp2_startup_s"] = time.perf_counter() - start
        try:
            if backend == "ray":
                executor = llm.llm_engine.engine_core.model_executor
                assert isinstance(executor, RayDistributedExecutor) and len(executor.actors) == 2
            got = _call_with_deadline(_greedy_with_logprobs, llm, prompts)
            _assert_logprobs_close(expected, got, LOGPROB_TOL[torch.float16])
        finally:
            llm.llm_engine.shutdown()
    print("start-up:", json.dumps({k: round(v, 2) for k, v in times.items()}))
    out = os.environ.get("PYORCH_TEST_STARTUP_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(times, f, indent=1)
