"""serve_bench: serving throughput and latency through the gateway, modelled on vLLM's benchmark_serving.

    python -m bench.serve_bench            # or: deepinfer bench serve
    python -m bench.serve_bench --preset tiny --sessions 6 --concurrency 1,4 --long-tokens 1024  # a quick run

Workload: multi-turn sessions (at least --min-turns turns) of the Mooncake conversation trace
(../shared/data): each trace hash id becomes a fixed run of --hash-tokens token ids (the trace's 512
scaled down so prompts fit this machine; equal ids give equal tokens, so a session's turns share
their prefix), output lengths from the trace capped at --max-output. Phases (--phases):
  sweep        closed loop at each --concurrency (each user sends whole sessions, turn after turn),
               then a Poisson run at --rate requests/s: request and output token throughput, TTFT,
               TPOT, ITL (mean, p50, p90, p99)
  cache        the same multi-turn workload at --cache-concurrency users on a stack with the cache off
               (no disk tier, no memory tier) beside the cache-on numbers of the sweep
  interference a --long-tokens miss sent while --streams streams decode: their TPOT p99 during its
               prefill against their TPOT with nothing else running, and its TTFT against its TTFT alone
  streams      the issue's first measurement, as a new user would try it: closed loops of 1 and
               --stream-users users, each sending --stream-requests short prompts nobody sent before
               (--stream-prompt tokens) for --stream-tokens tokens: output token throughput side by side.
               The trace's workload is prefill-bound (its prompts are ~33x its outputs, scaled alike), so
               its user sweep mostly measures prefill; this phase measures what batching decode gives
  split        the multi-turn workload at --split-concurrency users on an undivided stack (two engines of
               role both) and on a split one (a prefill and a decode engine), each engine pinned to a core
               of its own, the same cores in both: TTFT, TPOT, throughput
  handoff      fresh prompts of --handoff-lengths tokens on a split stack (a prefill and a decode engine) and
               an undivided one (one engine), unpinned: the gap between the first and second tokens less the
               later gaps' median, the time the handoff adds (--handoff-repeats each, medians)
The stacks are started here (one engine, --preset, fresh data dir each) unless --url is given. Before the
measured runs, a warm pass (the last --warm-sessions sessions, no level's) at the sweep's highest
concurrency compiles the shapes this workload meets, as a server that has been up a while has them; each
run then also reports the engine's own accounting of it (busy, prefill, decode and compile seconds, from
its /metrics: on stacks started here).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench import report
from bench.serve_client import Client, closed_loop, percentiles, poisson, summarize
from bench.trace_format import DEFAULT_TRACE, load_trace, prompt_token_ids, scale_request, session_slice
from bench.trace_live import TOKEN_RANGE
from model.config import SERVING_DTYPES
from services.common.metrics_text import Samples

COMMAND = "python -m bench.serve_bench"


def say(message: str) -> None:
    print(f"[serve_bench] {message}", flush=True)


def workload(args) -> list[list[tuple[list[int], int]]]:
    """Sessions of (prompt token ids, max_tokens), in trace order."""
    trace = load_trace(args.trace, limit=args.trace_limit)
    chosen = session_slice(trace, args.sessions, min_turns=args.min_turns)
    factor = 512 // args.hash_tokens
    sessions: dict[tuple, list] = {}
    for request in chosen:
        scaled = scale_request(request, factor)
        prompt = prompt_token_ids(scaled, args.hash_tokens, TOKEN_RANGE)
        sessions.setdefault(request.hash_ids[:2], []).append((prompt, min(args.max_output, scaled.output_length)))
    return [turns[: args.max_turns or None] for turns in sessions.values()]


class EngineProbe:
    """The engines' own accounting of a run, read from their /metrics (with the admin token): seconds the
    model thread was busy, and of those prefill and decode, seconds spent compiling new shapes, and the
    prefill passes it took."""

    SERIES = {"busy_s": "deepinfer_engine_step_seconds_total", "prefill_s": "deepinfer_engine_prefill_seconds_total",
              "decode_s": "deepinfer_engine_decode_seconds_total", "compile_s": "deepinfer_engine_compile_seconds_total",
              "prefill_passes": "deepinfer_engine_prefill_passes_total",
              "prefill_slices": "deepinfer_engine_prefill_slices_total"}

    def __init__(self, urls: list[str], admin_token: str):
        self.urls, self.headers = urls, {"Authorization": f"Bearer {admin_token}"}

    async def snapshot(self) -> dict:
        totals = dict.fromkeys(self.SERIES, 0.0)
        async with aiohttp.ClientSession(headers=self.headers) as session:
            for url in self.urls:
                async with session.get(url + "/metrics") as reply:
                    reply.raise_for_status()
                    samples = Samples(await reply.text())
                for key, series in self.SERIES.items():
                    totals[key] += samples.total(series)  # summed over its label sets (compile stages)
        return totals

    @staticmethod
    def spent(before: dict, after: dict) -> dict:
        return {key: after[key] - before[key] for key in before}


class StackRun:
    """A stack of this machine for one phase (one engine; or `engines`: of roles both, prefill, decode, and `pin`: each
    on a core of its own), or the --url stack."""

    def __init__(self, args, cache: bool, name: str, engines: tuple[int, int, int] = (1, 0, 0), pin: bool = False):
        self.args, self.cache, self.name, self.stack, self.dir = args, cache, name, None, None
        self.engines, self.pin = engines, pin
        self.url, self.probe = args.url, None  # no probe for --url: its admin token is not ours

    def __enter__(self) -> "StackRun":
        if self.args.url:
            return self
        from services.launcher import Stack, StackConfig
        from tests.conftest import free_port, free_ports
        if self.args.dir:
            Path(self.args.dir).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"serve_bench_{self.name}_", dir=self.args.dir))
        # Every phase's stack serves the same weights (a preset's are created once under --models-dir).
        model_dir = self.args.model_dir or str(ensure_model(self.args))
        cfg = StackConfig(preset=self.args.preset, model_dir=model_dir, data_dir=str(self.dir),
                          cache=self.cache, gateway_port=free_port(), kvstore_port=free_port(),
                          engine_port=free_ports(sum(self.engines)), redis_port=free_port(), ready_timeout_s=900,
                          batch_invariant=self.args.batch_invariant, dtype=self.args.dtype, engines=self.engines[0],
                          prefill_engines=self.engines[1], decode_engines=self.engines[2])
        say(f"starting a stack ({'cache on' if self.cache else 'cache off'}) in {self.dir}")
        os.environ.setdefault("DEEPINFER_GATEWAY_FIRST_TOKEN_TIMEOUT_S", "3600")
        # The bench's users share one API key: the gateway's per-key limit (16 by default) would turn the
        # 64-user level's requests past 16 into 429s.
        users = max([*self.args.concurrency, self.args.cache_concurrency, self.args.stream_users, self.args.streams + 1])
        os.environ.setdefault("DEEPINFER_GATEWAY_KEY_MAX_CONCURRENT", str(max(16, users)))
        self.stack = Stack(cfg, quiet=True).start()
        self.url, self.probe = self.stack.gateway_url, EngineProbe(self.stack.engine_urls, self.stack.admin_token)
        if self.pin:
            say(f"engines pinned to cores {pin_engines(self.stack)}")
        return self

    def __exit__(self, *exc) -> None:
        if self.stack is not None:
            self.stack.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def pin_engines(stack) -> list[int]:
    """Engine i's process (every thread) on core i of this process's cores, round robin; returns the cores."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = []
    for i, name in enumerate(sorted((n for n in stack.procs if n.startswith("engine")), key=lambda n: int(n[6:]))):
        core = cores[i % len(cores)]
        for task in os.listdir(f"/proc/{stack.procs[name].pid}/task"):
            os.sched_setaffinity(int(task), {core})
        pinned.append(core)
    return pinned


