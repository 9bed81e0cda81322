"""What a model step costs, fitted online from the engine's measured steps, so the scheduler can size a
prefill segment by time instead of by a fixed token count. Numbers in, numbers out: the engine times its
steps and feeds the seconds here; nothing in this file reads a clock, so tests feed it chosen numbers.

A prefill segment of n tokens ending at position `end` costs t ~ a*n + b*n*end: every token goes through
the projections and the MoE (a*n), and attends over a view of about `end` latents (b*n*end: the paged
runner gathers and reads the whole prefix for every segment). At 16K context the second term dominates, so
a fixed 256-token segment there takes many decode steps' time; at short contexts it is cheap.
"""
from __future__ import annotations

from collections import deque
from statistics import median

import numpy as np

PREFILL_WINDOW = 64  # segments the fit uses (the latest): old enough to span contexts, recent enough to track
DECODE_WINDOW = 9  # decode steps per batch bucket; the median ignores a step that compiled a new shape
SPREAD = 1.5  # the context term is fitted only once the window's segment ends differ by this factor


class PrefillCost:
    """t(n, end) = a*n + b*n*end seconds, least squares over the latest segments on relative error
    (segments range from milliseconds to seconds; relative error also keeps one slow outlier, such as a
    step that compiled, from dominating). Until the window's ends differ enough to tell a from b, the
    whole cost is put on a (b = 0). Coefficients are never negative."""

    def __init__(self, window: int = PREFILL_WINDOW):
        self.segments: deque[tuple[int, int, float]] = deque(maxlen=window)  # (n, end, seconds)
        self.a: float | None = None  # seconds per token
        self.b: float = 0.0  # seconds per token per token of context

    def observe(self, n: int, end: int, seconds: float) -> None:
        if n < 1 or end < n or not seconds > 0:
            return  # a clock glitch or an empty segment says nothing about cost
        self.segments.append((n, end, seconds))
        self._fit()

    def predict(self, n: int, end: int) -> float | None:
        """Seconds for n tokens ending at `end`; None before any segment was measured."""
        return None if self.a is None else self.a * n + self.b * n * end

    def _fit(self) -> None:
        rows = np.array(self.segments, np.float64)  # (S, 3): n, end, seconds
        n_S, end_S, t_S = rows[:, 0], rows[:, 1], rows[:, 2]
        a_only = float(np.sum(n_S / t_S) / np.sum((n_S / t_S) ** 2))  # relative least squares of t = a*n
        if end_S.max() < SPREAD * end_S.min():
            self.a, self.b = a_only, 0.0
            return
        X_S2 = np.stack([n_S, n_S * end_S], axis=1) / t_S[:, None]  # each row divided by its t: relative error
        (a, b), *_ = np.linalg.lstsq(X_S2, np.ones_like(t_S), rcond=None)
        if a >= 0 and b >= 0:
            self.a, self.b = float(a), float(b)
            return
        # A negative coefficient: the better of the two one-term fits.
        nb_S = n_S * end_S / t_S
        b_only = float(np.sum(nb_S) / np.sum(nb_S ** 2))
        err_a = np.sum((a_only * n_S / t_S - 1) ** 2)
        err_b = np.sum((b_only * nb_S - 1) ** 2)
        self.a, self.b = (a_only, 0.0) if err_a <= err_b else (0.0, b_only)

    def summary(self) -> dict:
        return {"seconds_per_token": self.a, "seconds_per_token_per_context_token": self.b,
                "segments": len(self.segments)}


class DecodeCost:
    """Seconds of a decode step by batch size (power-of-two buckets, the shapes the runner compiles):
    the median of the bucket's latest steps; a bucket not seen yet takes the nearest seen one's."""

    def __init__(self, window: int = DECODE_WINDOW):
        self.window = window
        self.steps: dict[int, deque[float]] = {}  # bucket -> seconds
        self.medians: dict[int, float] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def observe(self, batch: int, seconds: float) -> None:
        if batch < 1 or not seconds > 0:
            return
        key = self.bucket(batch)
        steps = self.steps.setdefault(key, deque(maxlen=self.window))
        steps.append(seconds)
        self.medians = {**self.medians, key: median(steps)}  # replaced whole: stats() reads it from another thread

    def predict(self, batch: int) -> float | None:
        medians = self.medians
        if not medians:
            return None
        key = self.bucket(batch)
        nearest = min(medians, key=lambda k: (abs(k.bit_length() - key.bit_length()), k))  # a tie: the smaller
        return medians.get(key, medians[nearest])

    def summary(self) -> dict:
        return {str(k): v for k, v in sorted(self.medians.items())}


class StepCost:
    """The two models together, as the scheduler asks them: what would this decode batch cost, and
    this prefill segment."""

    def __init__(self):
        self.prefill = PrefillCost()
        self.decode = DecodeCost()

    def decode_s(self, batch: int) -> float | None:
        return self.decode.predict(batch)

    def prefill_s(self, n: int, end: int) -> float | None:
        return self.prefill.predict(n, end)

    def summary(self) -> dict:
        return {"prefill": self.prefill.summary(), "decode_step_s_by_batch": self.decode.summary()}
