"""Faults on the real stack (tiny preset, real Valkey, real volumes, one process per service, engines
reading and saving through the kvstore service): each test breaks one part for real and shows
what DESIGN.md's invariants promise. The stack is shared; a test restarts what it killed.
RELIABILITY.md lists every fault with the test that shows it.
"""
import asyncio
import collections
import shutil
import signal
import subprocess
import threading
import time

import pytest
from openai import APIError, APIStatusError, AsyncOpenAI

from kvstore.segment import decode_header
from model.weights import read_identity
from services.launcher import StackConfig
from tests.conftest import free_port, free_ports
from tests.stack_probes import ADMIN_TOKEN
from tests.fault_stack import (SILENCE_S, B, FaultStack, SlowLink, admin_json, admin_post, audit_index, chat,
                               chat_logprobs, client, engines_metric, metric, metric_total, pinned, prompt,
                               read_saved_prefixes, same_answer, segment_files, streamed, wait_for_saves)

pytestmark = pytest.mark.timeout(300)

VERIFY_FAILURES = "kvstore_verification_failures_total"
FAILED_SAVES = 'deepinfer_engine_saves_total{outcome="failed"}'
SEGMENTS_WRITTEN = "kvstore_segments_written_total"
WRITE_FAILURES = "kvstore_write_failures_total"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("faults")
    kvstore_port = free_port()
    link = SlowLink(kvstore_port).start()
    cfg = StackConfig(preset="tiny", data_dir=str(data), engines=2, remote_cache=True, gateway_port=free_port(),
                      kvstore_port=kvstore_port, engine_port=free_ports(2), redis_port=free_port(),
                      admin_token=ADMIN_TOKEN, ready_timeout_s=400)
    running = FaultStack(cfg, link).start()
    yield running
    running.stop()
    link.stop()


def test_flipped_bytes_in_a_segment_are_a_verified_miss_with_the_same_answer(stack):
    content = prompt("flip")
    before = segment_files(stack.volume_args)
    miss_text, miss = chat(stack, content)
    assert miss.prompt_cache_hit_tokens == 0
    wait_for_saves(stack)
    written = [path for path in segment_files(stack.volume_args) if path not in before]
    assert written, "the miss saved no segment"
    for path in written:  # flip bytes of block 0 in the last layer's latents, past the header
        raw = bytearray(path.read_bytes())
        header = decode_header(bytes(raw[:header_end(raw)]))
        block_bytes = (len(raw) - header.data_offset) // (header.geometry.num_layers * header.n_blocks)
        at = header.data_offset + (header.geometry.num_layers - 1) * header.n_blocks * block_bytes + 100
        with open(path, "r+b") as f:  # in place: the kvstore's mapping of the file sees it
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in raw[at:at + 8]))
    failures = metric(stack.kvstore_url, VERIFY_FAILURES)
    fallbacks = engines_metric(stack, 'deepinfer_engine_cache_fallbacks_total{reason="verification"}')

    hit_text, hit = chat(stack, content)
    assert hit_text == miss_text  # greedy: exactly the clean miss's answer
    assert hit.prompt_cache_hit_tokens == 0  # the engine reports what it loaded verified: nothing
    assert metric(stack.kvstore_url, VERIFY_FAILURES) > failures
    assert engines_metric(stack, 'deepinfer_engine_cache_fallbacks_total{reason="verification"}') > fallbacks
    wait_for_saves(stack)

    failures = metric(stack.kvstore_url, VERIFY_FAILURES)
    third_text, third = chat(stack, content)
    assert third_text == miss_text
    assert third.prompt_cache_hit_tokens > 0  # the bad entry was dropped and the prefix saved again
    assert metric(stack.kvstore_url, VERIFY_FAILURES) == failures  # nothing reads the flipped bytes again
    assert asyncio.run(audit_index(stack, stack.volume_args)) > 0


def header_end(raw: bytes) -> int:
    return 12 + int.from_bytes(raw[8:12], "little")


