"""serve_bench's report: tables for BENCHMARKS.md and plots, stating only what the run measured."""
from __future__ import annotations

import math

from bench import report


def _ms(p: dict, key: str) -> str:
    v = p.get(key, math.nan)
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.0f}"


def _row(label: str, s: dict) -> list:
    e = s.get("engine")  # the engine's own accounting (its /metrics), on stacks the bench started
    engine = ([f"{e['busy_s']:.1f} ({e['busy_s'] / s['duration_s']:.0%})", f"{e['prefill_s']:.1f}",
               f"{e['decode_s']:.1f}", f"{e['compile_s']:.1f}"] if e else ["-"] * 4)
    return [label, f"{s['completed']}/{s['requests']}", f"{s['duration_s']:.1f}", f"{s['request_throughput']:.3f}",
            f"{s['output_token_throughput']:.2f}", f"{s['hit_tokens']}/{s['total_input_tokens']}",
            *(_ms(s["ttft_s"], k) for k in ("p50", "p99")), *(_ms(s["tpot_s"], k) for k in ("p50", "p99")), *engine]


# ITL percentiles, TTFT/TPOT means and p90s are in the run's JSON (bench/out/NAME.json).
HEADER = ["run", "ok", "s", "req/s", "out tok/s", "hit / prompt tok", "TTFT p50 ms", "p99", "TPOT p50 ms", "p99",
          "engine busy s", "prefill s", "decode s", "compiling s"]


def _levels(levels: dict, prefix: str = "") -> list[tuple[str, dict]]:
    return [(f"{prefix}{c} users", s) for c, s in sorted(levels.items(), key=lambda kv: int(kv[0]))]


def sweep_goals(result: dict) -> list[str]:
    lines = []
    sweep = result.get("sweep", {})
    if "1" in sweep and "16" in sweep:
        ratio = sweep["16"]["output_token_throughput"] / sweep["1"]["output_token_throughput"]
        lines.append(f"output token throughput, 16 users / 1 user: {ratio:.2f}x (goal >= 8x)")
    peer = result.get("peer", {}).get("sweep", {})
    if "16" in peer and "16" in sweep:
        lines.append(f"output token throughput at 16 users, DeepInfer / {result['peer']['name']}: "
                     f"{sweep['16']['output_token_throughput'] / peer['16']['output_token_throughput']:.2f}x "
                     "(goal > 1x)")
    return lines


def cache_goals(result: dict) -> list[str]:
    sweep, off = result.get("sweep", {}), result.get("cache_off", {})
    c = next(iter(off), None)
    if c is None or c not in sweep:
        return []
    ratio = sweep[c]["request_throughput"] / off[c]["request_throughput"]
    return [f"multi-turn request throughput at {c} users, cache on / off: {ratio:.2f}x (goal >= 3x)"
            + _cache_ceiling(sweep[c], off[c])]


def streams_goals(result: dict) -> list[str]:
    chat = result.get("streams")
    if not chat:
        return []
    users = max(chat["levels"], key=int)
    lines = [f"short prompts, output token throughput, {users} users / 1 user: {chat['ratio']:.2f}x (goal >= 8x)"]
    if "peer" in chat:
        peer = chat["peer"]
        ours, theirs = chat["levels"], peer["levels"]
        lines.append(f"short prompts, {peer['name']}: {users} users / 1 user {peer['ratio']:.2f}x; DeepInfer / "
                     f"{peer['name']} output token throughput at {users} users "
                     f"{ours[users]['output_token_throughput'] / theirs[users]['output_token_throughput']:.2f}x, "
                     f"at 1 user {ours['1']['output_token_throughput'] / theirs['1']['output_token_throughput']:.2f}x "
                     "(goal > 1x)")
    return lines


def interference_goals(result: dict) -> list[str]:
    inter = result.get("interference")
    if not inter:
        return []
    return [f"while a {inter['long_tokens']}-token miss prefills, the {inter['streams']} streams' p99 token gap / "
            f"their idle TPOT p99: {inter['tpot_p99_ratio']:.2f}x (goal <= 3x"
            + (f"; per text chunk {inter['chunk_gap_p99_ratio']:.2f}x" if "chunk_gap_p99_ratio" in inter else "")
            + f"); the miss's TTFT / alone: {inter['long_ttft_ratio']:.2f}x (goal <= 1.5x)"]


