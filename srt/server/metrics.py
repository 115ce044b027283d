"""Prometheus metrics of the server.

Counters and latency histograms are updated by the tokenizer manager as tokens stream back;
the gauges (queue, KV usage, graph and compile state) are read from the live scheduler and
runner info at each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


class ServerMetrics:
    def __init__(self) -> None:
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
        self.gauges = {
            name: Gauge(f"srt_{name}", doc, registry=r)
            for name, doc in [
                ("running_requests", "Requests in the running batch."),
                ("queued_requests", "Requests waiting for admission."),
                ("kv_cache_usage_ratio", "Fraction of KV slots in use (cached prefixes included)."),
                ("kv_cache_used_slots", "KV slots in use (cached prefixes included)."),
                ("captured_buckets", "Graph buckets captured so far, all phases."),
                ("compile_seconds", "Seconds spent in torch.compile."),
                ("capture_seconds", "Seconds spent capturing graphs."),
                ("startup_seconds", "Seconds from launch to ready."),
            ]
        }

    def observe_tokens(self, n: int, since_last_s: float, first: bool) -> None:
        self.generation_tokens.inc(n)
        (self.ttft if first else self.itl).observe(since_last_s)

    def observe_finish(self, reason: str, e2e_s: float) -> None:
        self.requests.labels(reason).inc()
        self.e2e.observe(e2e_s)

    def render(self, scheduler: SchedulerInfo, runner: RunnerInfo, startup_s: float) -> bytes:
        """The Prometheus text exposition, gauges set from the live info."""
        graphs = graph_figures(runner)
        values = {
            "running_requests": scheduler.running_requests,
            "queued_requests": scheduler.queued_requests,
            "kv_cache_usage_ratio": scheduler.kv_usage,
            "kv_cache_used_slots": scheduler.kv_slots_used,
            "captured_buckets": graphs["captured_buckets"],
            "compile_seconds": graphs["compile_s"],
            "capture_seconds": graphs["capture_s"],
            "startup_seconds": startup_s,
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        return generate_latest(self.registry)
