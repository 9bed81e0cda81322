"""The engine's Prometheus metrics (a per-engine registry)."""
from __future__ import annotations

import threading
from collections import defaultdict

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


# jax.monitoring's duration events of a compile, by stage. A listener is process-wide and cannot be
# removed, so one is registered once and every engine's registry reads the same totals.
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load",
}
_compile_seconds: dict[str, float] = defaultdict(float)
_listening = threading.Lock()
_registered = False


def _on_duration(event: str, seconds: float, **_) -> None:
    stage = _COMPILE_EVENTS.get(event)
    if stage is not None:
        _compile_seconds[stage] += seconds


def compile_seconds() -> dict[str, float]:
    """Seconds this process has spent compiling, by stage (trace, lower, compile, cache_load)."""
    global _registered
    with _listening:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
    return {stage: _compile_seconds[stage] for stage in _COMPILE_EVENTS.values()}


class _CompileCollector:
    def collect(self):
        family = CounterMetricFamily("deepinfer_engine_compile_seconds",
                                     "Time this engine process spent tracing, lowering and compiling model "
                                     "shapes (or loading them from the compilation cache), by stage", labels=["stage"])
        for stage, seconds in compile_seconds().items():
            family.add_metric([stage], seconds)
        yield family


class _KvEventsCollector:
    def __init__(self, publisher) -> None:
        self.publisher = publisher  # kvstore.kv_events.EventPublisher

    def collect(self):
        yield CounterMetricFamily("deepinfer_engine_kv_events_published",
                                  "KV events appended to the Redis stream (announcements included)",
                                  value=self.publisher.published)
        yield CounterMetricFamily("deepinfer_engine_kv_events_dropped",
                                  "KV events dropped because Redis did not take them (an announcement follows)",
                                  value=self.publisher.dropped)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("deepinfer_engine_ttft_seconds", "Time to first token inside the engine",
                              ["path"], buckets=_TTFT_BUCKETS, registry=r)
        self.prefill_tokens = Counter("deepinfer_engine_prefill_tokens_total",
                                      "Prompt tokens by source: computed or loaded from the cache",
                                      ["source"], registry=r)
        self.prefetch_stall = Counter("deepinfer_engine_prefetch_stall_seconds_total",
                                      "Time disk hits' prefills waited for a layer of their prefix to load (other "
                                      "sequences kept running)", registry=r)
        self.overlapped_units = Counter("deepinfer_engine_prefill_units_overlapping_load_total",
                                        "Prefill units (a layer's chunk) of disk hits computed while later layers of "
                                        "their prefix were still loading", registry=r)
        self.bytes_loaded = Counter("deepinfer_engine_loaded_bytes_total", "Latent bytes loaded on hits", registry=r)
        self.generated_tokens = Counter("deepinfer_engine_generated_tokens_total", "Tokens generated", registry=r)
        self.decode_seconds = Counter("deepinfer_engine_decode_seconds_total", "Time spent decoding", registry=r)
        self.step_seconds = Counter("deepinfer_engine_step_seconds_total",
                                    "Time the model thread spent in steps (model calls, sampling, bookkeeping); "
                                    "the rest of the wall time it waited for work", registry=r)
        self.prefill_seconds = Counter("deepinfer_engine_prefill_seconds_total",
                                       "Time spent computing prompt tokens (prefill passes)", registry=r)
        self.prefill_passes = Counter("deepinfer_engine_prefill_passes_total",
                                      "Prefill passes (one or several sequences' segments each)", registry=r)
        self.prefill_slices = Counter("deepinfer_engine_prefill_slices_total",
                                      "Steps that ran part of a sliced prefill pass (some of its layers)", registry=r)
        self.prefill_aborted = Counter("deepinfer_engine_prefill_passes_aborted_total",
                                       "Sliced prefill passes closed part-way (their sequence was cancelled or "
                                       "preempted)", registry=r)
        self.requests = Counter("deepinfer_engine_requests_total", "Requests by outcome", ["outcome"], registry=r)
        self.cache_fallbacks = Counter("deepinfer_engine_cache_fallbacks_total",
                                       "Hits served (partly) by recompute, by reason", ["reason"], registry=r)
        self.saves = Counter("deepinfer_engine_saves_total", "Block saves by outcome", ["outcome"], registry=r)
        self.saved_blocks = Counter("deepinfer_engine_saved_blocks_total", "Blocks saved", registry=r)
        self.queue_depth = Gauge("deepinfer_engine_queue_depth", "Requests waiting for a slot", registry=r)
        self.in_flight = Gauge("deepinfer_engine_in_flight", "Requests generating", registry=r)
        self.prefix_hit_tokens = Counter("deepinfer_engine_prefix_hit_tokens_total",
                                         "Prompt tokens served from a cache tier (memory or disk)", ["tier"],
                                         registry=r)
        self.preemptions = Counter("deepinfer_engine_preemptions_total",
                                   "Sequences preempted (pages freed, requeued) for lack of pages", registry=r)
        self.step_failures = Counter("deepinfer_engine_step_failures_total",
                                     "Model steps that raised (their sequences got an error)", registry=r)
        self.decode_batch = Histogram("deepinfer_engine_decode_batch_size", "Sequences per decode step",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.pool_pages = Gauge("deepinfer_engine_pool_pages", "Pages in the latent pool (one block each)", registry=r)
        self.pool_bytes = Gauge("deepinfer_engine_pool_bytes", "Bytes of the latent pool", registry=r)
        self.pool_owned_pages = Gauge("deepinfer_engine_pool_owned_pages", "Pages owned by running sequences",
                                      registry=r)
        self.pool_hot_pages = Gauge("deepinfer_engine_pool_hot_pages",
                                    "Pages of finished sequences kept as the memory tier", registry=r)
        compile_seconds()  # listens from now on
        r.register(_CompileCollector())

    def count_kv_events(self, publisher) -> None:
        """Exports `publisher`'s counts (a kvstore.kv_events.EventPublisher)."""
        self.registry.register(_KvEventsCollector(publisher))
