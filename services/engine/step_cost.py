"""What a model step costs, fitted online from the engine's measured seconds, so the scheduler can size a
prefill segment by time. Nothing here reads a clock."""
from __future__ import annotations

from collections import deque
from statistics import median

import numpy as np
from scipy.optimize import nnls  # scipy comes with jax

from model.latent_pool import pow2  # the shapes the runner compiles, for segment sizes and batches

PREFILL_WINDOW = 16  # latest segments kept per size: old sizes still tell per-token from per-segment terms
DECODE_WINDOW = 9  # decode steps per batch bucket; the median ignores a step that compiled a new shape
SPREAD = 1.5  # a term is fitted only once the window's segments vary enough (in end, in n) to tell it apart


def relative_nnls(terms: dict[str, np.ndarray], t_S: np.ndarray) -> dict[str, float]:
    """Non-negative k with t ~ sum(k[name] * terms[name]), least squares on relative error (outliers count less)."""
    X_SK = np.stack(list(terms.values()), axis=1) / t_S[:, None]
    scale_K = X_SK.max(axis=0)  # columns of one magnitude, for the solver
    k_K, _ = nnls(X_SK / scale_K, np.ones_like(t_S))
    return dict(zip(terms, (k_K / scale_K).tolist()))


class PrefillCost:
    """t(n, end) = a*n + b*n*end + c*end + d seconds for n tokens ending at `end` (per token, attention, the view per
    layer, dispatch once a pass); a term joins the fit once the window tells it apart (ends, then sizes, by SPREAD)."""

    def __init__(self, window: int = PREFILL_WINDOW):
        self.window = window
        # power-of-two tokens of a pass -> (tokens, sum of n*end, sum of end, seconds) of its latest passes
        self.by_size: dict[int, deque[tuple[int, int, int, float]]] = {}
        self.coef: dict[str, float] | None = None  # a, b, c, d

    def observe(self, n: int, end: int, seconds: float) -> None:
        self.observe_pass([(n, end)], seconds)

    def observe_pass(self, segments: list[tuple[int, int]], seconds: float) -> None:
        """One pass that computed these (n, end) segments together in `seconds`."""
        if not segments or any(n < 1 or end < n for n, end in segments) or not seconds > 0:
            return  # a clock glitch or an empty segment says nothing about cost
        n = sum(n for n, _ in segments)
        features = (n, sum(n * end for n, end in segments), sum(end for _, end in segments), seconds)
        self.by_size.setdefault(pow2(n), deque(maxlen=self.window)).append(features)
        self._fit()

    @property
    def segments(self) -> list[tuple[int, int, float]]:
        """The kept passes as (tokens, token-weighted mean end, seconds)."""
        return [(n, n_end / n, t) for kept in self.by_size.values() for n, n_end, _, t in kept]

    def predict(self, n: int, end: int) -> float | None:
        """Seconds for n tokens ending at `end`; None before any segment was measured."""
        k = self.coef
        return None if k is None else k["a"] * n + k["b"] * n * end + k["c"] * end + k["d"]

    @property
    def per_pass_s(self) -> float:
        """d: what a segment that joins another's pass does not pay again."""
        return (self.coef or {}).get("d", 0.0)

    def _fit(self) -> None:
        rows = np.array([p for kept in self.by_size.values() for p in kept], np.float64)  # (S, 4)
        n_S, n_end_S, end_sum_S, t_S = rows.T
        end_S = n_end_S / n_S  # a pass's token-weighted end
        terms = {"a": n_S}
        if end_S.max() >= SPREAD * end_S.min():
            terms["b"] = n_end_S
            if n_S.max() >= SPREAD * n_S.min():
                terms |= {"c": end_sum_S, "d": np.ones_like(n_S)}
        fitted = relative_nnls(terms, t_S)
        self.coef = {name: fitted.get(name, 0.0) for name in "abcd"}  # replaced whole: stats() reads it

    def summary(self) -> dict:
        k = self.coef or {}
        return {"seconds_per_token": k.get("a"), "seconds_per_token_per_context_token": k.get("b"),
                "seconds_per_context_token": k.get("c"), "seconds_per_segment": k.get("d"),
                "segments": len(self.segments)}


class DecodeCost:
    """Seconds of a decode step by batch size: the median of its power-of-two bucket's (else the nearest's) steps."""

    def __init__(self, window: int = DECODE_WINDOW):
        self.window = window
        self.steps: dict[int, deque[float]] = {}  # bucket -> seconds
        self.medians: dict[int, float] = {}

    def observe(self, batch: int, seconds: float) -> None:
        if batch < 1 or not seconds > 0:
            return
        key = pow2(batch)
        steps = self.steps.setdefault(key, deque(maxlen=self.window))
        steps.append(seconds)
        self.medians = {**self.medians, key: median(steps)}  # replaced whole: stats() reads it

    def predict(self, batch: int) -> float | None:
        medians = self.medians
        if not medians:
            return None
        key = pow2(batch)
        nearest = min(medians, key=lambda k: (abs(k.bit_length() - key.bit_length()), k))  # a tie: the smaller
        return medians.get(key, medians[nearest])

    def summary(self) -> dict:
        return {str(k): v for k, v in sorted(self.medians.items())}


class DispatchCost:
    """t(B, S) = f + g*B*S + h*B seconds for a decode dispatch of B padded rows over S-row views (weights, view rows,
    sequences), fitted once the shapes differ in B*S by SPREAD: whether a batch is cheaper as two dispatches."""

    def __init__(self, window: int = DECODE_WINDOW):
        self.window = window
        self.by_shape: dict[tuple[int, int], deque[float]] = {}
        self.coef: dict[str, float] | None = None  # f, g, h

    def observe(self, batch: int, view: int, seconds: float) -> None:
        if batch < 1 or view < 1 or not seconds > 0:
            return
        self.by_shape.setdefault((batch, view), deque(maxlen=self.window)).append(seconds)
        rows = np.array([(b, v, median(ts)) for (b, v), ts in self.by_shape.items()], np.float64)
        b_S, v_S, t_S = rows.T
        cells = b_S * v_S
        if len(rows) < 3 or cells.max() < SPREAD * cells.min():
            return
        self.coef = relative_nnls({"f": np.ones_like(b_S), "g": cells, "h": b_S}, t_S)

    def predict(self, batch: int, view: int) -> float | None:
        k = self.coef
        return None if k is None else k["f"] + k["g"] * batch * view + k["h"] * batch

    def summary(self) -> dict:
        k = self.coef or {}
        return {"seconds_per_dispatch": k.get("f"), "seconds_per_view_row": k.get("g"),
                "seconds_per_sequence": k.get("h"), "shapes": len(self.by_shape)}


class StepCost:
    """The cost models together, as the scheduler asks them."""

    def __init__(self):
        self.prefill = PrefillCost()
        self.decode = DecodeCost()
        self.dispatch = DispatchCost()

    def decode_s(self, batch: int) -> float | None:
        return self.decode.predict(batch)

    def prefill_s(self, n: int, end: int) -> float | None:
        return self.prefill.predict(n, end)

    def summary(self) -> dict:
        return {"prefill": self.prefill.summary(), "decode_step_s_by_batch": self.decode.summary(),
                "decode_dispatch": self.dispatch.summary()}
