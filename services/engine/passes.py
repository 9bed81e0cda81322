"""Prefill passes in flight, a unit at a time between decode dispatches: a pass runs whole in one step, a sliced one
a budget's worth of units a step, a loading sequence's one each layer once that layer is in its pages (tiers.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import numpy as np

from model.runner import PrefillPass, Runner, Segment
from services.engine.engine_metrics import EngineMetrics
from services.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class Flight:
    """A pass under way: (sequence, tokens from its `computed`) segments, and the sequences its first rows sample."""
    group: list[tuple[Sequence, int]]
    wanted: list[Sequence]
    run: PrefillPass
    sliced: bool
    seconds: float = 0.0
    waiting_since: float | None = None


class Passes:
    def __init__(self, runner: Runner, metrics: EngineMetrics):
        self.runner, self.metrics = runner, metrics
        self.flights: list[Flight] = []

    @property
    def sequences(self) -> list[Sequence]:
        return [seq for flight in self.flights for seq, _ in flight.group]

    @property
    def slicing(self) -> bool:
        return any(flight.sliced for flight in self.flights)

    def start(self, group: list[tuple[Sequence, int]], sliced: bool) -> Flight:
        group.sort(key=lambda item: not completes(*item))  # those it completes first: theirs are the first logits
        wanted = [seq for seq, n in group if completes(seq, n)]
        segments = [Segment(np.asarray(seq.tokens[seq.computed:seq.computed + n]), seq.computed, seq.pages)
                    for seq, n in group]
        flight = Flight(group, wanted, self.runner.prefill(segments, bool(wanted)), sliced)
        self.flights.append(flight)
        return flight

    def advance(self, flight: Flight, budget_s: float | None) -> bool:
        """Runs the pass's next units while their layers are placed: all without a budget; with one, until the next unit
        would overshoot `budget_s` (at least one). Returns whether one ran; a finished pass leaves `flights`."""
        run, begin, dispatched, out = flight.run, time.perf_counter(), 0, None
        while run.done < run.units and self._ready(flight):
            out = run.step()
            dispatched += 1
            if any(seq.load is not None for seq, _ in flight.group):
                self.metrics.overlapped_units.inc()
            if budget_s is not None:
                jax.block_until_ready(out)
                spent = time.perf_counter() - begin
                if run.done < run.units and spent + (flight.seconds + spent) / dispatched / 2 > budget_s:
                    break
        if not dispatched:
            return False
        jax.block_until_ready(run.result if run.done == run.units else out)
        flight.seconds += time.perf_counter() - begin
        if flight.sliced:
            self.metrics.prefill_slices.inc()
        if run.done == run.units:
            self.flights.remove(flight)
        return True

    def _ready(self, flight: Flight) -> bool:
        """Whether the next unit's layer is in every loading sequence's pages; a wait counts as their stall."""
        layer, now = flight.run.layer, time.perf_counter()
        ready = all(seq.load is None or seq.load.placed > layer for seq, _ in flight.group)
        if not ready and flight.waiting_since is None:
            flight.waiting_since = now
        elif ready and flight.waiting_since is not None:
            for seq, _ in flight.group:
                seq.stall_s += now - flight.waiting_since
            flight.waiting_since = None
        return ready

    def abort(self, seq: Sequence) -> None:
        """Closes the pass in flight that `seq` is in; its sequences compute the segment again."""
        for flight in [f for f in self.flights if any(s is seq for s, _ in f.group)]:
            flight.run.close()
            self.flights.remove(flight)
            self.metrics.prefill_aborted.inc()

    def close(self) -> None:
        for flight in self.flights:
            flight.run.close()
        self.flights.clear()


def completes(seq: Sequence, n: int) -> bool:
    """Whether a segment of n tokens ends the sequence's prompt (its first token is then sampled)."""
    return seq.generated == 0 and seq.computed + n == seq.target
