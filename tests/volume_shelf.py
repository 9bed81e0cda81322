"""Volumes for store tests, of either kind, and direct access to the bytes of their segments (to
tear, corrupt or remove them for real): `FileShelf`, directories under a temp dir, and
`S3Shelf`, prefixes in a bucket of a real S3-compatible server (moto in server mode)."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import tensorstore as ts

from kvstore.volume import segment_key, volume_spec
from tests.conftest import free_port

BUCKET = "deepinfer-tests"
# moto accepts any credentials; these are the standard variables an s3 volume reads (volume_spec).
S3_ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "moto-test-key", "AWS_SECRET_ACCESS_KEY": "moto-test-secret",
                  "AWS_REGION": "us-east-1"}


class MotoServer:
    """`moto_server` (an in-memory S3-compatible server, a separate process) on a free loopback port."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "MotoServer":
        moto = Path(sys.executable).parent / "moto_server"
        self.proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{self.url}/{BUCKET}", method="PUT"), timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start:\n" + self.log_path.read_text()[-2000:])
                time.sleep(0.1)

    @property
    def environment(self) -> dict[str, str]:
        return S3_ENVIRONMENT | {"AWS_ENDPOINT_URL": self.url}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


class FileShelf:
    kind = "file"

    def __init__(self, root: Path) -> None:
        self.root = root

    def volumes(self, count: int) -> list[str]:
        return [str(self.root / f"ssd{i}") for i in range(count)]

    def _path(self, segment: str) -> Path:
        return next(self.root.glob(f"ssd*/{segment_key(segment)}"))

    def segments(self, volume: str) -> list[str]:
        directory = Path(volume) / "segments"
        return sorted(os.listdir(directory)) if directory.exists() else []

    def read(self, segment: str) -> bytes:
        return self._path(segment).read_bytes()

    def write(self, segment: str, payload: bytes) -> None:
        """Replace the object's bytes in place (a file volume's mapping sees the change)."""
        path = self._path(segment)
        with open(path, "r+b") as f:
            f.write(payload)
            f.truncate(len(payload))

    def remove(self, segment: str) -> None:
        self._path(segment).unlink()


class S3Shelf:
    kind = "s3"

    def __init__(self, server: MotoServer, prefix: str = "") -> None:
        self.prefix = prefix or f"s3://{BUCKET}/{secrets.token_hex(6)}"  # a fresh key space per test
        self._stores: dict[str, ts.KvStore] = {}

    def volumes(self, count: int) -> list[str]:
        return [f"{self.prefix}/ssd{i}" for i in range(count)]

    def _store(self, volume: str) -> ts.KvStore:
        if volume not in self._stores:
            self._stores[volume] = ts.KvStore.open(volume_spec(volume)).result()
        return self._stores[volume]

    def _volume_of(self, segment: str) -> str:
        for volume in self.volumes(8):
            if self._store(volume).read(segment_key(segment), byte_range=slice(0, 0)).result().state == "value":
                return volume
        raise FileNotFoundError(segment)

    def segments(self, volume: str) -> list[str]:
        keys = self._store(volume).list(ts.KvStore.KeyRange("segments/", "segments0")).result()
        return sorted(k.decode().split("/", 1)[1] for k in keys)

    def read(self, segment: str) -> bytes:
        return self._store(self._volume_of(segment)).read(segment_key(segment)).result().value

    def write(self, segment: str, payload: bytes) -> None:
        self._store(self._volume_of(segment)).write(segment_key(segment), payload).result()

    def remove(self, segment: str) -> None:
        self._store(self._volume_of(segment)).write(segment_key(segment), None).result()