def ensure_model(args) -> Path:
    from services.engine.model_source import ensure_preset
    return ensure_preset(args.preset, args.models_dir)


async def warm_up(client: Client, args, sessions, label: str = "") -> None:
    """The warm pass: the last --warm-sessions sessions (no measured run's), whole, at the sweep's highest
    concurrency, so the shapes of this workload are compiled outside every measurement."""
    if args.warm_sessions <= 0:
        return
    warm = sessions[-args.warm_sessions:]
    c = min(max(args.concurrency), len(warm))
    say(f"{label}warm pass: {len(warm)} sessions at {c} users")
    results, duration = await closed_loop(client, warm, c)
    say(f"{label}  warm pass done in {duration:.1f} s ({sum(not r.error for r in results)}/{len(results)} ok)")


async def closed_level(client: Client, args, sessions, c: int, label: str = "", probe: EngineProbe | None = None
                       ) -> dict:
    """One closed loop of `c` users over the level's own sessions: its summary (with the engines' own
    accounting of it when there is a probe)."""
    picked = level_sessions(args, sessions, c)
    say(f"{label}closed loop, {c} users, {len(picked)} sessions ({sum(map(len, picked))} requests)")
    before = await probe.snapshot() if probe else None
    results, duration = await closed_loop(client, picked, c)
    summary = summarize(results, duration)
    if probe:
        summary["engine"] = EngineProbe.spent(before, await probe.snapshot())
    _said(summary)
    return summary


