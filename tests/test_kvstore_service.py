"""The kvstore service as a real process (python -m services.kvstore), over real HTTP."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import json
import urllib.error
import urllib.request
from typing import NamedTuple

import aiohttp
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import CacheGeometry, block_hashes
from services.kvstore.client import KvstoreClient, KvstoreError
from tests.conftest import free_port

GEOMETRY = CacheGeometry(num_layers=4, latent_dim=576, block_tokens=16)
FP = "svc-model-fp"
TOKEN = "s3cret-admin"
SERVICE_TOKEN = "s3cret-service"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Reply(NamedTuple):
    status_code: int
    content: bytes

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode()


def call(method: str, url: str, data: bytes | None = None, headers: dict | None = None, json_body=None,
         timeout: float = 10.0) -> Reply:
    """One real HTTP request (stdlib urllib); 4xx/5xx come back as a Reply, not an exception. Data
    endpoints get the service token unless the call gives its own Authorization (or an empty one)."""
    headers = dict(headers or {})
    if "Authorization" not in headers and "/admin/" not in url:
        headers["Authorization"] = f"Bearer {SERVICE_TOKEN}"
    elif not headers.get("Authorization", True):
        del headers["Authorization"]
    if json_body is not None:
        data, headers["Content-Type"] = json.dumps(json_body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, response.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


class requests:  # the few calls these tests need, in the shape of the familiar library
    get = staticmethod(lambda url, headers=None, timeout=10.0: call("GET", url, headers=headers, timeout=timeout))
    delete = staticmethod(lambda url, headers=None: call("DELETE", url, headers=headers))
    post = staticmethod(lambda url, data=None, headers=None, json=None: call("POST", url, data, headers, json))


def start_service(tmp_path, redis_url: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "services.kvstore", "--port", str(port), "--fingerprint", FP,
            "--num-layers", "4", "--block-tokens", "16", "--volume", str(tmp_path / "v0"),
            "--volume", str(tmp_path / "v1"), "--redis-url", redis_url, "--max-body-mib", "4",
            "--max-segment-blocks", "4", "--reader-grace-s", "0", "--sweep-interval-s", "0", *extra]
    env = dict(os.environ, DEEPINFER_KVSTORE_ADMIN_TOKEN=TOKEN, DEEPINFER_KVSTORE_SERVICE_TOKEN=SERVICE_TOKEN,
               DEEPINFER_KVSTORE_MAC_KEY="svc-mac-key")
    log = open(tmp_path / f"kvstore-{port}.log", "wb")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp_path / f"kvstore-{port}.log").read_text())
        try:
            if requests.get(url + "/healthz", timeout=0.5).status_code == 200:
                return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("kvstore service did not come up")


@pytest.fixture(scope="module")
def service(tmp_path_factory, valkey_server):
    tmp = tmp_path_factory.mktemp("kvstore-svc")
    proc, url = start_service(tmp, valkey_server.connection_url, "--index-prefix", "svc")
    yield url, tmp
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
async def client(service):
    c = KvstoreClient(service[0], GEOMETRY, FP, service_token=SERVICE_TOKEN)
    yield c
    await c.close()


def prompt(n_blocks: int, seed: int) -> list[int]:
    return [(seed * 9973 + i) % 40_000 for i in range(n_blocks * 16)]


def latents(n_blocks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n_blocks * 16, 576), dtype=np.float32).astype(GEOMETRY.np_dtype)
            for _ in range(GEOMETRY.num_layers)]


def segment_files(tmp) -> set[str]:
    return {f for v in ("v0", "v1") if (tmp / v / "segments").exists() for f in os.listdir(tmp / v / "segments")}


async def test_health_and_readiness(service):
    url, _ = service
    assert requests.get(url + "/healthz").json() == {"status": "ok"}
    ready = requests.get(url + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert len([k for k in ready.json()["checks"] if k.startswith("volume:")]) == 2


async def test_save_lookup_prefetch_through_the_service(client):
    hashes = block_hashes(prompt(6, 1), FP, "tenant-a", 16)
    data = latents(6, 1)
    result = await client.save(hashes, data, tenant="tenant-a")
    assert result.blocks == 6 and len(result.segments) == 2
    hit = await client.lookup(hashes)
    assert hit.blocks == 6
    p = client.prefetch(hit)
    for layer in range(GEOMETRY.num_layers):
        got = await p.layer(layer)
        assert np.array_equal(got.view(np.uint16), data[layer].view(np.uint16))
    assert await p.valid_tokens() == 96


async def test_large_saves_go_as_several_requests(service):
    small = KvstoreClient(service[0], GEOMETRY, FP, service_token=SERVICE_TOKEN,
                          max_request_bytes=3 * GEOMETRY.num_layers * GEOMETRY.block_bytes)
    try:
        hashes = block_hashes(prompt(8, 9), FP, "t", 16)
        data = latents(8, 9)
        await small.save(hashes[:1], [x[:16] for x in data])
        result = await small.save(hashes, [x[16:] for x in data], start_block=1)
        assert result.blocks == 7 and len(result.segments) == 3  # requests of 3 + 3 + 1 blocks
        hit = await small.lookup(hashes)
        p = small.prefetch(hit)
        assert await p.valid_tokens() == 128
        assert np.array_equal((await p.layer(2)).view(np.uint16), data[2].view(np.uint16))
    finally:
        await small.close()


async def test_bad_requests_are_clear_4xx_and_write_nothing(service):
    url, tmp = service
    before = segment_files(tmp)
    hashes = block_hashes(prompt(2, 2), FP, "t", 16)
    good = {"fingerprint": FP, "geometry": GEOMETRY.as_dict(), "hashes": hashes,
            "layers": [x.view(np.uint8).tobytes() for x in latents(2, 2)]}

    def post(path, body):
        return requests.post(url + path, data=body, headers={"Content-Type": "application/msgpack"})

    r = post("/v1/segments", b"\xc1\xff not msgpack")
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = post("/v1/segments", msgpack.packb({k: v for k, v in good.items() if k != "hashes"}))
    assert r.status_code == 400 and r.json()["field"] == "hashes"
    r = post("/v1/segments", msgpack.packb(good | {"layers": good["layers"][:1] * 4 + [b"x"]}))
    assert r.status_code == 400 and "layers" in r.json()["field"]
    r = post("/v1/segments", msgpack.packb(good | {"layers": [b"\0" * 100] * 4}))
    assert r.status_code == 400 and r.json()["field"] == "layers[0]"
    r = post("/v1/segments", msgpack.packb(good | {"fingerprint": "another-model"}))
    assert r.status_code == 409 and r.json()["field"] == "fingerprint"
    r = post("/v1/segments", msgpack.packb(good | {"geometry": GEOMETRY.as_dict() | {"dtype": "float32"}}))
    assert r.status_code == 409 and r.json()["field"] == "geometry"
    r = post("/v1/segments", msgpack.packb(good | {"retention": "forever"}))
    assert r.status_code == 400 and "retention" in r.json()["error"]
    r = post("/v1/segments", msgpack.packb(good | {"ttl_s": "forever"}))
    assert r.status_code == 400 and r.json()["field"] == "ttl_s"
    r = post("/v1/segments", msgpack.packb(good | {"ttl_s": 10 ** 9}))
    assert r.status_code == 400 and "ttl_s" in r.json()["error"]
    r = post("/v1/segments", msgpack.packb(good | {"start_block": 2}))
    assert r.status_code == 400 and r.json()["field"] == "start_block"
    r = post("/v1/segments", b"\0" * (5 << 20))
    assert r.status_code == 413 and "too large" in r.json()["error"]
    read = {"fingerprint": FP, "geometry": GEOMETRY.as_dict(), "root": hashes[0], "hashes": hashes[:1], "layer": 0}
    r = post("/v1/read", msgpack.packb(read | {"runs": [["00" * 8, "../../etc/passwd", 0, 1, 1, 4096]]}))
    assert r.status_code == 400 and "segment id" in r.json()["error"]
    r = post("/v1/read", msgpack.packb(read | {"runs": [["00" * 8, "ab" * 16, 0, 1, 1, 4096]]}))
    assert r.status_code == 404 and "unknown volume" in r.json()["error"]
    volume = requests.get(url + "/admin/volumes", headers={"Authorization": f"Bearer {TOKEN}"}).json()["volumes"][0]["id"]
    r = post("/v1/read", msgpack.packb(read | {"runs": [[volume, "ab" * 16, 0, 1, 1, 4096]]}))
    assert r.status_code == 404 and "unknown segment" in r.json()["error"]
    r = post("/v1/read", msgpack.packb(read | {"runs": [[volume, "ab" * 16, 0, 2, 2, 4096]]}))
    assert r.status_code == 400 and r.json()["field"] == "runs"
    r = post("/v1/read", msgpack.packb(read | {"runs": [[volume, "ab" * 16, 0, 1, 1, 4096]], "layer": 99}))
    assert r.status_code == 400 and r.json()["field"] == "layer"
    assert requests.delete(url + "/v1/segments/..%2F..%2Fetc").status_code in (400, 404)
    r = requests.delete(url + "/v1/segments/not-a-segment")
    assert r.status_code == 400 and r.json()["field"] == "segment"
    assert requests.delete(url + "/v1/segments/" + "cd" * 16).status_code == 404
    assert segment_files(tmp) == before


async def test_admin_needs_the_token(service, client):
    url, _ = service
    assert requests.get(url + "/admin/stats").status_code == 401
    assert requests.get(url + "/admin/stats", headers={"Authorization": "Bearer wrong"}).status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    stats = requests.get(url + "/admin/stats", headers=auth).json()
    assert "bytes_written" in stats and "volume_used_bytes" in stats
    volumes = requests.get(url + "/admin/volumes", headers=auth).json()["volumes"]
    assert len(volumes) == 2 and all(v["reachable"] for v in volumes)
    assert requests.post(url + "/admin/evict", headers=auth, json={}).status_code == 400
    a = block_hashes(prompt(2, 3), FP, "tenant-x", 16)
    b = block_hashes(prompt(2, 3), FP, "tenant-y", 16)
    await client.save(a, latents(2, 3), tenant="tenant-x")
    await client.save(b, latents(2, 3), tenant="tenant-y")
    r = requests.post(url + "/admin/evict", headers=auth, json={"tenant": "tenant-x"})
    assert r.json() == {"evicted": 1}
    assert (await client.lookup(a)).blocks == 0 and (await client.lookup(b)).blocks == 2
    swept = requests.post(url + "/admin/sweep", headers=auth).json()
    assert swept["deleted"] >= 1


async def test_delete_segment_and_metrics(service, client):
    url, _ = service
    hashes = block_hashes(prompt(3, 4), FP, "t", 16)
    result = await client.save(hashes, latents(3, 4))
    r = requests.delete(url + "/v1/segments/" + result.segments[0])
    assert r.status_code == 200
    assert (await client.lookup(hashes)).blocks == 0
    assert requests.delete(url + "/v1/segments/" + result.segments[0]).status_code == 404
    text = requests.get(url + "/metrics").text
    for name in ("kvstore_bytes_written_total", "kvstore_bytes_read_total", "kvstore_layer_read_seconds_bucket",
                 "kvstore_evictions_total", "kvstore_verification_failures_total", "kvstore_volume_used_bytes"):
        assert name in text


async def test_corruption_is_a_shorter_read_and_a_metric(service, client):
    url, tmp = service
    hashes = block_hashes(prompt(3, 5), FP, "t", 16)
    result = await client.save(hashes, latents(3, 5))
    hit = await client.lookup(hashes)
    path = next(p for p in tmp.glob(f"v*/segments/{result.segments[0]}"))
    with open(path, "r+b") as f:  # layer 1, block 2
        f.seek(hit.runs[0].data_offset + (1 * 3 + 2) * GEOMETRY.block_bytes + 5)
        f.write(b"\xff\xfe")
    p = client.prefetch(hit)
    assert (await p.layer(0)).shape[0] in (32, 48)  # 48 if delivered before layer 1 failed
    assert await p.valid_tokens() == 32
    assert (await p.layer(3)).shape[0] == 32
    assert "kvstore_verification_failures_total 1.0" in requests.get(url + "/metrics").text
    assert (await client.lookup(hashes)).blocks == 2


async def test_client_degrades_to_miss_when_service_is_down():
    dead = KvstoreClient(f"http://127.0.0.1:{free_port()}", GEOMETRY, FP, timeout_s=2)
    hashes = block_hashes(prompt(2, 6), FP, "t", 16)
    assert (await dead.lookup(hashes)).blocks == 0
    from kvstore import Hit, SegmentRun
    hit = Hit(hashes[0], tuple(hashes), (SegmentRun("00" * 8, "ab" * 16, 0, 2, 2, 4096),))
    p = dead.prefetch(hit)
    assert (await p.layer(0)).shape == (0, 576)
    assert await p.valid_tokens() == 0
    with pytest.raises(aiohttp.ClientError):
        await dead.save(hashes, latents(2, 6))
    await dead.close()


async def test_not_ready_without_redis(tmp_path):
    proc, url = start_service(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    try:
        r = requests.get(url + "/readyz")
        assert r.status_code == 503 and r.json()["checks"]["redis"] is False
        assert requests.get(url + "/healthz").status_code == 200
        client = KvstoreClient(url, GEOMETRY, FP, service_token=SERVICE_TOKEN)
        try:
            hashes = block_hashes(prompt(2, 8), FP, "t", 16)
            assert (await client.lookup(hashes)).blocks == 0  # a miss, not an error
            with pytest.raises(KvstoreError) as error:
                await client.save(hashes, latents(2, 8))
            assert error.value.status == 503
        finally:
            await client.close()
        r = requests.post(url + "/v1/lookup", data=msgpack.packb({"hashes": [b"x" * 16]}))
        assert r.status_code == 503 and "Redis" in r.json()["error"]
        assert not segment_files(tmp_path)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_client_save_errors_carry_status(service):
    wrong = KvstoreClient(service[0], GEOMETRY, "some-other-model", service_token=SERVICE_TOKEN)
    try:
        with pytest.raises(KvstoreError) as error:
            await wrong.save(block_hashes(prompt(2, 7), "some-other-model", "t", 16), latents(2, 7))
        assert error.value.status == 409 and "fingerprint" in str(error.value)
    finally:
        await wrong.close()


async def test_a_lost_index_is_republished_at_start_and_on_the_admin_call(tmp_path, valkey_server):
    import redis
    auth = {"Authorization": f"Bearer {TOKEN}"}
    index = redis.Redis(host=valkey_server.host, port=valkey_server.port)
    proc, url = start_service(tmp_path, valkey_server.connection_url, "--index-prefix", "lost",
                              "--reconcile-min-age-s", "0")
    client = KvstoreClient(url, GEOMETRY, FP, service_token=SERVICE_TOKEN)
    try:
        hashes = block_hashes(prompt(6, 10), FP, "t", 16)
        await client.save(hashes, latents(6, 10))
        assert requests.post(url + "/admin/reconcile").status_code == 401
        for key in index.scan_iter(match="lost:*"):  # the index lost, the volumes kept
            index.delete(key)
        assert (await client.lookup(hashes)).blocks == 0
        report = requests.post(url + "/admin/reconcile", headers=auth).json()
        assert report["outcomes"]["republished"] == 2 and report["busy"] == [] and len(report["volumes"]) == 2
        assert (await client.lookup(hashes)).blocks == 6
        p = client.prefetch(await client.lookup(hashes))
        assert await p.valid_tokens() == 96
        assert 'kvstore_reconciled_segments_total{outcome="republished"} 2.0' in requests.get(url + "/metrics").text
    finally:
        await client.close()
        proc.terminate()
        proc.wait(timeout=10)
    for key in index.scan_iter(match="lost:*"):
        index.delete(key)
    proc, url = start_service(tmp_path, valkey_server.connection_url, "--index-prefix", "lost",
                              "--reconcile-min-age-s", "0")
    client = KvstoreClient(url, GEOMETRY, FP, service_token=SERVICE_TOKEN)
    try:  # restarted over an empty index: the pass at start republishes, in the background
        deadline = time.monotonic() + 60
        while (status := requests.get(url + "/admin/reconcile", headers=auth).json())["passes"] < 1:
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status["last"]["outcomes"]["republished"] == 2
        assert (await client.lookup(hashes)).blocks == 6
    finally:
        await client.close()
        proc.terminate()
        proc.wait(timeout=10)
        index.close()


async def test_data_endpoints_need_the_service_token(service, client):
    """Lookup, read, save and delete without the service token: 401 (none) or 403 (wrong), before
    the body is read; a save refused this way stores nothing. With it, the same save succeeds."""
    url, tmp = service
    hashes = block_hashes(prompt(2, 77), FP, "t", 16)
    data = latents(2, 77)
    save = msgpack.packb({"fingerprint": FP, "geometry": GEOMETRY.as_dict(), "hashes": hashes, "start_block": 0,
                          "tenant": "t", "retention": "chat", "ttl_s": None,
                          "layers": [x.view(np.uint8).tobytes() for x in data]})
    before = segment_files(tmp)
    requests_ = [("POST", "/v1/lookup", msgpack.packb({"hashes": hashes})), ("POST", "/v1/segments", save),
                 ("POST", "/v1/read", msgpack.packb({})), ("DELETE", "/v1/segments/" + "ab" * 16, None),
                 ("GET", "/metrics", None)]
    for method, path, body in requests_:
        for authorization, status in (("", 401), ("Bearer", 401), ("Bearer wrong", 403), (f"Bearer {TOKEN}x", 403),
                                      (f"Bearer {SERVICE_TOKEN[:-1]}", 403), (f"Basic {SERVICE_TOKEN}", 403)):
            reply = call(method, url + path, body, {"Authorization": authorization,
                                                    "Content-Type": "application/msgpack"})
            assert reply.status_code == status, (method, path, authorization, reply)
    assert segment_files(tmp) == before
    assert (await client.lookup(hashes)).blocks == 0
    assert call("POST", url + "/v1/segments", save, {"Content-Type": "application/msgpack"}).status_code == 200
    assert (await client.lookup(hashes)).blocks == 2
    wrong = KvstoreClient(url, GEOMETRY, FP, service_token="not-it")
    try:
        assert (await wrong.lookup(hashes)).blocks == 0
        with pytest.raises(KvstoreError, match="403"):
            await wrong.save(hashes, data)
    finally:
        await wrong.close()


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=True)
    | st.binary(max_size=40) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=30)


def _fuzzed_bodies(fields: list[str]) -> st.SearchStrategy[bytes]:
    """msgpack maps over the endpoint's own field names (and others) with values of any msgpack type:
    a property-based stand-in for schema fuzzing, which cannot encode msgpack."""
    keys = st.sampled_from(fields) | st.text(max_size=8)
    return st.dictionaries(keys, _MSGPACK_VALUES, max_size=len(fields) + 2).map(msgpack.packb)


def test_the_openapi_document_describes_every_route(service):
    url, _ = service
    document = requests.get(url + "/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            secured = operation.get("security", document["security"])
            if "requestBody" in operation:
                assert "application/msgpack" in operation["requestBody"]["content"], path
            assert bool(secured) == (path not in ("/healthz", "/readyz")), path
    assert requests.get(url + "/openapi.json", headers={"Authorization": ""}).status_code == 401


@pytest.mark.parametrize("path", ["/v1/segments", "/v1/read", "/v1/lookup"])
def test_fuzzed_msgpack_bodies_get_no_server_error(service, path):
    """With the service token, any msgpack map of the endpoint's fields (any types, sizes, nesting) is
    answered 2xx or 4xx, never 5xx."""
    url, _ = service
    schema = requests.get(url + "/openapi.json").json()["paths"][path]["post"]["requestBody"]["content"][
        "application/msgpack"]["schema"]
    fields = list(schema["properties"])
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_fuzzed_bodies(fields))
    def run(body: bytes) -> None:
        reply = requests.post(url + path, data=body, headers={"Content-Type": "application/msgpack"})
        statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (reply.status_code, reply.text[:300], body[:200])

    run()
    assert max(statuses) < 500 and 400 in statuses, statuses
