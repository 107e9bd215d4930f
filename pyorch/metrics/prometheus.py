"""Prometheus export of the engine's stats under vLLM's metric names, with a `pyorch:` prefix
(or `vllm:`, `--metrics-prefix vllm`, so that dashboards built for vLLM work unchanged).

One `PrometheusStatLogger` per server, on its own `CollectorRegistry` (not prometheus_client's
global one), so that several servers can live in one process (tests do). The API server's
`GET /metrics` renders `logger.registry`.

`SchedulerStats` counters are cumulative since the engine core started; Prometheus counters are
fed their increments.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pyorch.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

logger = logging.getLogger(__name__)

PREFIX = "pyorch:"
# --metrics-prefix choices -> the prefix every metric name carries.
METRIC_PREFIXES = {"pyorch": "pyorch:", "vllm": "vllm:"}
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets (seconds, tokens).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


class PrometheusStatLogger(StatLoggerBase):
    """Exports SchedulerStats / IterationStats to a dedicated registry.

    Parameters
    ----------
    model_name: the `model_name` label on every metric (the served model name).
    max_model_len: top of the token-count histograms' buckets.
    registry: where to register; a fresh CollectorRegistry when None.
    prefix: what every metric name starts with ("pyorch:", or "vllm:" for vLLM's dashboards).
    """

    def __init__(self, model_name: str, max_model_len: int = 2048,
                 registry: Optional[CollectorRegistry] = None, prefix: str = PREFIX) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self.num_requests_running = gauge("num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_hit_rate = gauge(
            "gpu_prefix_cache_hit_rate",
            "Prefix-cache hit rate since start (hits / queries, in tokens).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix-cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix-cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter(prefix + "request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=reg)
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            [float(b) for b in _ITERATION_TOKEN_BUCKETS])
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.",
            [float(b) for b in _N_BUCKETS])
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self._cache_config_info = Gauge(
            prefix + "cache_config_info", "Information of the LLMEngine CacheConfig",
            ["model_name", *CACHE_CONFIG_INFO_LABELS], registry=reg)
        # Last cumulative values seen, to feed the counters their increments.
        self._last_queries = self._last_hits = self._last_preemptions = 0

    def record(self, scheduler_stats: Optional[SchedulerStats],
               iteration_stats: Optional[IterationStats]) -> None:
        try:
            if scheduler_stats is not None:
                self._record_scheduler(scheduler_stats)
            if iteration_stats is not None:
                self._record_iteration(iteration_stats)
        except Exception:  # a logger never stops the engine
            logger.exception("PrometheusStatLogger.record failed")

    def _record_scheduler(self, s: SchedulerStats) -> None:
        self.num_requests_running.set(s.num_running_reqs)
        self.num_requests_waiting.set(s.num_waiting_reqs)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.prefix_cache_hit_rate.set(s.prefix_cache_hit_rate)
        self._last_queries = self._inc(self.prefix_cache_queries, s.prefix_cache_queries,
                                       self._last_queries)
        self._last_hits = self._inc(self.prefix_cache_hits, s.prefix_cache_hits, self._last_hits)
        self._last_preemptions = self._inc(self.num_preemptions, s.num_preemptions,
                                           self._last_preemptions)

    @staticmethod
    def _inc(counter: Counter, cumulative: int, last: int) -> int:
        # Snapshots arrive in order; an older one (smaller value) adds nothing.
        if cumulative > last:
            counter.inc(cumulative - last)
        return max(cumulative, last)

    def set_cache_config_info(self, info: dict[str, Any]) -> None:
        """Publishes `<prefix>cache_config_info` (value 1, the settings as labels, vLLM's
        info metric); `info` holds CACHE_CONFIG_INFO_LABELS (see `cache_config_info`)."""
        self._cache_config_info.labels(
            self.model_name, *(str(info[k]) for k in CACHE_CONFIG_INFO_LABELS)).set(1)

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_prompt_tokens + it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for req in it.finished_requests:
            reason = req.finish_reason if req.finish_reason in FINISH_REASONS else "stop"
            self.request_success[reason].inc()
            self.e2e.observe(req.e2e_latency)
            self.queue_time.observe(req.queued_time)
            self.prefill_time.observe(req.prefill_time)
            self.decode_time.observe(req.decode_time)
            self.inference_time.observe(req.inference_time)
            self.request_params_n.observe(req.n_param)
            if req.max_tokens_param is not None:
                self.request_params_max_tokens.observe(req.max_tokens_param)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


# vLLM's CacheConfig.metrics_info() labels that pyorch's cache has.
CACHE_CONFIG_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching",
                            "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks")


def cache_config_info(cache_config: Any) -> dict[str, Any]:
    """The `cache_config_info` labels of a started engine's CacheConfig (num_gpu_blocks: the
    KV blocks the engine has, on the GPU or, on the CPU, in host memory)."""
    return {"block_size": cache_config.block_size, "cache_dtype": cache_config.cache_dtype,
            "enable_prefix_caching": cache_config.enable_prefix_caching,
            "gpu_memory_utilization": cache_config.gpu_memory_utilization,
            "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
            "num_gpu_blocks": cache_config.num_blocks}
