"""Prefetch: the layers of a hit, read in the background ahead of the consumer."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple, Protocol

import numpy as np

from .geometry import CacheGeometry
from .location import Hit

log = logging.getLogger(__name__)


class LayerRead(NamedTuple):
    latents: np.ndarray          # (valid_blocks * block_tokens, row_width) stored rows, geometry.row_dtype
    valid_blocks: int


class LayerSource(Protocol):
    """Where a Prefetch reads from: a local BlockStore, or a kvstore service over HTTP.

    read_layer never raises for cache faults: it returns fewer valid blocks.
    """

    geometry: CacheGeometry

    async def begin_read(self, hit: Hit) -> tuple[Any, int]:
        """Start reading `hit`: (context for read_layer, leading blocks that may be valid)."""

    async def read_layer(self, hit: Hit, layer: int, context: Any = None, out: np.ndarray | None = None) -> LayerRead:
        """One layer of `hit`'s leading blocks, verified; into `out` (tokens, row_width) if given."""

    def end_read(self, hit: Hit) -> None:
        """The prefetch of `hit` is over (its segments may be deleted now)."""


class LayerBuffers(Protocol):
    """Where a Prefetch reads each layer: `await take(l)` gives a C-contiguous (>= hit tokens, row_width) array
    in row_dtype, waiting while it has none free (an engine's staging slots, freed as it places layers)."""

    async def take(self, layer: int) -> np.ndarray: ...


class Prefetch:
    """Reads every layer of `hit`, at most `read_ahead` layers in flight, starting at once.

    With `out` (num_layers, >= hit tokens, row_width), e.g. an engine's reused staging buffer,
    layer l is read into out[l] and layer(l) returns a view of it: no fresh memory per read. `out`
    may also be LayerBuffers, which hand out a buffer per layer as the consumer frees them.

    Stored rows (geometry.py) are latents in cache dtype, or fp8 rows of row_bytes in the fp8 format.
    Invariants: `await layer(l)` returns (tokens, row_width) stored rows holding only
    verified rows, tokens a multiple of block_tokens and never more than any earlier layer's;
    a cache fault (missing or corrupt data, wrong fingerprint, a service down) only shortens
    the result and never raises. The prefix the caller may use for every layer is
    `await valid_tokens()`, known once all layers are verified.
    """

    def __init__(self, source: LayerSource, hit: Hit, read_ahead: int,
                 out: np.ndarray | LayerBuffers | None = None) -> None:
        g = source.geometry
        if isinstance(out, np.ndarray) and (out.dtype != g.row_dtype or out.ndim != 3 or out.shape[0] != g.num_layers
                                or out.shape[1] < hit.blocks * g.block_tokens or out.shape[2] != g.row_width
                                or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous ({g.num_layers}, >= {hit.blocks * g.block_tokens}, "
                             f"{g.row_width}) {g.row_dtype} array, got {out.shape} {out.dtype}")
        self.hit = hit
        self._out = out
        self._source = source
        self._geometry = source.geometry
        self._valid_blocks = hit.blocks
        self._slots = asyncio.Semaphore(max(1, read_ahead))
        loop = asyncio.get_running_loop()
        self._layers: list[asyncio.Future] = [loop.create_future() for _ in range(self._geometry.num_layers)]
        self._reads: list[asyncio.Task] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            context, valid = await self._source.begin_read(self.hit)
            self._valid_blocks = min(self._valid_blocks, valid)
            for layer in range(len(self._layers)):
                await self._slots.acquire()
                self._reads.append(asyncio.create_task(self._read(layer, context)))
            await asyncio.gather(*self._reads)
        except asyncio.CancelledError:
            raise  # reads in flight finish on their own (they may be writing into `out`)
        except Exception:  # a cache fault must not reach the caller: degrade to a miss
            log.exception("prefetch of %d blocks failed; serving a miss", self.hit.blocks)
            self._valid_blocks = 0
            self._fail_rest()
        finally:
            self._source.end_read(self.hit)

    async def _read(self, layer: int, context: Any) -> None:
        try:
            out = self._out
            if out is not None:
                out = out[layer] if isinstance(out, np.ndarray) else await out.take(layer)
            read = await self._source.read_layer(self.hit.truncated(self._valid_blocks), layer, context, out)
            self._valid_blocks = min(self._valid_blocks, read.valid_blocks)
            if layer > 0:  # deliver in layer order, so a later layer is never longer than an earlier one
                await asyncio.shield(self._layers[layer - 1])
            rows = self._valid_blocks * self._geometry.block_tokens
            if not self._layers[layer].done():
                self._layers[layer].set_result(read.latents[:rows])
        finally:
            self._slots.release()

    def _fail_rest(self) -> None:
        empty = np.empty((0, self._geometry.row_width), self._geometry.row_dtype)
        for fut in self._layers:
            if not fut.done():
                fut.set_result(empty)

    def ready(self, layer: int) -> bool:
        """Whether layer(layer) has its result. Callable from any thread (it reads a flag)."""
        return self._layers[layer].done()

    def result(self, layer: int) -> np.ndarray:
        """The result of a ready layer, without a trip through the event loop (any thread)."""
        return self._layers[layer].result()

    async def layer(self, layer: int) -> np.ndarray:
        """(tokens, row_width) stored rows of `layer`; tokens <= hit.blocks * block_tokens."""
        return await asyncio.shield(self._layers[layer])

    async def valid_tokens(self) -> int:
        """Tokens valid in every layer (waits for all layers)."""
        await asyncio.gather(*(asyncio.shield(f) for f in self._layers))
        return self._valid_blocks * self._geometry.block_tokens

    def cancel(self) -> None:
        """Stop reading; layers not yet delivered come back empty and valid_tokens() is 0.
        Layer reads already in flight still finish: await aclose() before reusing `out`."""
        self._task.cancel()
        self._valid_blocks = 0
        self._fail_rest()

    async def aclose(self) -> None:
        """cancel(), then wait until nothing writes into `out` any more."""
        self.cancel()
        await asyncio.gather(self._task, *self._reads, return_exceptions=True)
