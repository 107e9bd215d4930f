"""Scheduler, CPU-only, no model: a fake runner keeps its own per-request state from the
SchedulerOutput diffs and emulates the KV cache (each slot stores a fingerprint of the prefix
that produced it), so every step checks that each request reads exactly its own KV, whether it
came from its own compute, a prefix hit, or after a preemption."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pyorch.config import SchedulerConfig
from pyorch.core.request import Request, RequestStatus
from pyorch.core.scheduler import Scheduler
from pyorch.core.scheduler_output import SchedulerOutput
from pyorch.sampling_params import SamplingParams

BS = 4
VOCAB = 50
EOS = 0


@dataclass
class FakeRunnerOutput:  # the fields of ModelRunnerOutput the scheduler reads
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
    pooled: dict[str, Any] = field(default_factory=dict)


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': the next token depends on the whole sequence; never EOS."""
    return 1 + (hash(tuple(tokens)) * 2654435761 >> 7) % (VOCAB - 1)


class FakeRunner:
    def __init__(self, block_size: int, script: dict[str, list[int]] | None = None) -> None:
        self.block_size = block_size
        self.kv: dict[int, list[Any]] = {}  # block id -> per-slot prefix fingerprint
        self.reqs: dict[str, dict[str, Any]] = {}
        self.script = script or {}  # req_id -> forced output tokens, by output index

    def execute(self, so: SchedulerOutput) -> FakeRunnerOutput:
        bs = self.block_size
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = {
                "tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                "num_prompt": len(new.prompt_token_ids),
                "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens,
            }
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.reqs[rid]
            assert state["computed"] == computed
            state["blocks"].extend(blocks)
        req_ids, sampled = [], []
        # As a model layer does: the KV of every token of the step is written first, then
        # attention reads (so a request may hit blocks another one fills in the same step).
        for rid, n in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            tokens, blocks, start = state["tokens"], state["blocks"], state["computed"]
            end = start + n
            assert 0 < n and end <= len(tokens) and len(blocks) * bs >= end
            assert 0 not in blocks, "the null block was handed out"
            for pos in range(start, end):
                slots = self.kv.setdefault(blocks[pos // bs], [None] * bs)
                slots[pos % bs] = hash(tuple(tokens[: pos + 1]))
        for rid, n in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            tokens, blocks, start = state["tokens"], state["blocks"], state["computed"]
            end = start + n
            for pos in range(end):  # every slot read holds this request's prefix KV
                assert self.kv[blocks[pos // bs]][pos % bs] == hash(tuple(tokens[: pos + 1])), (
                    f"{rid} read wrong KV at position {pos}"
                )
            state["computed"] = end
            req_ids.append(rid)
            if end == len(tokens):
                out_idx = len(tokens) - state["num_prompt"]
                forced = self.script.get(rid, [])
                tok = forced[out_idx] if out_idx < len(forced) else next_token(tokens)
                tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return FakeRunnerOutput(req_ids, sampled, [None] * len(req_ids))


@pytest.fixture
def make_scheduler():
    """Builds schedulers; at teardown aborts what is left and checks every block came back."""
    made: list[Scheduler] = []

    def make(**kwargs: Any) -> Scheduler:
        defaults = {
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "max_model_len": 64,
            "block_size": BS,
            "num_blocks": 64,
        }
        defaults.update(kwargs)
        sched = Scheduler(**defaults)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
        kv = sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks - 1 and kv.usage == 0.0
        assert not kv.req_to_blocks and not sched.running and not len(sched.waiting)


def req(
    rid: str,
    prompt: list[int],
    arrival: float = 0.0,
    priority: int = 0,
    salt: str | None = None,
    **params: Any,
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, prompt, SamplingParams(**params), EOS, arrival, priority, salt)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % (VOCAB - 1) for i in range(n)]


def run(sched: Scheduler, runner: FakeRunner, max_steps: int = 2000,
        async_scheduling: bool = False) -> dict[str, Any]:
    """Steps until idle, checking per-step limits. Returns outputs, finish info and step log.

    async_scheduling: step N+1 is scheduled (and run) before step N's output is applied, as
    EngineCore does with async scheduling; the last in-flight step is applied at the end."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, tuple] = {}
    steps: list[SchedulerOutput] = []

    def apply(so: SchedulerOutput, out: FakeRunnerOutput) -> None:
        for o in sched.update_from_output(so, out):
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.req_id] = (o.finish_reason, o.stop_reason, o.num_cached_tokens)

    in_flight = None
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
        steps.append(so)
        out = runner.execute(so)
        if not async_scheduling:
            apply(so, out)
            continue
        if in_flight is not None:
            apply(*in_flight)
        in_flight = (so, out)
    else:
        raise AssertionError("the scheduler did not drain")
    if in_flight is not None:
        apply(*in_flight)  # tokens of requests that already finished: dropped
    assert all(r.num_output_placeholders == 0 for r in sched.requests.values())
    return {"tokens": tokens, "finish": finish, "steps": steps}


def test_single_request_to_max_tokens(make_scheduler):
    sched = make_scheduler()
    sched.add_request(req("a", prompt_of(10), max_tokens=5))
    res = run(sched, FakeRunner(BS))
    assert len(res["tokens"]["a"]) == 5
    assert res["finish"]["a"] == ("length", None, 0)
    assert [s.total_num_scheduled_tokens for s in res["steps"]] == [10, 1, 1, 1, 1]
    assert "a" in sched.schedule().finished_req_ids  # the runner is told to drop it


def test_token_budget_and_max_num_seqs(make_scheduler):
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(7):
        sched.add_request(req(f"r{i}", prompt_of(9 + i, i), arrival=i, max_tokens=6))
    res = run(sched, FakeRunner(BS))
    assert all(len(res["tokens"][f"r{i}"]) == 6 for i in range(7))
    assert max(len(s.num_scheduled_tokens) for s in res["steps"]) == 3
    assert max(s.total_num_scheduled_tokens for s in res["steps"]) == 20


def test_chunked_prefill(make_scheduler):
    sched = make_scheduler(max_num_batched_tokens=16, enable_prefix_caching=False)
    sched.add_request(req("a", prompt_of(50), max_tokens=3))
    res = run(sched, FakeRunner(BS))
    assert [s.num_scheduled_tokens["a"] for s in res["steps"]] == [16, 16, 16, 2, 1, 1]
    assert len(res["tokens"]["a"]) == 3


def test_chunked_prefill_shares_the_budget_with_decodes(make_scheduler):
    sched = make_scheduler(max_num_batched_tokens=16, enable_prefix_caching=False)
    sched.add_request(req("a", prompt_of(5), arrival=0, max_tokens=10))
    runner = FakeRunner(BS)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.add_request(req("b", prompt_of(40, 1), arrival=1, max_tokens=2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}  # decode first, then a chunk
    sched.update_from_output(so, runner.execute(so))
    run(sched, runner)


def test_long_prefill_token_threshold(make_scheduler):
    sched = make_scheduler(
        max_num_batched_tokens=32, long_prefill_token_threshold=8, enable_prefix_caching=False
    )
    sched.add_request(req("a", prompt_of(20), max_tokens=1))
    res = run(sched, FakeRunner(BS))
    assert [s.num_scheduled_tokens["a"] for s in res["steps"]] == [8, 8, 4]


def test_chunked_prefill_disabled(make_scheduler):
    with pytest.raises(ValueError, match="chunked prefill"):
        Scheduler(
            max_num_batched_tokens=32,
            max_model_len=64,
            num_blocks=64,
            block_size=BS,
            enable_chunked_prefill=False,
        )
    sched = make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    sched.add_request(req("a", prompt_of(40), arrival=0, max_tokens=2))
    sched.add_request(req("b", prompt_of(30, 1), arrival=1, max_tokens=2))
    res = run(sched, FakeRunner(BS))
    # b does not fit beside a's 40 tokens and is never split: it waits for the next step.
    assert res["steps"][0].num_scheduled_tokens == {"a": 40}
    assert res["steps"][1].num_scheduled_tokens == {"a": 1, "b": 30}


def test_prefix_hits(make_scheduler):
    sched = make_scheduler()
    runner = FakeRunner(BS)
    shared = prompt_of(33)
    sched.add_request(req("a", shared + [5, 6], max_tokens=2))
    run(sched, runner)
    sched.add_request(req("b", shared + [7], max_tokens=2))
    sched.add_request(req("c", shared + [7], salt="other", max_tokens=2))
    res = run(sched, runner)
    assert res["finish"]["b"][2] == 32 and res["finish"]["c"][2] == 0
    assert res["steps"][0].num_scheduled_tokens["b"] == 2
    assert res["steps"][0].num_scheduled_tokens["c"] == 34
    # A prompt that is entirely cached still recomputes its last token (here: a whole block).
    sched.add_request(req("d", shared[:32], max_tokens=1))
    res = run(sched, runner)
    assert res["finish"]["d"][2] == 28 and res["steps"][0].num_scheduled_tokens["d"] == 4
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 32 + 28
    assert stats.prefix_cache_queries == 35 + 34 + 34 + 32
    assert 0 < stats.prefix_cache_hit_rate < 1


def test_prefix_hits_within_one_step(make_scheduler):
    """Requests that share a prompt prefix and are admitted in the same step: the first one's
    full prompt blocks serve the others at once (the fake runner, like a model layer, writes
    every token's KV before any read), so the prefix is computed once, not once per request; a
    running prompt's chunk serves the requests admitted after it too."""
    sched = make_scheduler(max_num_batched_tokens=64, num_blocks=64)
    runner = FakeRunner(BS)
    shared = prompt_of(16)
    for i in range(3):
        sched.add_request(req(f"s{i}", shared + prompt_of(3, 10 + i), arrival=i, max_tokens=2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"s0": 19, "s1": 3, "s2": 3}
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [0, 16, 16]
    sched.update_from_output(so, runner.execute(so))
    stats = sched.make_stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (32, 57)
    # A 40-token prompt chunked over steps: the blocks its first chunk fills serve a request
    # admitted after it in the same step.
    long = prompt_of(40, 5)
    chunked = make_scheduler(max_num_batched_tokens=24, num_blocks=64)
    chunked.add_request(req("long", long, arrival=0, max_tokens=1))
    chunked.add_request(req("twin", long[:36] + [9], arrival=1, max_tokens=1))
    so = chunked.schedule()
    assert so.num_scheduled_tokens == {"long": 24}
    chunked.update_from_output(so, runner.execute(so))
    chunked.add_request(req("late", long[:16] + [8], arrival=2, max_tokens=1))
    # long's second chunk (16 tokens, up to 40) fills the blocks twin's 36-token hit ends in.
    so = chunked.schedule()
    assert so.num_scheduled_tokens == {"long": 16, "twin": 1, "late": 1}
    chunked.update_from_output(so, runner.execute(so))


def test_prefix_caching_off(make_scheduler):
    sched = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(BS)
    sched.add_request(req("a", prompt_of(20), max_tokens=2))
    run(sched, runner)
    sched.add_request(req("b", prompt_of(20), max_tokens=2))
    res = run(sched, runner)
    assert res["finish"]["b"][2] == 0 and sched.make_stats().prefix_cache_queries == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_outputs(make_scheduler, policy, prefix_caching):
    def workload(sched: Scheduler) -> dict[str, Any]:
        for i in range(6):
            sched.add_request(
                req(
                    f"r{i}",
                    prompt_of(10 + 3 * i, i % 3),
                    arrival=i,
                    priority=i % 2,
                    max_tokens=20,
                    ignore_eos=True,
                )
            )
        return run(sched, FakeRunner(BS))

    # reserve_kv_for_growth off: admit whatever fits now, so the tiny cache must preempt.
    kwargs = {"policy": policy, "enable_prefix_caching": prefix_caching, "max_model_len": 48,
              "reserve_kv_for_growth": False}
    big = workload(make_scheduler(num_blocks=200, **kwargs))
    tiny_sched = make_scheduler(num_blocks=13, **kwargs)  # 48 tokens: one max-length sequence
    tiny = workload(tiny_sched)
    assert tiny_sched.make_stats().num_preemptions > 0
    assert tiny["tokens"] == big["tokens"]
    assert [len(big["tokens"][f"r{i}"]) for i in range(6)] == [20] * 6
    # Every preemption told the runner to drop the request; it came back as a new request.
    dropped = set().union(*(s.finished_req_ids for s in tiny["steps"]))
    resumed = [n for s in tiny["steps"] for n in s.scheduled_new_reqs if n.output_token_ids]
    assert resumed and all(n.req_id in dropped for n in resumed)


def test_growth_reservation_runs_the_tiny_cache_without_preemption(make_scheduler):
    """Requests that all run to max_tokens (ignore_eos) on a cache that holds one max-length
    sequence: admission keeps room for what the running ones will still grow into, so nothing
    is preempted (the same workload preempts with the reservation off) and outputs match."""
    def workload(sched: Scheduler) -> dict[str, Any]:
        for i in range(6):
            sched.add_request(req(f"r{i}", prompt_of(10 + 3 * i, i % 3), arrival=i,
                                  max_tokens=20, ignore_eos=True))
        return run(sched, FakeRunner(BS))

    big = workload(make_scheduler(num_blocks=200, max_model_len=48))
    caps = {f"r{i}": -(-min(10 + 3 * i + 20, 48) // BS) for i in range(6)}  # blocks at the cap
    widest = {}
    for num_blocks in (13, 25):  # room for one max-length sequence; for two of the short ones
        sched = make_scheduler(num_blocks=num_blocks, max_model_len=48)
        tiny = workload(sched)
        assert sched.num_preemptions == 0 and tiny["tokens"] == big["tokens"]
        running: set[str] = set()
        for so in tiny["steps"]:  # every admission left room for everyone's cap (ratio 1)
            running |= {n.req_id for n in so.scheduled_new_reqs}
            running &= set(so.num_scheduled_tokens)
            assert sum(caps[r] for r in running) <= num_blocks - 1
        widest[num_blocks] = max(len(so.num_scheduled_tokens) for so in tiny["steps"])
    assert widest == {13: 1, 25: 2}


@pytest.mark.parametrize("num_requests", [18, 40])
def test_thin_tail_starts_past_the_reservation(make_scheduler, num_requests):
    """Same-length requests (ignore_eos) on a cache that holds 16 of them to their cap. 18: the
    two left over are a thin tail (2 x 8 <= 16 running, 16 blocks <= 1/8 of the cache), so they
    start with the others instead of running alone after them; when the cache runs out they,
    the latest arrivals, are preempted once each, and the run takes fewer steps than with the
    reservation alone. 40: the queue is long, the reservation holds, nothing is preempted."""
    made: list[Request] = []

    def workload(sched: Scheduler) -> dict[str, Any]:
        made.clear()
        for i in range(num_requests):  # 8 + 24 tokens: 8 blocks at the cap
            made.append(req(f"r{i}", prompt_of(8, i), arrival=i, max_tokens=24, ignore_eos=True))
            sched.add_request(made[-1])
        return run(sched, FakeRunner(BS))

    kw = {"max_model_len": 32, "max_num_seqs": 64}
    big = workload(make_scheduler(num_blocks=8 * num_requests + 1, **kw))
    sched = make_scheduler(num_blocks=129, **kw)  # 128 usable blocks: 16 requests to the cap
    res = workload(sched)
    assert res["tokens"] == big["tokens"]
    preempted = {r.request_id: r.num_preemptions for r in made if r.num_preemptions}
    widest = max(len(so.num_scheduled_tokens) for so in res["steps"])
    held = make_scheduler(num_blocks=129, tail_overcommit=False, **kw)
    reserved = workload(held)
    assert reserved["tokens"] == big["tokens"] and held.num_preemptions == 0
    if num_requests == 18:
        assert widest == 18 and 1 <= sched.num_preemptions <= 2
        assert len(res["steps"]) < len(reserved["steps"])
        assert set(preempted) <= {"r16", "r17"} and set(preempted.values()) == {1}
    else:
        assert widest == 16 and sched.num_preemptions == 0
        assert len(res["steps"]) == len(reserved["steps"])


def test_growth_ratio_learns_from_early_stops(make_scheduler):
    """Requests that stop on EOS long before max_tokens lower growth_ratio, so more run at
    once than a full max_tokens reservation would allow; a preemption raises it again."""
    sched = make_scheduler(num_blocks=33, max_model_len=64, max_num_seqs=8)  # 32 usable blocks
    n = 40
    for i in range(n):  # 8-token prompts, max_tokens 40 (12 blocks at the cap), EOS as 2nd token
        sched.add_request(req(f"r{i}", prompt_of(8, i), arrival=i, max_tokens=40))
    res = run(sched, FakeRunner(BS, script={f"r{i}": [5, EOS] for i in range(n)}))
    assert all(len(res["tokens"][f"r{i}"]) == 2 for i in range(n))
    widths = [len(so.num_scheduled_tokens) for so in res["steps"]]
    assert max(widths[:2]) <= 2  # 32 // 12: the first admissions reserve the whole cap
    assert max(widths[-10:]) > 2 and sched.growth_ratio < 0.5
    ratio = sched.growth_ratio
    sched.add_request(req("x", prompt_of(8, 99), max_tokens=40))
    so = sched.schedule()
    sched.update_from_output(so, FakeRunner(BS).execute(so))
    sched._preempt(sched.running.pop())
    assert sched.growth_ratio == pytest.approx(ratio + 0.1)
    sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert sched.growth_ratio == pytest.approx(ratio + 0.1)  # an abort says nothing about length


def test_preemption_victim_fcfs_is_latest_arrival(make_scheduler):
    sched = make_scheduler(num_blocks=9, max_model_len=32,  # 8 usable blocks
                           reserve_kv_for_growth=False)
    runner = FakeRunner(BS)
    sched.add_request(req("old", prompt_of(12), arrival=0, max_tokens=30, ignore_eos=True))
    sched.add_request(req("new", prompt_of(12, 1), arrival=1, max_tokens=30, ignore_eos=True))
    while not sched.num_preemptions:
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    assert sched.requests["new"].num_preemptions == 1
    assert sched.requests["old"].status == RequestStatus.RUNNING
    run(sched, runner)


def test_priority_policy(make_scheduler):
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, prio, arrival in [("p5", 5, 0), ("p1a", 1, 1), ("p3", 3, 2), ("p1b", 1, 3)]:
        sched.add_request(req(rid, prompt_of(5), arrival=arrival, priority=prio, max_tokens=2))
    res = run(sched, FakeRunner(BS))
    order = [n.req_id for s in res["steps"] for n in s.scheduled_new_reqs]
    assert order == ["p1a", "p1b", "p3", "p5"]


def test_priority_preempts_the_lowest_priority(make_scheduler):
    sched = make_scheduler(policy="priority", num_blocks=9, max_model_len=32,
                           reserve_kv_for_growth=False)
    runner = FakeRunner(BS)
    sched.add_request(
        req("low", prompt_of(12), arrival=0, priority=9, max_tokens=30, ignore_eos=True)
    )
    sched.add_request(
        req("high", prompt_of(12, 1), arrival=1, priority=0, max_tokens=30, ignore_eos=True)
    )
    while not sched.num_preemptions:
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    assert sched.requests["high"].status == RequestStatus.RUNNING
    res = run(sched, runner)
    assert len(res["tokens"]["low"]) + len(res["tokens"]["high"]) > 0


def test_abort_waiting_and_running(make_scheduler):
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(BS)
    sched.add_request(req("run", prompt_of(10), arrival=0, max_tokens=20))
    sched.add_request(req("wait", prompt_of(10, 1), arrival=1, max_tokens=20))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.finish_requests("wait", RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    # Aborted between schedule and update: its sampled token is dropped, no output.
    so = sched.schedule()
    sched.finish_requests(["run", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(so, runner.execute(so)) == []
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.usage == 0.0
    assert sched.schedule().finished_req_ids == {"run"}
    with pytest.raises(ValueError):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_add_request_validation(make_scheduler):
    sched = make_scheduler(max_model_len=16, num_blocks=8)
    # Prompt rules belong to the front end (test_input_processor.py); the scheduler asserts them.
    with pytest.raises(AssertionError):
        sched.add_request(req("long", prompt_of(17)))
    with pytest.raises(AssertionError):
        sched.add_request(req("empty", []))
    sched.add_request(req("full", prompt_of(16), max_tokens=10))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("full", prompt_of(3)))
    res = run(sched, FakeRunner(BS))
    assert len(res["tokens"]["full"]) == 1 and res["finish"]["full"][0] == "length"
    with pytest.raises(ValueError, match="KV cache holds 28 tokens"):
        Scheduler(max_model_len=32, block_size=BS, num_blocks=8)


def test_max_model_len_caps_output(make_scheduler):
    sched = make_scheduler(max_model_len=20, num_blocks=8)
    sched.add_request(req("a", prompt_of(15), max_tokens=100))
    res = run(sched, FakeRunner(BS))
    assert len(res["tokens"]["a"]) == 5 and res["finish"]["a"][0] == "length"


@pytest.mark.parametrize(
    "params,script,expect_len,expect_finish",
    [
        ({"max_tokens": 10}, [7, 8, EOS, 9], 3, ("stop", None)),
        ({"max_tokens": 10, "ignore_eos": True}, [7, 8, EOS, 9], 10, ("length", None)),
        ({"max_tokens": 10, "min_tokens": 4}, [7, EOS, EOS, 8, EOS], 5, ("stop", None)),
        ({"max_tokens": 10, "stop_token_ids": [8]}, [7, 8, 9], 2, ("stop", 8)),
        ({"max_tokens": 10, "stop_token_ids": [8], "min_tokens": 3}, [8, 8, 8, 9], 3, ("stop", 8)),
        (
            {"max_tokens": 10, "ignore_eos": True, "stop_token_ids": [9]},
            [EOS, EOS, 9],
            3,
            ("stop", 9),
        ),
        ({"max_tokens": 3}, [EOS if i == 2 else 7 for i in range(5)], 3, ("stop", None)),
        ({"max_tokens": 2}, [7, 7, 7], 2, ("length", None)),
    ],
)
def test_stop_conditions(make_scheduler, params, script, expect_len, expect_finish):
    sched = make_scheduler()
    sched.add_request(req("a", prompt_of(6), **params))
    res = run(sched, FakeRunner(BS, script={"a": script}))
    assert res["tokens"]["a"] == script[:expect_len] or len(res["tokens"]["a"]) == expect_len
    assert len(res["tokens"]["a"]) == expect_len
    assert res["finish"]["a"][:2] == expect_finish


def test_stats_and_from_config(make_scheduler):
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", prompt_of(8, i), arrival=i))
    runner = FakeRunner(BS)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 63)  # 2 blocks each
    assert sched.get_request_counts() == (2, 1) and sched.get_num_unfinished_requests() == 3

    @dataclass
    class CC:
        block_size: int = 8
        enable_prefix_caching: bool = False

    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32,
                         policy="priority", max_num_partial_prefills=2, target_step_ms=25.0)
    sc.validate()
    s2 = Scheduler.from_config(sc, CC(), num_blocks=10)
    assert (s2.policy, s2.block_size, s2.enable_prefix_caching) == ("priority", 8, False)
    # vLLM's default threshold with concurrent partial prefills: 4% of max_model_len.
    assert (s2.max_num_partial_prefills, s2.long_prefill_token_threshold) == (2, 1)
    assert s2.step_cost is not None and s2.step_cost.target_step_ms == 25.0


class FakeLogprobs:  # a prompt-logprobs entry: one row per prompt position
    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def slice(self, start: int, end: int) -> FakeLogprobs:
        return FakeLogprobs(self.rows[start:end])


def test_prompt_logprobs_not_repeated_after_preemption(make_scheduler):
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(req("a", prompt_of(20), prompt_logprobs=1, max_tokens=2))
    seen: list[int] = []
    for _ in range(2):  # two chunks: positions 0..7, 8..15
        so = sched.schedule()
        start = sched.requests["a"].num_computed_tokens - 8
        ro = FakeRunnerOutput(
            ["a"], [[]], [None], {"a": FakeLogprobs(list(range(start, start + 8)))}
        )
        for out in sched.update_from_output(so, ro):
            seen.extend(out.new_prompt_logprobs.rows)
    sched._preempt(sched.running.pop())
    while sched.has_unfinished_requests():
        so = sched.schedule()
        request = sched.requests["a"]
        end = request.num_computed_tokens
        start = end - so.num_scheduled_tokens["a"]
        stop = min(end, 19)
        entry = FakeLogprobs(list(range(start, stop))) if stop > start else None
        sampled = [[7]] if end == request.num_tokens else [[]]
        ro = FakeRunnerOutput(["a"], sampled, [None], {"a": entry} if entry else {})
        for out in sched.update_from_output(so, ro):
            if out.new_prompt_logprobs is not None:
                seen.extend(out.new_prompt_logprobs.rows)
    assert seen == list(range(19))


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [200, 13])
def test_async_scheduling_gives_the_same_outputs(make_scheduler, prefix_caching, num_blocks):
    """Scheduling step N+1 before step N's tokens land (placeholders) changes nothing the
    requests see: same tokens and finish reasons, every KV read is the request's own (the fake
    runner checks each slot), prefix hits only over known tokens, preemptions with a token in
    flight keep it, and no block leaks (fixture teardown)."""
    scripts = {"s1": [7, 8, EOS, 9], "s2": [5, 6, 7, 8, 9, 10]}

    def workload(async_scheduling: bool) -> tuple[dict[str, Any], Scheduler]:
        sched = make_scheduler(num_blocks=num_blocks, max_model_len=48,
                               enable_prefix_caching=prefix_caching, max_num_batched_tokens=24,
                               reserve_kv_for_growth=False)
        shared = prompt_of(12, 5)
        for i in range(5):
            sched.add_request(req(f"r{i}", prompt_of(10 + 3 * i, i % 3), arrival=i,
                                  max_tokens=20, ignore_eos=True))
        sched.add_request(req("p1", shared + [1, 2], arrival=5, max_tokens=6))
        sched.add_request(req("p2", shared + [3], arrival=6, max_tokens=6))
        sched.add_request(req("s1", prompt_of(9, 1), arrival=7, max_tokens=10))
        sched.add_request(req("s2", prompt_of(7, 2), arrival=8, max_tokens=10,
                              stop_token_ids=[8]))
        sched.add_request(req("cap", prompt_of(40, 4), arrival=9, max_tokens=100,
                              ignore_eos=True))
        return run(sched, FakeRunner(BS, script=scripts), async_scheduling=async_scheduling), sched

    sync, _ = workload(False)
    got, sched = workload(True)
    assert got["tokens"] == sync["tokens"]
    # (Prefix-hit sizes may differ: blocks are cached when a step's output lands, later here.)
    assert {k: v[:2] for k, v in got["finish"].items()} == {
        k: v[:2] for k, v in sync["finish"].items()}
    assert got["finish"]["s1"][:2] == ("stop", None) and got["tokens"]["s1"] == [7, 8, EOS]
    assert got["finish"]["s2"][:2] == ("stop", 8) and got["finish"]["cap"][0] == "length"
    assert len(got["tokens"]["cap"]) == 8  # max_model_len 48, never one token past it
    if num_blocks == 13:
        assert sched.make_stats().num_preemptions > 0
    # Requests ran in consecutive steps before their previous token had landed.
    assert any(set(a.num_scheduled_tokens) & set(b.num_scheduled_tokens)
               for a, b in zip(got["steps"], got["steps"][1:], strict=False))


def test_async_placeholder_stops_at_max_tokens(make_scheduler):
    sched = make_scheduler()
    sched.add_request(req("a", prompt_of(6), max_tokens=2, ignore_eos=True))
    first = sched.schedule()  # the prompt: samples output 1
    assert sched.requests["a"].num_output_placeholders == 1
    second = sched.schedule()  # output 1's input, before it landed: samples output 2
    assert second.num_scheduled_tokens == {"a": 1}
    assert sched.requests["a"].num_output_placeholders == 2
    assert sched.schedule().total_num_scheduled_tokens == 0  # output 3 would pass max_tokens
    runner = FakeRunner(BS)
    out1, out2 = runner.execute(first), runner.execute(second)
    assert [o.new_token_ids for o in sched.update_from_output(first, out1)] == \
        [out1.sampled_token_ids[0]]
    outs = sched.update_from_output(second, out2)
    assert outs[0].finish_reason == "length" and not sched.has_unfinished_requests()


# ---- the scheduling policy -----------------------------------------------------------------------
def _first_token_steps(sched: Scheduler, runner: FakeRunner, check_step: Any = None,
                       arrivals: dict[int, list[Request]] | None = None) -> dict[str, int]:
    """Steps until idle (adding `arrivals[step]` before that step); returns the step at which
    each request got its first token. check_step(decode_ready_ids, scheduler_output) runs on
    every step with the running requests that had only their next token to compute."""
    first: dict[str, int] = {}
    arrivals = arrivals or {}
    for step in range(5000):
        for request in arrivals.get(step, []):
            sched.add_request(request)
        if not sched.has_unfinished_requests() and step > max(arrivals, default=0):
            return first
        ready = {r.request_id for r in sched.running
                 if r.num_tokens - r.num_computed_tokens == 1}
        so = sched.schedule()
        if check_step is not None:
            check_step(ready, so)
        for o in sched.update_from_output(so, runner.execute(so)):
            if o.new_token_ids:
                first.setdefault(o.req_id, step)
    raise AssertionError("the scheduler did not drain")


def _fit_budget(sched: Scheduler, budget: int) -> None:
    """Feeds the step-time model two step sizes whose fit gives `budget` tokens at the target
    (a = 0 ms, b = target / budget ms per token)."""
    ms_per_token = sched.step_cost.target_step_ms / budget
    for _ in range(5):
        sched.record_step_time(8, 8 * ms_per_token)
        sched.record_step_time(40, 40 * ms_per_token)
    assert sched.step_token_budget == budget


def test_decodes_first_and_prefills_fill_the_step_budget(make_scheduler):
    """Under a step budget of 20 tokens (learned from step times), every running decode gets
    its token in every step, and prompt chunks add only what the budget leaves (at least
    min_prefill_tokens), however many long prompts wait."""
    # max_num_batched_tokens 300: the 290 waiting prompt tokens are no burst (_update_burst).
    sched = make_scheduler(max_num_batched_tokens=300, max_num_seqs=16, num_blocks=256,
                           max_model_len=256, target_step_ms=4.0, min_prefill_tokens=4,
                           enable_prefix_caching=False)
    _fit_budget(sched, 20)
    arrivals = {0: [req(f"s{i}", prompt_of(4, i), arrival=i, max_tokens=40) for i in range(8)],
                3: [req("long", prompt_of(200, 50), arrival=10, max_tokens=4)]
                + [req(f"m{i}", prompt_of(30, 60 + i), arrival=11 + i, max_tokens=4)
                   for i in range(3)]}
    steps_with_prefill = 0

    def check(ready: set[str], so: SchedulerOutput) -> None:
        nonlocal steps_with_prefill
        assert all(so.num_scheduled_tokens.get(rid) == 1 for rid in ready), (ready, so)
        num_prefill = so.total_num_scheduled_tokens - len(ready)
        assert num_prefill <= max(20 - len(ready), 4)
        steps_with_prefill += num_prefill > 0

    first = _first_token_steps(sched, FakeRunner(BS), check, arrivals)
    assert set(first) == {f"s{i}" for i in range(8)} | {"long", "m0", "m1", "m2"}
    assert steps_with_prefill > 12  # the 290 prompt tokens went in small chunks


def test_burst_fills_max_num_batched_tokens_then_the_budget_returns(make_scheduler):
    """A backlog of waiting prompt tokens larger than one step of max_num_batched_tokens is a
    burst: prompt chunks fill max_num_batched_tokens (vLLM's chunk) while every running decode
    still gets its token first, first tokens come in arrival order, and once no prompt waits or
    is part-way through, prompt chunks are held to the step budget again."""
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=32, num_blocks=512,
                           max_model_len=128, target_step_ms=4.0, min_prefill_tokens=4,
                           enable_prefix_caching=False)
    _fit_budget(sched, 16)
    burst = {0: [req(f"b{i}", prompt_of(20, i), arrival=i, max_tokens=30) for i in range(12)]}
    modes: list[tuple[bool, int, int]] = []  # (burst, prompt tokens, decodes) per step

    def check(ready: set[str], so: SchedulerOutput) -> None:
        assert all(so.num_scheduled_tokens.get(rid) == 1 for rid in ready), (ready, so)
        assert so.num_decode_tokens == len(ready)
        num_prefill = so.total_num_scheduled_tokens - len(ready)
        modes.append((sched.burst, num_prefill, len(ready)))
        if sched.burst:  # chunks fill the step while prompts are left to fill it with
            left = sum(r.num_tokens - r.num_computed_tokens for r in sched.requests.values()
                       if r.num_computed_tokens < r.num_prompt_tokens) + num_prefill
            assert so.total_num_scheduled_tokens == min(64, len(ready) + left)
        else:
            assert num_prefill <= max(16 - len(ready), 4)

    first = _first_token_steps(sched, FakeRunner(BS), check, burst)
    steps = [first[f"b{i}"] for i in range(12)]
    assert steps == sorted(steps)
    assert modes[0][0] and modes[0][1] == 64 and not modes[-1][0]
    # After the burst: a late pair of prompts (40 tokens <= 64) runs under the step budget.
    modes.clear()
    late = {0: [req(f"l{i}", prompt_of(20, 100 + i), arrival=100 + i, max_tokens=3)
                for i in range(2)]}
    first = _first_token_steps(sched, FakeRunner(BS), check, late)
    assert set(first) == {"l0", "l1"} and not any(m[0] for m in modes)
    assert max(m[1] for m in modes) == 16


def test_prompt_budget_shrinks_with_the_decodes_a_step_carries(make_scheduler):
    """The step-time model prices decode tokens apart from prompt tokens: with a decode token
    twice as dear as a prompt token, a step that carries 8 decodes leaves room for 16 fewer
    prompt tokens."""
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=32, num_blocks=512,
                           max_model_len=128, target_step_ms=8.0, min_prefill_tokens=4,
                           enable_prefix_caching=False)
    for i in range(40):  # 0.25 ms per prompt token, 0.5 per decode token
        p, d = 4 + 9 * (i % 7), 10 * (i % 5)
        sched.record_step_time(p + d, 0.25 * p + 0.5 * d, num_decode_tokens=d)
    assert sched.prefill_token_budget(0) == 32 and sched.prefill_token_budget(8) == 16
    runner = FakeRunner(BS)
    for i in range(8):
        sched.add_request(req(f"d{i}", prompt_of(3, i), arrival=i, max_tokens=20))
    so = sched.schedule()  # 24 prompt tokens: all eight prompts in one step
    sched.update_from_output(so, runner.execute(so))
    sched.add_request(req("p", prompt_of(60, 50), arrival=50, max_tokens=2))
    so = sched.schedule()
    assert so.num_decode_tokens == 8 and so.num_scheduled_tokens["p"] == 16


def test_step_budget_defaults_to_max_num_batched_tokens(make_scheduler):
    sched = make_scheduler(max_num_batched_tokens=48)
    sched.record_step_time(40, 30.0)  # no target: nothing is learned
    assert sched.step_cost is None and sched.step_token_budget == 48
    timed = make_scheduler(max_num_batched_tokens=48, target_step_ms=5.0, max_model_len=128,
                           min_prefill_tokens=4)
    assert timed.step_token_budget == 48  # nothing measured yet: no throttling on guesses
    timed.add_request(req("a", prompt_of(45), max_tokens=1))  # no burst: 45 <= 48 waiting
    assert timed.schedule().total_num_scheduled_tokens == 45
    timed = make_scheduler(max_num_batched_tokens=48, target_step_ms=5.0, max_model_len=128,
                           min_prefill_tokens=4)
    _fit_budget(timed, 24)
    timed.add_request(req("a", prompt_of(45), max_tokens=1))
    assert timed.schedule().total_num_scheduled_tokens == 24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_tokens_in_arrival_order_at_equal_priority(make_scheduler, seed):
    """Prompts of mixed lengths (some many budgets long) arriving over time under a small
    budget: first tokens come in arrival order, and every request finishes."""
    import random

    rng = random.Random(seed)
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8, num_blocks=200,
                           max_model_len=128, enable_prefix_caching=False)
    arrivals: dict[int, list[Request]] = {}
    for i, step in enumerate(sorted(rng.randrange(30) for _ in range(24))):
        length = rng.choice([3, 5, 17, 40, 90])
        arrivals.setdefault(step, []).append(
            req(f"r{i}", prompt_of(length, i), arrival=i, max_tokens=rng.randrange(1, 6)))
    added = [r.request_id for step in sorted(arrivals) for r in arrivals[step]]
    first = _first_token_steps(sched, FakeRunner(BS), arrivals=arrivals)
    assert set(first) == set(added)
    steps = [first[rid] for rid in added]
    assert steps == sorted(steps), (added, steps)


def test_long_prefill_threshold_lets_short_prompts_through(make_scheduler):
    """With long_prefill_token_threshold a long prompt takes at most that many tokens a step:
    it progresses every step, and a short prompt behind it starts at once instead of waiting
    for the whole long prompt."""
    base = dict(max_num_batched_tokens=16, num_blocks=128, max_model_len=256,
                enable_prefix_caching=False)
    arrivals = {0: [req("long", prompt_of(160), arrival=0, max_tokens=2),
                    req("short", prompt_of(4, 1), arrival=1, max_tokens=2)]}
    fcfs = _first_token_steps(make_scheduler(**base), FakeRunner(BS), arrivals=arrivals)
    assert fcfs["short"] > fcfs["long"] >= 9  # strict FCFS: behind 160 / 16 steps

    arrivals = {0: [req("long", prompt_of(160), arrival=0, max_tokens=2),
                    req("short", prompt_of(4, 1), arrival=1, max_tokens=2)]}
    sched = make_scheduler(long_prefill_token_threshold=12, **base)
    long_chunks = []

    def check(ready: set[str], so: SchedulerOutput) -> None:
        if "long" in so.num_scheduled_tokens and "long" not in ready:
            long_chunks.append(so.num_scheduled_tokens["long"])

    first = _first_token_steps(sched, FakeRunner(BS), check, arrivals)
    assert first["short"] == 0
    assert long_chunks[:-1] == [12] * (len(long_chunks) - 1) and sum(long_chunks) == 160


def test_concurrent_partial_prefills_pass_over_long_prompts(make_scheduler):
    """max_num_partial_prefills 2 / max_long_partial_prefills 1: while one long prompt is
    prefilled, a second long one waits and the short one behind it starts."""
    sched = make_scheduler(max_num_batched_tokens=32, num_blocks=128, max_model_len=200,
                           enable_prefix_caching=False, max_num_partial_prefills=2,
                           max_long_partial_prefills=1, long_prefill_token_threshold=8)
    for i, (rid, n) in enumerate([("long1", 64), ("long2", 64), ("short", 6)]):
        sched.add_request(req(rid, prompt_of(n, i), arrival=i, max_tokens=2))
    runner = FakeRunner(BS)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"long1": 8, "short": 6}
    assert [r.request_id for r in sched.waiting] == ["long2"]
    sched.update_from_output(so, runner.execute(so))
    res = run(sched, runner)
    assert set(res["finish"]) == {"long1", "long2", "short"}


def test_priority_orders_prompt_chunks(make_scheduler):
    """Priority policy under a small budget: lower values get their first token first, ties by
    arrival; a prompt of lower priority never delays one of higher priority."""
    # The threshold keeps several prompts in chunked prefill at once: their chunks must go in
    # priority order too, not only admission.
    sched = make_scheduler(policy="priority", max_num_batched_tokens=16, num_blocks=128,
                           enable_prefix_caching=False, long_prefill_token_threshold=6)
    specs = [("p5", 5, 0), ("p1a", 1, 1), ("p3", 3, 2), ("p1b", 1, 3), ("p0", 0, 4)]
    arrivals = {0: [req(rid, prompt_of(20, i), arrival=a, priority=p, max_tokens=3)
                    for i, (rid, p, a) in enumerate(specs)]}
    first = _first_token_steps(sched, FakeRunner(BS), arrivals=arrivals)
    steps = [first[rid] for rid in ("p0", "p1a", "p1b", "p3", "p5")]
    assert steps == sorted(steps) and steps[0] < steps[2] < steps[4], steps


def test_prefix_lookups_are_counted_once_per_request(make_scheduler):
    """A request that waits several steps at the head of the queue is looked up every step but
    counted once, when it is admitted."""
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(BS)
    shared = prompt_of(16)
    sched.add_request(req("a", shared + [1], max_tokens=6))
    sched.add_request(req("b", shared + [2], max_tokens=1))  # waits while a runs
    res = run(sched, runner)
    assert res["finish"]["b"][2] == 16
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 17 + 17 and stats.prefix_cache_hits == 16
    assert sched.kv_cache_manager.prefix_cache_requests == 2


def test_step_budget_never_blocks_a_whole_prompt_without_chunking(make_scheduler):
    """Without chunked prefill a prompt runs whole, so a step budget smaller than it must not
    apply (the prompt would wait forever)."""
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64, target_step_ms=4.0,
                           min_prefill_tokens=4, enable_chunked_prefill=False)
    _fit_budget(sched, 16)
    sched.add_request(req("a", prompt_of(40), max_tokens=2))
    res = run(sched, FakeRunner(BS))
    assert res["steps"][0].num_scheduled_tokens == {"a": 40} and len(res["tokens"]["a"]) == 2