async def sweep(args, url: str, sessions, result: dict, probe: EngineProbe | None = None) -> None:
    """Closed loops at each concurrency, then the Poisson run. With --peer-url the peer runs each level
    right after ours (same sessions, same order), so the load of this shared machine hits both alike."""
    out = result["sweep"] = {}
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(Client(url))
        await warm_up(client, args, sessions)
        peer = None
        if args.peer_url:
            peer = await stack.enter_async_context(Client(args.peer_url, model=args.peer_model,
                                                          fresh_connections=True))
            result["peer"] = {"name": args.peer_name, "url": args.peer_url, "sweep": {}}
            await warm_up(peer, args, sessions, f"{args.peer_name}: ")
        for c in args.concurrency:
            out[str(c)] = await closed_level(client, args, sessions, c, probe=probe)
            if peer is not None:
                result["peer"]["sweep"][str(c)] = await closed_level(peer, args, sessions, c, f"{args.peer_name}: ")
            report.write_json(args.name + "_partial", result)  # a run cut short keeps what it measured
        if args.rate:
            used = sum(max(args.min_sessions, c) for c in sorted(set(args.concurrency) | {args.cache_concurrency}))
            requests = [turn for s in sessions[used: len(sessions) - args.warm_sessions] for turn in s][: args.rate_requests]
            say(f"Poisson arrivals at {args.rate} requests/s, {len(requests)} requests")
            results, duration = await poisson(client, requests, args.rate)
            result["poisson"] = summarize(results, duration) | {"rate": args.rate}
            _said(result["poisson"])


def level_sessions(args, sessions, c: int) -> list:
    """The sessions of the closed loop at `c` users: a slice of its own (no level hits another's
    prefixes), the same slice in the cache-on and cache-off runs."""
    levels = sorted(set(args.concurrency) | {args.cache_concurrency})
    start = sum(max(args.min_sessions, level) for level in levels if level < c)
    picked = sessions[start: start + max(args.min_sessions, c)]
    if len(picked) < max(args.min_sessions, c) or start + len(picked) > len(sessions) - args.warm_sessions:
        raise SystemExit(f"the trace slice has {len(sessions)} sessions; {start + max(args.min_sessions, c)} are "
                         f"needed besides the {args.warm_sessions} of the warm pass: raise --sessions / --trace-limit")
    return picked


async def cache_off(args, url: str, sessions, result: dict, probe: EngineProbe | None = None) -> None:
    async with Client(url) as client:
        await warm_up(client, args, sessions, "cache off: ")
        c = args.cache_concurrency
        result["cache_off"] = {str(c): await closed_level(client, args, sessions, c, "cache off: ", probe)}


COUNTED = {"logprobs": 0}  # each chunk says how many tokens it brings


