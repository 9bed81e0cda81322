"""serve_bench's report: tables for BENCHMARKS.md and plots, stating only what the run measured."""
from __future__ import annotations

import math

from bench import report


def _ms(p: dict, key: str) -> str:
    v = p.get(key, math.nan)
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.0f}"


def _row(label: str, s: dict) -> list:
    return [label, f"{s['completed']}/{s['requests']}", f"{s['duration_s']:.1f}", f"{s['request_throughput']:.3f}",
            f"{s['output_token_throughput']:.2f}", f"{s['hit_tokens']}/{s['total_input_tokens']}",
            *(_ms(s["ttft_s"], k) for k in ("mean", "p50", "p90", "p99")),
            *(_ms(s["tpot_s"], k) for k in ("mean", "p50", "p90", "p99")),
            *(_ms(s["itl_s"], k) for k in ("p50", "p99"))]


HEADER = ["run", "ok", "s", "req/s", "output tok/s", "hit / prompt tokens", "TTFT mean ms", "p50", "p90", "p99",
          "TPOT mean ms", "p50", "p90", "p99", "ITL p50 ms", "p99"]


def _engine_rows(labelled: list[tuple[str, dict]]) -> list[list]:
    """The engine's own accounting of each run that has it (stacks the bench started)."""
    return [[label, f"{s['duration_s']:.1f}", f"{e['busy_s']:.1f} ({e['busy_s'] / s['duration_s']:.0%})",
             f"{e['prefill_s']:.1f}", f"{e['decode_s']:.1f}", f"{e['compile_s']:.1f}"]
            for label, s in labelled if (e := s.get("engine"))]


ENGINE_HEADER = ["run", "wall s", "engine busy s (share)", "prefill s", "decode s", "compiling s"]


def goals(result: dict) -> list[str]:
    """The issue's goals, each with the number this run measured."""
    lines = []
    sweep = result.get("sweep", {})
    if "1" in sweep and "16" in sweep:
        ratio = sweep["16"]["output_token_throughput"] / sweep["1"]["output_token_throughput"]
        lines.append(f"- output token throughput, 16 users / 1 user: **{ratio:.2f}x** (goal >= 8x)")
    if "cache_off" in result and sweep:
        c = next(iter(result["cache_off"]))
        if c in sweep:
            ratio = sweep[c]["request_throughput"] / result["cache_off"][c]["request_throughput"]
            lines.append(f"- multi-turn request throughput at {c} users, cache on / off: **{ratio:.2f}x** "
                         "(goal >= 3x)" + _cache_ceiling(sweep[c], result["cache_off"][c]))
    chat = result.get("streams")
    if chat:
        users = max(chat["levels"], key=int)
        lines.append(f"- short prompts, output token throughput, {users} users / 1 user: **{chat['ratio']:.2f}x** "
                     "(the issue's first measurement; goal >= 8x)")
        if "peer" in chat:
            peer = chat["peer"]
            ours, theirs = chat["levels"], peer["levels"]
            lines.append(f"- short prompts, {peer['name']}: {users} users / 1 user {peer['ratio']:.2f}x; DeepInfer / "
                         f"{peer['name']} output token throughput at {users} users: "
                         f"**{ours[users]['output_token_throughput'] / theirs[users]['output_token_throughput']:.2f}x**, "
                         f"at 1 user (decode tokens/s of one stream): "
                         f"**{ours['1']['output_token_throughput'] / theirs['1']['output_token_throughput']:.2f}x** "
                         "(goal > 1x)")
    peer = result.get("peer", {}).get("sweep", {})
    if "16" in peer and "16" in sweep:
        lines.append(f"- output token throughput at 16 users, DeepInfer / {result['peer']['name']}: "
                     f"**{sweep['16']['output_token_throughput'] / peer['16']['output_token_throughput']:.2f}x** "
                     "(goal > 1x)")
    inter = result.get("interference")
    if inter:
        lines.append(f"- while a {inter['long_tokens']}-token miss prefills, the {inter['streams']} streams' p99 "
                     f"token gap / their idle TPOT p99: **{inter['tpot_p99_ratio']:.2f}x** (goal <= 3x"
                     + (f"; per text chunk {inter['chunk_gap_p99_ratio']:.2f}x"
                        if "chunk_gap_p99_ratio" in inter else "")
                     + "); the miss's "
                     f"TTFT / alone: **{inter['long_ttft_ratio']:.2f}x** (goal <= 1.5x)")
    return lines


