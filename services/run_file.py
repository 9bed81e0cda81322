"""The run file: what `deepinfer up` started, for `deepinfer status` and `deepinfer stop`.

DATA_DIR/run.json, mode 0600 (it holds the admin token, which status needs for /admin/stats), written
atomically when the stack is ready and removed when it stops. A run file whose launcher is gone is
stale: its services may still run (a killed launcher) and `stop` stops them by pid, after checking
that each pid is still the process that was started (its DEEPINFER_INSTANCE_ID).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.instance import INSTANCE_ENV

RUN_FILE = "run.json"
STOP_ORDER_FIRST, STOP_ORDER_LAST = "gateway", "kvstore"  # gateway first so requests drain; engines; kvstore


@dataclass(frozen=True)
class ServiceRecord:
    pid: int
    url: str
    instance: str  # the DEEPINFER_INSTANCE_ID the process was started with ("" for Valkey)
    log: str


@dataclass(frozen=True)
class RunFile:
    data_dir: str
    launcher_pid: int          # the process that supervises the stack (SIGTERM stops it all); 0: none
    started_at: float          # unix seconds
    admin_token: str
    services: dict[str, ServiceRecord] = field(default_factory=dict)  # name -> record, valkey included

    @staticmethod
    def path(data_dir: str | Path) -> Path:
        return Path(data_dir) / RUN_FILE

    def write(self) -> Path:
        target = self.path(self.data_dir)
        temp = target.with_suffix(".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out, indent=1)
        os.chmod(temp, 0o600)  # an older temp file keeps its mode through O_CREAT
        os.replace(temp, target)
        return target

    @classmethod
    def read(cls, data_dir: str | Path) -> "RunFile | None":
        """The run file of `data_dir`, or None when there is none (or it is unreadable: not ours)."""
        try:
            raw = json.loads(cls.path(data_dir).read_text())
            services = {name: ServiceRecord(**record) for name, record in raw.pop("services").items()}
            return cls(services=services, **raw)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def remove(self) -> None:
        self.path(self.data_dir).unlink(missing_ok=True)

    def launcher_alive(self) -> bool:
        return self.launcher_pid > 0 and pid_alive(self.launcher_pid)

    def stop_order(self) -> list[str]:
        engines = sorted(n for n in self.services if n.startswith("engine"))
        rest = [n for n in (STOP_ORDER_FIRST, *engines, STOP_ORDER_LAST, "valkey") if n in self.services]
        return rest + [n for n in self.services if n not in rest]

    def is_ours(self, name: str) -> bool:
        """The pid recorded for `name` still runs the process that was started (not a reused pid)."""
        record = self.services[name]
        if not pid_alive(record.pid):
            return False
        try:
            if record.instance:
                environ = Path(f"/proc/{record.pid}/environ").read_bytes().split(b"\0")
                return f"{INSTANCE_ENV}={record.instance}".encode() in environ
            return b"valkey" in Path(f"/proc/{record.pid}/cmdline").read_bytes()
        except OSError:
            return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
