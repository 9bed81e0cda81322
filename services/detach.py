"""`deepinfer up --detach`, and where the launcher's own log goes.

Detached, the stack runs under a second `deepinfer up` in its own session, writing to the
launcher log; this process waits until that one has written the run file (ready) or exited
(then it repeats that one's console lines), and returns.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.preflight import preflight
from services.run_file import RunFile

if TYPE_CHECKING:
    from services.launcher import StackConfig

LAUNCHER_LOG = "launcher.log"
CONSOLE_PREFIX = "deepinfer up: "
EXIT_GRACE_S = 60.0  # beyond --ready-timeout-s: the child's own timeout fires first and it reports


def log_to_file(data_dir: Path) -> Path:
    """The launcher's log file: DATA_DIR/logs/launcher.log, or a temp file when the data dir is unusable."""
    path = data_dir / "logs" / LAUNCHER_LOG
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError:
        path = Path(tempfile.gettempdir()) / f"deepinfer-up-{Path.home().name}.log"
        handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s launcher %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def detach(cfg: "StackConfig", argv: list[str], log_path: Path) -> int:
    from services.launcher import Stack, ready_banner, refuse

    stack = Stack(cfg)
    problems = preflight(cfg, stack.data, stack.volumes)  # refused here, not after a fork
    if problems:
        refuse(problems, log_path)
        return 2
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "services.cli", "up",
                                  *[a for a in argv if a != "--detach"], "--no-detach"],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    print(f"starting in the background (pid {child.pid}); waiting until it is ready ...", flush=True)
    deadline = time.monotonic() + cfg.ready_timeout_s + EXIT_GRACE_S
    while time.monotonic() < deadline:
        run = RunFile.read(stack.data)
        if run is not None and run.launcher_pid == child.pid:
            print(ready_banner(stack, run.admin_token, f"deepinfer stop --data-dir {stack.data} stops it."),
                  flush=True)
            return 0
        if child.poll() is not None:
            with open(log_path, "rb") as log_file:
                log_file.seek(offset)
                said = [line for line in log_file.read().decode(errors="replace").splitlines()
                        if line.startswith(CONSOLE_PREFIX)]
            for line in said or [f"{CONSOLE_PREFIX}the stack exited with {child.returncode}; log: {log_path}"]:
                print(line, file=sys.stderr)
            return child.returncode or 1
        time.sleep(0.25)
    refuse([f"not ready after {cfg.ready_timeout_s + EXIT_GRACE_S:.0f} s; it still runs as pid {child.pid}"],
           log_path)
    return 1
