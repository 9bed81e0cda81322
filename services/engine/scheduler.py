"""Scheduling policy: who gets pages, and the whole plan of each model step.

A waiting queue (FCFS; preempted sequences go back to its front) and a running list (in admission order). Each
step's `Plan` is final: the decode dispatches (where the pool has no page for a token, the youngest running
sequence is preempted), the prefill passes and a sliced pass. The prefill budget is time (step_cost.py): segments
predicted to take about `prefill_step_ratio` times the decode step, a segment too long for a step as a sliced pass;
without costs yet, and in batch-invariant mode, `step_tokens` tokens; with nothing to decode, `solo_tokens`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from model.runner import MAX_PASS_TILES
from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, Status
from services.engine.step_cost import DispatchCost, StepCost


@dataclass(frozen=True, slots=True)
class SchedulePolicy:
    block_tokens: int
    max_batch: int  # sequences running (prefilling, decoding or loading) at once
    step_tokens: int  # tokens per step while anything decodes, with no costs measured yet or batch-invariant
    solo_tokens: int  # prefill tokens per step while nothing decodes; the cap of a time-sized segment
    batch_invariant: bool  # prefill segments on fixed boundaries, whatever else runs
    prefill_step_ratio: float  # a step's prefill segments take about this times its decode's time

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_batch", "step_tokens", "solo_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.prefill_step_ratio > 0:
            raise ValueError(f"prefill_step_ratio must be > 0, got {self.prefill_step_ratio}")

    def segment_sizes(self) -> list[int]:
        """A time-sized segment's sizes, smallest first: the block times powers of two, and solo_tokens."""
        sizes = [min(self.block_tokens, self.solo_tokens)]
        while sizes[-1] * 2 <= self.solo_tokens:
            sizes.append(sizes[-1] * 2)
        return sizes if sizes[-1] == self.solo_tokens else [*sizes, self.solo_tokens]


# A sliced pass is sized to about this many steps' prefill budgets (while it runs, other long prompts wait).
SLICED_STEPS = 32
# A segment this much slower per token than a sliced pass's takes the sliced pass: every pass reads all the weights.
SLICE_GAIN = 1.25


class Plan(NamedTuple):
    """A model step, as the engine executes it."""
    decode: list[list[Sequence]]  # decode dispatches; each sequence has the page its token goes to
    passes: list[list[tuple[Sequence, int]]]  # prefill passes run whole: (sequence, tokens from its `computed`)
    sliced: tuple[Sequence, int] | None = None  # a segment to start as a sliced pass (none while one is in flight)
    slice_s: float | None = None  # seconds left for the sliced pass after `passes` (None: it runs to its end)
    preempted: tuple[Sequence, ...] = ()  # pages freed, requeued: their passes and loads must end first
    ended: tuple[Sequence, ...] = ()  # they alone fill the pool: their answers end ("length")

    @property
    def decoding(self) -> list[Sequence]:
        return [seq for dispatch in self.decode for seq in dispatch]

    @property
    def prefill(self) -> list[tuple[Sequence, int]]:
        return [segment for group in self.passes for segment in group]


class Shapes(Protocol):  # the runner's (model/runner.py)
    def batchable(self, n: int, end: int) -> bool: ...
    def decode_shape(self, positions: list[int]) -> tuple[int, int]: ...


