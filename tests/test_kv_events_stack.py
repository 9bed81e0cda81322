"""KV events on the real stack: three engines (tiny preset) and two gateways, processes started as `deepinfer up`
starts them, sharing one Valkey. The event-driven router sends a request to the engine whose memory tier holds the
longest run of its prefix, no gateway reads block hashes from the engines, a gateway restarted mid-run routes from
the stream, and a dropped memory tier or a tenant purge makes the routers stop preferring the engines concerned.

Which engine served a request is read from the engines' own counters, never assumed from routing tie-breaks: each
request's prefix is held longer by one engine than by any other."""
from __future__ import annotations

import json
import signal
import time

import pytest
import redis

from kvstore.kv_events import DISK, BlockRemoved, EventKeys, decode_batch
from services.gateway.chat_template import ChatMessage, render_chat
from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import DeepSeekTokenizer
from services.launcher import Stack, StackConfig, probe
from tests.conftest import free_port, free_ports
from tests.stack_probes import ADMIN_TOKEN, admin_stats, http, metric

pytestmark = pytest.mark.timeout(900)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SYSTEM = "You answer questions about caches of attention latents, briefly and with numbers. " * 8
MORE = "Also cite the section of the design each number comes from, and say which tier served it. " * 8
QUESTION = "How does a prefix that an engine holds in memory reach the next request of the same tenant? " * 6
SHORT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
LONG = [{"role": "system", "content": SYSTEM + MORE}, {"role": "user", "content": QUESTION}]
B = 64


def test_each_prompt_has_full_blocks_past_the_prefix_both_share():
    """The premise of the routing test: whichever of SHORT and LONG an engine holds, the other's run is shorter."""
    cache = TokenCache(DeepSeekTokenizer(), 1 << 20)
    short, long_ = ([*render_chat([ChatMessage(m["role"], m["content"]) for m in p], cache)] for p in (SHORT, LONG))
    shared = next(i for i, (x, y) in enumerate(zip(short, long_)) if x != y) // B
    assert len(short) // B > shared >= 1 and len(long_) // B > shared


