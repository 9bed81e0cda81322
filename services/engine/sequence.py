"""One request's state inside the engine, from admission to its last token."""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvstore import Hit, Prefetch
from model.grammar import GrammarState
from model.sampling import SamplingParams


class Job(NamedTuple):
    request_id: str
    tokens: np.ndarray  # (n,) prompt token ids
    tenant: str
    tenant_salt: str
    hit: Hit  # from the gateway's lookup; may be empty
    params: SamplingParams
    retention: str
    digest: bool = False  # put a SHA-256 of each token's logits (float32 bytes) in its event
    grammar: str | None = None  # llguidance grammar text (model.grammar.grammar_source): decoding is constrained


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and requeued: owns no pages
    LOADING = "loading"  # owns its pages; its disk hit is being read
    RUNNING = "running"  # prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`tokens` is the prompt plus every token sampled so far; the latents of tokens[:computed] are in
    the pages of `pages` (its block table), for every layer. A running sequence whose prefill is
    done has computed == len(tokens) - 1: the last sampled token is fed by the next decode step."""

    job: Job
    seed: int
    events: asyncio.Queue  # dicts for the HTTP stream, put from the model thread via the event loop
    loop: asyncio.AbstractEventLoop
    tokens: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks of `tokens`
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    generated: int = 0
    status: Status = Status.WAITING
    cancelled: bool = False  # set on the event loop when the client went away
    memory_tokens: int = 0  # prompt tokens served from the memory tier (first admission)
    disk_tokens: int = 0  # prompt tokens read from disk (first admission)
    published_blocks: int = 0  # leading full blocks published to the memory tier
    saved_blocks: int = 0  # leading full blocks known to be on disk (saved or read from there)
    prefetch: Prefetch | None = None
    staging: np.ndarray | None = None  # (layers, padded tokens, A): where the disk read lands
    load_blocks: int = 0  # blocks [memory, load_blocks) are being read from disk
    load_begin: float = 0.0
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    stall_s: float = 0.0
    finish_reason: str = ""
    # The grammar's state follows `tokens` (not pages), so a preempted and resumed sequence keeps it.
    grammar: GrammarState | None = None

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def prompt_len(self) -> int:
        return int(self.job.tokens.size)

    @property
    def target(self) -> int:
        """Tokens to prefill: the prompt; after a preemption, everything but the last sampled token."""
        return len(self.tokens) if self.generated == 0 else len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        """Tokens it may still generate (max_tokens; the context can cut it shorter: the caller's min)."""
        return self.job.params.max_tokens - self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    def emit(self, event: dict[str, Any]) -> None:
        """Hands an event to the request's stream (callable from any thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)
