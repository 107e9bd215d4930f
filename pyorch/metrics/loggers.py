"""LoggingStatLogger: the server's periodic stats line (vLLM's LoggingStatLogger).

Every `PYORCH_LOG_STATS_INTERVAL` seconds (10 s, vLLM's default) the API server calls `log()`,
which writes one line while the engine is busy or was busy since the last line:

    Avg prompt throughput: 52.3 tokens/s, Avg generation throughput: 181.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 40.0%

`--disable-log-stats` turns stats off altogether, as in vLLM: neither this line nor the engine's
Prometheus metrics are recorded.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from pyorch.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

logger = logging.getLogger("pyorch.metrics")


class LoggingStatLogger(StatLoggerBase):
    """Accumulates token counts between `log()` calls and logs throughput and engine state."""

    def __init__(self) -> None:
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last: Optional[SchedulerStats] = None
        self._last_time = time.monotonic()
        self._was_idle = True

    def record(self, scheduler_stats: Optional[SchedulerStats],
               iteration_stats: Optional[IterationStats]) -> None:
        if scheduler_stats is not None:
            self._last = scheduler_stats
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        prompt, generation = self._prompt_tokens / elapsed, self._generation_tokens / elapsed
        s = self._last or SchedulerStats()
        idle = not (self._prompt_tokens or self._generation_tokens or s.num_running_reqs
                    or s.num_waiting_reqs)
        self._prompt_tokens = self._generation_tokens = 0
        self._last_time = now
        if idle and self._was_idle:
            return  # nothing happened since the last (idle) line: stay quiet
        self._was_idle = idle
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit "
            "rate: %.1f%%", prompt, generation, s.num_running_reqs, s.num_waiting_reqs,
            s.kv_cache_usage * 100, s.prefix_cache_hit_rate * 100)