def per_token_gaps(arrivals: list[list[float]], brought: list[list[int]], window: tuple[float, float]) -> list[float]:
    """The gaps between a stream's tokens whose chunk arrived within `window`: a chunk that brings k tokens (one
    held back by detokenization, as a token ending inside a UTF-8 character is) after a wait counts as k gaps
    of a k-th of it: the engine's pace, which the idle TPOT measures too."""
    return [(b - a) / k for times, ks in zip(arrivals, brought)
            for a, b, k in zip(times, times[1:], ks[1:]) if window[0] <= b <= window[1] for _ in range(k)]


async def interference(args, url: str, result: dict, probe: EngineProbe | None = None) -> None:
    rng = np.random.default_rng(11)
    fresh = lambda n: rng.integers(*TOKEN_RANGE, n).tolist()  # noqa: E731 - prompts nobody sent before
    out = result["interference"] = {"streams": args.streams, "long_tokens": args.long_tokens}
    async with Client(url) as client:
        await client.complete(fresh(64), 4)
        say(f"{args.streams} streams alone")
        idle = await asyncio.gather(*(client.complete(fresh(64), args.stream_tokens, extra=COUNTED)
                                      for _ in range(args.streams)))
        out["idle_tpot_s"] = percentiles([r.tpot_s for r in idle])
        out["idle_itl_s"] = percentiles([g for r in idle for g in r.itl_s])
        say(f"a {args.long_tokens}-token miss alone")
        before = await probe.snapshot() if probe else None
        alone = await client.complete(fresh(args.long_tokens), 4)
        if probe:
            out["engine_alone"] = EngineProbe.spent(before, await probe.snapshot())
        out["long_alone_ttft_s"] = alone.ttft_s
        say(f"the {args.long_tokens}-token miss while {args.streams} streams decode")
        # Enough tokens to outlast the long prefill three times over at the idle pace.
        budget = int(alone.ttft_s / max(out["idle_tpot_s"]["p50"], 1e-3) * 3) + args.stream_tokens
        started = [asyncio.Event() for _ in range(args.streams)]
        arrivals: list[list[float]] = [[] for _ in range(args.streams)]
        brought: list[list[int]] = [[] for _ in range(args.streams)]  # tokens per chunk (by their logprobs)
        streams = [asyncio.create_task(client.complete(fresh(64), budget, first_token=e, times=t, counts=k,
                                                       extra=COUNTED))
                   for e, t, k in zip(started, arrivals, brought)]
        await asyncio.gather(*(e.wait() for e in started))  # every stream is decoding
        # A newcomer's short prompt among the streams, then one sent while the long miss prefills: is it stuck
        # behind the long one (head-of-line blocking) or prefilled beside it?
        short_idle = await client.complete(fresh(64), 4)
        before = await probe.snapshot() if probe else None
        long_task = asyncio.create_task(client.complete(fresh(args.long_tokens), 4))
        await asyncio.sleep(min(5.0, alone.ttft_s / 4))
        short = await client.complete(fresh(64), 4)
        long = await long_task
        if probe:  # the model thread's seconds from the long prompt's arrival to its first token (and the short's)
            out["engine_together"] = EngineProbe.spent(before, await probe.snapshot())
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    window = (long.send_s, long.send_s + long.ttft_s)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if window[0] <= b <= window[1]]
    token_gaps = per_token_gaps(arrivals, brought, window)
    out["stream_tokens_during"] = len(token_gaps)
    out["during_itl_s"] = percentiles(gaps)
    out["during_token_gap_s"] = percentiles(token_gaps)
    out["long_together_ttft_s"] = long.ttft_s
    out["tpot_p99_ratio"] = out["during_token_gap_s"]["p99"] / out["idle_tpot_s"]["p99"]
    out["chunk_gap_p99_ratio"] = out["during_itl_s"]["p99"] / out["idle_tpot_s"]["p99"]
    out["long_ttft_ratio"] = long.ttft_s / alone.ttft_s
    out["short_idle_ttft_s"], out["short_during_ttft_s"] = short_idle.ttft_s, short.ttft_s
    out["short_before_long"] = short.send_s + short.ttft_s < long.send_s + long.ttft_s
    say(f"streams' p99 gap per token during the long prefill {out['during_token_gap_s']['p99']:.3f} s vs idle TPOT "
        f"p99 {out['idle_tpot_s']['p99']:.3f} s ({out['tpot_p99_ratio']:.2f}x; per text chunk "
        f"{out['chunk_gap_p99_ratio']:.2f}x); long TTFT {long.ttft_s:.1f} s vs alone "
        f"{alone.ttft_s:.1f} s ({out['long_ttft_ratio']:.2f}x); a 64-token prompt's TTFT {short.ttft_s:.2f} s while it "
        f"prefills ({short_idle.ttft_s:.2f} s among the streams alone)")


