"""PrometheusStatLogger (pyorch/metrics/prometheus.py): names, labels, counter increments."""

from __future__ import annotations

from conftest import metric

from pyorch.metrics.stats import SchedulerStats
from pyorch.metrics.prometheus import PrometheusStatLogger
from pyorch.metrics.stats import FinishedRequestStats, IterationStats


def test_gauges_counters_and_histograms():
    logger = PrometheusStatLogger("m", max_model_len=100)
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                                 prefix_cache_queries=100, prefix_cache_hits=40,
                                 num_preemptions=2), None)
    # Cumulative scheduler counters become increments.
    logger.record(SchedulerStats(num_running_reqs=0, prefix_cache_queries=150,
                                 prefix_cache_hits=40, num_preemptions=2),
                  IterationStats(num_prompt_tokens=7, num_generation_tokens=5,
                                 time_to_first_tokens=[0.2], inter_token_latencies=[0.01, 0.02],
                                 finished_requests=[FinishedRequestStats(
                                     "length", 1.5, 7, 5, queued_time=0.1)]))
    text = logger.render().decode()
    assert metric(text, "pyorch:num_requests_running", model_name="m") == 0
    assert metric(text, "pyorch:kv_cache_usage_perc") == 0
    assert metric(text, "pyorch:prefix_cache_queries_total") == 150
    assert metric(text, "pyorch:prefix_cache_hits_total") == 40
    assert metric(text, "pyorch:num_preemptions_total") == 2
    assert metric(text, "pyorch:prompt_tokens_total") == 7
    assert metric(text, "pyorch:generation_tokens_total") == 5
    assert metric(text, "pyorch:request_success_total", finished_reason="length") == 1
    assert metric(text, "pyorch:request_success_total", finished_reason="abort") == 0
    assert metric(text, "pyorch:inter_token_latency_seconds_count") == 2
    assert metric(text, "pyorch:e2e_request_latency_seconds_sum") == 1.5
    assert metric(text, "pyorch:request_prompt_tokens_bucket", le="10.0") == 1
    assert 'le="100.0"' in text and 'le="200.0"' not in text  # buckets stop at max_model_len


def test_each_logger_has_its_own_registry():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    a.record(None, IterationStats(num_generation_tokens=3))
    assert metric(a.render().decode(), "pyorch:generation_tokens_total") == 3
    assert metric(b.render().decode(), "pyorch:generation_tokens_total") == 0


def test_record_never_raises():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(), IterationStats(time_to_first_tokens=["bad"]))  # type: ignore


def test_vllm_prefix_and_request_param_metrics():
    from pyorch.config import CacheConfig
    from pyorch.metrics.prometheus import cache_config_info

    logger = PrometheusStatLogger("m", max_model_len=100, prefix="vllm:")
    logger.record(None, IterationStats(num_prompt_tokens=7, num_generation_tokens=2))
    logger.record(None, IterationStats())  # an empty step is not an iteration sample
    logger.record(None, IterationStats(num_generation_tokens=2, finished_requests=[
        FinishedRequestStats("stop", 2.0, 7, 4, queued_time=0.5, prefill_time=0.25,
                             decode_time=1.25, inference_time=1.5, n_param=2,
                             max_tokens_param=9)]))
    cache = CacheConfig(block_size=32, num_blocks=77)
    logger.set_cache_config_info(cache_config_info(cache))
    text = logger.render().decode()
    assert "pyorch:" not in text
    assert metric(text, "vllm:iteration_tokens_total_count") == 2
    assert metric(text, "vllm:iteration_tokens_total_sum") == 11
    assert metric(text, "vllm:iteration_tokens_total_bucket", le="8.0") == 1
    assert metric(text, "vllm:request_inference_time_seconds_sum") == 1.5
    assert metric(text, "vllm:request_params_n_bucket", le="1.0") == 0
    assert metric(text, "vllm:request_params_n_bucket", le="2.0") == 1
    assert metric(text, "vllm:request_params_max_tokens_sum") == 9
    assert metric(text, "vllm:cache_config_info", block_size="32", num_gpu_blocks="77",
                  model_name="m") == 1
