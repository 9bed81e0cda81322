"""One request's state inside the engine, from admission to its last token."""
from __future__ import annotations

import asyncio
import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvstore import Hit, cacheable_blocks, extend_block_hashes
from model.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:  # llguidance only where a request brings a grammar
    from model.grammar import GrammarState


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
    save_blocks: int | None = None  # admission: the leading full blocks it may write to disk (None: every one)
    epoch: int | None = None  # the tenant's purge epoch when the gateway looked it up (kvstore/fence.py)
    handoff: bool = False  # a split request's prefill: stop after the first token, report once its blocks are saved
    generated: tuple[int, ...] = ()  # tokens a prefill engine sampled already: this engine decodes after them


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and requeued: owns no pages
    RUNNING = "running"  # owns its pages: loading a disk hit, prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Load:
    """A disk hit read into the pages, positions [start, end) counted computed; `placed` layers are in."""
    start: int  # tokens it held before (from the memory tier): not read
    end: int
    begin: float  # perf_counter when it was asked for
    placed: int = 0
    cancel: object = None  # set by the tiers: stops the reads (any thread)


@dataclass(eq=False)
class Sequence:
    """`tokens` is the prompt plus every token sampled so far; the latents of tokens[:computed] are in `pages`, for
    every layer. After its prefill, computed == len(tokens) - 1: the next decode step feeds the last sampled token."""

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
    load: Load | None = None  # a disk hit being read
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    stall_s: float = 0.0
    finish_reason: str = ""
    grammar: GrammarState | None = None
    fenced: bool = False  # its tenant was purged since its job began: it publishes nothing
    saves: list = field(default_factory=list)  # (first block, end block, future of the store's result) per save

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

    def reusable_blocks(self, block_tokens: int) -> int:
        """Leading full blocks of the target a cache may serve: every one once a token is sampled (the next decode step
        feeds the last token), else all but the prompt's last token's (its logits give the first token)."""
        return self.target // block_tokens if self.generated else cacheable_blocks(self.target, block_tokens)

    @property
    def remaining(self) -> int:
        """Tokens it may still generate (max_tokens; the context can cut it shorter: the caller's min)."""
        return self.job.params.max_tokens - self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    @property
    def settled(self) -> int:
        """Tokens whose latents are in every layer of its pages (a load's are not until its last layer is)."""
        return self.computed if self.load is None else self.load.start

    def block_hashes(self, blocks: int, fingerprint: str, block_tokens: int) -> list[bytes]:
        """The chained hashes of its first `blocks` full blocks (extended as it grows)."""
        if len(self.hashes) < blocks:
            self.hashes = extend_block_hashes(self.hashes, self.tokens, fingerprint, self.job.tenant_salt,
                                              block_tokens)
        return self.hashes[:blocks]

    def take(self, token: int, logits_V: np.ndarray | None, logprobs: TokenLogprobs | None) -> dict[str, Any]:
        """Appends a sampled token; returns its event for the stream."""
        self.tokens.append(token)
        self.generated += 1
        event = {"type": "token", "id": token}
        if logprobs is not None:
            event["logprob"], event["top_logprobs"] = logprobs.logprob, [[t, lp] for t, lp in logprobs.top]
        if logits_V is not None:
            event["logits_sha256"] = hashlib.sha256(np.ascontiguousarray(logits_V, np.float32).tobytes()).hexdigest()
        if self.generated == 1:
            self.first_token_at = time.perf_counter()
            event["cached_tokens"] = self.memory_tokens + self.disk_tokens
        return event

    def done_event(self, loaded_bytes: int) -> dict[str, Any]:
        now = time.perf_counter()
        first = self.first_token_at or now
        done = {"type": "done", "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_len,
                "cached_tokens": self.memory_tokens + self.disk_tokens, "completion_tokens": self.generated,
                "tiers": {"memory": self.memory_tokens, "disk": self.disk_tokens},
                "timing": {"ttft_s": first - self.arrival, "prefetch_stall_s": self.stall_s,
                           "loaded_bytes": loaded_bytes, "decode_s": now - first, "preemptions": self.preemptions}}
        if self.grammar is not None:
            done["grammar_complete"] = self.grammar.complete
        return done

    def emit(self, event: dict[str, Any]) -> None:
        """Hands an event to the request's stream (callable from any thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)