def test_a_slow_link_to_the_kvstore_makes_the_engine_recompute_past_its_deadline(stack):
    words = 1000  # ~2,000 tokens: long enough that recomputing takes longer than the deadline's 0.5 s floor
    content = prompt("slow", words)
    _, miss_text, _ = streamed(stack, content)
    wait_for_saves(stack)
    _, _, hit = streamed(stack, content)  # a fast hit (also compiles the hit path's shapes)
    # A hit sums in another order than a miss, so a near-tie may part their greedy answers: other tests compare
    # a hit's answer with a miss's by their logprobs (fault_stack.same_answer). Here the recompute after the
    # deadline is the miss's computation again, and must give its text exactly.
    assert hit.prompt_cache_hit_tokens > 0
    wait_for_saves(stack)
    deadline_fallbacks = engines_metric(stack, 'deepinfer_engine_cache_fallbacks_total{reason="deadline"}')
    # Two cores shared with other work: timings are noisy, so compare the best of three interleaved pairs.
    miss_ttfts, slow_ttfts = [], []
    for i in range(3):
        ttft, _, usage = streamed(stack, prompt(f"slow-miss-{i}", words))
        assert usage.prompt_cache_hit_tokens == 0
        miss_ttfts.append(ttft)
        stack.link.slow(60.0)  # every response from the kvstore held a minute: far past any deadline
        try:
            ttft, slow_text, slow = streamed(stack, content, timeout_s=60)
        finally:
            stack.link.fast()
        slow_ttfts.append(ttft)
        assert slow_text == miss_text
        assert slow.prompt_cache_hit_tokens == 0  # nothing was loaded: the whole prompt was recomputed
        wait_for_saves(stack)  # the fallback saved the prefix again; the next slow hit finds it
    rates = [admin_json(stack, url + "/admin/stats")["prefill_tokens_per_s"] for url in stack.engine_urls]
    budget_s = max(0.5, slow.prompt_tokens / min(rates))
    print(f"miss TTFT {miss_ttfts}, slow-link hit TTFT {slow_ttfts}, deadline <= {budget_s:.2f} s")
    assert engines_metric(stack, 'deepinfer_engine_cache_fallbacks_total{reason="deadline"}') == deadline_fallbacks + 3
    assert min(slow_ttfts) < 2 * min(miss_ttfts) + 0.5


def test_a_hit_whose_disk_reads_stall_never_stops_other_streams_decoding(stack):
    """A stream decodes on engine 0; a disk hit pinned to the same engine stalls on a slow link until its
    deadline, then is recomputed. The stream receives tokens all the while: no step waits on a disk read."""
    content = prompt("stall-hit", 1000)
    _, miss_text, _ = streamed(stack, content, engine=0)
    wait_for_saves(stack)
    arrivals: list[float] = []
    first = threading.Event()

    def long_stream():
        stream = client(stack, 300).chat.completions.create(
            model="deepseek-chat", messages=[{"role": "user", "content": prompt("stall-stream", 20)}],
            max_tokens=3000, temperature=0, stream=True, extra_headers=pinned(stack, 0))
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
                first.set()
            if stop.is_set():
                stream.close()
                return

    stop = threading.Event()
    streaming = threading.Thread(target=long_stream)
    streaming.start()
    try:
        assert first.wait(120)
        stack.link.slow(60.0)  # every kvstore response held a minute: the hit waits for its deadline
        try:
            sent = time.perf_counter()
            ttft, hit_text, hit = streamed(stack, content, timeout_s=120, engine=0)
        finally:
            stack.link.fast()
        during = [t for t in arrivals if sent <= t <= sent + ttft]
    finally:
        stop.set()
        streaming.join(60)
    assert hit_text == miss_text and hit.prompt_cache_hit_tokens == 0  # recomputed after the deadline
    print(f"stream tokens while the stalled hit waited and prefilled ({ttft:.2f} s): {len(during)}")
    assert len(during) >= 2