class TwoGateways(Stack):
    """The launcher's stack and a second gateway with the first one's arguments on a port of its own."""

    def __init__(self, cfg: StackConfig):
        super().__init__(cfg, quiet=True)
        self.second_url = f"http://{cfg.host}:{free_port()}"
        self.commands: dict[str, tuple[str, list[str], dict | None]] = {}

    def _spawn(self, name: str, module: str, args: list[str], secret_fields: dict[str, str] | None = None) -> None:
        self.commands[name] = (module, list(args), secret_fields)
        super()._spawn(name, module, args, secret_fields)

    def start_second_gateway(self, timeout_s: float = 120.0) -> None:
        module, args, secrets = self.commands["gateway"]
        args[args.index("--port") + 1] = self.second_url.rsplit(":", 1)[1]
        self._spawn("gateway2", module, args, secrets)
        deadline = time.monotonic() + timeout_s
        while not probe(self.second_url, self.instances["gateway2"]).ready:
            assert self.procs["gateway2"].poll() is None, self.tail("gateway2")
            assert time.monotonic() < deadline, f"the second gateway is not ready:\n{self.tail('gateway2')}"
            time.sleep(0.2)

    def restart_second_gateway(self) -> None:
        proc = self.procs.pop("gateway2")
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        self.start_second_gateway()

    def stop(self, timeout_s: float = 30.0) -> None:
        proc = self.procs.pop("gateway2", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout_s)
        super().stop(timeout_s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = StackConfig(preset="tiny", data_dir=str(tmp_path_factory.mktemp("kv-events")), engines=3,
                      gateway_port=free_port(), kvstore_port=free_port(), engine_port=free_ports(3),
                      redis_port=free_port(), api_keys="key-a:tenant-a", admin_token=ADMIN_TOKEN,
                      pool_gib=0.02, ready_timeout_s=600)
    running = TwoGateways(cfg)
    try:
        running.start()
        running.start_second_gateway()
        yield running
    finally:
        running.stop()


def ask(gateway: str, messages: list[dict], pin: str | None = None) -> dict:
    headers = {"Authorization": "Bearer key-a", "Content-Type": "application/json"}
    if pin is not None:
        headers |= {"X-DeepInfer-Engine": pin, "X-DeepInfer-Admin-Token": ADMIN_TOKEN}
    body = {"model": "deepseek-chat", "messages": messages, "max_tokens": 4, "temperature": 0}
    reply = http("POST", gateway + "/v1/chat/completions", json.dumps(body).encode(), headers, timeout=300)
    assert reply.status == 200, reply
    return reply.json()


def served_by(stack: TwoGateways, gateway: str, messages: list[dict]) -> tuple[int, float]:
    """(the engine that answered, the prompt tokens it served from its memory tier), from the engines' counters."""
    def counts():
        return [(metric(url, "deepinfer_engine_requests_total", 'outcome="ok"'),
                 metric(url, "deepinfer_engine_prefix_hit_tokens_total", 'tier="memory"')) for url in stack.engine_urls]
    before = counts()
    ask(gateway, messages)
    moved = [(i, after[1] - was[1]) for i, (was, after) in enumerate(zip(before, counts())) if after[0] > was[0]]
    assert len(moved) == 1, moved
    return moved[0]


def views_caught_up(stack: TwoGateways, timeout_s: float = 60.0) -> None:
    """Until each gateway's view holds, for every engine, as many blocks as the engine says it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {stats["engine_id"]: stats["memory_blocks"] for stats in map(admin_stats, stack.engine_urls)}
        seen = [{e["stats"]["engine_id"]: e.get("memory_blocks") for e in admin_stats(gateway)["engines"]}
                for gateway in (stack.gateway_url, stack.second_url)]
        if all(view == held for view in seen):
            return
        assert time.monotonic() < deadline, f"engines hold {held}; the gateways' views {seen}"
        time.sleep(0.1)


def test_the_event_driven_router_sends_a_prefix_to_the_engine_whose_memory_holds_it(stack):
    a, b = stack.gateway_url, stack.second_url
    ask(a, LONG, pin=stack.engine_urls[1])  # engine 1 holds all of LONG's blocks
    ask(a, SHORT, pin=stack.engine_urls[2])  # engine 2 all of SHORT's; its system prompt leads LONG too
    views_caught_up(stack)
    for url in stack.engine_urls:
        assert "hot_blocks" not in admin_stats(url)  # a count for operators, never the hashes
    for gateway in (a, b):
        assert all("hot_blocks" not in e["stats"] for e in admin_stats(gateway)["engines"])

    engine, memory_hit = served_by(stack, b, LONG)
    assert engine == 1 and memory_hit > 0
    engine, memory_hit = served_by(stack, a, SHORT)
    assert engine == 2 and memory_hit > 0

    stack.restart_second_gateway()  # it rebuilds its view from the stream
    views_caught_up(stack)
    assert served_by(stack, b, SHORT)[0] == 2 and served_by(stack, b, LONG)[0] == 1
    assert metric(b, "gateway_kv_events_applied_total", 'event="BlockStored",medium="memory"') > 0

    dropped = http("POST", stack.engine_urls[1] + "/admin/memory-tier/drop", b"", ADMIN)
    assert dropped.status == 200 and dropped.json()["dropped_pages"] > 0
    views_caught_up(stack)
    assert all(e["memory_blocks"] == 0 for e in admin_stats(b)["engines"] if e["url"] == stack.engine_urls[1])
    engine, memory_hit = served_by(stack, b, LONG)  # engine 2's shorter run is now the longest
    assert engine == 2 and memory_hit > 0


def test_a_tenant_purge_empties_every_view_and_reports_the_disk_blocks_removed(stack):
    ask(stack.gateway_url, SHORT, pin=stack.engine_urls[0])
    views_caught_up(stack)
    assert admin_stats(stack.gateway_url)["kv_events"]["blocks"] > 0
    purged = http("DELETE", stack.gateway_url + "/admin/tenants/tenant-a/cache", None, ADMIN)
    assert purged.status == 200 and purged.json()["blocks"] > 0, purged
    views_caught_up(stack)
    for gateway in (stack.gateway_url, stack.second_url):
        assert admin_stats(gateway)["kv_events"]["blocks"] == 0  # no engine is preferred for tenant-a any more
    engines = {admin_stats(url)["engine_id"] for url in stack.engine_urls}
    client = redis.Redis.from_url(stack.redis_url, password=stack.secrets.redis_password)
    try:
        batches = [decode_batch(fields) for _, fields in client.xrange(EventKeys.under("dikv").stream)]
    finally:
        client.close()
    removed = [b.source for b in batches for e in b.events if isinstance(e, BlockRemoved) and e.medium == DISK]
    assert removed and not set(removed) & engines  # the kvstore service erased them and said so
