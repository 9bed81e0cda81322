"""`deepinfer up` and signals: SIGINT or SIGTERM, to the process or to its process group, in the
foreground or as a background job (whose shell starts it with SIGINT ignored), stops every service
cleanly, gateway first and Valkey last, says so, and leaves no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import free_port, free_ports

ORDER = ["stopped gateway", "stopped engine0", "stopped kvstore", "stopped valkey", "every service stopped"]


def _descendants(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found |= {int(entry)} | _descendants(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("signum, to_group, background", [
    (signal.SIGINT, True, True),     # Ctrl-C's signal to the whole group of a background job
    (signal.SIGTERM, False, False),  # a service manager's stop
], ids=["sigint-group-background", "sigterm-process"])
def test_a_signal_stops_every_service_valkey_last(tmp_path, signum, to_group, background):
    argv = [sys.executable, "-m", "services.cli", "up", "--preset", "tiny", "--data-dir", str(tmp_path),
            "--gateway-port", str(free_port()), "--kvstore-port", str(free_port()),
            "--engine-port", str(free_ports(1)), "--redis-port", str(free_port())]

    if background:  # what a non-interactive shell does for `cmd &`: SIGINT ignored, inherited by exec
        argv = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *argv]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 400
        while not any("DeepInfer is up" in line for line in lines):
            line = up.stdout.readline()
            assert line or up.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        children = _descendants(up.pid)
        assert len(children) >= 4, children  # valkey, kvstore, engine0, gateway
        if to_group:
            os.killpg(up.pid, signum)
        else:
            up.send_signal(signum)
        rest, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    output = "".join(lines) + rest
    assert up.returncode == 0, output
    positions = [output.find(line) for line in ORDER]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), output
    assert signal.Signals(signum).name in output
    assert not [pid for pid in children if _alive(pid)], output