def test_redis_down_serves_misses_and_caching_resumes_when_it_is_back(stack):
    saved = prompt("redis-saved")
    saved_text, _ = chat(stack, saved)
    wait_for_saves(stack)
    port = stack.valkey.port
    lookup_failures = metric(stack.gateway_url, "gateway_prefix_lookup_failures_total")
    failed_saves = engines_metric(stack, FAILED_SAVES)
    stack.valkey.stop()
    try:
        text, usage = chat(stack, saved, timeout_s=60)
        assert text == saved_text and usage.prompt_cache_hit_tokens == 0
        _, usage = chat(stack, prompt("redis-during"), timeout_s=60)
        assert usage.prompt_cache_hit_tokens == 0
        wait_for_saves(stack)
        assert metric(stack.gateway_url, "gateway_prefix_lookup_failures_total") >= lookup_failures + 2
        # The gateway could not read the tenant's purge epoch: a save it could not fence is never attempted.
        assert engines_metric(stack, FAILED_SAVES) == failed_saves
    finally:
        stack.valkey.start()
    assert stack.valkey.port == port
    fresh = prompt("redis-after")
    fresh_text, first = chat(stack, fresh)
    assert first.prompt_cache_hit_tokens == 0
    wait_for_saves(stack)
    text, again = chat(stack, fresh)
    assert again.prompt_cache_hit_tokens > 0 and text == fresh_text
    assert asyncio.run(audit_index(stack, stack.volume_args)) > 0


async def test_kvstore_killed_mid_saves_leaves_no_torn_entry_and_hits_resume_after_restart(stack):
    contents = [prompt(f"kill-{i}", 1000) for i in range(10)]
    written = await asyncio.to_thread(metric, stack.kvstore_url, SEGMENTS_WRITTEN)
    failed_saves = await asyncio.to_thread(engines_metric, stack, FAILED_SAVES)
    aclient = AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    requests = [asyncio.create_task(aclient.chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": c}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=2))
        for c in contents]
    try:
        def saves_pending() -> int:
            return sum(admin_json(stack, url + "/admin/stats")["pending_saves"] for url in stack.engine_urls)

        # Kill once some saves are published and, if the timing allows, while an engine has one in flight.
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(metric, stack.kvstore_url, SEGMENTS_WRITTEN) < written + 2:
            assert time.monotonic() < deadline, "no saves reached the kvstore"
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 10
        while not (pending := await asyncio.to_thread(saves_pending)) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        stack.kill("kvstore")  # SIGKILL while the other requests' saves are on their way
        print(f"kvstore killed with {pending} saves in flight on the engines")
        replies = await asyncio.wait_for(asyncio.gather(*requests), 180)
    finally:
        for task in requests:
            task.cancel()
        await aclient.close()
    answers = [r.choices[0].logprobs.content for r in replies]
    await asyncio.to_thread(wait_for_saves, stack)
    assert await asyncio.to_thread(engines_metric, stack, FAILED_SAVES) > failed_saves

    try:
        # The outage: prefixes the index still knows are read through a dead kvstore, so they are misses.
        for content, answer in [(contents[0], answers[0]), (prompt("kill-during"), None)]:
            entries, usage = await asyncio.to_thread(chat_logprobs, stack, content, 8, 60)
            assert usage.prompt_cache_hit_tokens == 0
            assert answer is None or not (why := same_answer(answer, entries)), why
        # Whatever the kill cut short, every index entry reads back whole and verified, and each
        # prompt's prefix is either a full verified hit or a miss.
        assert await audit_index(stack, stack.volume_args) > 0
        found = await read_saved_prefixes(stack, stack.volume_args, contents)
        print("tokens of each prompt found saved after the kill:", found)
        assert any(found)
    finally:
        await asyncio.to_thread(stack.restart, "kvstore")
    await asyncio.to_thread(wait_for_saves, stack)
    for content, answer, saved in zip(contents, answers, found):
        entries, usage = await asyncio.to_thread(chat_logprobs, stack, content)
        # A hit or a miss, never a different answer (first computed among the other requests: the same up to
        # float rounding, fault_stack.same_answer).
        assert not (why := same_answer(answer, entries)), why
        assert usage.prompt_cache_hit_tokens >= saved  # what was saved before the kill is hit again


@pytest.fixture
def small_volume(stack):
    """A 1 MiB tmpfs mounted as a volume (skips where mounting is not permitted)."""
    path = stack.data / "small-volume"
    path.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_then_read_only_volume_skips_saves_and_requests_still_succeed(stack, small_volume):
    spill = stack.data / "spill-volume"
    volumes = [str(small_volume), str(spill)]
    args = stack.commands["kvstore"][1]
    args = [a for i, a in enumerate(args) if "--volume" not in (a, args[i - 1] if i else "")]
    args += [arg for v in volumes for arg in ("--volume", v)]
    # A budget far past the 1 MiB tmpfs: this test is about ENOSPC, not the default budget (80% of the
    # file system), which would evict instead of filling the volume.
    args = [a for i, a in enumerate(args) if "--budget-gib" not in (a, args[i - 1] if i else "")] + ["--budget-gib", "1"]
    stack.restart("kvstore", args)
    try:
        write_failures = metric(stack.kvstore_url, WRITE_FAILURES)
        answers = {}
        for i in range(8):  # ~2,000-token prompts, ~400 KiB per saved prefix: the small volume fills
            content = prompt(f"full-{i}", 1000)
            answers[content], _ = chat_logprobs(stack, content)
            wait_for_saves(stack)
            if metric(stack.kvstore_url, WRITE_FAILURES) > write_failures:
                break
        assert metric(stack.kvstore_url, WRITE_FAILURES) > write_failures, "the small volume never filled"
        assert shutil.disk_usage(small_volume).free < 400 << 10
        assert asyncio.run(audit_index(stack, stack.volume_args + volumes)) > 0  # the failed save left nothing

        def saved_and_hit(content):  # a hit's answer is the miss's up to float rounding (same_answer)
            answers[content], _ = chat_logprobs(stack, content)
            wait_for_saves(stack)
            entries, usage = chat_logprobs(stack, content)
            assert usage.prompt_cache_hit_tokens > 0
            assert not (why := same_answer(answers[content], entries)), why

        # A full volume must not stop the cache: new prefixes are still saved (elsewhere) and hit.
        for i in range(2):
            saved_and_hit(prompt(f"after-full-{i}", 1000))

        # Read-only: a fresh kvstore (which knows of no failure yet) places the next save on the small
        # volume, now the least used; that write fails, the next saves go elsewhere, and what the
        # read-only volume holds is still served.
        subprocess.run(["mount", "-o", "remount,ro", str(small_volume)], check=True)
        stack.restart("kvstore", args)
        write_failures = metric(stack.kvstore_url, WRITE_FAILURES)
        answers[prompt("read-only-0", 1000)], _ = chat_logprobs(stack, prompt("read-only-0", 1000))
        wait_for_saves(stack)
        assert metric(stack.kvstore_url, WRITE_FAILURES) > write_failures  # read-only file system
        saved_and_hit(prompt("read-only-1", 1000))
        hits = 0
        for content, answer in answers.items():
            entries, usage = chat_logprobs(stack, content)
            assert not (why := same_answer(answer, entries)), why
            hits += usage.prompt_cache_hit_tokens > 0
        assert hits >= len(answers) - 2  # all but the two prefixes whose saves failed
        assert asyncio.run(audit_index(stack, stack.volume_args + volumes)) > 0
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_volume)], check=False)
        admin_post(stack, stack.kvstore_url + "/admin/evict", {"all": True})  # no entry outlives the volumes
        stack.restart("kvstore")


