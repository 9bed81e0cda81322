"""Retention classes: how long an index entry lives without a hit."""
from __future__ import annotations

from dataclasses import dataclass, field

DAY_S = 86_400


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """TTL (seconds) per retention class; a per-request override must lie in [min_ttl_s, max_ttl_s]."""

    classes: dict[str, int] = field(default_factory=lambda: {"chat": 7 * DAY_S, "agent": 3 * DAY_S})
    min_ttl_s: int = 60
    max_ttl_s: int = 30 * DAY_S

    def ttl_s(self, retention: str, override_s: int | None = None) -> int:
        """The TTL for a request; raises ValueError naming the bad field."""
        if retention not in self.classes:
            raise ValueError(f"retention must be one of {sorted(self.classes)}, got {retention!r}")
        if override_s is None:
            return self.classes[retention]
        if not isinstance(override_s, int) or not self.min_ttl_s <= override_s <= self.max_ttl_s:
            raise ValueError(f"ttl_s must be an integer in [{self.min_ttl_s}, {self.max_ttl_s}], got {override_s!r}")
        return override_s