def _token_gaps(inter: dict) -> str:
    gaps = inter.get("during_token_gap_s")  # (a result from before this was measured has chunk gaps only)
    return "-" if gaps is None else f"{_ms(gaps, 'p50')} / {_ms(gaps, 'p99')}"


def _short_ttfts(inter: dict) -> str:
    if "short_during_ttft_s" not in inter:  # a result from before this was measured
        return "-"
    during = f"{inter['short_during_ttft_s']:.2f}"
    return (f"{inter['short_idle_ttft_s']:.2f} / {during}"
            + ("" if inter["short_before_long"] else " (after the long one's first token)"))


def _cache_ceiling(on: dict, off: dict) -> str:
    """What the cache could give this workload at most: the cache-off run's engine time with its hit share of
    prefill time gone and the rest as it was (not a physical bound: it takes the off run's own costs)."""
    engine = off.get("engine")
    if not engine or not on["total_input_tokens"]:
        return ""
    share = on["hit_tokens"] / on["total_input_tokens"]
    rest = engine["busy_s"] - engine["prefill_s"] * share
    return (f"; ceiling on this workload {engine['busy_s'] / rest:.2f}x (the off run's engine time without the "
            f"{share:.0%} of its prefill time the hits would save, everything else as it was)")


def plots(result: dict, name: str) -> list[str]:
    plt = report_plt()
    made = []
    sweep = result.get("sweep", {})
    if sweep:
        cs = sorted(int(c) for c in sweep)
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(cs, [sweep[str(c)]["output_token_throughput"] for c in cs], "o-", label="DeepInfer, cache on")
        if "cache_off" in result:
            for c, s in result["cache_off"].items():
                a.plot([int(c)], [s["output_token_throughput"]], "x", markersize=10, label=f"cache off ({c} users)")
        peer = result.get("peer", {}).get("sweep", {})
        if peer:
            pcs = sorted(int(c) for c in peer)
            a.plot(pcs, [peer[str(c)]["output_token_throughput"] for c in pcs], "s--",
                   label=result["peer"]["name"])
        chat = result.get("streams")
        for side, style, label in ((chat, "^-", "DeepInfer, short prompts"),
                                   ((chat or {}).get("peer"), "v:", f"{peer_name(result)}, short prompts")):
            if side:
                ucs = sorted(int(c) for c in side["levels"])
                a.plot(ucs, [side["levels"][str(c)]["output_token_throughput"] for c in ucs], style, label=label)
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent users (closed loop)")
        a.set_ylabel("output tokens/s")
        a.grid(alpha=0.3)
        a.legend()
        for key, style in (("p50", "o-"), ("p99", "s--")):
            b.plot(cs, [sweep[str(c)]["ttft_s"][key] for c in cs], style, label=f"TTFT {key}")
            b.plot(cs, [sweep[str(c)]["tpot_s"][key] for c in cs], style, label=f"TPOT {key}")
        if peer:
            b.plot(pcs, [peer[str(c)]["tpot_s"]["p50"] for c in pcs], "^:",
                   label=f"{result['peer']['name']} TPOT p50")
        b.set_xscale("log", base=2)
        b.set_yscale("log")
        b.set_xlabel("concurrent users (closed loop)")
        b.set_ylabel("seconds (log)")
        b.grid(alpha=0.3, which="both")
        b.legend(fontsize=8)
        fig.suptitle(f"serve_bench, {result['preset']}: {result['machine']}", fontsize=9)
        fig.tight_layout()
        path = report.RESULTS / f"{name}_sweep.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path.name)
    return made


def peer_name(result: dict) -> str:
    return result.get("peer", {}).get("name") or result.get("streams", {}).get("peer", {}).get("name", "peer")


