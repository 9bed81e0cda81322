"""The gateway's Prometheus metrics, on a registry of its own (one per app, so tests can run
several apps in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gateway_requests_total", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("gateway_prompt_tokens_total",
                                     "Prompt tokens, by whether the engine loaded them from cache",
                                     ["cache"], registry=r)
        self.completion_tokens = Counter("gateway_completion_tokens_total",
                                         "Generated tokens sent to clients", registry=r)
        self.lookup_failures = Counter("gateway_prefix_lookup_failures_total",
                                       "Prefix index lookups that failed or timed out (served "
                                       "as misses)", registry=r)
        self.admission_blocks = Counter("gateway_admission_blocks_total",
                                        "Looked-up blocks not on disk yet, by admission's decision (--admit-after): "
                                        "admitted (the engine may write them) or deferred (seen too few times)",
                                        ["decision"], registry=r)
        self.lookup_hit_tokens = Counter("gateway_prefix_lookup_hit_tokens_total",
                                         "Prompt tokens found in the prefix index", registry=r)
        self.engine_failures = Counter("gateway_engine_failures_total",
                                       "Engine attempts that failed, by engine and reason",
                                       ["engine", "reason"], registry=r)
        self.hot_routes = Counter("gateway_hot_routes_total",
                                  "Requests routed to an engine that held their prefix in memory "
                                  "ahead of a less loaded one", registry=r)
        self.split_fallbacks = Counter("gateway_split_fallbacks_total",
                                       "Split requests run undivided because every prefill engine failed before "
                                       "the first token", registry=r)
        self.handoff_seconds = Histogram("gateway_handoff_seconds",
                                         "Split requests: the prefill engine's first token to the decode engine's "
                                         "first event (its saves, the lookup, the decode engine's start)",
                                         buckets=_LATENCY_BUCKETS_S, registry=r)
        self.client_disconnects = Counter("gateway_client_disconnects_total",
                                          "Requests cancelled because the client went away",
                                          registry=r)
        self.render_seconds = Histogram("gateway_render_seconds", "Chat template + tokenization",
                                        buckets=_LATENCY_BUCKETS_S, registry=r)
        self.ttft_seconds = Histogram("gateway_time_to_first_token_seconds",
                                      "Request arrival to first generated token",
                                      buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot_seconds = Histogram("gateway_time_per_output_token_seconds",
                                      "Time per generated token after the first, per request",
                                      buckets=_TPOT_BUCKETS_S, registry=r)
        self.prefix_index_up = Gauge("gateway_prefix_index_up",
                                     "1 when the prefix index (Redis) answers, read at each scrape", registry=r)
        self.in_flight = Gauge("gateway_requests_in_flight", "Generations in progress", registry=r)

    def count_kv_view(self, view) -> None:
        """Exports what `view` (a kvstore.kv_view.KvView) applied and holds."""
        self.registry.register(_KvViewCollector(view))


class _KvViewCollector:
    def __init__(self, view) -> None:
        self.view = view

    def collect(self):
        applied = CounterMetricFamily("gateway_kv_events_applied", "KV events applied to the routing view, by "
                                      "event and medium", labels=["event", "medium"])
        for (event, medium), count in sorted(self.view.applied.items()):
            applied.add_metric([event, medium], count)
        yield applied
        yield CounterMetricFamily("gateway_kv_events_malformed", "KV event stream entries skipped as malformed",
                                  value=self.view.malformed)
        yield CounterMetricFamily("gateway_kv_resyncs", "Requests to every engine to announce its whole memory set",
                                  value=self.view.resyncs)
        yield GaugeMetricFamily("gateway_kv_view_engines", "Engines in the routing view (lease held)",
                                value=self.view.engines)
        yield GaugeMetricFamily("gateway_kv_view_blocks", "Blocks the routing view holds, summed over engines",
                                value=self.view.blocks)
