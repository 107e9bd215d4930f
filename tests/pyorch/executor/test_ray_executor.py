"""The ray backend on one host: two CPU workers as Ray actors (gloo), greedy tokens equal to
one rank's; a killed actor fails the engine with a clear error."""

from __future__ import annotations

import os
import time

import pytest

from pyorch.executor.multiproc_executor import WorkerDiedError
from tests.pyorch.entrypoints.test_llm import _prompts
from tests.pyorch.executor.test_multiproc_executor import (  # noqa: F401 (tiny_llama: fixture)
    _call_with_deadline,
    _greedy_tokens,
    _llm,
    tiny_llama,
)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    # Ray's task processes import this checkout's pyorch and tests, as the test process does.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 p for p in (os.path.abspath(root), os.environ.get("PYTHONPATH")) if p)}})
    yield
    ray.shutdown()


def test_ray_tp2_greedy_equals_tp1_and_actor_death_is_reported(local_ray, tiny_llama):  # noqa: F811
    from pyorch.executor.ray_executor import RayDistributedExecutor

    path, vocab = tiny_llama
    prompts = _prompts(vocab, [1, 7, 17, 40])
    one = _llm(path)
    expected = _greedy_tokens(one, prompts)
    start = time.perf_counter()
    llm = _llm(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    startup_s = time.perf_counter() - start
    executor = llm.llm_engine.engine_core.model_executor
    try:
        assert isinstance(executor, RayDistributedExecutor) and len(executor.actors) == 2
        print(f"ray TP=2 start-up: {startup_s:.1f} s")
        assert _call_with_deadline(_greedy_tokens, llm, prompts) == expected
        ray.kill(executor.actors[1])
        with pytest.raises(WorkerDiedError, match="Ray worker rank 1 died"):
            _call_with_deadline(_greedy_tokens, llm, prompts)
    finally:
        llm.llm_engine.shutdown()
    assert ray.is_initialized()  # the caller's cluster is left running


def test_ray_is_the_default_inside_a_placement_group(local_ray, tiny_llama):  # noqa: F811
    """vLLM's rule: with several ranks and no backend named, a process inside a Ray placement
    group uses ray, any other mp."""
    from pyorch.engine.arg_utils import EngineArgs

    path, _ = tiny_llama
    args = EngineArgs(model=path, device="cpu", max_model_len=256, tensor_parallel_size=2)
    assert args.create_engine_config().parallel_config.distributed_executor_backend == "mp"

    @ray.remote(num_cpus=0)
    def backend_in_group() -> str:
        return args.create_engine_config().parallel_config.distributed_executor_backend

    group = ray.util.placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=60)
    try:
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_capture_child_tasks=True)
        assert ray.get(backend_in_group.options(scheduling_strategy=strategy).remote(),
                       timeout=120) == "ray"
    finally:
        ray.util.remove_placement_group(group)
