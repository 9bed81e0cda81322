"""Sending one generation to an engine: hashing, prefix lookup, least-loaded choice, retries, the split.

An engine that fails before the first token (unreachable, queue full, broken stream) is
skipped and the next one tried; the user sees an error only when every engine failed. Once a
token has been produced the request belongs to that engine.

With engines of role prefill and of role decode both ready, a request is split: a prefill engine
prefills the prompt, streams the first token and saves the prompt's full blocks through the store;
a decode engine then takes the prompt as a hit on those blocks (recomputing none of them), computes
the tail and decodes after the first token. A prefill engine that fails before its first token
hands the request to the next one, then to the other engines undivided; one that fails after it
leaves the decode engine to recompute what the index does not hold.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, NamedTuple

from kvstore.hashing import block_hashes
from kvstore.kv_view import KvView
from kvstore.location import Hit
from services.gateway.engine_client import (DoneEvent, EngineEvent, EngineRejected, EngineStats,
                                            EngineUnavailable)
from services.gateway.engine_pool import EnginePool, EngineState
from services.gateway.gateway_metrics import GatewayMetrics
from services.gateway.openai_errors import OpenAIError, invalid, unavailable
from services.gateway.openai_requests import Sampling
from services.gateway.prefix_lookup import PrefixLookup
from services.gateway.tenants import Tenant

log = logging.getLogger(__name__)

_TOP_K_MAX = 2 ** 31 - 1  # any k beyond the vocabulary means "all tokens"; keep it int32
_HASH_IN_THREAD_TOKENS = 16_384  # hashing ~0.1 ms per block; above this, keep the loop free
HOT_ROUTE_SLACK = 4  # requests in flight an engine holding the prefix hot may be ahead by and still win


class GenerationJob(NamedTuple):
    request_id: str
    tokens: list[int]
    tenant: Tenant
    sampling: Sampling
    retention: str                 # "chat" | "agent"
    stop_token_ids: tuple[int, ...]
    prompt_param: str              # request field blamed for an over-long prompt
    engine: str | None = None      # pinned by an admin (X-DeepInfer-Engine): an engine URL or index
    grammar: dict | None = None    # the engine's constraint: json_object, json_schema or lark
    grammar_param: str = "response_format"  # request field blamed for a grammar the engine refuses


class Generation(NamedTuple):
    engine_url: str
    hit_tokens: int                # prompt tokens the index found (the engine may verify fewer)
    first: EngineEvent
    events: AsyncIterator[EngineEvent]  # the events after `first`
    fingerprint: str = ""          # the engine's model fingerprint (the response's system_fingerprint)


class _Started(NamedTuple):
    engine: EngineState
    stack: AsyncExitStack               # leaving it cancels the generation on the engine
    first: EngineEvent
    events: AsyncIterator[EngineEvent]  # the engine's events after `first`
    hashes: list[bytes]
    hit: Hit

    def generation(self, events: AsyncIterator[EngineEvent]) -> Generation:
        stats = self.engine.stats
        return Generation(self.engine.client.url, self.hit.blocks * stats.block_tokens, self.first, events,
                          stats.fingerprint)


def _split(ranked: list[EngineState]) -> tuple[list[EngineState], list[EngineState]] | None:
    """(prefill engines, decode engines) when both roles are ready, else None (requests run undivided)."""
    prefill = [e for e in ranked if e.stats.role == "prefill"]
    decode = [e for e in ranked if e.stats.role == "decode"]
    return (prefill, decode) if prefill and decode else None


class EngineRouter:
    def __init__(self, pool: EnginePool, lookup: PrefixLookup, metrics: GatewayMetrics,
                 default_max_tokens: int, view: KvView | None = None):
        """`view`: what each engine holds in memory, from the KV events (None: least loaded only)."""
        self._pool = pool
        self._lookup = lookup
        self._metrics = metrics
        self._default_max_tokens = default_max_tokens
        self._view = view

    @asynccontextmanager
    async def generation(self, job: GenerationJob) -> AsyncIterator[Generation]:
        """The running generation; leaving the block cancels it on the engine."""
        if not self._pool.names:
            raise unavailable("No engine is configured for this gateway.", retry_after_s=None)
        ranked = self._pool.ranked()
        if not ranked:
            log.warning("request %s: no engine ready: %s", job.request_id,
                        [e.last_error for e in self._pool.engines])
            raise unavailable(f"No engine is ready to serve requests (0 of "
                              f"{len(self._pool.engines)} ready). Try again shortly.")
        prefixes: dict[tuple[str, int], tuple[list[bytes], Hit]] = {}
        # The purge epoch is read before the prefix lookup: a purge that begins after this read fences the job (its
        # saves and pages), and one that began before it has erased what the lookup could find.
        epoch = await self._lookup.epoch(job.tenant.name)
        failures: list[EngineUnavailable] = []
        split = _split(ranked) if job.engine is None else None
        if split is not None:
            prefill, decode = split
            started = await self._start(job, await self._prefer_hot(job, prefill, prefixes), prefixes, epoch,
                                        failures, handoff=True)
            if started is not None:
                events = self._handed_off(job, started, decode, prefixes, epoch)
                try:
                    yield started.generation(events)
                finally:
                    await events.aclose()  # the decode engine's stream, if it began
                    await started.stack.aclose()  # the prefill engine's, if still open
                return
            self._metrics.split_fallbacks.inc()  # every prefill engine failed: undivided, on the others
            ranked = [e for e in ranked if e not in prefill] + [e for e in prefill if e.routable]
        if job.engine is not None:
            ranked = self._pinned(job.engine)
        else:
            ranked = await self._prefer_hot(job, ranked, prefixes)
        started = await self._start(job, ranked, prefixes, epoch, failures)
        if started is None:
            retry_after = [f.retry_after_s for f in failures if f.retry_after_s is not None]
            raise unavailable(f"All {len(failures)} engine(s) failed or were busy before the first "
                              "token. Try again shortly.", retry_after_s=min(retry_after, default=1))
        async with started.stack:
            yield started.generation(self._watched(started.engine, started.events))

    async def _start(self, job: GenerationJob, ranked: list, prefixes: dict, epoch: int | None,
                     failures: list[EngineUnavailable], handoff: bool = False, generated: tuple[int, ...] = (),
                     handed: Callable[[list[bytes], Hit, EngineStats], Awaitable[Hit]] | None = None
                     ) -> _Started | None:
        """The job on the first engine of `ranked` that starts it; None when each failed (added to `failures`).
        `handoff`: a split's prefill; `generated` and `handed` (its hit from the handoff): a split's decode."""
        for engine in ranked:
            stats = engine.stats
            max_tokens = self._max_tokens(job, stats)
            key = (stats.fingerprint, stats.block_tokens)
            if key not in prefixes:
                prefixes[key] = await self._hashes_and_hit(job, stats)
            hashes, hit = prefixes[key]
            if handed is not None:
                hit = await handed(hashes, hit, stats)
            body = engine_job_body(job, hashes, self._savable(hit._replace(admitted=None) if handoff else hit, epoch),
                                   max_tokens, epoch)  # a handoff saves every block: the decode engine needs them
            body |= {"handoff": True} if handoff else {"generated": list(generated)} if generated else {}
            stack = AsyncExitStack()
            try:
                stack.enter_context(self._pool.claim(engine))
                events = await stack.enter_async_context(engine.client.generate(body))
                stack.push_async_callback(events.aclose)
                first = await anext(events)
            except EngineUnavailable as failure:
                await stack.aclose()
                self._note_failure(engine, failure)
                failures.append(failure)
                continue
            except EngineRejected as rejected:
                await stack.aclose()
                raise _user_error(rejected, job) from None
            except BaseException:
                await stack.aclose()
                raise
            return _Started(engine, stack, first, events, hashes, hit)
        return None

    async def _handed_off(self, job: GenerationJob, prefill: _Started, decode: list, prefixes: dict,
                          epoch: int | None) -> AsyncIterator[EngineEvent]:
        """A split request's events after its first: the prefill engine's end, then the decode engine's tokens and
        'done' (with the prefill's cached tokens: what the user's prompt hit)."""
        first, prefilled = prefill.first, prefill.first if isinstance(prefill.first, DoneEvent) else None
        begin = time.monotonic()
        try:
            async for event in prefill.events:
                if isinstance(event, DoneEvent):
                    prefilled = event
                    break
        except EngineUnavailable as failure:  # died saving: the decode engine recomputes what the index lacks
            self._pool.mark_failed(prefill.engine, f"failed handing off: {failure.reason}")
        await prefill.stack.aclose()  # the prefill engine's part is over
        if prefilled is not None and prefilled.finish_reason != "handoff":
            if prefilled is not first:
                yield prefilled  # it ended at its first token (stop, length)
            return
        published = prefilled.handoff_blocks if prefilled is not None else None
        cached = prefilled.cached_tokens if prefilled is not None else first.cached_tokens or 0

        async def handed(hashes: list[bytes], hit: Hit, stats: EngineStats) -> Hit:
            return await self._lookup.handoff(hashes, len(job.tokens), stats.block_tokens, published, hit)

        # a decode engine (the one holding the prefix hot first), else any other: the prefill engine holds it hot too
        candidates = await self._prefer_hot(job, [e for e in decode if e.routable], prefixes)
        candidates += [e for e in self._pool.ranked() if e not in decode]
        failures: list[EngineUnavailable] = []
        started = await self._start(job, candidates, prefixes, epoch, failures, generated=(first.token_id,),
                                    handed=handed)
        if started is None:
            raise EngineUnavailable(prefill.engine.client.url, f"no engine took the handoff ({len(failures)} failed)")
        self._metrics.handoff_seconds.observe(time.monotonic() - begin)
        async with started.stack:
            events = self._watched(started.engine, started.events)
            event = started.first
            while True:
                if isinstance(event, DoneEvent):
                    timing = {**event.timing, "prefill": prefilled.timing if prefilled else None,
                              "handoff_tokens": started.hit.blocks * started.engine.stats.block_tokens}
                    yield event._replace(cached_tokens=cached, timing=timing)
                    return
                yield event
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return

    async def _watched(self, engine, events: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
        """`events`, and the engine taken out of routing when they break: a replica killed in the
        middle of an answer gets no new request before its next probe passes (a dead container's
        address does not refuse connections, it lets them time out)."""
        try:
            async for event in events:
                yield event
        except EngineUnavailable as failure:
            self._pool.mark_failed(engine, f"failed mid-generation: {failure.reason}")
            raise

    def _pinned(self, pin: str) -> list:
        """The one engine an admin pinned: by its address URL, its index in /admin/stats' list,
        or a configured name that resolves to a single address."""
        engines = self._pool.engines
        chosen = [e for i, e in enumerate(engines) if pin in (e.client.url, str(i))]
        chosen = chosen or [e for e in engines if e.name == pin.rstrip("/")]
        if len(chosen) > 1:
            raise OpenAIError(f"The pinned engine {pin!r} names {len(chosen)} replicas; pin one of "
                              f"{[e.client.url for e in chosen]}.", code="ambiguous_engine",
                              param="X-DeepInfer-Engine")
        if not chosen or not chosen[0].routable or chosen[0].stats is None:
            raise unavailable(f"The pinned engine {pin!r} is not ready.")
        return chosen

    async def _prefer_hot(self, job: GenerationJob, ranked: list, prefixes: dict) -> list:
        """Cache-aware order: the engine holding the longest leading run of the prompt's blocks in its
        memory tier (as its KV events tell the view) goes first, unless it has HOT_ROUTE_SLACK more
        requests in flight than the least loaded engine (then the prefix is worth less than the queue)."""
        if self._view is None:
            return ranked
        best, best_run = None, 0
        for engine in ranked:
            if not self._view.held(engine.stats.engine_id):
                continue
            key = (engine.stats.fingerprint, engine.stats.block_tokens)
            if key not in prefixes:
                prefixes[key] = await self._hashes_and_hit(job, engine.stats)
            run = self._view.leading_run(engine.stats.engine_id, prefixes[key][0])
            if run > best_run:
                best, best_run = engine, run
        if best is None or best is ranked[0] or best.in_flight - ranked[0].in_flight >= HOT_ROUTE_SLACK:
            return ranked
        self._metrics.hot_routes.inc()
        return [best] + [e for e in ranked if e is not best]

    def _max_tokens(self, job: GenerationJob, stats: EngineStats) -> int:
        prompt = len(job.tokens)
        if prompt >= stats.max_context:
            raise invalid(job.prompt_param, f"This model's maximum context length is "
                          f"{stats.max_context} tokens. However, your prompt is {prompt} tokens.",
                          "context_length_exceeded")
        requested = job.sampling.max_tokens
        # A budget past the context is cut to what is left (finish_reason "length"), not refused:
        # the client cannot know the prompt's length in tokens before sending it.
        left = stats.max_context - prompt
        return min(self._default_max_tokens if requested is None else requested, left)

    def _savable(self, hit: Hit, epoch: int | None) -> Hit:
        """The hit as the job carries it: with a purge fence configured but its epoch unread (the index did not
        answer), the job may save nothing, since a purge could not fence its saves."""
        return hit._replace(admitted=0) if epoch is None and self._lookup.fence is not None else hit

    async def _hashes_and_hit(self, job: GenerationJob, stats: EngineStats
                              ) -> tuple[list[bytes], Hit]:
        args = (job.tokens, stats.fingerprint, job.tenant.salt, stats.block_tokens)
        if len(job.tokens) >= _HASH_IN_THREAD_TOKENS:
            hashes = await asyncio.to_thread(block_hashes, *args)
        else:
            hashes = block_hashes(*args)
        hit = await self._lookup.lookup(hashes, len(job.tokens), stats.block_tokens)
        return hashes, hit

    def _note_failure(self, engine, failure: EngineUnavailable) -> None:
        busy = failure.retry_after_s is not None
        self._metrics.engine_failures.labels(engine.client.url,
                                             "busy" if busy else "unavailable").inc()
        if busy:
            log.info("engine %s busy: %s", engine.client.url, failure.reason)
        else:
            self._pool.mark_failed(engine, failure.reason)


def engine_job_body(job: GenerationJob, hashes: list[bytes], hit: Hit, max_tokens: int,
                    epoch: int | None = None) -> dict:
    """The POST /internal/generate body; the optional fields only when they do something."""
    sampling = job.sampling
    optional = {"presence_penalty": sampling.presence_penalty or None,
                "frequency_penalty": sampling.frequency_penalty or None,
                "logit_bias": {str(token): bias for token, bias in sampling.logit_bias} or None,
                "logprobs": sampling.logprobs,  # 0 is "the chosen token's logprob only"
                "grammar": job.grammar,
                "tenant_epoch": epoch}  # the saves of this request carry it (kvstore/fence.py)
    return {
        "request_id": job.request_id,
        "tokens": job.tokens,
        "tenant": job.tenant.name,  # recorded with the blocks the engine saves
        "tenant_salt": job.tenant.salt,
        "block_hashes": [h.hex() for h in hashes],
        # Items are kvstore SegmentRuns as objects; the engine rebuilds the Hit as
        # Hit(hashes[0], hashes[:blocks], tuple(SegmentRun(**item) for item in locations)).
        "hit": {"blocks": hit.blocks, "locations": [run._asdict() for run in hit.runs]},
        **({} if hit.admitted is None else {"save_blocks": hit.admitted}),  # admission: leading blocks to write
        "max_tokens": max_tokens,
        "temperature": job.sampling.temperature,
        "top_p": job.sampling.top_p,
        "top_k": min(job.sampling.top_k, _TOP_K_MAX),
        "seed": job.sampling.seed,
        "stop_token_ids": list(job.stop_token_ids),
        "retention": job.retention,
        **{name: value for name, value in optional.items() if value is not None},
    }


# Engine fields a user set by name; any other field the engine blames (e.g. "tokens") is the prompt.
_USER_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                "frequency_penalty", "logit_bias", "logprobs")



def _user_error(rejected: EngineRejected, job: GenerationJob) -> OpenAIError:
    error = rejected.error
    param = error.get("param")
    if param == "grammar":  # the engine could not compile the schema: blame what it came from
        param = job.grammar_param
    elif param not in _USER_FIELDS:
        param = job.prompt_param
    return OpenAIError(str(error.get("message") or "The engine rejected the request."),
                       param=param,
                       code=error.get("code") or "invalid_value")
