"""The engine process's heap settings: keep freed memory for reuse instead of handing it back to the kernel.

XLA:CPU allocates every temporary of a model step afresh (a decode step over 16 sequences at 2K tokens
holds a 38 MB page view per layer). glibc serves blocks that large with mmap and returns them with munmap
when freed, so every step page-faults its temporaries in again: measured here, 303 MB of minor faults per
decode step of 16 sequences at 2K context, 20-25% of the step's time. With one arena whose large blocks
come from the heap and stay there, the step reuses the same memory (0 faults; BENCHMARKS.md, decode_bench).
The price: the process keeps its peak heap instead of shrinking after a burst.

glibc reads these settings (GLIBC_TUNABLES) at process start only, so `python -m services.engine` starts
itself again with them unless GLIBC_TUNABLES already sets glibc.malloc values (the operator's then win) or
DEEPINFER_ENGINE_HEAP=system. Other C libraries ignore the variable.
"""
from __future__ import annotations

import os
import sys

HEAP_TUNABLES = ":".join([
    "glibc.malloc.arena_max=1",  # every thread's blocks in the main heap (a thread arena's heap is 64 MB at most)
    f"glibc.malloc.mmap_threshold={1 << 32}",  # large blocks from the heap, not from mmap
    f"glibc.malloc.trim_threshold={1 << 34}",  # and the heap's free top is kept, not trimmed
    f"glibc.malloc.top_pad={1 << 28}",  # the heap grows 256 MB at a time
])


def engine_environment(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to restart the engine with, or None when it already runs with its heap settings
    (or the operator chose otherwise)."""
    current = env.get("GLIBC_TUNABLES", "")
    if env.get("DEEPINFER_ENGINE_HEAP", "engine") == "system" or "glibc.malloc." in current:
        return None
    return env | {"GLIBC_TUNABLES": f"{current}:{HEAP_TUNABLES}" if current else HEAP_TUNABLES}


def restart_with_engine_heap(argv: list[str], module: str = "services.engine") -> None:
    """Replaces this process with `python -m module argv` under HEAP_TUNABLES, if they are not set (the
    in-process benches restart themselves too, so they measure the model as the engine runs it)."""
    env = engine_environment(dict(os.environ))
    if env is not None and sys.platform.startswith("linux"):
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def heap_in_use() -> str:
    """'engine' when this process runs with HEAP_TUNABLES, else 'system'."""
    return "engine" if HEAP_TUNABLES in os.environ.get("GLIBC_TUNABLES", "") else "system"
