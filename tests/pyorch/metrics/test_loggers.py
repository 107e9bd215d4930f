"""LoggingStatLogger (pyorch/metrics/loggers.py): the periodic stats line."""

from __future__ import annotations

import logging

from pyorch.metrics.loggers import LoggingStatLogger
from pyorch.metrics.stats import IterationStats, SchedulerStats


def test_logs_throughput_and_state_then_goes_quiet(caplog):
    caplog.set_level(logging.INFO, logger="pyorch.metrics")
    stat_logger = LoggingStatLogger()
    stat_logger.log()
    assert not caplog.records  # idle from the start: nothing to say
    stat_logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1,
                                      kv_cache_usage=0.5, prefix_cache_queries=10,
                                      prefix_cache_hits=4),
                       IterationStats(num_prompt_tokens=30, num_generation_tokens=6))
    stat_logger.log()
    line = caplog.records[-1].getMessage()
    assert "Avg prompt throughput: " in line and "Running: 2 reqs, Waiting: 1 reqs" in line
    assert "KV cache usage: 50.0%" in line and "Prefix cache hit rate: 40.0%" in line
    prompt_rate = float(line.split("Avg prompt throughput: ")[1].split(" ")[0])
    assert prompt_rate > 0
    # The engine drained: one line says so (all zero), then silence while idle.
    stat_logger.record(SchedulerStats(), None)
    stat_logger.log()
    assert "Running: 0 reqs" in caplog.records[-1].getMessage()
    count = len(caplog.records)
    stat_logger.log()
    assert len(caplog.records) == count