async def streams(args, url: str, result: dict, probe: EngineProbe | None = None) -> None:
    """Closed loops of 1 and --stream-users users over fresh short prompts, one after the other on one stack;
    with --peer-url the peer runs each level right after ours, on the same prompts."""
    users = args.stream_users
    out = result["streams"] = {"prompt_tokens": args.stream_prompt, "output_tokens": args.stream_tokens,
                               "requests_per_user": args.stream_requests, "levels": {}}
    if args.peer_url:
        out["peer"] = {"name": args.peer_name, "levels": {}}
    for c in (1, users):
        rng = np.random.default_rng(12 + c)  # the same prompts for us and the peer
        warm = [[(rng.integers(*TOKEN_RANGE, args.stream_prompt).tolist(), args.stream_tokens)] for _ in range(c)]
        work = [[(rng.integers(*TOKEN_RANGE, args.stream_prompt).tolist(), args.stream_tokens)
                 for _ in range(args.stream_requests)] for _ in range(c)]
        async with Client(url) as client:
            out["levels"][str(c)] = await _stream_level(client, warm, work, "", probe)
        if args.peer_url:
            async with Client(args.peer_url, model=args.peer_model, fresh_connections=True) as peer:
                out["peer"]["levels"][str(c)] = await _stream_level(peer, warm, work, f"{args.peer_name}: ")
    for side in (out, out.get("peer")):
        if side:
            levels = side["levels"]
            side["ratio"] = levels[str(users)]["output_token_throughput"] / levels["1"]["output_token_throughput"]
            say(f"streams: {side.get('name', 'DeepInfer')} output token throughput {users} users / 1 user "
                f"{side['ratio']:.2f}x")


async def _stream_level(client: Client, warm, work, label: str, probe: EngineProbe | None = None) -> dict:
    """A round at this width first (its batch shapes compiled outside the run), then the measured closed loop."""
    await closed_loop(client, warm, len(warm))
    n = work[0][0]
    say(f"{label}streams: {len(work)} users x {len(work[0])} requests of {len(n[0])} prompt tokens, {n[1]} output "
        "tokens")
    before = await probe.snapshot() if probe else None
    results, duration = await closed_loop(client, work, len(work))
    summary = summarize(results, duration)
    if probe:
        summary["engine"] = EngineProbe.spent(before, await probe.snapshot())
    _said(summary)
    return summary


SPLIT_LAYOUTS = {"undivided": (2, 0, 0), "split": (0, 1, 1)}  # engines of roles (both, prefill, decode)


async def split_level(args, url: str, sessions, probe: EngineProbe | None, label: str) -> dict:
    async with Client(url) as client:
        await warm_up(client, args, sessions, label)
        return await closed_level(client, args, sessions, args.split_concurrency, label, probe)


