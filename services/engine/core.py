"""The serving engine: continuous batching over the paged latent pool, on one model thread.

Requests reach the model thread through an inbox; it loops: take the inbox and the disk tier's completions, admit,
execute the scheduler's plan, sample, stream, publish and save full blocks; idle, it waits for the next event.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import jax
import numpy as np

from kvstore import extend_block_hashes
from kvstore.latent_format import row_codec
from model.attention import make_backend
from model.latent_pool import LatentPool, pow2
from model.runner import DecodeRow, Runner
from model.sampling import SamplingRow, TokenLogprobs, request_seed, sample_batch
from model.serving import serving_model
from model.weights import LoadedModel
from services.engine.block_manager import BlockManager
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.engine_metrics import EngineMetrics
from services.engine.passes import Flight, Passes
from services.engine.scheduler import Plan, SchedulePolicy, Scheduler
from services.engine.sequence import Job, Sequence, Status
from services.engine.step_cost import StepCost
from services.engine.tiers import Tiers

if TYPE_CHECKING:
    from kvstore.kv_events import BlockEvents
    from model.grammar import GrammarState, TokenGrammar

log = logging.getLogger(__name__)


class QueueFull(Exception):  # more requests wait than max_queue allows
    pass


class TooLarge(ValueError):  # the request could never fit the engine's pool (the user's fault: 400)
    pass


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, cache: CacheLink, metrics: EngineMetrics,
                 events: BlockEvents | None = None):
        platform = jax.default_backend()
        # The served model (model/serving.py) under the cache's fingerprint (the model's, or its fp8 format's: the
        # block hashes); the checkpoint's own projections are dropped with `loaded`.
        self.loaded = loaded._replace(model=serving_model(loaded.model, cfg.dtype, platform=platform),
                                      fingerprint=cache.fingerprint)
        self.cfg, self.cache, self.metrics, self.B = cfg, cache, metrics, cfg.block_tokens
        g = loaded.config
        self.token_bytes = g.num_layers * g.latent_dim * np.dtype(g.cache_dtype).itemsize  # a token's latents
        num_pages = cfg.pool_pages(self.token_bytes)
        self.latents = LatentPool(g, num_pages, self.B, row_codec(cache.geometry))
        backend = make_backend(cfg.attention, g, platform, cfg.dtype, page_tokens=self.B)
        if cfg.batch_invariant and not backend.batch_invariant:
            raise ValueError(f"the {backend.name} attention backend is not batch-invariant")
        self.runner = Runner(self.loaded.model, g, self.latents, backend, chunk_tokens=cfg.chunk_tokens,
                             fixed_batch=pow2(cfg.max_batch) if cfg.batch_invariant else 0)
        self.blocks = BlockManager(num_pages, self.B, self.loaded.fingerprint, cfg.memory_tier, events)
        self.scheduler = Scheduler(self.blocks, SchedulePolicy(self.B, cfg.max_batch, cfg.step_tokens, cfg.solo_tokens,
                                                               cfg.batch_invariant, cfg.prefill_step_ratio),
                                   self.runner)
        self._wake = threading.Event()
        self.tiers = Tiers(cfg, cache, self.latents, self.blocks, metrics, self._wake.set, platform)
        self.cost = StepCost()  # measured step costs (model thread); size prefill segments by time
        self.stops = {g.eos_token_id}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.prefill_tokens_per_s: float | None = None  # measured at warm-up; sets the load deadline
        self.waiting = self.active = 0  # not yet admitted; admitted and not finished (both threads, under a lock)
        self._count_lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._drop_hot: asyncio.Future | None = None  # an admin asked to empty the memory tier
        self._purges: queue.SimpleQueue = queue.SimpleQueue()  # (tenant, epoch, future): purges to run
        self.fences: dict[str, int] = {}  # tenant -> the newest purge epoch seen (model thread)
        self.passes = Passes(self.runner, metrics)  # prefill passes in flight (model thread)
        self._thread = threading.Thread(target=self._serve, name="model", daemon=True)
        metrics.pool_pages.set(self.blocks.usable)
        metrics.pool_bytes.set(self.latents.bytes)

    # -- the event loop's side --

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = self.tiers.loop = loop
        self._thread.start()

    @property
    def grammars(self) -> TokenGrammar:
        """The grammar compiler for this model's tokenizer (built on first use: seconds)."""
        from model.grammar import default_tokenizer_json, token_grammar  # llguidance only where grammars come
        g = self.loaded.config
        return token_grammar(default_tokenizer_json(self.cfg.model_dir or None), g.vocab_size, g.eos_token_id)

    def check(self, job: Job) -> GrammarState | None:
        """The job's grammar compiled; ValueError for bad ids or a prompt too long, GrammarError for a bad grammar."""
        self.runner.check_tokens(np.concatenate([job.tokens, np.asarray(job.generated, np.int64)]),
                                 job.params.max_tokens - len(job.generated))
        if self.blocks.pages_for(job.tokens.size + len(job.generated) + 1) > self.blocks.usable:
            raise TooLarge(f"prompt of {job.tokens.size} tokens does not fit this engine's latent pool of "
                           f"{self.blocks.usable * self.B} tokens")
        if job.grammar is None:
            return None
        grammar = self.grammars.state(job.grammar)
        for i, token in enumerate(job.generated):  # the prefill engine's tokens, taken as it took them
            left = min(job.params.max_tokens - i, self.loaded.config.max_context - job.tokens.size - i)
            if token in self.stops or grammar.take(token, left) != token:
                raise ValueError(f"generated token {token} does not continue the grammar")
        return grammar

    async def run(self, job: Job, grammar: GrammarState | None = None) -> AsyncIterator[dict]:
        """The request's events: a first 'progress' (admitted to the queue), tokens, then 'done'."""
        if self.waiting >= self.cfg.max_queue:
            raise QueueFull()
        args = (list(job.hit.hashes), job.tokens, self.loaded.fingerprint, job.tenant_salt, self.B)
        hashes = (await asyncio.to_thread(extend_block_hashes, *args) if job.tokens.size >= 16_384
                  else extend_block_hashes(*args))
        seq = Sequence(job, request_seed(job.params), asyncio.Queue(), asyncio.get_running_loop(),
                       tokens=[int(t) for t in (*job.tokens, *job.generated)], hashes=hashes,
                       generated=len(job.generated))
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

    async def purge_tenant(self, tenant: str, epoch: int) -> int:
        """Fences `tenant` at `epoch` on the model thread's next turn (see _fence); returns the pages dropped."""
        done = asyncio.get_running_loop().create_future()
        self._purges.put((tenant, epoch, done))
        self._wake.set()
        return await done

    async def stop(self, timeout_s: float) -> None:
        """Stops the model thread, then waits for pending saves."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout_s)
        await self.tiers.drain(timeout_s)

    def stats(self) -> dict:
        s, b = self.scheduler, self.blocks
        return {"in_flight": self.active, "waiting": self.waiting, "running": len(s.running),
                "loading": len(s.loading), "pending_saves": len(self.tiers.saves),
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "max_batch": self.cfg.max_batch,
                "batch_invariant": self.cfg.batch_invariant, "attention_backend": self.runner.backend.name,
                "prefill_pass_in_flight": self.passes.slicing,  # a sliced pass, some units done
                "staging_pinned": self.tiers.pinned,
                "step_cost": {**self.cost.summary(), "prefill_step_ratio": self.cfg.prefill_step_ratio},
                "pool": {"pages": b.usable, "page_tokens": self.B, "tokens": b.usable * self.B,
                         "bytes": self.latents.bytes, "owned_pages": b.owned_pages, "hot_pages": b.hot_pages,
                         "evictions": b.evictions},
                "tenant_pages": b.tenant_pages(),
                "memory_blocks": b.held_blocks}  # which ones: the KV events (kvstore/kv_events.py)

    # -- the model thread --

    def _serve(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                if self._drop_hot is not None:
                    done, self._drop_hot = self._drop_hot, None
                    self.loop.call_soon_threadsafe(done.set_result, self.blocks.drop_hot())
                while not self._purges.empty():
                    tenant, epoch, done = self._purges.get()
                    self.loop.call_soon_threadsafe(done.set_result, self._fence(tenant, epoch))
                self._take_inbox()
                self.tiers.take(self.passes.abort)
                for seq, memory in self.scheduler.admit():
                    self._admitted(seq, memory)
                deadline = self.tiers.deadlines(self.scheduler.loading, self.prefill_tokens_per_s, self.passes.abort)
                begin = time.perf_counter()
                if self._execute(self.scheduler.schedule(self.cost, self.passes.sequences, self.passes.slicing)):
                    self.metrics.step_seconds.inc(time.perf_counter() - begin)
                else:
                    self._wake.wait(deadline)
            except Exception:  # noqa: BLE001 - a bug must fail its requests, not stop the engine
                log.exception("engine step failed; failing the sequences in flight")
                self.metrics.step_failures.inc()
                self.passes.close()
                for seq in [*self.scheduler.running]:
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
                if seq.job.epoch is not None:  # a job of a newer epoch: a purge this engine missed
                    self._fence(seq.job.tenant, seq.job.epoch)
                    seq.fenced = seq.job.epoch < self.fences[seq.job.tenant]
                self.scheduler.add(seq)

    def _fence(self, tenant: str, epoch: int) -> int:
        """A purge of `tenant` at `epoch`: its pages leave the memory tier and its sequences of older epochs publish
        nothing more (their saves are refused by the store); returns the pages dropped (0 if already fenced)."""
        if epoch <= self.fences.get(tenant, 0):
            self.fences.setdefault(tenant, epoch)
            return 0
        self.fences[tenant] = epoch
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            if seq.job.tenant == tenant and (seq.job.epoch or 0) < epoch:
                seq.fenced = True
        return self.blocks.drop_tenant(tenant)

    def _admitted(self, seq: Sequence, memory: list[int]) -> None:
        if seq.preemptions == 0:
            self._count(waiting=-1, active=1)
            seq.memory_tokens = seq.computed
        seq.published_blocks = len(memory)
        usable = min(seq.job.hit.blocks, seq.reusable_blocks(self.B))
        if self.tiers.store is not None and usable * self.B > seq.computed:
            self.tiers.load(seq, usable * self.B)
        else:  # the memory tier holds what the index has on disk: those blocks need no second write
            seq.saved_blocks = max(seq.saved_blocks, usable)

    def _execute(self, plan: Plan) -> bool:
        """Runs the plan; returns whether anything was dispatched."""
        for seq in plan.preempted:
            log.info("pool full: preempted request %s (%d tokens)", seq.request_id, len(seq.tokens))
            self.metrics.preemptions.inc()
            self.passes.abort(seq)
            self.tiers.cancel(seq)
        for seq in plan.ended:
            self._finish(seq, "length")
        worked = bool(plan.decode)
        if plan.decode:
            begin = time.perf_counter()
            for dispatch in plan.decode:
                self._decode(dispatch)
            elapsed = time.perf_counter() - begin
            self.cost.decode.observe(len(plan.decoding), elapsed)
            self.metrics.decode_batch.observe(len(plan.decoding))
            self.metrics.decode_seconds.inc(elapsed)
        fresh = [self.passes.start(group, False) for group in plan.passes]
        if plan.sliced is not None:
            self.passes.start([plan.sliced], True)
        for flight in [*fresh, *(f for f in self.passes.flights if f not in fresh)]:
            worked |= self.passes.advance(flight, plan.slice_s if flight.sliced else None)
            if flight.run.result is not None:
                self._passed(flight)
        return worked

    def _decode(self, dispatch: list[Sequence]) -> None:
        """One decode dispatch: a token for each of these sequences."""
        begin = time.perf_counter()
        rows = [DecodeRow(seq.tokens[-1], seq.computed, seq.pages) for seq in dispatch]
        logits = self.runner.decode(rows)  # dispatched: grammar masks are computed while it runs
        taken = self._sample(logits, dispatch)
        self.cost.dispatch.observe(*self.runner.decode_shape([r.position for r in rows]), time.perf_counter() - begin)
        for seq in dispatch:
            seq.computed += 1
            self.blocks.publish_sequence(seq)
        self._answer(logits, dispatch, taken)

    def _passed(self, flight: Flight) -> None:
        """A pass is done: its sequences advance, publish and save; those whose prompt it completed sample."""
        group, wanted = flight.group, flight.wanted
        self.cost.prefill.observe_pass([(n, seq.computed + n) for seq, n in group], flight.seconds)
        self.metrics.prefill_seconds.inc(flight.seconds)
        self.metrics.prefill_passes.inc()
        for seq, n in group:
            seq.computed += n
            self.metrics.prefill_tokens.labels("computed").inc(n)
            self.blocks.publish_sequence(seq)
            if seq not in wanted and seq.computed // self.B - seq.saved_blocks >= self.cfg.save_every_tokens // self.B:
                self._save(seq)  # a long prefill keeps its progress if it is preempted, cancelled or fails
        if wanted:
            self._answer(flight.run.result, wanted, self._sample(flight.run.result, wanted))

    def _answer(self, logits, seqs: list[Sequence], taken: list[tuple[int, TokenLogprobs | None]]) -> None:
        host = np.asarray(logits) if any(seq.job.digest for seq in seqs) else None
        for i, (seq, (token, logprobs)) in enumerate(zip(seqs, taken)):
            self._accept(seq, token, None if host is None else host[i], logprobs)

    def _remaining(self, seq: Sequence) -> int:
        return min(seq.remaining, self.loaded.config.max_context - len(seq.tokens))

    def _sample(self, logits, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        """A token per sequence, with its penalties, bias and grammar mask (computed on the host while the device runs);
        the grammar may replace a token with its closing token (sampled again, forced, for its logprobs)."""
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

    def _accept(self, seq: Sequence, token: int, logits_V: np.ndarray | None = None,
                logprobs: TokenLogprobs | None = None) -> None:
        if token in self.stops or token in seq.job.params.stop_token_ids:
            return self._finish(seq, "stop")
        seq.emit(seq.take(token, logits_V, logprobs))
        if seq.generated == 1:
            tier = "disk" if seq.disk_tokens else "memory" if seq.memory_tokens else "miss"
            self.metrics.ttft.labels(tier).observe(seq.first_token_at - seq.arrival)
            self._save(seq)  # the prompt's blocks, once the first token is out
        if seq.grammar is not None and seq.grammar.stopped:
            self._finish(seq, "stop")  # only the end may follow: no EOS token is emitted
        elif seq.generated >= seq.job.params.max_tokens or len(seq.tokens) >= self.loaded.config.max_context:
            self._finish(seq, "length")
        elif seq.job.handoff:
            self._finish(seq, "handoff")  # a decode engine goes on from here

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self._release(seq, "ok")
        self.metrics.generated_tokens.inc(seq.generated - len(seq.job.generated))
        done = seq.done_event(self._disk_bytes(seq))
        if seq.job.handoff:  # reported once its saves are published: the decode engine's lookup finds them
            asyncio.run_coroutine_threadsafe(self.tiers.hand_off(seq, done), self.loop)
        else:
            seq.emit(done)

    def _cancel(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING and seq.preemptions == 0:
            self._count(waiting=-1, active=1)  # _release counts it out
        self._release(seq, "cancelled")

    def _count(self, waiting: int = 0, active: int = 0) -> None:
        with self._count_lock:
            self.waiting += waiting
            self.active += active

    def _release(self, seq: Sequence, outcome: str) -> None:
        """Publishes and saves what the sequence computed (unless its step failed), then frees its pages."""
        self.passes.abort(seq)
        self.tiers.cancel(seq)
        if seq.status is Status.RUNNING and outcome != "error":
            self.blocks.publish_sequence(seq)
            self._save(seq)
        self.scheduler.remove(seq)
        self._count(active=-1)
        self.metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            self.metrics.prefix_hit_tokens.labels("memory").inc(seq.memory_tokens)
            self.metrics.prefix_hit_tokens.labels("disk").inc(seq.disk_tokens)
            self.metrics.prefill_tokens.labels("loaded").inc(seq.memory_tokens + seq.disk_tokens)
            self.metrics.bytes_loaded.inc(self._disk_bytes(seq))
            self.metrics.prefetch_stall.inc(seq.stall_s)

    def _disk_bytes(self, seq: Sequence) -> int:
        return seq.disk_tokens * self.token_bytes

    def _save(self, seq: Sequence) -> None:
        if seq.fenced:  # a purge of its tenant began after it started: it leaves no block
            return
        full = min(seq.settled // self.B, len(seq.pages))
        if seq.job.save_blocks is not None:  # admission: blocks seen too few times stay off the disk
            full = min(full, seq.job.save_blocks)
        if self.tiers.store is not None and self.cfg.save and full > seq.saved_blocks:
            self.tiers.save(seq, seq.block_hashes(full, self.loaded.fingerprint, self.B), full)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(self.waiting)
        m.in_flight.set(self.active)
        m.pool_owned_pages.set(self.blocks.owned_pages)
        m.pool_hot_pages.set(self.blocks.hot_pages)

    def warm_up(self) -> None:
        """Compiles the common shapes and measures prefill speed before the model thread starts."""
        n = min(self.cfg.chunk_tokens, 512, (self.blocks.usable - 1) * self.B)
        pages = self.blocks.allocate(-(-(n + 1) // self.B))
        batches = [1 << i for i in range(pow2(self.cfg.max_batch).bit_length())]
        try:
            elapsed = self.runner.warm_up(pages, n, self.scheduler.policy.segment_sizes(),
                                          batches[-1:] if self.cfg.batch_invariant else batches)
        finally:
            self.blocks.release(pages)
        self.prefill_tokens_per_s = n / elapsed
        self.cost.prefill.observe(n, n, elapsed)  # the seed; segments among decoding streams refine it
        log.info("warm: prefill %.0f tokens/s; pool %d pages (%d tokens, %.2f GiB); attention backend %s",
                 self.prefill_tokens_per_s, self.blocks.usable, self.blocks.usable * self.B,
                 self.latents.bytes / 2**30, self.runner.backend.name)
