"""`deepinfer stop`: stops the stack started from a data dir, the way Ctrl-C on `deepinfer up` does.

With its launcher alive: SIGTERM to the launcher, which stops every service in order (gateway first,
so in-flight requests drain). With the launcher gone (killed): each recorded process that is still
the one that was started (services.run_file.RunFile.is_ours) gets SIGTERM in that order, SIGKILL
after the timeout. Then the run file is removed.
"""
from __future__ import annotations

import os
import signal
import time

from services.common.config import load_config
from services.run_file import RunFile, pid_alive
from services.stack_status import NOT_RUNNING, RunDirConfig

LAUNCHER_WAIT_S = 120.0  # the launcher gives each service 30 s to drain
SERVICE_WAIT_S = 30.0


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_run(run: RunFile) -> list[str]:
    """Stops everything `run` records; the lines say what was done."""
    said = []
    if run.launcher_alive():
        os.kill(run.launcher_pid, signal.SIGTERM)
        if _wait_gone(run.launcher_pid, LAUNCHER_WAIT_S):
            said.append(f"stopped the stack (launcher pid {run.launcher_pid})")
        else:
            said.append(f"launcher pid {run.launcher_pid} did not stop in {LAUNCHER_WAIT_S:.0f} s; "
                        "stopping its services one by one")
    for name in run.stop_order():
        if not run.is_ours(name):
            continue
        pid = run.services[name].pid
        os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, SERVICE_WAIT_S):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5.0)
        said.append(f"stopped {name} (pid {pid})")
    run.remove()
    return said


def stop(argv: list[str] | None = None) -> int:
    cfg = load_config(RunDirConfig, "up", argv, prog="deepinfer stop")
    run = RunFile.read(cfg.data_dir)
    if run is None:
        print(f"no DeepInfer stack runs from data dir {cfg.data_dir} (no run file)")
        return NOT_RUNNING
    print("\n".join(stop_run(run)))
    return 0