async def handoff(args, url: str, label: str) -> dict:
    """Per length: fresh prompts (the same ones on every stack), each streamed for --handoff-tokens tokens."""
    rng = np.random.default_rng(21)
    out = {}
    async with Client(url) as client:
        await client.complete(rng.integers(*TOKEN_RANGE, 64).tolist(), 4)
        for n in args.handoff_lengths:
            runs = []
            for i in range(args.handoff_repeats):
                counts: list[int] = []
                r = await client.complete(rng.integers(*TOKEN_RANGE, n).tolist(), args.handoff_tokens, extra=COUNTED,
                                          counts=counts)
                t = r.token_times_s
                if r.error or len(t) < 4:
                    raise SystemExit(f"{label}a {n}-token prompt failed or ended early: {r.error or t}")
                later = statistics.median((b - a) / k for a, b, k in zip(t[1:], t[2:], counts[2:]))
                runs.append({"ttft_s": r.ttft_s, "first_gap_s": t[1] - t[0], "later_gap_s": later,
                             "added_s": t[1] - t[0] - counts[1] * later})
                say(f"{label}{n} tokens, run {i + 1}: TTFT {r.ttft_s:.2f} s, first gap {t[1] - t[0]:.3f} s, later "
                    f"gaps {later * 1000:.0f} ms")
            out[str(n)] = {key: statistics.median(run[key] for run in runs) for key in runs[0]} | {"runs": runs}
    return out


def split_phases(args, sessions, result: dict) -> None:
    """The split phase (pinned engines, the conversation workload) and the handoff phase (unpinned, long prompts),
    each on an undivided and a split stack."""
    if "split" in args.phases:
        out = result["split"] = {"concurrency": args.split_concurrency}
        for layout, engines in SPLIT_LAYOUTS.items():
            with StackRun(args, cache=True, name=layout, engines=engines, pin=True) as run:
                out[layout] = asyncio.run(split_level(args, run.url, sessions, run.probe, f"{layout}: "))
            report.write_json(args.name + "_partial", result)
    if "handoff" in args.phases:
        from model.weights import read_identity
        config, _ = read_identity(args.model_dir or ensure_model(args))
        result["latent_bytes_per_token"] = config.num_layers * config.latent_dim * 2  # bf16, every layer
        out = result["handoff"] = {"tokens": args.handoff_tokens, "repeats": args.handoff_repeats}
        for layout, engines in (("undivided", (1, 0, 0)), ("split", (0, 1, 1))):
            with StackRun(args, cache=True, name=f"handoff_{layout}", engines=engines) as run:
                out[layout] = asyncio.run(handoff(args, run.url, f"handoff, {layout}: "))
            report.write_json(args.name + "_partial", result)


def _said(s: dict) -> None:
    say(f"  {s['completed']}/{s['requests']} ok in {s['duration_s']:.1f} s: {s['request_throughput']:.3f} req/s, "
        f"{s['output_token_throughput']:.2f} output tok/s, TTFT p50 {s['ttft_s']['p50']:.2f} s, "
        f"TPOT p50 {s['tpot_s']['p50'] * 1000:.0f} ms, hit tokens {s['hit_tokens']}"
        + (f"; first error: {s['first_error']}" if s["first_error"] else ""))


async def peer_sweep(args, sessions, result: dict) -> None:
    """The sweep's closed loops against the peer alone (when the sweep phase did not run them)."""
    out = result["peer"] = {"name": args.peer_name, "url": args.peer_url, "sweep": {}}
    async with Client(args.peer_url, model=args.peer_model, fresh_connections=True) as client:
        await warm_up(client, args, sessions, f"{args.peer_name}: ")
        for c in args.concurrency:
            out["sweep"][str(c)] = await closed_level(client, args, sessions, c, f"{args.peer_name}: ")


