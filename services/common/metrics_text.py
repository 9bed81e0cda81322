"""Reading Prometheus text back: what `deepinfer status` and the dashboard feed take from /metrics.

    samples = Samples(text)
    samples.total("gateway_prompt_tokens_total", cache="hit")   # sum over the series that match
    samples.by("kvstore_volume_used_bytes", "volume")           # {"vol0": 1.2e6, ...}
    samples.buckets("gateway_time_to_first_token_seconds")      # [(upper bound s, cumulative count)]
"""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


class Samples:
    def __init__(self, text: str = "") -> None:
        self.rows: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            self.rows += [(s.name, s.labels, s.value) for s in family.samples]

    def has(self, name: str) -> bool:
        return any(row[0] == name for row in self.rows)

    def total(self, name: str, **labels: str) -> float:
        return sum(value for n, have, value in self.rows
                   if n == name and all(have.get(k) == v for k, v in labels.items()))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, have, value in self.rows:
            if n == name and label in have:
                out[have[label]] = out.get(have[label], 0.0) + value
        return out

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets (summed over series), by upper bound; +Inf last."""
        counts: dict[float, float] = {}
        for n, have, value in self.rows:
            if n == name + "_bucket" and all(have.get(k) == v for k, v in labels.items()):
                bound = float(have["le"])
                counts[bound] = counts.get(bound, 0.0) + value
        return sorted(counts.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (bound, count) buckets; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # in the open top bucket: its lower edge, as Prometheus does
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
