"""vLLM's Prometheus exposition for one simulated instance (contract §1).

Gauges and counters are read from the engine at scrape time by a custom collector, so they can never
drift from the engine's state; latency histograms are observed as requests progress. Both the 0.11
names and the 0.8-0.10 names (gpu_cache_usage_perc, gpu_prefix_cache_*, time_per_output_token) are
emitted so old and new readers both work. Histogram values are in simulated seconds, which is what
the same workload would show on real hardware. The simulator-only ``vllm_sim_step_lag_seconds`` gauge
and its two companion counters (which give the exact lag ratio over an interval) are in wall seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_sim.engine import Engine
from vllm_sim.request import FINISH_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (contract §1.3).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
LABELS = ("model_name", "engine")


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, model: str, lag: Callable[[], tuple[float, float, float]]) -> None:
        self.engine = engine
        self.labels = [model, "0"]
        self.lag = lag

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.labels, value)
        return c

    def collect(self) -> Iterator[Metric]:
        e, c = self.engine, self.engine.counters
        usage = e.pool.usage()
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", e.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting
        )
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            usage,
        )
        queries = "Prefix cache queries, in terms of number of queried tokens."
        hits = "Prefix cache hits, in terms of number of cached tokens."
        yield self._counter("vllm:prefix_cache_queries", queries, c.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", hits, c.prefix_hits)
        yield self._counter(
            "vllm:gpu_prefix_cache_queries", "GPU " + queries + " DEPRECATED.", c.prefix_queries
        )
        yield self._counter("vllm:gpu_prefix_cache_hits", "GPU " + hits + " DEPRECATED.", c.prefix_hits)
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.preemptions
        )
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"),
        )
        for reason in FINISH_REASONS:
            success.add_metric([*self.labels, reason], c.finished[reason])
        yield success
        cfg = e.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=(
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "gpu_memory_utilization",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ),
        )
        info.add_metric(
            [str(e.block_size), "auto", "True", "0", "0.9", "0", str(cfg.num_gpu_blocks), "sha256"], 1.0
        )
        yield info
        lag = GaugeMetricFamily(
            "vllm_sim_step_lag_seconds",
            "Simulator only: largest lag of the engine's step schedule behind real "
            "time over the last 2 s of wall time.",
            labels=LABELS,
        )
        window_max, total_lag, total_busy = self.lag()
        lag.add_metric(self.labels, window_max)
        yield lag
        # The exact ratio a benchmark needs: wall seconds steps ended late over wall seconds of steps.
        yield self._counter(
            "vllm_sim_step_overrun_seconds",
            "Simulator only: wall time the step schedule lost to a loop that fell behind.",
            total_lag,
        )
        yield self._counter(
            "vllm_sim_step_busy_seconds",
            "Simulator only: total scheduled duration of engine steps (wall s).",
            total_busy,
        )


class InstanceMetrics:
    """The registry of one instance plus the histograms its request handlers observe."""

    def __init__(self, engine: Engine, model: str, lag: Callable[[], tuple[float, float, float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model, lag))

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(model, "0")

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: use "
            "vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