def report_plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write(result: dict, name: str) -> None:
    ours = [(f"{c} users", s) for c, s in sorted(result.get("sweep", {}).items(), key=lambda kv: int(kv[0]))]
    if "poisson" in result:
        ours.append((f"Poisson {result['poisson']['rate']}/s", result["poisson"]))
    ours += [(f"{c} users, cache off", s) for c, s in result.get("cache_off", {}).items()]
    rows = [_row(label, s) for label, s in ours]
    engine_rows = _engine_rows(ours)
    peer = result.get("peer")
    if peer:
        rows += [_row(f"{peer['name']}: {c} users", s)
                 for c, s in sorted(peer["sweep"].items(), key=lambda kv: int(kv[0]))]
    images = plots(result, name)
    inter = result.get("interference")
    turns = f"at most {result['max_turns']} turns" if result.get("max_turns", 3) else "every turn"
    body = [f"Command: `{result['command']}` ({result['wall_s'] / 60:.0f} min; load average "
            f"{result['load_average_start']:.1f} at the start, {result['load_average_end']:.1f} at the end).",
            f"Machine: {result['machine']}. Model `{result['preset']}` served in {result.get('dtype', 'float32')}, one "
            "engine, through the gateway. Workload: "
            f"{result['requests']} requests of {result['sessions']} Mooncake conversation sessions (>= 3 turns, "
            f"{turns} sent), "
            f"{result['hash_tokens']} token ids per trace hash id (median prompt {result['prompt_tokens_median']:.0f} "
            f"tokens), outputs capped at {result['max_output']} tokens. Metrics as vLLM's benchmark_serving; "
            "percentiles are nearest-rank over the run's requests."
            + (f" Before the measured runs, a warm pass of {result['warm_sessions']} other sessions at the highest "
               "concurrency compiled the workload's shapes." if result.get("warm_sessions") else ""), ""]
    if rows:
        body += [report.markdown_table(HEADER, rows), ""]
    if engine_rows:
        body += ["The engine's own accounting of each run (its /metrics, before and after): the model thread's busy "
                 "time, of it prefill passes and decode steps, and the time this process spent compiling shapes it "
                 "had not met before (inside the busy time, stalling every stream).", "",
                 report.markdown_table(ENGINE_HEADER, engine_rows), ""]
    if inter:
        body += [report.markdown_table(
            ["streams", "long prompt", "idle TPOT p50 / p99 ms",
             "gap per token during the long prefill p50 / p99 ms", "gap per text chunk p50 / p99 ms",
             "long TTFT alone s", "long TTFT among streams s",
             "a 64-token prompt's TTFT among the streams / while the long one prefills s"],
            [[inter["streams"], inter["long_tokens"], f"{_ms(inter['idle_tpot_s'], 'p50')} / "
              f"{_ms(inter['idle_tpot_s'], 'p99')}", _token_gaps(inter), f"{_ms(inter['during_itl_s'], 'p50')} / "
              f"{_ms(inter['during_itl_s'], 'p99')}", f"{inter['long_alone_ttft_s']:.1f}",
              f"{inter['long_together_ttft_s']:.1f}", _short_ttfts(inter)]]), ""]
    chat = result.get("streams")
    if chat:
        levels = [(f"{c} users", s) for c, s in sorted(chat["levels"].items(), key=lambda kv: int(kv[0]))]
        if "peer" in chat:
            levels += [(f"{chat['peer']['name']}: {c} users", s)
                       for c, s in sorted(chat["peer"]["levels"].items(), key=lambda kv: int(kv[0]))]
        body += [f"Short prompts (the issue's first measurement): each user sends {chat['requests_per_user']} prompts "
                 f"of {chat['prompt_tokens']} tokens nobody sent before, {chat['output_tokens']} output tokens each, "
                 "one after another; a round at each width first compiles its shapes.", "",
                 report.markdown_table(HEADER, [_row(label, s) for label, s in levels]), "",
                 report.markdown_table(ENGINE_HEADER, _engine_rows(levels)), ""]
    body += ["Goals, as measured in this run:", *goals(result), ""]
    body += [f"![serve_bench](bench/results/{image})" for image in images]
    title = "Serving (serve_bench)" if "sweep" in result["phases"] else "Serving: a long prefill among streams (serve_bench)"
    if result["phases"] == ["streams"]:
        title = "Serving: short prompts (serve_bench)"
    if peer:
        title = f"Serving beside {peer['name']} (llama_peer + serve_bench)"
    report.update_section(title, "\n".join(body))