def test_pooling_request_is_prefill_only(make_scheduler):
    """A pooling request runs its prompt in chunks, never holds an output placeholder, and
    finishes ("stop") in the step whose runner output carries its pooled array."""
    import numpy as np

    from pyorch.pooling_params import PoolingParams

    sched = make_scheduler(max_num_batched_tokens=16, enable_prefix_caching=True)
    sched.add_request(req("gen", prompt_of(40, 1), max_tokens=3))
    pooling = Request("pool", prompt_of(40, 1), SamplingParams(), EOS, 1.0,
                      pooling_params=PoolingParams("embed", True, None))
    assert pooling.max_tokens == 0 and not pooling.use_prefix_cache
    sched.add_request(pooling)
    finished = {}
    for _ in range(50):
        so = sched.schedule()
        if not so.total_num_scheduled_tokens:
            break
        assert pooling.num_output_placeholders == 0
        done = {r for r in so.num_scheduled_tokens if r == "pool"
                and pooling.num_computed_tokens == pooling.num_prompt_tokens}
        ids = list(so.num_scheduled_tokens)
        sampled = [[] if r == "pool" or sched.requests[r].num_output_placeholders == 0
                   else [5] for r in ids]
        out = FakeRunnerOutput(ids, sampled, [None] * len(ids),
                               pooled={r: np.full(4, 0.5, np.float32) for r in done})
        for o in sched.update_from_output(so, out):
            if o.finished:
                finished[o.req_id] = o
    assert finished["pool"].finish_reason == "stop" and finished["pool"].new_token_ids == []
    assert finished["pool"].pooled.tolist() == [0.5] * 4
    assert finished["pool"].num_cached_tokens == 0  # no prefix hit, though "gen" shares it
    assert finished["gen"].finish_reason == "length"
    assert "pool" not in sched.requests