class Scheduler:
    def __init__(self, blocks: BlockManager, policy: SchedulePolicy, shapes: Shapes | None = None):
        """`shapes`: the runner's (None: every segment goes alone, every decode batch in one dispatch)."""
        self.blocks, self.policy, self.shapes = blocks, policy, shapes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def loading(self) -> list[Sequence]:
        return [seq for seq in self.running if seq.load is not None]

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[tuple[Sequence, list[int]]]:
        """Grants pages to waiting sequences in order while they fit; returns (sequence, memory hit pages) each."""
        admitted = []
        while self.waiting and len(self.running) < self.policy.max_batch:
            seq = self.waiting[0]
            memory = self.blocks.grant(seq, seq.reusable_blocks(self.policy.block_tokens))
            if memory is None:
                break  # (a sequence that could never fit is refused before it is queued)
            self.waiting.popleft()
            seq.computed, seq.status = len(memory) * self.policy.block_tokens, Status.RUNNING
            self.running.append(seq)
            admitted.append((seq, memory))
        return admitted

    def schedule(self, cost: StepCost | None = None, in_flight: Collection[Sequence] = (), slicing: bool = False
                 ) -> Plan:
        """The next step's plan; `in_flight`: sequences in a pass in flight (no segment); `slicing`: one is sliced."""
        preempted, ended = [], []
        decode = self._grow([s for s in self.running if not s.prefilling and s.load is None], preempted, ended)
        p = self.policy
        decode_s = cost.decode_s(len(decode)) if cost is not None and decode else None
        sliced = slice_s = None
        if decode_s is not None and not p.batch_invariant and cost.prefill_s(1, 1) is not None:
            share = max(1.0, (len(self.running) - len(decode)) / len(decode))
            prefill, sliced, slice_s = self._timed_prefill(cost, p.prefill_step_ratio * decode_s * share, in_flight,
                                                           slicing)
        else:
            prefill = [] if slicing else self._token_prefill(len(decode), in_flight)
        return Plan(self._dispatches(decode, cost), self._passes(prefill), sliced, slice_s, tuple(preempted),
                    tuple(ended))

    def _token_prefill(self, decoding: int, in_flight: Collection[Sequence]) -> list[tuple[Sequence, int]]:
        p = self.policy
        budget = (p.step_tokens - decoding) if decoding else p.solo_tokens
        prefill = []
        for seq in self.running:
            if not seq.prefilling or seq in in_flight or budget <= 0:
                continue
            left = seq.target - seq.computed
            if p.batch_invariant:
                n = min(left, (seq.computed // p.step_tokens + 1) * p.step_tokens - seq.computed)
            else:
                n = min(left, budget)
            prefill.append((seq, n))
            budget -= n
        return prefill

    def _timed_prefill(self, cost: StepCost, seconds: float, in_flight: Collection[Sequence], slicing: bool
                       ) -> tuple[list[tuple[Sequence, int]], tuple[Sequence, int] | None, float | None]:
        """Prefill segments predicted to take about `seconds`: each sequence's largest fitting size; of those fitting
        none (or SLICE_GAIN slower a token), the least predicted rest gets a sliced pass (<= SLICED_STEPS budgets)."""
        sizes = self.policy.segment_sizes()
        budget = seconds

        def rate(n: int, computed: int) -> float:  # tokens per second of an n-token segment in a pass of its own
            return n / max(cost.prefill_s(n, computed + n), 1e-9)

        prefill, wanting = [], []  # wanting: (predicted time of the rest of its prompt, sequence, slice size)

        def predicted(seq: Sequence, n: int) -> float:  # after the first, segments mostly join its pass (d paid)
            return cost.prefill_s(n, seq.computed + n) - (cost.prefill.per_pass_s if prefill else 0.0)

        def candidates(seq: Sequence) -> list[int]:  # its segment sizes, the last its rest of the prompt
            return list(dict.fromkeys(min(n, seq.target - seq.computed) for n in sizes))

        def fitting(seq: Sequence) -> list[int]:  # its sizes that fit what the step has left
            return [n for n in candidates(seq) if predicted(seq, n) <= seconds]

        def add(seq: Sequence, n: int) -> None:
            nonlocal seconds
            prefill.append((seq, n))
            # charged after it joins `prefill`: a step's first segment skips its pass's fixed cost (a tuned slack)
            seconds -= predicted(seq, n)

        for seq in self.running:
            if not seq.prefilling or seq in in_flight:
                continue
            fits = fitting(seq)
            slice_n = None
            if not slicing:
                within = [n for n in candidates(seq) if cost.prefill_s(n, seq.computed + n) <= SLICED_STEPS * budget]
                slice_n = within[-1] if within else candidates(seq)[0]
            if fits and not (slice_n is not None and slice_n > fits[-1]
                             and rate(slice_n, seq.computed) >= SLICE_GAIN * rate(fits[-1], seq.computed)):
                add(seq, fits[-1])
            elif slice_n is not None:
                wanting.append((cost.prefill_s(seq.target - seq.computed, seq.target), seq, slice_n))
        sliced = None
        if wanting:
            _, chosen, n = min(wanting, key=lambda w: w[0])
            sliced = (chosen, n)
            for _, seq, _ in wanting:
                if seq is not chosen and (fits := fitting(seq)):
                    add(seq, fits[-1])
        if sliced is None and not slicing:
            return prefill, None, None
        return prefill, sliced, max(seconds, 0.0)

    def _grow(self, decode: list[Sequence], preempted: list[Sequence], ended: list[Sequence]) -> list[Sequence]:
        """Gives each decoding sequence its next token's page, preempting the youngest while none is free."""
        for seq in decode:
            if seq.status is not Status.RUNNING:
                continue
            while not self.blocks.extend(seq):
                if len(seq.pages) >= self.blocks.usable:
                    self.running.remove(seq)  # its answer ends here; the engine frees it after saving
                    ended.append(seq)
                    break
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        return [seq for seq in decode if seq.status is Status.RUNNING and seq not in ended]

    def _dispatches(self, decode: list[Sequence], cost: StepCost | None) -> list[list[Sequence]]:
        """The decode batch as one dispatch, or two, shorter sequences apart (`decode_cut`; batch-invariant: one)."""
        if not decode:
            return []
        if self.policy.batch_invariant or len(decode) < 2 or self.shapes is None or cost is None:
            return [decode]
        ordered = sorted(decode, key=lambda seq: seq.computed)
        cut = decode_cut([seq.computed for seq in ordered], self.shapes.decode_shape, cost.dispatch)
        return [ordered[:cut], ordered[cut:]] if cut else [decode]

    def _passes(self, segments: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
        """The segments as passes: batchable ones in passes of up to MAX_PASS_TILES tiles, in order of where they end,
        then each other one alone (all alone in batch-invariant mode: a sequence's numbers never depend on its pass)."""
        alone, batched = [], []
        for seq, n in segments:
            if (self.policy.batch_invariant or self.shapes is None or seq.load is not None
                    or not self.shapes.batchable(n, seq.computed + n)):
                alone.append([(seq, n)])
            else:
                batched.append((seq, n))
        batched.sort(key=lambda item: item[0].computed + item[1])
        passes, shared, tiles = [], [], 0
        for seq, n in batched:
            count = -(-n // self.policy.block_tokens)
            if tiles + count > MAX_PASS_TILES:
                passes.append(shared)
                shared, tiles = [], 0
            shared.append((seq, n))
            tiles += count
        return passes + ([shared] if shared else []) + alone

    def preempt(self, seq: Sequence) -> None:
        """Frees the sequence's pages and puts it first in line; what it computed is published first (a memory hit)."""
        self.blocks.publish_sequence(seq)
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.computed, seq.status, seq.published_blocks = 0, Status.WAITING, 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or cancelled sequence out and releases its pages."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.pages:
            self.blocks.free(seq)
        seq.status = Status.FINISHED


SPLIT_GAIN = 0.9  # a decode batch goes as two dispatches only when they are predicted this much cheaper


def decode_cut(positions: list[int], shape: Callable[[list[int]], tuple[int, int]], cost: DispatchCost) -> int:
    """Where to cut a decode batch (ascending positions) in two dispatches: the cheapest if SPLIT_GAIN cheaper, or 0."""
    if len(positions) < 2 or cost.predict(1, 1) is None:
        return 0
    whole = shape(positions)
    best, cut = SPLIT_GAIN * cost.predict(*whole), 0
    for k in range(1, len(positions)):
        if shape(positions[:k])[1] == whole[1]:
            break  # the short part would read views as long as the whole batch's
        split = cost.predict(*shape(positions[:k])) + cost.predict(*shape(positions[k:]))
        if split < best:
            best, cut = split, k
    return cut
