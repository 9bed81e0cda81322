"""The engine's HTTP API: POST /internal/generate (NDJSON stream), health, metrics, admin."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
import uuid

import numpy as np
from aiohttp import web

from kvstore import Hit, SegmentRun, block_hashes, cacheable_blocks, miss, open_redis
from kvstore.kv_events import EventPublisher
from kvstore.location import SEGMENT_ID, VOLUME_ID
from model.grammar import GrammarError, grammar_source
from model.runner import enable_compilation_cache
from model.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from services.common.admin import admin_auth_middleware
from services.common.instance import add_instance_header
from services.common.service_auth import service_auth_middleware
from services.common.metrics import add_metrics_route
from services.common.request_id import add_request_ids
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.engine_metrics import EngineMetrics
from services.engine.core import Engine, QueueFull
from services.engine.sequence import Job
from services.engine.openapi_document import INT31, INT63, RETENTION_CLASSES, engine_openapi_document
from services.engine.model_source import open_model

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a 128K-token prompt is ~1 MB of JSON
# Below this, float32 logits / temperature overflow (the sampler returns token 0); sampling near 0 is greedy.
GREEDY_BELOW_TEMPERATURE = 1e-30


class BadJob(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status, headers=headers)


SALT_HEX = re.compile(r"^(?:[0-9a-f]{32})?$")
MAX_REQUEST_ID = 200  # characters


def _field(body: dict, name: str, kind, default=None, required: bool = False, low=None, high=None):
    """body[name] of type `kind` (int: not bool; float: finite, ints accepted) within [low, high)
    when given; `default` when absent or null. Raises BadJob naming the field."""
    if name not in body or body[name] is None:
        if required:
            raise BadJob(f"'{name}' is required", name)
        return default
    value = _integral(body[name]) if kind is int else body[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        if not -INT63 <= value < INT63:
            raise BadJob(f"'{name}' is out of range", name)
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadJob(f"'{name}' must be of type {kind.__name__}", name)
    if kind is float and not math.isfinite(value):
        raise BadJob(f"'{name}' must be a finite number", name)
    if (low is not None and value < low) or (high is not None and value >= high):
        raise BadJob(f"'{name}' must be in [{low}, {high}), got {value}", name)
    return value


def _integral(value):
    """JSON Schema's integers include 2.0: an integral finite float becomes an int (then range-checked)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int_list(body: dict, name: str, required: bool = False) -> list[int]:
    """A list of token ids in [0, 2^31); anything else (1e400, 1.5, bools, huge ints) is a BadJob naming the field."""
    values = [_integral(v) for v in _field(body, name, list, [], required)]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < INT31 for t in values):
        raise BadJob(f"'{name}' must be a list of integer token ids in [0, 2^31)", name)
    return values


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} (ids as decimal strings or ints) -> ((id, bias), ...), checked as OpenAI does."""
    raw = _field(body, "logit_bias", dict, {})
    if len(raw) > MAX_LOGIT_BIAS:
        raise BadJob(f"'logit_bias' may have at most {MAX_LOGIT_BIAS} entries, got {len(raw)}", "logit_bias")
    out = {}
    for key, value in raw.items():
        token = int(key) if isinstance(key, str) and key.isdigit() and len(key) < 12 else None
        if token is None or token >= vocab_size:
            raise BadJob(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        value = _integral(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise BadJob(f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for {key}", "logit_bias")
        out[token] = out.get(token, 0.0) + float(value)
    return tuple(sorted(out.items()))


def parse_job(body: object, fingerprint: str, block_tokens: int, vocab_size: int = INT31) -> Job:
    """A generation job from the gateway's JSON: every malformed field is a BadJob (400) naming it."""
    if not isinstance(body, dict):
        raise BadJob("the body must be a JSON object")
    tokens = _int_list(body, "tokens", required=True)
    if not tokens:
        raise BadJob("'tokens' must be a non-empty list of integer token ids", "tokens")
    salt = _field(body, "tenant_salt", str, "")
    if not SALT_HEX.match(salt):
        raise BadJob("'tenant_salt' must be 32 lowercase hex digits", "tenant_salt")
    tenant = _field(body, "tenant", str, "")
    request_id = _field(body, "request_id", str, "") or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID:
        raise BadJob(f"'request_id' must be at most {MAX_REQUEST_ID} characters", "request_id")
    retention = _field(body, "retention", str, "chat")
    if retention not in RETENTION_CLASSES:
        raise BadJob(f"'retention' must be one of {RETENTION_CLASSES}", "retention")
    stop = tuple(_int_list(body, "stop_token_ids"))
    temperature = _field(body, "temperature", float, 0.0)
    temperature = 0.0 if 0.0 <= temperature < GREEDY_BELOW_TEMPERATURE else temperature
    penalties = {name: _field(body, name, float, 0.0) for name in ("presence_penalty", "frequency_penalty")}
    for name, value in penalties.items():
        if not -2.0 <= value <= 2.0:
            raise BadJob(f"'{name}' must be in [-2, 2], got {value}", name)
    logit_bias = _logit_bias(body, vocab_size)
    logprobs = _field(body, "logprobs", int, None, low=0, high=MAX_LOGPROBS + 1)
    try:
        grammar = None if body.get("grammar") is None else grammar_source(body["grammar"])
    except GrammarError as error:
        raise BadJob(str(error), "grammar") from None
    try:
        params = SamplingParams(max_tokens=_field(body, "max_tokens", int, 16, low=1, high=INT31),
                                temperature=temperature,
                                top_p=_field(body, "top_p", float, 1.0),
                                top_k=_field(body, "top_k", int, 0, low=0, high=INT31),
                                seed=_field(body, "seed", int, None, low=-INT63, high=INT63), stop_token_ids=stop,
                                logit_bias=logit_bias, logprobs=logprobs, **penalties)
    except ValueError as error:  # SamplingParams names the field first ("top_p must be in ...")
        raise BadJob(str(error), str(error).split(" ", 1)[0]) from None
    token_array = np.asarray(tokens, np.int64)
    digest = _field(body, "logits_digest", bool, False)
    save_blocks = _field(body, "save_blocks", int, None, low=0, high=INT31)
    handoff = _field(body, "handoff", bool, False)
    generated = tuple(_int_list(body, "generated"))
    if len(generated) > 1 or len(generated) >= params.max_tokens:
        raise BadJob("'generated' holds at most one token (a prefill engine's first), fewer than max_tokens",
                     "generated")
    if handoff and generated:
        raise BadJob("a handoff job starts a generation: 'generated' must be empty", "generated")
    known = np.asarray([*tokens, *generated], np.int64)  # a hit may cover every full block before the next token
    return Job(request_id, token_array, tenant, salt,
               _parse_hit(body.get("hit"), known, fingerprint, salt, block_tokens), params, retention, digest,
               grammar, save_blocks, epoch=_field(body, "tenant_epoch", int, None, low=0, high=INT63),
               handoff=handoff, generated=generated)