def measure(args) -> dict:
    sessions = workload(args)
    result = {"preset": args.preset, "dtype": args.dtype, "hash_tokens": args.hash_tokens,
              "max_output": args.max_output, "max_turns": args.max_turns, "sessions": len(sessions),
              "warm_sessions": args.warm_sessions,
              "requests": sum(map(len, sessions)),
              "prompt_tokens_median": statistics.median(len(p) for s in sessions for p, _ in s),
              "phases": args.phases}
    say(f"{len(sessions)} sessions, {result['requests']} requests, median prompt {result['prompt_tokens_median']} "
        "tokens")
    begin = time.perf_counter()
    if {"sweep", "interference", "streams"} & set(args.phases):
        with StackRun(args, cache=True, name="on") as run:
            if "sweep" in args.phases:
                asyncio.run(sweep(args, run.url, sessions, result, run.probe))
            if "interference" in args.phases:
                asyncio.run(interference(args, run.url, result, run.probe))
            if "streams" in args.phases:
                asyncio.run(streams(args, run.url, result, run.probe))
    if "cache" in args.phases:
        with StackRun(args, cache=False, name="off") as run:
            asyncio.run(cache_off(args, run.url, sessions, result, run.probe))
    if {"split", "handoff"} & set(args.phases):
        split_phases(args, sessions, result)
    if args.peer_url and not {"sweep", "streams"} & set(args.phases):
        asyncio.run(peer_sweep(args, sessions, result))
    result["wall_s"] = time.perf_counter() - begin
    result["load_average_end"] = os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None, command: str = "") -> int:
    """`command`: how a wrapper (bench.llama_peer) was called, for the report, instead of this module's argv."""
    p = argparse.ArgumentParser(prog="serve_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--model-dir", default="", help="a saved model instead of the preset")
    p.add_argument("--models-dir", default="data/models", help="where the preset's weights are (created once)")
    p.add_argument("--url", default="", help="an already running gateway (then --phases cache is skipped)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--trace-limit", type=int, default=12031, help="trace records read to pick sessions from")
    p.add_argument("--sessions", type=int, default=140)
    p.add_argument("--min-turns", type=int, default=3)
    p.add_argument("--max-turns", type=int, default=0, help="turns per session sent (0: every turn)")
    p.add_argument("--min-sessions", type=int, default=4, help="sessions per closed-loop run at least")
    p.add_argument("--warm-sessions", type=int, default=16,
                   help="sessions of the warm pass before the measured runs (the last ones; 0: none)")
    p.add_argument("--hash-tokens", type=int, default=16, help="token ids per trace hash id (the trace's is 512)")
    p.add_argument("--max-output", type=int, default=32, help="cap on each request's output tokens")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (0: no Poisson run)")
    p.add_argument("--rate-requests", type=int, default=48)
    p.add_argument("--cache-concurrency", type=int, default=16)
    p.add_argument("--streams", type=int, default=15)
    p.add_argument("--stream-tokens", type=int, default=32, help="output tokens per stream request")
    p.add_argument("--stream-prompt", type=int, default=64, help="prompt tokens per stream request")
    p.add_argument("--stream-users", type=int, default=16, help="users of the streams phase's wide run")
    p.add_argument("--stream-requests", type=int, default=4, help="requests per user in the streams phase")
    p.add_argument("--long-tokens", type=int, default=16384)
    p.add_argument("--split-concurrency", type=int, default=8, help="users of the split phase's closed loops")
    p.add_argument("--handoff-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192, 32768])
    p.add_argument("--handoff-repeats", type=int, default=3)
    p.add_argument("--handoff-tokens", type=int, default=8, help="output tokens per handoff prompt")
    p.add_argument("--phases", type=lambda s: s.split(","), default=["sweep", "cache", "interference", "streams"],
                   help="of sweep, cache, interference, streams, split, handoff")
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=SERVING_DTYPES, help="the engines' serving dtype")
    p.add_argument("--peer-url", default="", help="also run the sweep against this OpenAI-compatible server")
    p.add_argument("--peer-name", default="llama-server")
    p.add_argument("--peer-model", default="mini", help="the model name the peer serves")
    p.add_argument("--dir", default=None, help="where stacks' data dirs go (default: the system temp dir)")

    def checked(args) -> dict:
        if args.url and "cache" in args.phases:
            args.phases.remove("cache")
        if args.url and {"split", "handoff"} & set(args.phases):
            raise SystemExit("--phases split and handoff start their own stacks: drop --url")
        if 512 % args.hash_tokens:
            raise SystemExit("--hash-tokens must divide 512")
        return measure(args)
    from bench import serve_report
    return report.main(p, checked, serve_report.write, name="serve_bench", command=COMMAND, argv=argv, shown=command)


if __name__ == "__main__":
    raise SystemExit(main())
