"""Prefetch: the layers of a hit, read in the background ahead of the consumer."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from .location import Hit

if TYPE_CHECKING:
    from .store import BlockStore

log = logging.getLogger(__name__)


class Prefetch:
    """Reads every layer of `hit`, at most `read_ahead` layers in flight, starting at once.

    Invariants: `await layer(l)` returns (tokens, latent_dim) in cache dtype holding only
    verified rows, tokens a multiple of block_tokens and never more than any earlier layer's;
    a cache fault (missing or corrupt data, wrong fingerprint) only shortens the result and
    never raises. The prefix the caller may use for every layer is `await valid_tokens()`,
    known once all layers are verified.
    """

    def __init__(self, store: "BlockStore", hit: Hit, read_ahead: int) -> None:
        self.hit = hit
        self._store = store
        self._valid_blocks = hit.blocks
        self._slots = asyncio.Semaphore(max(1, read_ahead))
        self._layers: list[asyncio.Future] = [
            asyncio.get_running_loop().create_future() for _ in range(store.geometry.num_layers)]
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        store = self._store
        segments = {run.segment for run in self.hit.runs}
        store.hold(segments)
        try:
            headers = await store.verified_headers(self.hit)
            self._valid_blocks = min(self._valid_blocks, headers.valid_blocks)
            tasks = []
            for layer in range(len(self._layers)):
                await self._slots.acquire()
                tasks.append(asyncio.create_task(self._read(layer, headers)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            raise
        except Exception:  # a cache fault must not reach the caller: degrade to a miss
            log.exception("prefetch of %d blocks failed; serving a miss", self.hit.blocks)
            store.stats.verification_failures += 1
            self._valid_blocks = 0
            self._fail_rest()
        finally:
            store.release(segments)

    async def _read(self, layer: int, headers) -> None:
        try:
            blocks = self._valid_blocks
            read = await self._store.read_layer(self.hit.truncated(blocks), layer, headers)
            self._valid_blocks = min(self._valid_blocks, read.valid_blocks)
            if layer > 0:  # deliver in layer order, so a later layer is never longer than an earlier one
                await asyncio.shield(self._layers[layer - 1])
            rows = self._valid_blocks * self._store.geometry.block_tokens
            if not self._layers[layer].done():
                self._layers[layer].set_result(read.latents[:rows])
        finally:
            self._slots.release()

    def _fail_rest(self) -> None:
        empty = np.empty((0, self._store.geometry.latent_dim), self._store.geometry.np_dtype)
        for fut in self._layers:
            if not fut.done():
                fut.set_result(empty)

    async def layer(self, layer: int) -> np.ndarray:
        """(tokens, latent_dim) latents of `layer`; tokens <= hit.blocks * block_tokens."""
        return await asyncio.shield(self._layers[layer])

    async def valid_tokens(self) -> int:
        """Tokens valid in every layer (waits for all layers)."""
        await asyncio.gather(*(asyncio.shield(f) for f in self._layers))
        return self._valid_blocks * self._store.geometry.block_tokens

    def cancel(self) -> None:
        """Stop reading; layers not yet delivered come back empty."""
        self._task.cancel()
        self._valid_blocks = 0
        self._fail_rest()
