"""Prometheus view of a BlockStore's counters and its volumes' usage."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvstore import BlockStore
from kvstore.kv_events import EventPublisher
from kvstore.reconcile import OUTCOMES, Reconciler


class StoreCollector:
    """Collects from `store.stats` at scrape time; `volume_used` is refreshed before each scrape."""

    def __init__(self, store: BlockStore, reconciler: Reconciler | None = None,
                 events: EventPublisher | None = None) -> None:
        self.store = store
        self.reconciler = reconciler
        self.events = events
        self.volume_used: dict[str, int] = {}
        self.tenant_used: dict[str, int] = {}
        self.quotas: tuple[int, dict[str, int]] = (0, {})

    async def refresh(self) -> None:
        try:
            self.volume_used = await self.store.ledger.used(list(self.store.volumes))
            self.tenant_used = await self.store.ledger.tenants_used(list(self.store.volumes))
            self.quotas = await self.store.quotas.all()
        except Exception:  # Redis down: report the last known usage
            pass

    def collect(self):
        s = self.store.stats
        for name, value, doc in [
            ("kvstore_bytes_read", s.bytes_read, "latent bytes delivered by verified reads"),
            ("kvstore_bytes_written", s.bytes_written, "segment bytes made durable"),
            ("kvstore_blocks_written", s.blocks_written, "blocks saved"),
            ("kvstore_segments_written", s.segments_written, "segments saved"),
            ("kvstore_write_failures", s.write_failures, "saves that failed (nothing published)"),
            ("kvstore_verification_failures", s.verification_failures, "blocks that failed verification"),
            ("kvstore_forged_segments", s.forged_segments, "segments whose block MACs did not verify"),
            ("kvstore_old_format_segments", s.old_format_segments, "segments of another format version (misses)"),
            ("kvstore_nonfinite_blocks", s.nonfinite_blocks, "blocks with NaN or Inf latents (misses)"),
            ("kvstore_evictions", s.evictions, "segments evicted for capacity or by an admin"),
            ("kvstore_expired_segments", s.expired, "segments retired after their entries expired"),
            ("kvstore_segments_deleted", s.segments_deleted, "segment objects deleted from volumes"),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
        h = s.read_latency
        cumulative, buckets = 0, []
        for bound, count in zip(list(h.buckets) + [float("inf")], h.counts):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        yield HistogramMetricFamily("kvstore_layer_read_seconds", "latency of one verified layer read of a hit",
                                    buckets=buckets, sum_value=h.total_s)
        used = GaugeMetricFamily("kvstore_volume_used_bytes", "bytes of live segments per volume", labels=["volume"])
        budget = GaugeMetricFamily("kvstore_volume_budget_bytes", "byte budget per volume", labels=["volume"])
        for vid in self.store.volumes:
            used.add_metric([vid], self.volume_used.get(vid, 0))
            budget.add_metric([vid], self.store.capacity.budget_of(vid))
        yield used
        yield budget
        # Tenants are names (no secret): index keys are salted hashes, these gauges only sum bytes.
        tenant_bytes = GaugeMetricFamily("kvstore_tenant_bytes", "bytes of live segments per tenant", labels=["tenant"])
        tenant_quota = GaugeMetricFamily("kvstore_tenant_quota_bytes", "byte quota per tenant (0: none)",
                                         labels=["tenant"])
        default, quotas = self.quotas
        for tenant in sorted(set(self.tenant_used) | set(quotas)):
            tenant_bytes.add_metric([tenant], self.tenant_used.get(tenant, 0))
            tenant_quota.add_metric([tenant], quotas.get(tenant, default))
        yield tenant_bytes
        yield tenant_quota
        if self.events is not None:
            yield CounterMetricFamily("kvstore_kv_events_published", "KV events (medium disk) appended to the stream",
                                      value=self.events.published)
            yield CounterMetricFamily("kvstore_kv_events_dropped", "KV events dropped because Redis did not take them",
                                      value=self.events.dropped)
        if self.reconciler is not None:
            outcomes = CounterMetricFamily("kvstore_reconciled_segments",
                                           "segment objects examined by reconciliation, by outcome", labels=["outcome"])
            for outcome in OUTCOMES:
                outcomes.add_metric([outcome], self.reconciler.totals[outcome])
            yield outcomes
            yield CounterMetricFamily("kvstore_reconcile_passes", "reconciliation passes completed",
                                      value=self.reconciler.passes)
