"""peer_ttft: time to first token of one long prompt, DeepInfer beside llama.cpp's llama-server on the same
weights, side by side in one run.

    python -m bench.peer_ttft --llama-dir /path/to/llama.cpp [--tokens 8192] [--repeats 3]   # root: drops caches

Per repeat, a prompt nobody sent before (--tokens of prefix, then --suffix new tokens), asked for one token:
  miss         the whole prompt computed;
  memory hit   the same prefix with a new suffix, the server still up: DeepInfer's memory tier,
               llama-server's slot (cache_prompt, the same slot: its in-memory prompt reuse);
  disk hit     the same prefix with another new suffix after a restart (fresh processes, page cache dropped
               before and after they start): DeepInfer's volumes through its durable index (Valkey's
               append-only file), llama-server's slot saved to --slot-save-path before the restart and
               restored after it (`POST /slots/0?action=restore`): its disk hit is restore + request.
Both take their weights into memory at start (llama-server with --load-mode none: a mapped model would read its
weights from disk inside the first request after the dropped page cache, which is not what a hit costs).
DeepInfer's TTFT is its gateway's (tokens in, first token out, over HTTP); llama-server's its /v1/completions.
The peer is an optional benchmark step (not part of `make test`); see bench.llama_peer for building llama.cpp.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import report
from bench.kv_bench import drop_caches, free_port
from bench.llama_peer import LlamaServer, add_peer_arguments, peer_files, same_weights
from bench.serve_client import Client, Result
from bench.trace_live import TOKEN_RANGE
from bench.stack import BenchStack, GatewayDriver

COMMAND = "python -m bench.peer_ttft"
POINTS = ("miss", "memory hit", "disk hit")


def say(message: str) -> None:
    print(f"[peer_ttft {time.strftime('%H:%M:%S')}] {message}", flush=True)


def ask(url: str, prompt: list[int], model: str, extra: dict | None = None) -> Result:
    async def one() -> Result:
        async with Client(url, model=model, fresh_connections=True) as client:
            return await client.complete(prompt, 1, extra=extra)
    result = asyncio.run(one())
    if result.error:
        raise SystemExit(f"a request to {url} failed: {result.error}")
    return result


def prompts(args, repeat: int) -> tuple[list[int], list[list[int]]]:
    """The repeat's prefix and its three suffixes (one per point): seeded, so both servers get the same."""
    rng = np.random.default_rng(1000 + repeat)
    prefix = rng.integers(*TOKEN_RANGE, args.tokens).tolist()
    return prefix, [rng.integers(*TOKEN_RANGE, args.suffix).tolist() for _ in POINTS]


def ours(args, model_dir: Path, work: Path) -> dict:
    """DeepInfer: one stack, restarted before each disk hit."""
    stack = BenchStack(args.preset, model_dir, work / "deepinfer")
    out: dict = {point: [] for point in POINTS} | {"hit_tokens": {point: [] for point in POINTS}}
    say("DeepInfer: starting its stack")
    stack.start()
    try:
        for repeat in range(args.repeats):
            prefix, suffixes = prompts(args, repeat)
            url = stack.stack.gateway_url
            for point, suffix in zip(POINTS, suffixes):
                if point == "disk hit":
                    GatewayDriver(url, stack.stack.admin_token).wait_for_saves()
                    restart = stack.restart(drop_caches)
                    say(f"DeepInfer: restarted in {restart.stop_s + restart.start_s:.1f} s (page cache dropped: "
                        f"{restart.dropped})")
                    url = stack.stack.gateway_url
                r = ask(url, prefix + suffix, "deepseek-chat")
                out[point].append(r.ttft_s)
                out["hit_tokens"][point].append(r.hit_tokens)
                say(f"DeepInfer {point} {repeat + 1}/{args.repeats}: {r.ttft_s:.3f} s ({r.hit_tokens} hit tokens)")
    finally:
        stack.stop()
    return out