def goals(result: dict) -> list[str]:
    """Every goal of the run's phases, each with the number this run measured."""
    return sweep_goals(result) + cache_goals(result) + streams_goals(result) + interference_goals(result)


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
    plt = report.pyplot()
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
        fig.suptitle(f"serve_bench, {result['preset']}", fontsize=9)
        made.append(report.save_figure(fig, f"{name}_sweep.png"))
    return made


def split_plot(result: dict, name: str) -> str | None:
    split, hand = result.get("split"), result.get("handoff")
    if not split and not hand:
        return None
    plt = report.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    if split:
        layouts = [k for k in ("undivided", "split") if k in split]
        keys = [("TTFT p50", "ttft_s", "p50"), ("TTFT p99", "ttft_s", "p99"), ("TPOT p50", "tpot_s", "p50"),
                ("TPOT p99", "tpot_s", "p99")]
        for i, layout in enumerate(layouts):
            a.bar([j + 0.4 * i for j in range(len(keys))], [split[layout][k][q] for _, k, q in keys], 0.4,
                  label=layout)
        a.set_xticks([j + 0.2 for j in range(len(keys))], [label for label, _, _ in keys])
        a.set_yscale("log")
        a.set_ylabel("seconds (log)")
        a.set_title(f"{split['concurrency']} users, conversation trace", fontsize=9)
        a.legend()
    if hand:
        for layout, style in (("undivided", "o-"), ("split", "s-")):
            if layout in hand:
                ns = sorted(int(n) for n in hand[layout])
                b.plot(ns, [hand[layout][str(n)]["first_gap_s"] for n in ns], style, label=f"{layout}: first gap")
        ns = sorted(int(n) for n in hand.get("split", {}))
        b.plot(ns, [hand["split"][str(n)]["later_gap_s"] for n in ns], "x:", label="split: later gaps")
        b.set_xscale("log", base=2)
        b.set_yscale("log")
        b.set_xlabel("prompt tokens (a miss)")
        b.set_ylabel("seconds between tokens 1 and 2 (log)")
        b.legend(fontsize=8)
    for axis in (a, b):
        axis.grid(alpha=0.3, which="both")
    fig.suptitle(f"serve_bench split and handoff, {result['preset']}", fontsize=9)
    return report.save_figure(fig, f"{name}_split.png")


def _added(hand: dict, layout: str) -> str:
    side = hand.get(layout, {})
    return " / ".join(f"{side[n]['added_s'] * 1000:.0f}" for n in sorted(side, key=int)) or "-"


def _tokens(n: str) -> str:
    return f"{int(n) // 1024}K" if int(n) % 1024 == 0 else n


def latent_bytes_per_token(result: dict) -> int:
    """A token's latents over every layer in bf16: the run's, else its preset's."""
    if "latent_bytes_per_token" in result:
        return result["latent_bytes_per_token"]
    from model.config import preset
    config = preset(result["preset"])
    return config.num_layers * config.latent_dim * 2


def split_table(result: dict) -> str:
    """One row per stack: the conversation workload's numbers (split phase) and the handoff's added ms (handoff)."""
    split, hand = result.get("split", {}), result.get("handoff", {})
    lengths = " / ".join(_tokens(n) for n in sorted(hand.get("split", {}), key=int))
    rows = []
    for layout, label in (("undivided", "undivided: 2 engines of role both"), ("split", "split: prefill + decode")):
        s = split.get(layout)
        numbers = ([f"{s['completed']}/{s['requests']}", f"{s['request_throughput']:.3f}",
                    f"{s['output_token_throughput']:.2f}", *(_ms(s["ttft_s"], k) for k in ("p50", "p99")),
                    *(_ms(s["tpot_s"], k) for k in ("p50", "p99"))] if s else ["-"] * 7)
        rows.append([label, *numbers, _added(hand, layout)])
    return report.markdown_table(["stack", "ok", "req/s", "out tok/s", "TTFT p50 ms", "p99", "TPOT p50 ms", "p99",
                                  f"first token gap added, {lengths} ms"], rows)


