"""ttft_bench's own stack, restartable: a cold hit has to come from processes that never touched the
prefix, since a running engine keeps the segments it read mapped and dropping the page cache does
not evict mapped pages.

A restart stops every process (gateway, engine, kvstore, Valkey), drops the page cache, starts the
same stack again (same ports, data dir, volumes and durable index: Valkey's append-only file), waits
for the kvstore's start-time reconciliation pass to finish (so it does not run beside the measured
request; it reads segment headers) and drops the page cache once more. The seconds of each part are
returned: they are reported, not counted in any TTFT.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, NamedTuple

from bench.kv_bench import free_port
from bench.ttft_client import http_get
from services.launcher import Stack, StackConfig


class Restart(NamedTuple):
    """Seconds of one restart."""
    stop_s: float  # SIGTERM to every process (gateway first, Valkey last) until all exited
    start_s: float  # new processes until every service answers /readyz (model load, compile-cache reads, warm-up)
    reconcile_s: float  # ready -> the kvstore's first reconciliation pass done
    dropped: bool  # the page cache was dropped (root only)


class BenchStack:
    """One stack on fixed ports and one data dir, started, restarted and stopped by the bench."""

    def __init__(self, preset: str, model_dir: Path, data_dir: Path, engines: int = 1):
        self.cfg = StackConfig(preset=preset, model_dir=str(model_dir), data_dir=str(data_dir), engines=engines,
                               gateway_port=free_port(), kvstore_port=free_port(), engine_port=free_port(),
                               redis_port=free_port(), ready_timeout_s=600)
        self.stack: Stack | None = None

    def start(self) -> float:
        """Starts the stack; seconds until every service is ready."""
        begin = time.perf_counter()
        self.stack = Stack(self.cfg, quiet=True).start()
        return time.perf_counter() - begin

    def stop(self) -> float:
        begin = time.perf_counter()
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        return time.perf_counter() - begin

    def restart(self, drop: Callable[[], bool]) -> Restart:
        stop_s = self.stop()
        dropped = drop()
        start_s = self.start()
        reconcile_s = self.wait_for_reconciliation()
        return Restart(stop_s, start_s, reconcile_s, dropped and drop())

    def wait_for_reconciliation(self, timeout_s: float = 300.0) -> float:
        """Blocks until the kvstore has finished a reconciliation pass; seconds waited."""
        begin = time.perf_counter()
        while True:
            state = json.loads(http_get(self.kvstore_url + "/admin/reconcile", self.admin_token))
            if state["passes"] >= 1 and not state["running"]:
                return time.perf_counter() - begin
            if time.perf_counter() - begin > timeout_s:
                raise TimeoutError(f"kvstore still reconciling after {timeout_s:.0f} s")
            time.sleep(0.05)

    @property
    def gateway_url(self) -> str:
        return self.stack.gateway_url

    @property
    def kvstore_url(self) -> str:
        return self.stack.kvstore_url

    @property
    def engine_urls(self) -> list[str]:
        return self.stack.engine_urls

    @property
    def admin_token(self) -> str:
        return self.stack.admin_token

    @property
    def engine_pid(self) -> int:
        return self.stack.procs["engine0"].pid

    @property
    def logs(self) -> Path:
        return Path(self.cfg.data_dir) / "logs"
