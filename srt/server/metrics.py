"""Prometheus metrics of the server.

Counters and latency histograms are updated by the tokenizer manager as tokens stream back;
the gauges (queue, KV usage, graph and compile state) are read from the live scheduler and
runner info at each scrape.

With several tokenizer workers a scrape reaches one of them, and must still count every
worker's requests: their counters and histograms are then prometheus_client's multiprocess
ones (values in files under `PROMETHEUS_MULTIPROC_DIR`, which the launcher sets for every
worker before any imports prometheus_client), summed over the workers at each scrape. The
gauges are the scheduler's and runner's, the same whichever worker asks.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from srt.ipc.reports import RunnerInfo, SchedulerInfo

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


def graph_figures(runner: RunnerInfo) -> dict[str, float]:
    """Compile seconds, capture seconds and captured buckets of the runner, all phases."""
    phases = runner.graphs.values()
    return {
        "compile_s": runner.compile.total_s,
        "capture_s": float(sum(p.capture_s for p in phases)),
        "captured_buckets": sum(len(p.captured) for p in phases),
    }


_GAUGES = {
    "running_requests": "Requests in the running batch.",
    "queued_requests": "Requests waiting for admission.",
    "kv_cache_usage_ratio": "Fraction of KV slots in use (cached prefixes included).",
    "kv_cache_used_slots": "KV slots in use (cached prefixes included).",
    "captured_buckets": "Graph buckets captured so far, all phases.",
    "compile_seconds": "Seconds spent in torch.compile.",
    "capture_seconds": "Seconds spent capturing graphs.",
    "startup_seconds": "Seconds from launch to ready.",
}


class LiveGauges:
    """A collector of the gauges' values at one scrape (no process keeps them)."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"srt_{name}", doc, value=self.values[name])


class ServerMetrics:
    def __init__(self, shared: bool = False) -> None:
        """`shared`: the counts are every tokenizer worker's (see the module's docstring)."""
        self.shared = shared
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "srt_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("srt_prompt_tokens", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter("srt_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(
            "srt_time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "srt_inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "srt_e2e_request_latency_seconds",
            "Request latency, end to end.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def observe_tokens(self, n: int, since_last_s: float, first: bool) -> None:
        self.generation_tokens.inc(n)
        (self.ttft if first else self.itl).observe(since_last_s)

    def observe_finish(self, reason: str, e2e_s: float) -> None:
        self.requests.labels(reason).inc()
        self.e2e.observe(e2e_s)

    def render(self, scheduler: SchedulerInfo, runner: RunnerInfo, startup_s: float) -> bytes:
        """The Prometheus text exposition, gauges set from the live info."""
        graphs = graph_figures(runner)
        values: dict[str, float] = {
            "running_requests": scheduler.running_requests,
            "queued_requests": scheduler.queued_requests,
            "kv_cache_usage_ratio": scheduler.kv_usage,
            "kv_cache_used_slots": scheduler.kv_slots_used,
            "captured_buckets": graphs["captured_buckets"],
            "compile_seconds": graphs["compile_s"],
            "capture_seconds": graphs["capture_s"],
            "startup_seconds": startup_s,
        }
        totals = self.registry
        if self.shared:
            totals = CollectorRegistry()
            MultiProcessCollector(totals)
        live = CollectorRegistry()
        live.register(LiveGauges(values))
        return generate_latest(totals) + generate_latest(live)