def _slot(url: str, action: str, filename: str) -> dict:
    request = urllib.request.Request(f"{url}/slots/0?action={action}", json.dumps({"filename": filename}).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def theirs(args, binary: Path, gguf: Path, model_dir: Path, work: Path) -> dict:
    """llama-server: one slot; its slot saved before each restart and restored after it."""
    slots = work / "llama-slots"
    slots.mkdir(parents=True, exist_ok=True)
    port = free_port()
    context = args.tokens + args.suffix + 64
    extra = ("--slot-save-path", str(slots), "--load-mode", "none")

    def server() -> LlamaServer:
        return LlamaServer(binary, gguf, 1, args.threads, context, args.preset, work / "llama-server.log", extra, port)

    out: dict = {point: [] for point in POINTS}
    out |= {"restore_s": [], "request_s": [], "hit_tokens": {point: [] for point in POINTS}}
    body = {"id_slot": 0, "cache_prompt": True}
    running = server()
    url = running.__enter__()
    try:
        peer_tokens, our_tokens = same_weights(url, model_dir, {"bf16": "bfloat16", "f32": "float32"}[args.gguf_type],
                                               [1, 2, 3])
        if peer_tokens != our_tokens:
            raise SystemExit(f"the peer's greedy tokens {peer_tokens} differ from ours {our_tokens}: not the same "
                             "weights")
        for repeat in range(args.repeats):
            prefix, suffixes = prompts(args, repeat)
            for point, suffix in zip(POINTS, suffixes):
                restore_s = 0.0
                if point == "disk hit":
                    name = f"repeat{repeat}.bin"
                    _slot(url, "save", name)
                    running.__exit__(None, None, None)
                    drop_caches()
                    running = server()
                    url = running.__enter__()
                    drop_caches()
                    begin = time.perf_counter()
                    restored = _slot(url, "restore", name)
                    restore_s = time.perf_counter() - begin
                    say(f"llama-server: restored {restored.get('n_restored')} tokens in {restore_s:.3f} s")
                r = ask(url, prefix + suffix, args.preset, body)
                out[point].append(restore_s + r.ttft_s)
                out["hit_tokens"][point].append(r.hit_tokens)
                if point == "disk hit":
                    out["restore_s"].append(restore_s)
                    out["request_s"].append(r.ttft_s)
                say(f"llama-server {point} {repeat + 1}/{args.repeats}: {restore_s + r.ttft_s:.3f} s "
                    f"({r.hit_tokens} hit tokens)")
    finally:
        running.__exit__(None, None, None)
    return out


def write_report(result: dict) -> None:
    us, peer = result["deepinfer"], result["peer"]
    med = statistics.median
    rows = []
    for point in POINTS:
        a, b = us[point], peer[point]
        label = point if point != "disk hit" else (
            f"disk hit after a restart ({result['peer_name']}: restore {med(peer['restore_s']):.2f} s + request "
            f"{med(peer['request_s']):.2f} s)")
        hits = f"{med(us['hit_tokens'][point]):.0f} / {med(peer['hit_tokens'][point]):.0f}"
        rows.append([label, f"{med(a):.3f} ({min(a):.3f}-{max(a):.3f})", f"{med(b):.3f} ({min(b):.3f}-{max(b):.3f})",
                     f"{med(b) / med(a):.2f}x", hits])
    fig, ax = report.pyplot().subplots(figsize=(7, 4))
    x = np.arange(len(POINTS))
    ax.bar(x - 0.2, [med(us[p]) for p in POINTS], 0.4, label="DeepInfer")
    ax.bar(x + 0.2, [med(peer[p]) for p in POINTS], 0.4, label=result["peer_name"])
    ax.set_xticks(x, POINTS)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, seconds (log; median)")
    ax.set_title(f"{result['tokens']} + {result['suffix']} tokens, {result['preset']}", fontsize=8)
    ax.legend()
    ax.grid(alpha=0.3, which="both", axis="y")
    image = report.save_figure(fig, f"{result.get('name', 'peer_ttft')}.png")
    table = report.markdown_table(["point", "DeepInfer TTFT s", f"{result['peer_name']} TTFT s",
                                   f"{result['peer_name']} / DeepInfer", "hit tokens (DeepInfer / peer)"], rows)
    notes = [f"model `{result['preset']}`, the same random weights in both: DeepInfer in {result['dtype']} through its "
             f"gateway, {result['peer_name']} from a GGUF at {result['gguf_type']} ({result['threads']} threads); "
             f"{result['tokens']} prefix + {result['suffix']} new tokens, one output token, median (min-max) of "
             f"{result['repeats']} repeats" + ("" if result["dropped"] else "; the page cache was not dropped")]
    report.section(f"TTFT beside {result['peer_name']} (peer_ttft)", result["command"], result["machine"], table,
                   image, notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peer_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_arguments(p, gguf_type="f32")
    p.add_argument("--tokens", type=int, default=8192, help="prefix tokens")
    p.add_argument("--suffix", type=int, default=64, help="new tokens after the prefix")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="", help="work directory (stack data, slot files; default: a temp dir)")
    p.add_argument("--peer-name", default="llama-server")

    def measure(args) -> dict:
        binary, model_dir, gguf = peer_files(args)
        work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="peer_ttft_"))
        work.mkdir(parents=True, exist_ok=True)
        result = {"preset": args.preset, "dtype": "bfloat16", "gguf_type": args.gguf_type, "threads": args.threads,
                  "tokens": args.tokens, "suffix": args.suffix, "repeats": args.repeats, "peer_name": args.peer_name,
                  "dropped": drop_caches()}
        result["deepinfer"] = ours(args, model_dir, work)
        result["peer"] = theirs(args, binary, gguf, model_dir, work)
        return result

    def done(result: dict) -> int:
        for point in POINTS:
            say(f"{point}: DeepInfer {statistics.median(result['deepinfer'][point]):.3f} s, {result['peer_name']} "
                f"{statistics.median(result['peer'][point]):.3f} s")
        return 0
    return report.main(p, measure, write_report, name="peer_ttft", command=COMMAND, argv=argv, done=done)


if __name__ == "__main__":
    sys.exit(main())
