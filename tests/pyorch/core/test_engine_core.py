"""EngineCore in-process (steps, aborts, stop-string finishes, stats) and LLMEngine's stat
loggers."""

from __future__ import annotations

import pytest

from pyorch.core.engine_core import EngineCore
from pyorch.core.request import Request, RequestStatus
from pyorch.engine.llm_engine import LLMEngine
from pyorch.metrics.stats import StatLoggerBase
from pyorch.sampling_params import SamplingParams
from tests.pyorch.engine.test_async_llm import engine_args, make_tiny_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_core"))
    return engine_args(path, skip_tokenizer_init=True).create_engine_config()


@pytest.fixture(scope="module")
def core(config) -> EngineCore:
    return EngineCore(config)


def _request(req_id: str, max_tokens: int = 5, prompt=(5, 6, 7)) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(prompt), params, eos_token_id=2, arrival_time=0.0)


def _assert_idle(core: EngineCore) -> None:
    info = core.get_kv_cache_info()
    assert not core.has_unfinished_requests() and info["num_unfinished_requests"] == 0
    assert info["num_free_blocks"] == info["num_usable_blocks"] == info["num_blocks"] - 1


def test_step_batches_requests_and_reports_stats(core):
    core.add_request(_request("a", max_tokens=4))
    core.add_request(_request("b", max_tokens=6, prompt=range(10, 40)))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finish: dict[str, str] = {}
    first = core.step()
    assert sorted(first.scheduled_new_req_ids) == ["a", "b"]
    assert first.scheduler_stats.num_running_reqs == 2
    assert first.scheduler_stats.kv_cache_usage > 0
    assert first.timestamp >= first.scheduled_time > 0
    step = first
    while True:
        for out in step.outputs:
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                finish[out.req_id] = out.finish_reason
        if not core.has_unfinished_requests():
            break
        step = core.step()
    assert {k: len(v) for k, v in tokens.items()} == {"a": 4, "b": 6}
    assert finish == {"a": "length", "b": "length"}
    assert step.scheduler_stats.num_running_reqs == 0
    _assert_idle(core)


def test_abort_and_finish_stopped_free_blocks(core):
    core.add_request(_request("x", max_tokens=100))
    core.add_request(_request("y", max_tokens=100))
    core.step()
    assert core.get_kv_cache_info()["kv_cache_usage"] > 0
    core.abort_requests(["x", "unknown"])
    core.finish_requests(["y"], RequestStatus.FINISHED_STOPPED)
    _assert_idle(core)
    assert core.make_stats().num_running_reqs == 0
    assert core.reset_prefix_cache() is True


def test_add_request_refuses_duplicates(core):
    core.add_request(_request("dup"))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(_request("dup"))
    core.abort_requests(["dup"])
    _assert_idle(core)


def test_ready_info(core, config):
    info = core.ready_info()
    assert info["block_size"] == 16 and info["max_model_len"] == 512
    assert info["vocab_size"] == config.model_config.vocab_size
    assert info["num_kv_blocks"] == info["num_usable_blocks"] + 1 > 32


# ---- LLMEngine (in-process front end) ---------------------------------------------------------
class _Recorder(StatLoggerBase):
    def __init__(self) -> None:
        self.records: list = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


class _Broken(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats) -> None:
        raise RuntimeError("broken")


def test_llm_engine_feeds_stat_loggers(config):
    recorder = _Recorder()
    engine = LLMEngine(config, stat_loggers=[_Broken(), recorder])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("s0", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.add_request("s1", {"prompt_token_ids": [8, 9]}, params)
    engine.add_request("s2", {"prompt_token_ids": [8, 9, 10]}, params)
    engine.step()
    engine.abort_request("s2")
    while engine.has_unfinished_requests():
        engine.step()
    assert recorder.records and all(s is not None for s, _ in recorder.records)
    iterations = [it for _, it in recorder.records]
    assert sum(it.num_generation_tokens for it in iterations) == 5 + 5 + 1
    assert sum(it.num_prompt_tokens for it in iterations) == 3 + 2 + 3
    finished = sorted((f.finish_reason, f.num_generation_tokens)
                      for it in iterations for f in it.finished_requests)
    assert finished == [("abort", 1), ("length", 5), ("length", 5)]
    assert recorder.records[0][0].num_running_reqs == 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_times_feed_the_step_budget(tmp_path, async_scheduling):
    """With target_step_ms the core reports every step it ran (tokens, wall ms) to the
    scheduler's step-time model; steps of different sizes give it a fit and a budget."""
    path = make_tiny_model(tmp_path)
    config = engine_args(path, skip_tokenizer_init=True, target_step_ms=50.0,
                         async_scheduling=async_scheduling).create_engine_config()
    assert config.scheduler_config.target_step_ms == 50.0
    core = EngineCore(config)
    model = core.scheduler.step_cost
    assert model is not None and model.num_steps == 0
    core.add_request(_request("a", max_tokens=6, prompt=range(10, 90)))
    core.add_request(_request("b", max_tokens=6, prompt=range(100, 110)))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    assert model.num_steps >= 6 and model.num_steps <= steps
    assert core.scheduler.step_token_budget >= core.scheduler.min_prefill_tokens
    _assert_idle(core)
