"""The serving engine: continuous batching over the paged latent pool, on one model thread.

Requests arrive on the event loop (`run`), become Sequences and go to the model thread through an
inbox. The model thread loops: admit (pages from the pool, memory-tier hits taken by reference),
start disk loads of hits (read on the event loop, ahead of and apart from compute), move loaded
sequences to running, run one step (the scheduler's decode batch and prefill segments, or some layers of
a sliced pass: a segment at a long context whose cost exceeds a step's prefill budget), sample, emit events,
publish completed blocks to the memory tier, hand new full blocks to the store. A disk hit
joins the running set only once every layer of its prefix is in its pages, so no step ever waits
on a disk read: other sequences keep decoding while it loads, and its time to first token is the
load plus its suffix's compute (the load is the smaller part here: see BENCHMARKS.md).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jax
import numpy as np

from kvstore import extend_block_hashes
from model.grammar import GrammarState, TokenGrammar, default_tokenizer_json, token_grammar
from model.paged_runner import MAX_PASS_TILES, SCRATCH_PAGE, DecodeRow, LatentPool, PagedRunner, PrefillLayers, Segment
from model.runner import _pow2
from model.sampling import SamplingParams, SamplingRow, TokenLogprobs, request_seed, sample_batch
from model.serving import serving_model
from model.weights import LoadedModel
from services.common.request_id import current_request_id
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.engine_metrics import EngineMetrics
from services.engine.pool import PagePool
from services.engine.scheduler import Admission, SchedulePolicy, Scheduler, Step, decode_cut
from services.engine.sequence import Job, Sequence, Status
from services.engine.step_cost import StepCost

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.005  # how often the model thread looks at disk loads when nothing else runs
_GREEDY = SamplingParams()


@dataclass(slots=True, eq=False)
class PrefillPass:
    """A prefill pass under way: its segments, the sequences whose first token it samples, its layers (and
    then its head) still to dispatch, and the time its slices took so far."""
    group: list[tuple[Sequence, int]]
    wanted: list[Sequence]
    layers: PrefillLayers
    units: int  # units (layers, or chunks of layers: PagedRunner.prefill_units) not yet dispatched (the head
    # goes with the last)
    done: int = 0  # units dispatched
    seconds: float = 0.0


class QueueFull(Exception):
    """More requests are waiting than max_queue allows."""


class TooLarge(ValueError):
    """The request could never fit the engine's pool (the user's fault: 400)."""


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, cache: CacheLink, metrics: EngineMetrics):
        # The served model (model/serving.py); the checkpoint's own projections are dropped with `loaded`.
        self.loaded = loaded._replace(model=serving_model(loaded.model, cfg.dtype))
        self.cfg, self.cache, self.metrics = cfg, cache, metrics
        model_cfg = loaded.config
        self.B = cfg.block_tokens
        num_pages = cfg.pool_pages(model_cfg.num_layers * model_cfg.latent_dim
                                   * np.dtype(model_cfg.cache_dtype).itemsize)
        self.latents = LatentPool(model_cfg, num_pages, self.B)
        self.runner = PagedRunner(self.loaded.model, model_cfg, self.latents, chunk_tokens=cfg.chunk_tokens,
                                  fixed_batch=_pow2(cfg.max_batch) if cfg.batch_invariant else 0)
        self.pages = PagePool(num_pages, cfg.memory_tier)
        self.scheduler = Scheduler(self.pages, SchedulePolicy(self.B, cfg.max_batch, cfg.step_tokens,
                                                              cfg.solo_tokens, cfg.batch_invariant,
                                                              cfg.prefill_step_ratio))
        self.cost = StepCost()  # measured step costs (model thread); size prefill segments by time
        self.stops = {model_cfg.eos_token_id}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.saves: set[concurrent.futures.Future] = set()  # saves handed to the event loop, not yet done
        self._saves_lock = threading.Lock()
        self.prefill_tokens_per_s: float | None = None  # measured at warm-up; sets the load deadline
        self.waiting = 0  # sequences not yet admitted (changed by both threads, under _count_lock)
        self.active = 0  # sequences admitted and not finished
        self._count_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._drop_hot: asyncio.Future | None = None  # an admin asked to empty the memory tier
        self._pass: PrefillPass | None = None  # a sliced prefill pass in flight (model thread)
        self._thread = threading.Thread(target=self._serve, name="model", daemon=True)
        metrics.pool_pages.set(self.pages.usable)
        metrics.pool_bytes.set(self.latents.bytes)

    # -- the event loop's side --

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    @property
    def grammars(self) -> TokenGrammar:
        """The grammar compiler for this model's tokenizer (built on first use: seconds)."""
        g = self.loaded.config
        return token_grammar(default_tokenizer_json(self.cfg.model_dir or None), g.vocab_size, g.eos_token_id)

    def check(self, job: Job) -> GrammarState | None:
        """Raises ValueError (the user's fault) for ids out of range, a prompt too long for the context
        or for the pool, GrammarError for a grammar that does not compile. An answer that would outgrow the
        pool is cut there ("length"), not refused. Returns the job's grammar compiled (for `run`: a large
        schema compiles once, where the caller chose to spend that time)."""
        self.runner.check_tokens(job.tokens, job.params.max_tokens)
        if self.scheduler.pages_for(job.tokens.size + 1) > self.pages.usable:
            raise TooLarge(f"prompt of {job.tokens.size} tokens does not fit this engine's latent pool of "
                           f"{self.pages.usable * self.B} tokens")
        return None if job.grammar is None else self.grammars.state(job.grammar)

    async def run(self, job: Job, grammar: GrammarState | None = None) -> AsyncIterator[dict]:
        """The request's events: a first 'progress' (admitted to the queue), tokens, then 'done'. `grammar`:
        the job's grammar as `check` compiled it (compiled here, on the event loop, when not given)."""
        if self.waiting >= self.cfg.max_queue:
            raise QueueFull()
        hashes = list(job.hit.hashes)
        if job.tokens.size >= 16_384:
            hashes = await asyncio.to_thread(extend_block_hashes, hashes, job.tokens, self.loaded.fingerprint,
                                             job.tenant_salt, self.B)
        else:
            hashes = extend_block_hashes(hashes, job.tokens, self.loaded.fingerprint, job.tenant_salt, self.B)
        seq = Sequence(job, request_seed(job.params), asyncio.Queue(), asyncio.get_running_loop(),
                       tokens=[int(t) for t in job.tokens], hashes=hashes)
        if job.grammar is not None:
            seq.grammar = grammar if grammar is not None else self.grammars.state(job.grammar)
        self._count(waiting=1)
        self._inbox.put(seq)
        self._wake.set()
        try:
            yield {"type": "progress", "phase": "queued"}
            while True:
                event = await seq.events.get()
                yield event
                if event["type"] in ("done", "error"):
                    return
        finally:
            if seq.status is not Status.FINISHED:
                seq.cancelled = True  # the model thread frees it at its next step
                self._inbox.put(seq)
                self._wake.set()

    async def drop_memory_tier(self) -> int:
        """Empties the memory tier on the model thread's next turn; returns the pages freed."""
        self._drop_hot = asyncio.get_running_loop().create_future()
        self._wake.set()
        return await self._drop_hot

    async def stop(self, timeout_s: float) -> None:
        """Stops the model thread, then waits for pending saves (each publishes only durable data)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout_s)
        with self._saves_lock:
            saves = [asyncio.wrap_future(f) for f in self.saves]
        if saves:
            _, pending = await asyncio.wait(saves, timeout=timeout_s)
            for future in pending:
                future.cancel()

    def stats(self) -> dict:
        s = self.scheduler
        return {"in_flight": self.active, "waiting": self.waiting, "running": len(s.running),
                "loading": len(s.loading), "pending_saves": len(self.saves),
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "max_batch": self.cfg.max_batch,
                "batch_invariant": self.cfg.batch_invariant,
                "prefill_pass_in_flight": self._pass is not None,  # a sliced pass, some of its layers done
                # "cpu-kernel": pages read in place (model/cpu_kernels.py); "xla-view": gathered dense views
                "decode_attention": self.runner.decode_attention,
                "step_cost": {**self.cost.summary(), "prefill_step_ratio": self.cfg.prefill_step_ratio},
                "pool": {"pages": self.pages.usable, "page_tokens": self.B, "tokens": self.pages.usable * self.B,
                         "bytes": self.latents.bytes, "owned_pages": self.pages.owned_pages,
                         "hot_pages": self.pages.hot_pages, "evictions": self.pages.evictions},
                # What this engine holds in memory, for the gateway's cache-aware routing.
                "hot_blocks": [h.hex() for h in self.pages.held_hashes()]}

    # -- the model thread --

    def _serve(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                if self._drop_hot is not None:
                    done, self._drop_hot = self._drop_hot, None
                    self.loop.call_soon_threadsafe(done.set_result, self.pages.drop_hot())
                self._take_inbox()
                for admission in self.scheduler.admit():
                    self._admitted(admission)
                self._poll_loads()
                step = self.scheduler.schedule(self.cost, [seq for seq, _ in self._pass.group] if self._pass else ())
                if step.decode or step.prefill or step.sliced or self._pass is not None:
                    begin = time.perf_counter()
                    self._step(step)
                    self.metrics.step_seconds.inc(time.perf_counter() - begin)
                elif self.scheduler.loading:
                    self._wake.wait(IDLE_POLL_S)
                else:
                    self._wake.wait()
            except Exception:  # noqa: BLE001 - a bug must fail its requests, not stop the engine
                log.exception("engine step failed; failing the sequences in flight")
                self.metrics.step_failures.inc()
                self._pass = None
                for seq in [*self.scheduler.live()]:
                    seq.emit({"type": "error", "message": "the engine failed this request's step"})
                    self._release(seq, "error")
            self._update_gauges()

    def _take_inbox(self) -> None:
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if seq.cancelled:
                if seq.status is not Status.FINISHED:
                    self._cancel(seq)
            elif seq.status is Status.WAITING and seq not in self.scheduler.waiting:
                self.scheduler.add(seq)

    def _admitted(self, admission: Admission) -> None:
        seq = admission.seq
        first = seq.preemptions == 0
        if first:
            self._count(waiting=-1, active=1)
            seq.memory_tokens = seq.computed
        seq.published_blocks = len(admission.memory_pages)
        store = self.cache.store
        usable = min(seq.job.hit.blocks, (seq.target - 1) // self.B)
        if store is not None and usable * self.B > seq.computed:
            seq.load_blocks = usable
            seq.load_begin = time.perf_counter()
            seq.status = Status.LOADING
            self.scheduler.loading.append(seq)
            asyncio.run_coroutine_threadsafe(self._start_load(seq, store), self.loop)
        else:
            self.scheduler.start_running(seq)

    async def _start_load(self, seq: Sequence, store) -> None:
        if seq.status is not Status.LOADING:
            return
        current_request_id.set(seq.request_id)  # this task's reads carry it to the kvstore service
        hit = seq.job.hit.truncated(seq.load_blocks)
        # Layers are read straight into one staging buffer, padded to a power of two of pages, so
        # each layer goes to the pool as one copy and one scatter with no repacking.
        staging = np.empty((self.loaded.config.num_layers, _pow2(seq.load_blocks) * self.B,
                            self.loaded.config.latent_dim), np.dtype(self.loaded.config.cache_dtype))
        seq.prefetch = store.prefetch(hit, out=staging)
        seq.staging = staging
        done = asyncio.ensure_future(seq.prefetch.valid_tokens())
        done.add_done_callback(lambda _: self._wake.set())

    def _poll_loads(self) -> None:
        for seq in list(self.scheduler.loading):
            prefetch = seq.prefetch
            waited = time.perf_counter() - seq.load_begin
            if prefetch is not None and prefetch.ready(self.loaded.config.num_layers - 1):
                self._place(seq)
            elif waited > self._load_deadline(seq):
                # Waiting on disk longer than recomputing the prefix would take makes the hit a loss.
                log.warning("request %s: disk hit of %d blocks took over %.2f s; recomputing",
                            seq.request_id, seq.load_blocks, waited)
                self.metrics.cache_fallbacks.labels("deadline").inc()
                if prefetch is not None:
                    self.loop.call_soon_threadsafe(prefetch.cancel)
                seq.stall_s += waited
                self.scheduler.start_running(seq)

    def _load_deadline(self, seq: Sequence) -> float:
        rate = self.prefill_tokens_per_s
        tokens = seq.load_blocks * self.B - seq.computed
        return max(0.5, self.cfg.prefetch_deadline_factor * tokens / rate) if rate else float("inf")

    def _place(self, seq: Sequence) -> None:
        """Moves a finished disk read into the sequence's pages: per layer one copy and one scatter."""
        L, B = self.loaded.config.num_layers, self.B
        valid = min(seq.prefetch.result(layer).shape[0] for layer in range(L)) // B
        memory = seq.computed // B
        if valid < seq.load_blocks:
            log.warning("request %s: cached prefix cut from %d to %d blocks (verification)", seq.request_id,
                        seq.load_blocks, valid)
            self.metrics.cache_fallbacks.labels("verification").inc()
        # Rows that failed verification (or were never read) must not reach the scratch page: attention
        # masks those rows' scores, but 0 x NaN in P.V would still poison every padded batch.
        seq.staging[:, valid * B:] = 0
        if valid > memory:
            padded = seq.staging.shape[1] // B
            targets = [SCRATCH_PAGE] * padded
            targets[memory:valid] = seq.pages[memory:valid]
            for layer in range(L):
                self.latents.place(layer, targets, seq.staging[layer])
            seq.computed = valid * B
            seq.saved_blocks = max(seq.saved_blocks, valid)
            if seq.preemptions == 0:
                seq.disk_tokens = (valid - memory) * B
            self._publish(seq)
        seq.stall_s += time.perf_counter() - seq.load_begin
        seq.prefetch, seq.staging = None, None
        self.scheduler.start_running(seq)

    def _step(self, step: Step) -> None:
        decode = self._grow(step.decode)
        if decode:
            begin = time.perf_counter()
            for group in self._decode_dispatches(decode):
                self._decode(group)
            elapsed = time.perf_counter() - begin
            self.cost.decode.observe(len(decode), elapsed)
            self.metrics.decode_batch.observe(len(decode))
            self.metrics.decode_seconds.inc(elapsed)
        self._prefill([(seq, n) for seq, n in step.prefill if seq.status is Status.RUNNING])  # (not preempted)
        if self._pass is not None:
            self._advance(self._pass, step.slice_s)
        elif step.sliced is not None and step.sliced[0].status is Status.RUNNING:
            self._prefill([step.sliced], step.slice_s)

    def _decode(self, decode: list[Sequence]) -> None:
        """One decode dispatch: a token for each of these sequences."""
        begin = time.perf_counter()
        rows = [DecodeRow(seq.tokens[-1], seq.computed, seq.pages) for seq in decode]
        logits = self.runner.decode(rows)  # dispatched: grammar masks are computed while it runs
        taken = self._sample(logits, decode)
        self.cost.dispatch.observe(*self.runner.decode_shape([r.position for r in rows]), time.perf_counter() - begin)
        host = np.asarray(logits) if any(s.job.digest for s in decode) else None
        for i, (seq, (token, logprobs)) in enumerate(zip(decode, taken)):
            seq.computed += 1
            self._publish(seq)
            self._accept(seq, token, None if host is None else host[i], logprobs)

    def _decode_dispatches(self, decode: list[Sequence]) -> list[list[Sequence]]:
        """The decode batch as one dispatch, or as two, the shorter sequences apart from the longer ones
        (`decode_cut`). Batch-invariant mode always takes one (its batch is padded to a fixed size)."""
        if self.cfg.batch_invariant or len(decode) < 2:
            return [decode]
        ordered = sorted(decode, key=lambda seq: seq.computed)
        cut = decode_cut([seq.computed for seq in ordered], self.runner.decode_shape, self.cost.dispatch)
        return [ordered[:cut], ordered[cut:]] if cut else [decode]

    def _prefill(self, segments: list[tuple[Sequence, int]], slice_s: float | None = None) -> None:
        """Computes the step's prefill segments in passes (`_prefill_passes`: short ones of several sequences
        together, PagedRunner.prefill_segments; the others alone). With `slice_s` (one segment, which costs
        more than the step's prefill budget has left) the pass runs the units that fit it and stays in flight
        for the next steps (`_advance`)."""
        L = self.loaded.config.num_layers
        for group in self._prefill_passes(segments):
            # Sequences whose prompt this pass completes come first: their logits are the pass's first rows.
            group.sort(key=lambda item: not self._completes(*item))
            wanted = [seq for seq, n in group if self._completes(seq, n)]
            if len(group) == 1:
                (seq, n), = group
                # Over gathered views the pass may reuse the keys and values its sequence's last one kept and keep
                # its own for the next (not in batch-invariant mode, whose bits must not depend on what was kept).
                context = None if self.cfg.batch_invariant else seq
                layers = self.runner.prefill_layers(np.asarray(seq.tokens[seq.computed:seq.computed + n]),
                                                    seq.computed, seq.pages, bool(wanted), context,
                                                    keep=seq.computed + n < seq.target)
            else:
                layers = self.runner.prefill_segments_layers([
                    Segment(np.asarray(seq.tokens[seq.computed:seq.computed + n]), seq.computed, seq.pages)
                    for seq, n in group])
            units = self.runner.prefill_units(n, seq.computed + n) if len(group) == 1 else L
            run = PrefillPass(group, wanted, layers, units)
            if not self._advance(run, slice_s):
                self._pass = run
                return

    def _advance(self, run: PrefillPass, budget_s: float | None) -> bool:
        """Runs the pass's next units (layers, or chunks of layers), all of them without a budget; with one, a unit
        at a time, each waited for, until the next unit's expected time would end the slice farther past
        `budget_s` than stopping now falls short of it (at least one unit): the slice ends at the unit boundary
        nearest its budget, so slices take their budget on average whatever the units' size (a unit is expected
        to take the mean of this pass's units so far: measured, not predicted). Timed, so that the cost model
        learns the whole pass's time (the sum of its slices) and the next decode step starts after them. The
        head (a few rows' logits) goes with the last unit, which finishes the pass (True)."""
        begin = time.perf_counter()
        while run.units:
            out = next(run.layers)
            run.units -= 1
            run.done += 1
            if budget_s is None:
                continue
            jax.block_until_ready(out)
            spent = time.perf_counter() - begin
            expected = (run.seconds + spent) / run.done
            if run.units and spent + expected / 2 > budget_s:
                break
        if not run.units:
            try:
                next(run.layers)
            except StopIteration as done:
                out = done.value
        jax.block_until_ready(out)
        run.seconds += time.perf_counter() - begin
        if run.units:
            self.metrics.prefill_slices.inc()
            return False
        if self._pass is run:
            self.metrics.prefill_slices.inc()
            self._pass = None
        self._passed(run, out)
        return True

    def _abort_pass(self, seq: Sequence) -> None:
        """Closes the pass in flight if `seq` is in it (cancelled, finished or preempted: its pages are about to
        be freed, and no later layer may write into them). Its sequences keep their `computed`: they compute
        the segment again. What the runner kept of `seq` for its next segment goes too."""
        self.runner.forget(seq)
        run = self._pass
        if run is not None and any(s is seq for s, _ in run.group):
            run.layers.close()
            self._pass = None
            self.metrics.prefill_aborted.inc()

    def _passed(self, run: PrefillPass, logits) -> None:
        """A pass is done: its sequences advance, publish and save their progress; the first token of every
        sequence whose prompt it completed is sampled."""
        group, wanted, elapsed = run.group, run.wanted, run.seconds
        if len(group) == 1 and wanted:
            logits = logits[None]
        self.cost.prefill.observe_pass([(n, seq.computed + n) for seq, n in group], elapsed)
        self.metrics.prefill_seconds.inc(elapsed)
        self.metrics.prefill_passes.inc()
        for seq, n in group:
            seq.computed += n
            if not seq.prefilling:
                self.runner.forget(seq)
            self.metrics.prefill_tokens.labels("computed").inc(n)
            self._publish(seq)
            if seq not in wanted and seq.computed // self.B - seq.saved_blocks >= self.cfg.save_every_tokens // self.B:
                self._save(seq)  # a long prefill keeps its progress if it is preempted, cancelled or fails
        if wanted:
            host = np.asarray(logits) if any(seq.job.digest for seq in wanted) else None
            for i, (seq, (token, logprobs)) in enumerate(zip(wanted, self._sample(logits, wanted))):
                self._accept(seq, token, None if host is None else host[i], logprobs)

    @staticmethod
    def _completes(seq: Sequence, n: int) -> bool:
        """Whether a segment of n tokens ends the sequence's prompt (its first token is then sampled)."""
        return seq.generated == 0 and seq.computed + n == seq.target

    def _prefill_passes(self, segments: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
        """The step's segments as passes: those the runner can batch together in passes of up to
        MAX_PASS_TILES tiles, taken in order of where they end, so that a pass holds segments of like
        context (its tiles attend in one vmapped loop, as many key blocks for each as for its longest: 16
        segments of 64 tokens at 64-2,000 tokens of context took 803 ms in two passes packed this way, 1,085 ms
        in admission order); then each other one alone (a long segment, which the runner chunks).
        Batch-invariant mode computes every segment alone, so a sequence's numbers never depend on who shares
        its pass."""
        alone, batched = [], []
        for seq, n in segments:
            if self.cfg.batch_invariant or not self.runner.batchable(n, seq.computed + n):
                alone.append([(seq, n)])
            else:
                batched.append((seq, n))
        batched.sort(key=lambda item: item[0].computed + item[1])
        passes, shared, tiles = [], [], 0
        for seq, n in batched:
            count = -(-n // self.B)
            if tiles + count > MAX_PASS_TILES:
                passes.append(shared)
                shared, tiles = [], 0
            shared.append((seq, n))
            tiles += count
        return passes + ([shared] if shared else []) + alone

    def _remaining(self, seq: Sequence) -> int:
        return min(seq.remaining, self.loaded.config.max_context - len(seq.tokens))

    def _sample(self, logits, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        """One token per sequence, with its penalties, bias and grammar mask (computed here on the host, while
        the device still runs the step that made `logits`); the grammar takes each token, or its closing
        token when the sampled one would leave no room to close (then sampled again, forced, for its logprobs)."""
        rows = [self._row(seq) for seq in seqs]
        sampled = sample_batch(logits, rows)
        out = [(int(t), lp) for t, lp in zip(sampled.tokens, sampled.logprobs)]
        for i, seq in enumerate(seqs):
            token = out[i][0]
            if seq.grammar is None or token in self.stops or token in seq.job.params.stop_token_ids:
                continue
            taken = seq.grammar.take(token, self._remaining(seq))
            if taken != token:
                forced = rows[i]._replace(allowed=seq.grammar.only(taken))
                out[i] = (taken, sample_batch(logits[i:i + 1], [forced]).logprobs[0])
        return out

    def _row(self, seq: Sequence) -> SamplingRow:
        p = seq.job.params
        counted = seq.tokens[seq.prompt_len:] if p.presence_penalty or p.frequency_penalty else ()
        allowed = seq.grammar.mask(self._remaining(seq)) if seq.grammar is not None else None
        return SamplingRow(p, seq.seed, seq.generated, counted, allowed)

    def _grow(self, decode: list[Sequence]) -> list[Sequence]:
        """Gives every decoding sequence the page its next token goes to, preempting the youngest
        running sequences while the pool has none; returns the sequences still running."""
        for seq in decode:
            if seq.status is not Status.RUNNING or seq.computed // self.B < len(seq.pages):
                continue
            while self.pages.available() == 0:
                if len(seq.pages) >= self.pages.usable:  # it alone fills the pool: its answer ends here
                    self._finish(seq, "length")
                    break
                victim = self.scheduler.youngest()
                log.info("pool full: preempting request %s (%d tokens)", victim.request_id, victim.computed)
                self.metrics.preemptions.inc()
                self._abort_pass(victim)
                self._publish(victim)
                self.scheduler.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                seq.pages += self.pages.allocate(1)
        return [seq for seq in decode if seq.status is Status.RUNNING]

    def _accept(self, seq: Sequence, token: int, logits_V: np.ndarray | None = None,
                logprobs: TokenLogprobs | None = None) -> None:
        if token in self.stops or token in seq.job.params.stop_token_ids:
            self._finish(seq, "stop")
            return
        seq.tokens.append(token)
        seq.generated += 1
        event = {"type": "token", "id": token}
        if logprobs is not None:
            event["logprob"] = logprobs.logprob
            event["top_logprobs"] = [[t, lp] for t, lp in logprobs.top]
        if logits_V is not None:
            event["logits_sha256"] = hashlib.sha256(np.ascontiguousarray(logits_V, np.float32).tobytes()).hexdigest()
        if seq.generated == 1:
            seq.first_token_at = time.perf_counter()
            event["cached_tokens"] = seq.memory_tokens + seq.disk_tokens
            tier = "disk" if seq.disk_tokens else "memory" if seq.memory_tokens else "miss"
            self.metrics.ttft.labels(tier).observe(seq.first_token_at - seq.arrival)
        seq.emit(event)
        if seq.generated == 1:
            self._save(seq)  # the prompt's blocks, once the first token is out
        if seq.grammar is not None and seq.grammar.stopped:
            self._finish(seq, "stop")  # only the end may follow: no EOS token is emitted
        elif seq.generated >= seq.job.params.max_tokens or len(seq.tokens) >= self.loaded.config.max_context:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        now = time.perf_counter()
        loaded = seq.memory_tokens + seq.disk_tokens
        self._release(seq, "ok")
        loaded_bytes = self._disk_bytes(seq)
        self.metrics.generated_tokens.inc(seq.generated)
        done = {"type": "done", "finish_reason": reason, "prompt_tokens": seq.prompt_len,
                "cached_tokens": loaded, "completion_tokens": seq.generated,
                "tiers": {"memory": seq.memory_tokens, "disk": seq.disk_tokens},
                "timing": {"ttft_s": (seq.first_token_at or now) - seq.arrival,
                           "prefetch_stall_s": seq.stall_s, "loaded_bytes": int(loaded_bytes),
                           "decode_s": now - (seq.first_token_at or now), "preemptions": seq.preemptions}}
        if seq.grammar is not None:
            done["grammar_complete"] = seq.grammar.complete
        seq.emit(done)

    def _cancel(self, seq: Sequence) -> None:
        if seq.prefetch is not None:
            self.loop.call_soon_threadsafe(seq.prefetch.cancel)
        if seq.status is Status.WAITING and seq.preemptions == 0:
            self._count(waiting=-1, active=1)  # _release counts it out
        self._release(seq, "cancelled")

    def _count(self, waiting: int = 0, active: int = 0) -> None:
        with self._count_lock:
            self.waiting += waiting
            self.active += active

    def _release(self, seq: Sequence, outcome: str) -> None:
        """Publishes and saves what the sequence computed (unless its step failed), then frees its pages."""
        self._abort_pass(seq)
        if seq.status is Status.RUNNING and outcome != "error":
            self._publish(seq)
            self._save(seq)
        self.scheduler.remove(seq)
        self._count(active=-1)
        self.metrics.requests.labels(outcome).inc()
        loaded = seq.memory_tokens + seq.disk_tokens
        if outcome == "ok":
            self.metrics.prefix_hit_tokens.labels("memory").inc(seq.memory_tokens)
            self.metrics.prefix_hit_tokens.labels("disk").inc(seq.disk_tokens)
            self.metrics.prefill_tokens.labels("loaded").inc(loaded)
            self.metrics.bytes_loaded.inc(self._disk_bytes(seq))
            self.metrics.prefetch_stall.inc(seq.stall_s)

    def _disk_bytes(self, seq: Sequence) -> int:
        g = self.loaded.config
        return seq.disk_tokens * g.num_layers * g.latent_dim * np.dtype(g.cache_dtype).itemsize

    # -- the two tiers --

    def _hashes(self, seq: Sequence, blocks: int) -> list[bytes]:
        if len(seq.hashes) < blocks:
            seq.hashes = extend_block_hashes(seq.hashes, seq.tokens, self.loaded.fingerprint,
                                             seq.job.tenant_salt, self.B)
        return seq.hashes[:blocks]

    def _publish(self, seq: Sequence) -> None:
        """Full blocks whose latents are complete become shareable (the memory tier)."""
        full = min(seq.computed // self.B, len(seq.pages))
        if full <= seq.published_blocks:
            return
        hashes = self._hashes(seq, full)
        for block in range(seq.published_blocks, full):
            self.pages.publish(seq.pages[block], hashes[block])
        seq.published_blocks = full

    def _save(self, seq: Sequence) -> None:
        """Hands the new full blocks to the store: the pages are copied on the device here (cheap, in
        order with later steps), the host copy and the disk write happen on the event loop's side."""
        store = self.cache.store
        full = min(seq.computed // self.B, len(seq.pages))
        if store is None or not self.cfg.save or full <= seq.saved_blocks:
            return
        start = seq.saved_blocks
        layers = self.latents.read(seq.pages[start:full])
        hashes = self._hashes(seq, full)
        seq.saved_blocks = full
        # Counted as pending from here (not from when the loop starts it): a caller that saw the
        # request's 'done' event and then reads pending_saves == 0 knows the blocks are published.
        future = asyncio.run_coroutine_threadsafe(self._save_async(store, seq.job, hashes, layers, start), self.loop)
        with self._saves_lock:
            self.saves.add(future)
        future.add_done_callback(self._save_done)

    def _save_done(self, future) -> None:
        with self._saves_lock:
            self.saves.discard(future)

    async def _save_async(self, store, job: Job, hashes: list[bytes], layers: list, start: int) -> None:
        current_request_id.set(job.request_id)  # this task's writes carry it to the kvstore service
        try:
            host = await asyncio.to_thread(lambda: [self.latents.host(x) for x in layers])
            result = await store.save(hashes, host, start_block=start, tenant=job.tenant, retention=job.retention)
            self.metrics.saves.labels("ok").inc()
            self.metrics.saved_blocks.inc(result.blocks)
        except Exception as error:  # noqa: BLE001 - a failed save never fails the request
            log.warning("request %s: saving %d blocks failed: %r", job.request_id, len(hashes) - start, error)
            self.metrics.saves.labels("failed").inc()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(self.waiting)
        m.in_flight.set(self.active)
        m.pool_owned_pages.set(self.pages.owned_pages)
        m.pool_hot_pages.set(self.pages.hot_pages)

    # -- start-up --

    def warm_up(self) -> None:
        """Compiles the common shapes and measures prefill speed (for the load deadline). Runs before the
        model thread starts, on pages it frees again."""
        cfg = self.loaded.config
        n = min(self.cfg.chunk_tokens, 512, (self.pages.usable - 1) * self.B)
        pages = self.pages.allocate(-(-(n + 1) // self.B))
        try:
            tokens = np.arange(1, 17) % cfg.vocab_size
            logits = self.runner.prefill(tokens, 0, pages, True)
            sample_batch(logits[None], [SamplingRow(_GREEDY, 0, 0)])
            self.runner.decode([DecodeRow(1, 16, pages)])
            long = np.arange(n) % cfg.vocab_size
            self.runner.prefill(long, 0, pages, True)
            begin = time.perf_counter()
            np.asarray(self.runner.prefill(long, 0, pages, True))
            elapsed = time.perf_counter() - begin
            self.prefill_tokens_per_s = n / elapsed
            self.cost.prefill.observe(n, n, elapsed)  # the seed; segments among decoding streams refine it
            # The segment sizes below it, as a step among decoding streams takes them (a prompt's first token
            # after each): their chunk shapes at any context (the prefill kernel's tables have one width), so
            # a first one never stalls every stream (a first 256-token chunk took a step of 0.30 s, 0.08 after).
            for size in self.scheduler.policy.segment_sizes():
                if size < n:
                    self.runner.prefill(np.arange(size) % cfg.vocab_size, 0, pages, True)
            # Every decode batch size at short contexts, and their sampler shapes: a first compile stalls
            # every running stream for seconds (once per machine: the compilation cache keeps them).
            sizes = [1 << i for i in range(_pow2(self.cfg.max_batch).bit_length())]
            warmed = set()
            for batch in sizes if not self.cfg.batch_invariant else sizes[-1:]:
                for position in (16, 300, 700):
                    shape = self.runner.decode_shape([position] * batch)
                    if position < len(pages) * self.B and shape not in warmed:
                        warmed.add(shape)
                        rows = [DecodeRow(1, position, pages)] * batch
                        sample_batch(self.runner.decode(rows), [SamplingRow(_GREEDY, 0, 0)] * batch)
        finally:
            self.pages.release(pages)
        log.info("warm: prefill %.0f tokens/s; pool %d pages (%d tokens, %.2f GiB); decode attention: %s",
                 self.prefill_tokens_per_s, self.pages.usable, self.pages.usable * self.B, self.latents.bytes / 2**30,
                 "CPU kernel over pages in place" if self.runner.decode_kernel else "XLA over gathered views")