async def test_an_engine_killed_mid_request_is_retried_before_the_first_token_or_a_clear_503(stack):
    aclient = AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=90)
    started = collections.defaultdict(asyncio.Event)  # request name -> its first streamed token arrived

    # The requests that fill the engines' slots must outlast the test by length alone: end of sequence is
    # barred (a greedy answer of a random model may reach it, and where depends on what shares its steps),
    # and they may run to most of the context.
    eos = read_identity(stack.data / "models" / stack.cfg.preset)[0].eos_token_id

    async def ask(name: str, content: str, max_tokens: int, stream: bool, endless: bool = False):
        """'ok' or the error the client saw; never hangs (bounded client and test timeouts)."""
        try:
            reply = await aclient.chat.completions.create(
                model="deepseek-chat", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                temperature=0, stream=stream, logit_bias={str(eos): -100} if endless else None)
            if stream:
                async for _ in reply:
                    started[name].set()
            return "ok"
        except APIStatusError as error:
            assert error.status_code == 503 and error.body["type"] == "service_unavailable_error", error.body
            return "503"
        except APIError as error:  # an error event in the SSE stream after the first token
            assert "engine" in error.message.lower(), error.message
            return "stream error"

    def load() -> list[tuple[int, int]]:
        """(generating, waiting for a slot) per engine."""
        stats = [admin_json(stack, url + "/admin/stats") for url in stack.engine_urls]
        return [(s["in_flight"], s["waiting"]) for s in stats]

    def first_tokens(i: int) -> float:
        return metric_total(stack.engine_urls[i], "deepinfer_engine_ttft_seconds_count")

    async def until(condition, what: str, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def landed(name: str, content: str, stream: bool, running: list[int]) -> int:
        """Start request `name`, wait until it generates on an engine (first token out); that engine."""
        ttfts = [first_tokens(i) for i in range(2)]
        tasks[name] = asyncio.create_task(ask(name, content, 12000, stream, endless=True))
        placed = []

        def generating() -> bool:
            now = [generating for generating, _ in load()]
            grew = [i for i in range(2) if now[i] > running[i] and first_tokens(i) > ttfts[i]]
            placed[:] = grew
            return len(grew) == 1
        await until(generating, f"{name} did not start generating on one engine")
        running[placed[0]] += 1
        return placed[0]

    def failures(engine: int, reason: str) -> float:
        series = f'gateway_engine_failures_total{{engine="{stack.engine_urls[engine]}",reason="{reason}"}}'
        return metric(stack.gateway_url, series)

    # Two streams and two non-streamed requests generating, spread over both engines (the gateway picks
    # the engine with fewer requests in flight), which fills both engines' two slots; then one more
    # request, queued on one of them before its first token. That engine is killed. Where each request
    # went is observed (engine stats and first-token counts), not assumed from the routing's tie-breaks.
    tasks, on = {}, {}
    running = [generating for generating, _ in load()]
    assert running == [0, 0], running
    for name in ("stream-a", "stream-b"):
        on[name] = await landed(name, prompt(f"engine-kill-{name}"), True, running)
        await asyncio.wait_for(started[name].wait(), 60)
    for name in ("whole-a", "whole-b"):
        on[name] = await landed(name, prompt(f"engine-kill-{name}"), False, running)
    assert running == [2, 2] and sorted(on.values()) == [0, 0, 1, 1], (running, on)
    tasks["queued"] = asyncio.create_task(ask("queued", prompt("engine-kill-queued", 1000), 8, False))
    waiting = []

    def queued() -> bool:
        waiting[:] = [i for i, (_, w) in enumerate(load()) if w == 1]
        return len(waiting) == 1
    try:
        await until(queued, "the last request is not waiting on an engine")
    except AssertionError as error:
        ended = {name: task.result() for name, task in tasks.items() if task.done() and not task.exception()}
        state = await asyncio.to_thread(load)
        for task in tasks.values():
            task.cancel()
        await aclient.close()
        raise AssertionError(f"{error}; requests that ended: {ended}; (generating, waiting) per engine: "
                             f"{state}") from error
    victim = waiting[0]
    doomed = {name for name, engine in on.items() if engine == victim}
    survivors = set(on) - doomed
    before = {reason: failures(victim, reason) for reason in ("unavailable", "mid_generation")}
    try:
        stack.kill(f"engine{victim}")
        outcomes = {name: await asyncio.wait_for(tasks[name], 60) for name in doomed}
        for name in survivors:  # free the other engine's slots for the retried request
            tasks[name].cancel()
        outcomes["queued"] = await asyncio.wait_for(tasks["queued"], 90)
        print(f"outcomes after killing engine{victim}:", outcomes)
        # Had tokens when the engine died: a clear error, streamed or not. Had none: retried elsewhere.
        expected = {name: "stream error" if name.startswith("stream") else "503" for name in doomed}
        assert outcomes == expected | {"queued": "ok"}
        assert failures(victim, "mid_generation") >= before["mid_generation"] + 2
        assert failures(victim, "unavailable") > before["unavailable"]
        for i in range(2):  # the dead engine is out of the rotation: nothing more fails
            await asyncio.to_thread(chat, stack, prompt(f"engine-kill-after-{i}"), 4, 60)
    finally:
        for task in tasks.values():
            task.cancel()
        await aclient.close()
        await asyncio.to_thread(stack.restart, f"engine{victim}")


def test_a_stopped_engine_is_failed_over_after_its_silence_timeout(stack):
    """SIGSTOP: the engine accepts connections (the kernel does) but says nothing. The gateway gives
    up on it after --first-token-timeout-s of silence and retries the request on the other engine;
    nothing waits longer than that. Engines' progress events keep working engines under it."""
    before = metric(stack.gateway_url, f'gateway_engine_failures_total{{engine="{stack.engine_urls[0]}",'
                                       'reason="unavailable"}')
    stack.procs["engine0"].send_signal(signal.SIGSTOP)
    try:
        answers = [None, None]

        def ask(i: int) -> None:
            began = time.monotonic()
            answers[i] = chat(stack, prompt(f"stopped-engine-{i}"), 4, timeout_s=90), time.monotonic() - began
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for asker in askers:  # two at once: one goes to engine0 while the gateway still finds it routable
            asker.start()
        for asker in askers:
            asker.join(120)
        assert all(answer is not None for answer in answers), answers
        slowest = max(seconds for _, seconds in answers)
        print(f"both answered; the slower after {slowest:.1f} s (silence timeout {SILENCE_S} s)")
        assert slowest < SILENCE_S + 30
        after = metric(stack.gateway_url, f'gateway_engine_failures_total{{engine="{stack.engine_urls[0]}",'
                                          'reason="unavailable"}')
        assert after > before  # the request routed to the stopped engine was failed over, not lost
    finally:
        stack.procs["engine0"].send_signal(signal.SIGCONT)
    stack.wait_routable("engine0")


def test_sigterm_lets_in_flight_requests_finish_saves_them_and_leaves_no_torn_entry(stack):
    """On an engine that mounts the volumes itself (the launcher's default mode), then the gateway."""
    results = {}

    def ask(name, content, max_tokens):
        results[name] = streamed(stack, content, max_tokens, timeout_s=120), time.monotonic()

    args = stack.commands["engine0"][1]
    at = args.index("--kvstore-url")
    mounted = args[:at] + ["--redis-url", stack.redis_url] + args[at + 2:]
    mounted += [arg for volume in stack.volume_args for arg in ("--volume", volume)]
    stack.restart("engine0", mounted)
    content = prompt("sigterm-engine")
    try:
        # Both engines idle, and probed idle by the gateway (every 2 s): engine0, the first of
        # equals, takes the request.
        deadline = time.monotonic() + 60
        while any(admin_json(stack, url + "/admin/stats")["in_flight"] for url in stack.engine_urls):
            assert time.monotonic() < deadline, "the engines never went idle"
            time.sleep(0.1)
        time.sleep(4.5)  # two polls
        asking = threading.Thread(target=ask, args=("engine", content, 400))
        asking.start()
        deadline = time.monotonic() + 60
        while not admin_json(stack, stack.engine_urls[0] + "/admin/stats")["in_flight"]:
            assert time.monotonic() < deadline, "the request never reached engine0"
            time.sleep(0.02)
        time.sleep(0.3)
        began = time.monotonic()
        assert stack.kill("engine0", signal.SIGTERM, wait_s=60) == 0  # exits cleanly once drained
        asking.join(60)
        print(f"engine0 exited {time.monotonic() - began:.1f} s after SIGTERM")
        (_, text, usage), finished = results["engine"]
        assert finished > began and usage.completion_tokens == 400  # in flight at SIGTERM, finished in full
        assert asyncio.run(audit_index(stack, stack.volume_args)) > 0
    finally:
        stack.restart("engine0")
    # Its answer's blocks were saved too (the save after the last token was drained, not dropped):
    # the next turn hits past the prompt, into the answer.
    next_turn = client(stack).chat.completions.create(
        model="deepseek-chat", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": content}, {"role": "assistant", "content": text},
                  {"role": "user", "content": "Go on."}])
    assert next_turn.usage.prompt_cache_hit_tokens > usage.prompt_tokens // B * B

    # The gateway: SIGTERM with a request in flight; the request still completes.
    asking = threading.Thread(target=ask, args=("gateway", prompt("sigterm-gateway"), 300))
    asking.start()
    deadline = time.monotonic() + 60
    while not admin_json(stack, stack.gateway_url + "/admin/stats")["in_flight"]:
        assert time.monotonic() < deadline, "the request never reached the gateway"
        time.sleep(0.02)
    time.sleep(0.3)
    began = time.monotonic()
    try:
        assert stack.kill("gateway", signal.SIGTERM, wait_s=60) == 0
        asking.join(60)
        (_, _, usage), finished = results["gateway"]
        assert finished > began and usage.completion_tokens == 300
    finally:
        stack.restart("gateway")