def _parse_hit(raw: object, tokens: np.ndarray, fingerprint: str, salt: str, block_tokens: int) -> Hit:
    """The gateway's lookup result, its block hashes recomputed from the tokens: a stale or wrong location is a miss."""
    if not raw:
        return miss()
    hit_blocks = _integral(raw.get("blocks")) if isinstance(raw, dict) else None
    if not isinstance(hit_blocks, int) or isinstance(hit_blocks, bool) or not isinstance(raw.get("locations"), list):
        raise BadJob("'hit' must be {\"blocks\": int, \"locations\": [...]}", "hit")
    runs = []
    for item in raw["locations"]:
        try:
            if not isinstance(item, dict):
                raise TypeError(item)
            run = SegmentRun(**{key: _integral(value) for key, value in item.items()})
            numbers = (run.first, run.count, run.n_blocks, run.data_offset)
            if not (isinstance(run.volume, str) and isinstance(run.segment, str)
                    and VOLUME_ID.match(run.volume) and SEGMENT_ID.match(run.segment)) \
                    or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < INT63 for n in numbers) \
                    or run.count <= 0:
                raise ValueError
        except (TypeError, ValueError):
            raise BadJob("'hit.locations' holds a malformed segment run", "hit") from None
        runs.append(run)
    # Locations covering fewer blocks than claimed: only what they cover can be read (a wrong hit is a miss).
    blocks = min(hit_blocks, sum(run.count for run in runs), cacheable_blocks(tokens.size, block_tokens))
    if blocks <= 0:
        return miss()
    hashes = block_hashes(tokens[: blocks * block_tokens].tolist(), fingerprint, salt, block_tokens)
    return Hit(hashes[0], tuple(hashes), tuple(runs)).truncated(blocks)


