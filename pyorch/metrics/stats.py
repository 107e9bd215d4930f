"""What the engine reports each step, for metrics.

The engine core sends a `SchedulerStats` snapshot (defined here; the scheduler fills it) with
every batch of outputs; the front end (`AsyncLLM`, `LLMEngine`) turns each batch of
EngineCoreOutputs into one `IterationStats` and hands both to its stat loggers
(`StatLoggerBase.record`). The Prometheus logger in `pyorch.metrics.prometheus` exports them under
vLLM's metric names with the `pyorch:` prefix.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics (counters are cumulative since it started)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks held by requests
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass
class FinishedRequestStats:
    """One finished (parent) request, for the per-request histograms."""

    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float = 0.0  # seconds from arrival to first scheduled (0 when unknown)
    prefill_time: float = 0.0  # seconds from first scheduled to first token (0 when unknown)
    decode_time: float = 0.0  # seconds from first token to the last
    inference_time: float = 0.0  # seconds from first scheduled to the last token (0: unknown)
    n_param: int = 1  # the request's n
    max_tokens_param: Optional[int] = None  # the request's max_tokens


@dataclass
class IterationStats:
    """What one batch of engine outputs contained (one engine step, seen from the front end)."""

    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token this step
    num_generation_tokens: int = 0  # tokens generated this step
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, per request
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, per token
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLoggerBase:
    """Receives every step's stats. Subclasses must not raise (a logger never stops the engine)."""

    def record(self, scheduler_stats: Optional[SchedulerStats],
               iteration_stats: Optional[IterationStats]) -> None:
        raise NotImplementedError

    def log(self) -> None:  # periodic summary (optional)
        pass


def record_stats(stat_loggers: list[StatLoggerBase], scheduler_stats: Optional[SchedulerStats],
                 iteration_stats: IterationStats) -> None:
    """Hands one step's stats to every logger; a logger that raises is logged, not fatal."""
    for stat_logger in stat_loggers:
        try:
            stat_logger.record(scheduler_stats, iteration_stats)
        except Exception:
            logger.exception("stat logger %s failed; continuing", type(stat_logger).__name__)


@dataclass
class StepTimings:
    """Cumulative wall time of the engine's steps by phase, in seconds (benchmarks read it).

    Everything but `wait` is host work; `launch` also absorbs any time the host is held up
    launching kernels behind a full device queue. With async scheduling the host phases of step
    N+1 run while the device computes step N, so a step costs max(host, device), not the sum.
    """

    steps: int = 0
    schedule: float = 0.0  # Scheduler.schedule
    prepare: float = 0.0  # runner: apply the diff, pack the inputs, host -> device copy
    launch: float = 0.0  # runner: forward (graph replay or eager), logits, sampler
    wait: float = 0.0  # blocked until the step's sampled tokens reached the host
    update: float = 0.0  # runner + scheduler: append tokens, stop checks, free blocks
    output: float = 0.0  # front end: detokenization, stop strings, RequestOutputs
    cascade_steps: int = 0  # decode steps that ran cascade attention (pyorch/executor/cascade.py)
    # Benchmarks set a list here to get one record per step on CUDA (`ModelRunner` fills it
    # from CUDA events; `summarize_step_trace` reads it). None: nothing is recorded.
    trace: Optional[list[dict[str, Any]]] = None
    # While tracing: the garbage collector's pauses, recorded with each step.
    gc_pauses: Optional[GcPauses] = None

    PHASES = ("schedule", "prepare", "launch", "wait", "update", "output")

    def snapshot(self) -> StepTimings:
        return dataclasses.replace(self)

    def per_step_ms(self, since: StepTimings) -> dict[str, float]:
        """Milliseconds per step of each phase since `since`, plus `host` (all but wait)."""
        steps = max(self.steps - since.steps, 1)
        out = {k: (getattr(self, k) - getattr(since, k)) / steps * 1e3 for k in self.PHASES}
        out["host"] = sum(v for k, v in out.items() if k != "wait")
        out["steps"] = self.steps - since.steps
        return out


