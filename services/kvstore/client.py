"""KvstoreClient: the kvstore service over HTTP, with BlockStore's save/prefetch shape.

For engines that do not mount the volumes:
    client = KvstoreClient("http://127.0.0.1:8100", geometry, fingerprint, service_token=token)
    await client.save(hashes, layers, start_block=hit.blocks, tenant=..., retention="chat")
    p = client.prefetch(hit); await p.layer(l); await p.valid_tokens(); p.cancel()
    await client.lookup(hashes) -> Hit; await client.close()
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import aiohttp
import msgpack
import numpy as np

from kvstore import CacheGeometry, Hit, LayerRead, Prefetch, SaveResult, miss
from kvstore.store import READ_AHEAD_LAYERS
from services.common.request_id import forwarded_headers
from services.common.service_auth import bearer_headers

from . import wire

log = logging.getLogger(__name__)


class KvstoreError(RuntimeError):
    """The service refused or failed a save: `status` and its JSON error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"kvstore {status}: {message}")
        self.status = status


class KvstoreClient:
    """Invariants as for BlockStore: save() returns once the data is durable and published (or
    raises KvstoreError); reads never raise for cache faults or an unreachable service, they
    serve fewer (possibly zero) valid tokens."""

    def __init__(self, base_url: str, geometry: CacheGeometry, fingerprint: str, *, read_ahead: int = READ_AHEAD_LAYERS,
                 timeout_s: float = 30.0, max_request_bytes: int = 256 << 20,
                 session: aiohttp.ClientSession | None = None, service_token: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Content-Type": wire.MSGPACK} | bearer_headers(service_token)
        self.geometry = geometry
        self.fingerprint = fingerprint
        self.read_ahead = read_ahead
        # a save larger than this goes as several requests, in block order (keep it under the
        # service's --max-body-mib)
        self.max_request_bytes = max_request_bytes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    def _model(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "geometry": self.geometry.as_dict()}

    async def _post(self, path: str, message: dict[str, Any]) -> aiohttp.ClientResponse:
        body = msgpack.packb(message)
        headers = self._headers | forwarded_headers()  # the engine's request id, if any
        return await self._http().post(self.base_url + path, data=body, headers=headers)

    async def save(self, hashes: Sequence[bytes], layers: Sequence[np.ndarray], *, start_block: int = 0,
                   tenant: str = "", retention: str = "chat", ttl_s: int | None = None,
                   epoch: int | None = None) -> SaveResult:
        """Store blocks start_block.. of the chain `hashes`; layers[l] is (new_tokens, row_width) stored rows.
        `epoch`: the tenant's purge epoch the request began under (BlockStore.save).

        Raises KvstoreError if the service refuses (4xx) or fails (5xx); a save split over several
        requests may have published its leading part when a later request fails.
        """
        g = self.geometry
        per_block = g.num_layers * g.block_bytes
        step = max(1, self.max_request_bytes // per_block)  # blocks per request
        blocks, segments, written = 0, [], 0
        for first in range(start_block, len(hashes), step):
            last = min(len(hashes), first + step)
            rows = slice((first - start_block) * g.block_tokens, (last - start_block) * g.block_tokens)
            message = self._model() | {
                "hashes": list(hashes[:last]), "start_block": first, "tenant": tenant, "retention": retention,
                "ttl_s": ttl_s, "epoch": epoch, "layers": [np.ascontiguousarray(x[rows]).view(np.uint8).tobytes() for x in layers]}
            async with await self._post("/v1/segments", message) as response:
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise KvstoreError(response.status, body.get("error", str(body)))
            blocks += body["blocks"]
            segments += body["segments"]
            written += body["bytes"]
        return SaveResult(blocks, tuple(segments), written)

    async def lookup(self, hashes: Sequence[bytes]) -> Hit:
        """The index's longest leading run (a miss if the service is unreachable)."""
        try:
            async with await self._post("/v1/lookup", {"hashes": list(hashes)}) as response:
                if response.status != 200:
                    return miss(hashes[0] if hashes else b"")
                return wire.decode_hit(msgpack.unpackb(await response.read()))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.warning("kvstore lookup failed: %r", e)
            return miss(hashes[0] if hashes else b"")

    def prefetch(self, hit: Hit, read_ahead: int | None = None, out: np.ndarray | None = None) -> Prefetch:
        """Start reading every layer of `hit` from the service (into `out` if given, see Prefetch)."""
        return Prefetch(self, hit, self.read_ahead if read_ahead is None else read_ahead, out)

    async def begin_read(self, hit: Hit) -> tuple[None, int]:
        return None, hit.blocks

    async def read_layer(self, hit: Hit, layer: int, context: Any = None, out: np.ndarray | None = None) -> LayerRead:
        g = self.geometry
        empty = LayerRead(np.empty((0, g.row_width), g.row_dtype), 0)
        if hit.blocks == 0:
            return empty
        message = self._model() | wire.encode_hit(hit) | {"layer": layer}
        try:
            async with await self._post("/v1/read", message) as response:
                if response.status != 200:
                    log.warning("kvstore read of layer %d: %d %s", layer, response.status, await response.text())
                    return empty
                body = await response.read()
                valid = int(response.headers.get(wire.VALID_BLOCKS_HEADER, "0"))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.warning("kvstore read of layer %d failed: %r", layer, e)
            return empty
        if valid > hit.blocks or len(body) != valid * g.block_bytes:
            log.warning("kvstore read of layer %d: %d bytes for %d blocks", layer, len(body), valid)
            return empty
        latents = np.frombuffer(body, g.row_dtype).reshape(-1, g.row_width)  # (valid tokens, row_width)
        if out is not None:
            out[:len(latents)] = latents
            latents = out[:len(latents)]
        return LayerRead(latents, valid)

    def end_read(self, hit: Hit) -> None:
        pass

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
