"""Per-tenant (per API key) limits: requests in flight and tokens per minute, 429 + Retry-After.

Concurrency: at most `max_concurrent` requests of one tenant are in the gateway at once; one more
is refused at once (Retry-After: 1), not queued, so one tenant cannot hold every engine slot.
Tokens: a bucket of `tokens_per_minute`, refilled continuously; a request is admitted while the
bucket is positive and is charged its prompt and completion tokens as they are known, so the bucket
may go into debt by one request; Retry-After is the time the debt takes to refill.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from services.gateway.openai_errors import OpenAIError


@dataclass
class _TenantUse:
    in_flight: int
    tokens: float      # the bucket: tokens left (negative: debt)
    refilled_at: float  # clock seconds


def rate_limited(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(message, code="rate_limit_exceeded", status=429, error_type="rate_limit_error",
                       retry_after_s=retry_after_s)


class KeyLimits:
    def __init__(self, max_concurrent: int, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic):
        """0 disables a limit."""
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._use: dict[str, _TenantUse] = {}

    def _refilled(self, tenant: str) -> _TenantUse:
        now = self._clock()
        use = self._use.get(tenant)
        if use is None:
            use = self._use[tenant] = _TenantUse(0, float(self.tokens_per_minute), now)
        use.tokens = min(float(self.tokens_per_minute),
                         use.tokens + (now - use.refilled_at) * self.tokens_per_minute / 60.0)
        use.refilled_at = now
        return use

    @contextmanager
    def admitted(self, tenant: str) -> Iterator[None]:
        """Hold one of the tenant's request slots for the block; raises a 429 OpenAIError instead."""
        use = self._refilled(tenant)
        if self.max_concurrent and use.in_flight >= self.max_concurrent:
            raise rate_limited(f"Too many concurrent requests for this API key (limit {self.max_concurrent}).", 1)
        if self.tokens_per_minute and use.tokens <= 0:
            wait_s = math.ceil((1 - use.tokens) * 60.0 / self.tokens_per_minute)
            raise rate_limited(f"Rate limit of {self.tokens_per_minute} tokens per minute for this API key "
                               f"reached; try again in {wait_s} s.", wait_s)
        use.in_flight += 1
        try:
            yield
        finally:
            use.in_flight -= 1

    def charge(self, tenant: str, tokens: int) -> None:
        """Take `tokens` (prompt or completion) from the tenant's bucket."""
        if self.tokens_per_minute:
            self._refilled(tenant).tokens -= tokens