class GcPauses:
    """Time the garbage collector stops the process for, and full (generation-2) collections,
    while installed as a `gc.callbacks` entry (`with GcPauses() as pauses:`)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.full_collections = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.total_s += time.perf_counter() - self._start
        self.full_collections += info.get("generation") == 2

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


# Running totals a trace record may carry besides host_total_s / wait_total_s, and the per-step
# delta each becomes in `summarize_step_trace` (seconds become milliseconds).
_TRACE_TOTALS = {"gc_total_s": "gc_ms", "gc_full_total": "gc_full",
                 "alloc_retries_total": "alloc_retries"}


def summarize_step_trace(records: list[dict[str, Any]], start_s: float,
                         end_s: float) -> dict[str, Any]:
    """Where a run's time went, from `StepTimings.trace` records (steps in launch order) and
    the run's perf_counter() bounds: device busy time per step, device idle time before each
    step's first device work, and the host's work and wait between one step's launch and the
    next, split into decode-only steps and steps with prefill tokens; per step also the host
    time by phase, GC pauses and allocator retries where the records carry their totals, and
    the five longest idle gaps with the host work of the step before each."""
    for r, nxt in itertools.pairwise(records):
        r["host_ms"] = (nxt["host_total_s"] - r["host_total_s"]) * 1e3
        r["wait_ms"] = (nxt["wait_total_s"] - r["wait_total_s"]) * 1e3
        if "phase_s" in r:  # the host time by phase
            r["phase_ms"] = {k: (nxt["phase_s"][k] - v) * 1e3 for k, v in r["phase_s"].items()}
        for total, delta in _TRACE_TOTALS.items():
            if total in r:
                r[delta] = (nxt[total] - r[total]) * (1e3 if total.endswith("_s") else 1)
    kinds: dict[str, dict[str, Any]] = {}
    for r in records:
        k = kinds.setdefault("decode" if r["decode_only"] else "prefill",
                             {"steps": 0, "tokens": 0, "busy_ms": 0.0, "idle_ms": 0.0,
                              "idle_steps": 0, "host_ms": 0.0, "wait_ms": 0.0, "gc_ms": 0.0,
                              "gc_full": 0, "alloc_retries": 0})
        k["steps"] += 1
        k["tokens"] += r["num_tokens"]
        k["busy_ms"] += r["device_ms"]
        idle = r.get("idle_before_ms", 0.0)
        k["idle_ms"] += idle
        k["idle_steps"] += idle > 0.05
        k["host_ms"] += r.get("host_ms", 0.0)
        k["wait_ms"] += r.get("wait_ms", 0.0)
        for key in ("gc_ms", "gc_full", "alloc_retries"):
            k[key] += r.get(key, 0)
    for k in kinds.values():
        for key in ("busy_ms", "idle_ms", "host_ms", "wait_ms"):
            k[key.replace("_ms", "_ms_per_step")] = k[key] / k["steps"]
    busy = sum(k["busy_ms"] for k in kinds.values())
    idle = sum(k["idle_ms"] for k in kinds.values())
    first = (records[0]["t_s"] - start_s) * 1e3 if records else 0.0
    wall = (end_s - start_s) * 1e3
    # The steps before the longest device idle gaps, with what their host time went to.
    idle_gaps = sorted(range(1, len(records)), key=lambda i: -records[i].get("idle_before_ms", 0))
    worst = [{"step": i, "idle_before_ms": records[i]["idle_before_ms"],
              **{k: records[i - 1][k] for k in ("host_ms", "phase_ms", "gc_ms", "alloc_retries",
                                                "num_tokens") if k in records[i - 1]}}
             for i in idle_gaps[:5] if records[i].get("idle_before_ms", 0) > 1.0]
    return {"wall_ms": wall, "device_busy_ms": busy, "device_idle_between_steps_ms": idle,
            "before_first_launch_ms": first,
            "after_last_step_ms": wall - first - busy - idle, "by_kind": kinds,
            "longest_idle_gaps": worst}


def format_step_trace(summary: dict[str, Any]) -> str:
    """One line of `summarize_step_trace`'s figures."""
    parts = [f"wall {summary['wall_ms']:.0f} ms = before the first launch "
             f"{summary['before_first_launch_ms']:.0f} + device busy "
             f"{summary['device_busy_ms']:.0f} + idle between steps "
             f"{summary['device_idle_between_steps_ms']:.0f} + after the last step "
             f"{summary['after_last_step_ms']:.0f}"]
    for name, k in summary["by_kind"].items():
        parts.append(f"{name}: {k['steps']} steps, busy {k['busy_ms_per_step']:.2f} ms/step, "
                     f"idle {k['idle_ms_per_step']:.2f} ({k['idle_steps']} steps), host "
                     f"{k['host_ms_per_step']:.2f}, wait {k['wait_ms_per_step']:.2f}, gc "
                     f"{k['gc_ms']:.0f} ms ({k['gc_full']} full), allocator retries "
                     f"{k['alloc_retries']}")
    return "; ".join(parts)