class EngineState:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.metrics = EngineMetrics()
        self.engine: Engine | None = None
        self.cache: CacheLink | None = None
        self.loaded = None
        self.ready = False
        self.load_error: str | None = None
        self.engine_id = uuid.uuid4().hex  # this process's name in KV events and leases (addresses differ per viewer)
        self.events: EventPublisher | None = None  # with a Redis URL: this engine's KV events

    async def start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            enable_compilation_cache()
            cfg = self.cfg
            self.loaded = await loop.run_in_executor(None, open_model, cfg.model_dir, cfg.preset, cfg.models_dir,
                                                     cfg.cache_dtype)
            model_cfg = self.loaded.config
            if cfg.redis_url and cfg.kv_events:
                self.events = EventPublisher(open_redis(cfg.redis_url, cfg.redis_cluster, password=cfg.redis_password),
                                             cfg.index_prefix, self.engine_id, cfg.block_tokens, cfg.kv_events_max_len,
                                             lease_s=cfg.kv_events_lease_s)
                self.metrics.count_kv_events(self.events)
            self.cache = CacheLink.for_model(cfg, model_cfg, self.loaded.fingerprint, self.events)
            await self.cache.start()
            self.engine = await loop.run_in_executor(None, Engine, self.loaded, cfg, self.cache, self.metrics,
                                                     self.events)
            self.loaded = self.engine.loaded  # the served model: the checkpoint's projections can be freed
            if cfg.warmup:
                await loop.run_in_executor(None, self.engine.warm_up)
            self.engine.start(loop)
            if self.events is not None:
                self.events.start()
            self.ready = True
            log.info("engine ready: %s (fingerprint %s) on %s:%d", model_cfg.name, self.loaded.fingerprint,
                     cfg.host, cfg.port)
        except Exception as error:
            self.load_error = repr(error)
            log.exception("engine failed to load its model")

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop(timeout_s=10.0)
        if self.cache is not None:
            await self.cache.close()
        if self.events is not None:
            await self.events.close()
            await self.events.redis.aclose()

    def stats(self) -> dict:
        out = {"ready": self.ready, "load_error": self.load_error, "block_tokens": self.cfg.block_tokens,
               "role": self.cfg.role, "engine_id": self.engine_id}
        if self.loaded is not None:
            c = self.loaded.config
            out |= {"model": c.name, "fingerprint": self.loaded.fingerprint, "max_context": c.max_context,
                    "num_layers": c.num_layers, "latent_dim": c.latent_dim, "cache_dtype": c.cache_dtype}
        if self.engine is not None:
            out |= self.engine.stats()
        if self.cache is not None:
            out["cache_connected"] = self.cache.store is not None
            stats = getattr(self.cache.store, "stats", None)  # a mounted BlockStore's, not the remote client's
            if dataclasses.is_dataclass(stats):
                out["store"] = dataclasses.asdict(stats)
        return out


