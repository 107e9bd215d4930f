"""What the engine reports each step, for metrics.

The engine-core process sends a `SchedulerStats` snapshot (pyorch.engine.scheduler_output) with
every batch of outputs; the front end (`AsyncLLM`, `LLMEngine`) turns each batch of
EngineCoreOutputs into one `IterationStats` and hands both to its stat loggers
(`StatLoggerBase.record`). The Prometheus logger in `pyorch.metrics.prometheus` exports them under
vLLM's metric names with the `pyorch:` prefix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from pyorch.engine.scheduler_output import SchedulerStats


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
