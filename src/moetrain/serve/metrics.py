"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase


FRONT_METRICS = ("requests", "cache_hits", "cache_misses")
"""The metrics the HTTP front counts (the engine counts the others)."""


class ServeMetrics:
    """The counters, gauges and histograms that ``GET /metrics`` exports (names prefixed ``moetrain_``).

    Rates: mean active experts per token over a window is ``rate(moetrain_expert_assignments_total) /
    rate(moetrain_routed_tokens_total)``; the gauge ``moetrain_active_experts_per_token`` is the last step's.

    Args:
        scope: which metrics :meth:`render` exports: ``all``; ``front`` (:data:`FRONT_METRICS`) or ``engine`` (the
            others) when the engine runs in a process of its own (serve/engine_process.py). Every attribute
            exists in each scope; those outside it count without being exported.
    Raises:
        ValueError: an unknown ``scope``.
    """

    def __init__(self, scope: str = "all") -> None:
        if scope not in ("all", "front", "engine"):
            raise ValueError(f"ServeMetrics: scope must be all, front or engine, got {scope!r}")
        r = None  # registered below, by scope
        self.requests = Counter("moetrain_requests", "completion requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("moetrain_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("moetrain_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("moetrain_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("moetrain_running", "sequences holding a slot", registry=r)
        self.batch_size = Histogram("moetrain_batch_size", "sequences per engine step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.step_seconds = Histogram("moetrain_step_seconds", "engine step time", registry=r,
                                      buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3))
        self.latency = Histogram("moetrain_request_seconds", "request latency (admission to last token)",
                                 registry=r, buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100))
        self.active_experts = Gauge("moetrain_active_experts_per_token",
                                    "mean routed experts per token in the last step, over MoE layers", registry=r)
        self.assignments = Counter("moetrain_expert_assignments", "token-to-expert assignments computed",
                                   registry=r)
        self.routed_tokens = Counter("moetrain_routed_tokens", "tokens through MoE layers (token x layer)",
                                     registry=r)
        self.expert_load = Counter("moetrain_expert_load", "assignments per expert", ["layer", "expert"],
                                   registry=r)
        self.load_top_k = Gauge("moetrain_load_top_k", "top-k chosen by the load policy for the last step",
                                registry=r)
        self.cache_hits = Counter("moetrain_cache_hits", "choices (completions) answered from the response cache",
                                  registry=r)
        self.cache_misses = Counter("moetrain_cache_misses", "cacheable choices (completions) not in the cache",
                                    registry=r)
        self.expert_pageins = Counter("moetrain_expert_pageins", "cold experts paged in", registry=r)
        self.expert_resident_bytes = Gauge("moetrain_expert_resident_bytes", "bytes of paged experts resident",
                                           registry=r)

        self.registry = CollectorRegistry()
        for name, metric in vars(self).items():
            exported = scope == "all" or (name in FRONT_METRICS) == (scope == "front")
            if isinstance(metric, MetricWrapperBase) and exported:
                self.registry.register(metric)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