def split_notes(result: dict) -> list[str]:
    notes = []
    split, hand = result.get("split"), result.get("handoff")
    if split:
        u, s = split["undivided"], split["split"]
        ratio = lambda key, q: s[key][q] / u[key][q]  # noqa: E731
        notes += [f"{split['concurrency']} users, closed loop, Mooncake sessions (median prompt "
                  f"{result['prompt_tokens_median']:.0f} tokens, <= {result['max_output']} out), `{result['preset']}`; "
                  "each engine pinned to a core of its own, the same cores in both stacks",
                  f"split / undivided: TTFT p50 {ratio('ttft_s', 'p50'):.2f}x, p99 {ratio('ttft_s', 'p99'):.2f}x; TPOT "
                  f"p50 {ratio('tpot_s', 'p50'):.2f}x, p99 {ratio('tpot_s', 'p99'):.2f}x; out tok/s "
                  f"{s['output_token_throughput'] / u['output_token_throughput']:.2f}x"]
    if hand and "split" in hand:
        longest = max(hand["split"], key=int)
        added = hand["split"][longest]["added_s"]
        moved = int(longest) * latent_bytes_per_token(result)
        notes.append(f"gap added: the gap between tokens 1 and 2 less the later gaps' median, fresh prompts, unpinned "
                     f"stacks (undivided: one engine), medians of {hand['repeats']}; at {_tokens(longest)} the decode "
                     f"engine reads {moved / 1e9:.2f} GB of latents (saved as they were prefilled) and the gap grows "
                     f"{added * 1000:.0f} ms" + (f" ({moved / 1e9 / added:.2f} GB/s)" if added > 0 else ""))
    return notes


def peer_name(result: dict) -> str:
    return result.get("peer", {}).get("name") or result.get("streams", {}).get("peer", {}).get("name", "peer")


def workload(result: dict) -> str:
    turns = f"at most {result['max_turns']} turns" if result.get("max_turns") else "every turn"
    return (f"model `{result['preset']}` served in {result.get('dtype', 'float32')}, one engine, through the gateway; "
            f"{result['requests']} requests of {result['sessions']} Mooncake sessions ({turns}), "
            f"{result['hash_tokens']} token ids per trace hash id (median prompt {result['prompt_tokens_median']:.0f} "
            f"tokens), outputs capped at {result['max_output']} tokens; percentiles nearest-rank")


def write(result: dict) -> None:
    """One section per phase the run measured, each with one table."""
    name = result.get("name", "serve_bench")
    beside = f", beside {peer_name(result)}" if "peer" in result or "peer" in result.get("streams", {}) else ""
    command, machine = result["command"], result["machine"]
    sweep = result.get("sweep", {})
    if sweep:
        rows = _levels(sweep)
        if "poisson" in result:
            rows.append((f"Poisson {result['poisson']['rate']}/s", result["poisson"]))
        rows += [(f"{c} users, cache off", s) for c, s in result.get("cache_off", {}).items()]
        rows += _levels(result.get("peer", {}).get("sweep", {}), f"{peer_name(result)}: ")
        figures = plots(result, name)
        report.section(f"Serving: users sweep (serve_bench{beside})", command, machine,
                       report.markdown_table(HEADER, [_row(label, s) for label, s in rows]),
                       figures[0] if figures else None,
                       [workload(result), *sweep_goals(result), *(cache_goals(result) if "cache_off" in result else [])])
    inter = result.get("interference")
    if inter:
        table = report.markdown_table(
            ["streams", "long prompt", "idle TPOT p50/p99 ms", "token gap p50/p99 ms", "chunk gap p50/p99 ms",
             "TTFT alone s", "among streams s", "64-token TTFT idle/during s"],
            [[inter["streams"], inter["long_tokens"], f"{_ms(inter['idle_tpot_s'], 'p50')} / "
              f"{_ms(inter['idle_tpot_s'], 'p99')}", _token_gaps(inter), f"{_ms(inter['during_itl_s'], 'p50')} / "
              f"{_ms(inter['during_itl_s'], 'p99')}", f"{inter['long_alone_ttft_s']:.1f}",
              f"{inter['long_together_ttft_s']:.1f}", _short_ttfts(inter)]])
        report.section(f"Serving: a long prefill among streams (serve_bench{beside})", command, machine, table,
                       None, interference_goals(result))
    if result.get("split") or result.get("handoff"):
        report.section("Serving: prefill/decode split (serve_bench)", command, machine, split_table(result),
                       split_plot(result, name), split_notes(result))
    chat = result.get("streams")
    if chat:
        rows = _levels(chat["levels"]) + _levels(chat.get("peer", {}).get("levels", {}), f"{peer_name(result)}: ")
        report.section(f"Serving: short prompts (serve_bench{beside})", command, machine,
                       report.markdown_table(HEADER, [_row(label, s) for label, s in rows]), None,
                       [f"each user sends {chat['requests_per_user']} prompts of {chat['prompt_tokens']} tokens "
                        f"nobody sent before, {chat['output_tokens']} output tokens each, one after another",
                        *streams_goals(result)])
