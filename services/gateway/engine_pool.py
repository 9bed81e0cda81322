"""The engines behind the gateway: health, model facts, and in-flight counts for routing.

The gateway is configured with engine URLs (names); each poll resolves them (engine_discovery)
and keeps one engine per address, so a name with N replicas behind it is N engines here.
An engine is routable when its last probe passed (/readyz 200 and /admin/stats parsed) and no
request has failed on it since. Requests go to the routable engine with the fewest of the
gateway's own requests in flight; a failed engine is probed again on the next poll.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator

import aiohttp

from services.gateway.engine_client import EngineClient, EngineStats
from services.gateway.engine_discovery import replica_urls

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineState:
    name: str              # the configured URL this engine's address was resolved from
    client: EngineClient   # its URL is the address's
    stats: EngineStats | None = None
    routable: bool = False
    in_flight: int = 0
    last_error: str = ""

    def describe(self) -> dict:
        return {"url": self.client.url, "name": self.name, "routable": self.routable, "in_flight": self.in_flight,
                "stats": self.stats._asdict() if self.stats else None, "last_error": self.last_error}


class EnginePool:
    def __init__(self, names: list[str], connect: Callable[[str], EngineClient], poll_s: float,
                 resolve: Callable[[str], Awaitable[list[str]]] = replica_urls):
        """names: configured engine URLs; connect(url) makes the client of one resolved address."""
        self.names = [name.rstrip("/") for name in names]
        self.engines: list[EngineState] = []  # in name order, then address order
        self._connect = connect
        self._resolve = resolve
        self._poll_s = poll_s
        self._poller: asyncio.Task | None = None
        self._unresolved: set[str] = set()  # names whose last resolution failed (logged once per failure spell)

    async def start(self) -> None:
        await self.probe_all()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await self.discover()
        await asyncio.gather(*(self._probe(engine) for engine in self.engines))

    async def discover(self) -> None:
        """Resolves every name again: new addresses join (not routable before their first probe),
        addresses no longer in a name's answer leave, a name that fails to resolve keeps its last."""
        answers = await asyncio.gather(*(self._resolve(name) for name in self.names), return_exceptions=True)
        known = {(e.name, e.client.url): e for e in self.engines}
        engines = []
        for name, answer in zip(self.names, answers):
            if isinstance(answer, BaseException):
                if not isinstance(answer, (OSError, ValueError)):
                    raise answer
                kept = [e for e in self.engines if e.name == name]
                if name not in self._unresolved:  # compose names a profile's engines that may not run
                    log.warning("engine name %s did not resolve (%r); keeping its %d known address(es)",
                                name, answer, len(kept))
                self._unresolved.add(name)
                for engine in kept:
                    engine.last_error = f"name did not resolve: {answer!r}"
                engines += kept
                continue
            if name in self._unresolved:
                log.info("engine name %s resolves again", name)
                self._unresolved.discard(name)
            for url in answer:
                engine = known.get((name, url))
                if engine is None:
                    log.info("engine %s: replica %s joined", name, url)
                    engine = EngineState(name, self._connect(url))
                engines.append(engine)
        gone = [e for e in self.engines if all(e is not kept for kept in engines)]
        for engine in gone:
            log.info("engine %s: replica %s left", engine.name, engine.client.url)
        self.engines = engines

    async def _probe(self, engine: EngineState) -> None:
        try:
            if not await engine.client.ready():
                raise ConnectionError("/readyz is not 200")
            engine.stats = await engine.client.stats()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
                TypeError) as error:
            if engine.routable:
                log.warning("engine %s is not ready: %r", engine.client.url, error)
            engine.routable, engine.last_error = False, f"probe failed: {error!r}"
            return
        if not engine.routable:
            log.info("engine %s is ready: %s", engine.client.url, engine.stats)
        engine.routable, engine.last_error = True, ""

    def ranked(self) -> list[EngineState]:
        """Routable engines, least loaded first: by this gateway's requests in flight, then by
        the engine's own count at the last probe (which includes other gateways' requests)."""
        return sorted((e for e in self.engines if e.routable and e.stats is not None),
                      key=lambda e: (e.in_flight, e.stats.in_flight))

    def mark_failed(self, engine: EngineState, reason: str) -> None:
        log.warning("engine %s failed a request: %s", engine.client.url, reason)
        engine.routable, engine.last_error = False, reason

    @contextmanager
    def claim(self, engine: EngineState) -> Iterator[EngineState]:
        engine.in_flight += 1
        try:
            yield engine
        finally:
            engine.in_flight -= 1

    def max_context(self) -> int | None:
        """The largest context (tokens) any engine has reported, or None before the first probe."""
        known = [e.stats.max_context for e in self.engines if e.stats is not None]
        return max(known) if known else None

    def in_flight(self) -> int:
        return sum(engine.in_flight for engine in self.engines)
