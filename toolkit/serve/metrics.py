"""The server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "toolkit_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.queue_depth = Gauge("toolkit_queue_depth", "requests waiting for a batch slot", registry=self.registry)
        self.active = Gauge("toolkit_active_requests", "requests in the running batch", registry=self.registry)
        self.batch_size = Histogram(
            "toolkit_batch_size", "rows per decode step", registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64)
        )
        self.ttft = Histogram("toolkit_time_to_first_token_seconds", "submit to first token", registry=self.registry)
        self.token_latency = Histogram(
            "toolkit_token_latency_seconds", "decode step time per token", registry=self.registry
        )
        self.cancelled = Counter(
            "toolkit_requests_cancelled",
            "requests ended before their answer was complete, by why: disconnect, timeout, shutdown",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("disconnect", "timeout", "shutdown"):
            self.cancelled.labels(reason)
        self.tokens = Counter("toolkit_tokens_generated", "tokens generated", registry=self.registry)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def step(self, batch: int, seconds: float) -> None:
        """The engine's callback after each decode step."""
        self.batch_size.observe(batch)
        self.token_latency.observe(seconds)

    def exposition(self, queue_depth: int, active: int) -> str:
        """The Prometheus text, with the gauges read from the engine just now."""
        self.queue_depth.set(queue_depth)
        self.active.set(active)
        return generate_latest(self.registry).decode()