async def generate(request: web.Request) -> web.StreamResponse:
    state: EngineState = request.app["state"]
    if not state.ready:
        return _error(503, "the engine is still loading its model", kind="service_unavailable",
                      headers={"Retry-After": "2"})
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return _error(400, "the body is not valid JSON")
    try:
        job = parse_job(body, state.loaded.fingerprint, state.cfg.block_tokens, state.loaded.config.vocab_size)
        if job.grammar is not None:  # compiling a large schema can take a while: off the event loop
            grammar = await asyncio.to_thread(state.engine.check, job)
        else:
            grammar = state.engine.check(job)
    except BadJob as error:
        return _error(400, str(error), error.param)
    except GrammarError as error:
        return _error(400, str(error), "grammar")
    except ValueError as error:
        return _error(400, str(error), "tokens")
    log.info("request %s: %d prompt tokens, %d hit blocks, max_tokens %d", job.request_id, job.tokens.size,
             job.hit.blocks, job.params.max_tokens)
    events = state.engine.run(job, grammar)
    try:
        admitted = await events.__anext__()
    except QueueFull:
        return _error(503, "the engine's queue is full", kind="service_unavailable", headers={"Retry-After": "1"})
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    begin = time.monotonic()
    pending: asyncio.Future | None = None
    try:
        await response.write(json.dumps(admitted).encode() + b"\n")
        while True:
            # a progress event every heartbeat_s while the next is slow to come: a caller's timeout measures silence
            pending = asyncio.ensure_future(events.__anext__())
            while not (await asyncio.wait({pending}, timeout=state.cfg.heartbeat_s))[0]:
                beat = {"type": "progress", "phase": "working", "elapsed_s": round(time.monotonic() - begin, 1)}
                await response.write(json.dumps(beat).encode() + b"\n")
            try:
                event = pending.result()
            except StopAsyncIteration:
                break
            await response.write(json.dumps(event).encode() + b"\n")
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("request %s: client went away, generation cancelled", job.request_id)
        raise
    except Exception as error:  # noqa: BLE001 - report on the stream, the status line is already sent
        log.exception("request %s failed", job.request_id)
        await response.write(json.dumps({"type": "error", "message": repr(error)}).encode() + b"\n")
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # the generation unwinds (its sequence is freed) before the stream closes
            await asyncio.wait({pending})
        if pending is not None and not pending.cancelled():
            pending.exception()  # retrieved: a stream that ended as the client left is no error to log
        await events.aclose()
    await response.write_eof()
    log.info("request %s: done in %.3f s", job.request_id, time.monotonic() - begin)
    return response


def build_app(cfg: EngineConfig) -> web.Application:
    state = EngineState(cfg)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[
        admin_auth_middleware(cfg.admin_token), service_auth_middleware(cfg.service_token, cfg.admin_token)])
    app["state"] = state
    add_request_ids(app)
    add_instance_header(app)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        checks = {"model": state.ready}
        if state.cache is not None:
            checks |= await state.cache.ready()
        # The cache is an accelerator: the engine is ready once its model is loaded and warm.
        return web.json_response({"ready": state.ready, "checks": checks, "error": state.load_error},
                                 status=200 if state.ready else 503)

    async def admin_stats(_: web.Request) -> web.Response:
        return web.json_response(state.stats())

    async def admin_drop_memory_tier(_: web.Request) -> web.Response:
        if state.engine is None:
            return _error(503, "the engine is still loading its model", kind="service_unavailable")
        return web.json_response({"dropped_pages": await state.engine.drop_memory_tier()})

    async def admin_purge_tenant(request: web.Request) -> web.Response:
        """POST {"epoch"}: the tenant's pages leave the memory tier; its sequences of older epochs publish nothing."""
        if state.engine is None:
            return _error(503, "the engine is still loading its model", kind="service_unavailable")
        try:
            epoch = _field(await request.json(), "epoch", int, None, True, low=1, high=INT63)
        except (ValueError, AttributeError, TypeError):
            return _error(400, "the body must be JSON: {\"epoch\": N}", "epoch")
        return web.json_response({"pages": await state.engine.purge_tenant(request.match_info["tenant"], epoch)})

    async def openapi(_: web.Request) -> web.Response:
        if not state.ready:
            return _error(503, "the engine is still loading its model", kind="service_unavailable",
                          headers={"Retry-After": "2"})
        config = state.loaded.config
        return web.json_response(engine_openapi_document(config.vocab_size, config.max_context))

    async def on_startup(_: web.Application) -> None:
        app["loader"] = asyncio.create_task(state.start())

    async def on_cleanup(_: web.Application) -> None:
        # Cleanup, not shutdown: aiohttp runs shutdown hooks before in-flight requests end (and save).
        app["loader"].cancel()
        await state.stop()

    app.router.add_post("/internal/generate", generate)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/admin/stats", admin_stats)
    app.router.add_post("/admin/memory-tier/drop", admin_drop_memory_tier)
    app.router.add_post("/admin/tenants/{tenant}/purge", admin_purge_tenant)
    app.router.add_get("/openapi.json", openapi)
    add_metrics_route(app, state.metrics.registry)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
