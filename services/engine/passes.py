"""Prefill passes in flight, a unit at a time between the steps' decode dispatches: a pass runs to its end in one
step, a sliced one about a budget's worth of units a step, and a loading sequence's one each layer's units once that
layer is in its pages (tiers.py), so its prefill overlaps its load. A pass closed part-way has written some
layers only: its sequences compute the segment again.
"""
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
    """A pass under way: its segments (sequence, tokens from its `computed`), the sequences it samples (its first
    rows), the runner's pass, whether it is sliced, its units' seconds so far, since when it waits for a layer."""
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
        # Sequences whose prompt this pass completes come first: their logits are the pass's first rows.
        group.sort(key=lambda item: not completes(*item))
        wanted = [seq for seq, n in group if completes(seq, n)]
        segments = [Segment(np.asarray(seq.tokens[seq.computed:seq.computed + n]), seq.computed, seq.pages)
                    for seq, n in group]
        flight = Flight(group, wanted, self.runner.prefill(segments, bool(wanted)), sliced)
        self.flights.append(flight)
        return flight

    def advance(self, flight: Flight, budget_s: float | None) -> bool:
        """Runs the pass's next units while their layers are placed: all of them without a budget; with one, each
        waited for, until the next unit's expected time would end the slice farther past `budget_s` than stopping
        now falls short of it (at least one unit). Timed: the cost model learns a pass's time (its slices' sum).
        Returns whether a unit was dispatched; a finished pass leaves `flights` (its result is `run.result`)."""
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
        """Whether the next unit's layer is in the pages of every sequence of the pass that is loading; the time a
        pass waits for one counts as its sequences' stall."""
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
        """Closes a pass in flight that `seq` is in (cancelled, finished, preempted, or its load cut: no later unit
        may write into its pages). Its sequences keep their `computed`: they compute the segment again."""
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
