"""KeyLimits: per-tenant concurrency and tokens per minute, with a clock the test advances."""
from __future__ import annotations

import pytest

from services.gateway.key_limits import KeyLimits
from services.gateway.openai_errors import OpenAIError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(limits: KeyLimits, tenant: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        with limits.admitted(tenant):
            pass
    assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
    return caught.value


def test_concurrency_is_per_tenant_and_released():
    limits = KeyLimits(max_concurrent=2, tokens_per_minute=0)
    with limits.admitted("alice"), limits.admitted("alice"):
        assert refused(limits, "alice").retry_after_s == 1
        with limits.admitted("bob"):  # bob has his own slots
            pass
    with limits.admitted("alice"):  # released on exit
        pass


def test_a_slot_is_released_when_the_request_fails():
    limits = KeyLimits(max_concurrent=1, tokens_per_minute=0)
    with pytest.raises(ValueError):
        with limits.admitted("alice"):
            raise ValueError("the request failed")
    with limits.admitted("alice"):
        pass


def test_tokens_per_minute_refill_and_retry_after():
    clock = Clock()
    limits = KeyLimits(max_concurrent=0, tokens_per_minute=600, clock=clock)  # 10 tokens/s
    with limits.admitted("alice"):
        limits.charge("alice", 500)
    with limits.admitted("alice"):  # 100 left: admitted, and goes 300 into debt
        limits.charge("alice", 400)
    error = refused(limits, "alice")
    assert error.retry_after_s == 31  # (300 + 1) tokens at 10 per second
    with limits.admitted("bob"):
        pass
    clock.now += 30.0
    refused(limits, "alice")
    clock.now += 1.0
    with limits.admitted("alice"):
        pass
    clock.now += 3600.0  # the bucket refills to its size, not beyond
    limits.charge("alice", 600)
    refused(limits, "alice")


def test_zero_disables_both():
    limits = KeyLimits(max_concurrent=0, tokens_per_minute=0)
    with limits.admitted("t"), limits.admitted("t"), limits.admitted("t"):
        limits.charge("t", 10 ** 9)
