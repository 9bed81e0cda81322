"""trace_bench's plots (bench/results/trace_*.png) and its BENCHMARKS.md section."""
from __future__ import annotations

import math

from bench import report

TITLE = "Trace replay (trace_bench)"
HIT_PLOT = report.RESULTS / "trace_hit_ratio.png"
TTFT_PLOT = report.RESULTS / "trace_ttft.png"


def plot_hit_ratio(index: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounded = [r for r in index["capacity"] if r["capacity_tokens"] is not None]
    unbounded = [r for r in index["capacity"] if r["capacity_tokens"] is None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if bounded:
        ax.plot([r["capacity_tokens"] for r in bounded], [100 * r["hit_ratio"] for r in bounded], "o-",
                label="DeepInfer (LRU-by-last-hit segments, 64-token blocks)")
        for r in bounded:
            ax.annotate(f"{r['hit_ratio']:.1%}", (r["capacity_tokens"], 100 * r["hit_ratio"]),
                        textcoords="offset points", xytext=(6, -12), fontsize=8)
    for r in unbounded:
        ax.axhline(100 * r["hit_ratio"], color="tab:green", ls=":", label=f"DeepInfer, unbounded ({r['hit_ratio']:.1%})")
    ceiling = index["ceiling"]["hit_ratio"]
    ax.axhline(100 * ceiling, color="tab:red", ls="--", label=f"trace ceiling ({ceiling:.1%})")
    ax.set_xscale("log")
    ax.set_xlabel("store capacity (tokens of latents, all volumes)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, max(5.0, 100 * ceiling * 1.15))
    ax.set_title(f"Mooncake conversation trace: {index['requests']:,} requests, one hour")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    HIT_PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(HIT_PLOT, dpi=110)
    plt.close(fig)


def plot_ttft(live: dict, hit_fraction: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in live["per_request"] if not r["error"]]
    groups = {"hit": [r for r in ok if r["hit_tokens"] >= hit_fraction * r["prompt_tokens"]],
              "miss": [r for r in ok if r["hit_tokens"] < hit_fraction * r["prompt_tokens"]]}
    colors = {"hit": "tab:green", "miss": "tab:red"}
    fig, (cdf, scatter) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, group in groups.items():
        values = sorted(r["ttft_s"] for r in group)
        if values:
            cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=colors[name],
                     label=f"{name} ({len(values)})")
            scatter.scatter([r["prompt_tokens"] - r["hit_tokens"] for r in group], [r["ttft_s"] for r in group],
                            s=14, color=colors[name], label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT, client side (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"TTFT CDF (hit: >= {hit_fraction:.0%} of the prompt cached)")
    scatter.set_xlabel("prompt tokens computed (prompt - cached)")
    scatter.set_ylabel("TTFT (s)")
    scatter.set_title(f"live slice, preset {live['preset']}")
    for ax in (cdf, scatter):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    TTFT_PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(TTFT_PLOT, dpi=110)
    plt.close(fig)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.0f}" if n >= 1e10 else f"{n / 1e9:,.1f}"


def _s(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def index_section(index: dict) -> str:
    rows = []
    for r in index["capacity"]:
        b = r["bytes"]
        rows.append([r["label"], f"{r['hit_ratio']:.1%}", f"{r['hit_ratio'] / index['ceiling']['hit_ratio']:.0%}",
                     f"{r['mostly_hit_requests']:,}", f"{r['stranded_tokens'] / r['input_tokens']:.1%}",
                     f"{r['evictions']:,}",
                     f"{_gb(b['mini']['bytes_read'])} / {_gb(b['mini']['bytes_written'])}",
                     f"{_gb(b['deepseek-v3']['bytes_read'])} / {_gb(b['deepseek-v3']['bytes_written'])}",
                     f"{b['deepseek-v3']['read_GBps_avg']:.2f} / {b['deepseek-v3']['written_GBps_avg']:.2f}"])
    table = report.markdown_table(
        ["capacity (tokens)", "hit ratio", "of ceiling", "requests >= 50% hit", "cached behind a gap",
         "segments evicted",
         "mini GB read / written", "V3 GB read / written", "V3 GB/s avg read / write"], rows)
    mini, v3 = (index["capacity"][0]["bytes"][g] for g in ("mini", "deepseek-v3"))
    return (f"Whole trace, index level: {index['requests']:,} requests, {index['input_tokens'] / 1e6:,.1f}M prompt "
            f"tokens, {index['output_tokens'] / 1e6:,.1f}M answer tokens over {index['trace_seconds'] / 60:.0f} min. "
            f"Trace ceiling (every prompt token of a hash id seen before): "
            f"**{index['ceiling']['hit_ratio']:.1%}**. Capacity is split over {index['volumes']} volumes "
            f"(per-volume budgets, as `deepinfer up`), sized with the {index['sizing_geometry']} geometry "
            f"(segment headers included).\n\n{table}\n\n"
            f"A hit token reads {mini['read_bytes_per_hit_token']:,} B (`mini`, 8 layers) or "
            f"{v3['read_bytes_per_hit_token']:,} B (`deepseek-v3`, 61 layers) of latents; a missed token costs "
            f"about {v3['written_bytes_per_miss_token'] / 1e3:,.0f} kB written for V3 at the smallest capacity "
            f"({mini['written_bytes_per_miss_token'] / 1e3:,.1f} kB for mini): a little more than one token's "
            f"latents, because answer blocks are saved too, segments have headers, and a block the one-token rule "
            f"or an eviction kept from hitting is saved again. Every request after the first hits the trace's "
            f"first hash id (512 tokens every request shares), so the table counts requests with at least half of the prompt hit.")


def live_section(live: dict, hit_fraction: float) -> str:
    t = live["ttft"]
    rows = [[name, t[name]["requests"], f"{t[name]['prompt_tokens_mean']:,.0f}", _s(t[name]["p50_s"]),
             _s(t[name]["p90_s"]), _s(t[name]["p99_s"])] for name in ("hit", "miss", "all")]
    table = report.markdown_table(["requests", "count", "mean prompt tokens", "TTFT p50 (s)", "p90 (s)", "p99 (s)"],
                                  rows)
    tp = live["throughput"]
    errors = f"**{live['errors']} errors**" + (f" ({'; '.join(live['error_examples'])})" if live["errors"] else "")
    return (f"Live slice: the first {live['sessions']} sessions of >= {live['min_turns']} requests (chosen for "
            f"multi-turn reuse: not the trace's mix), all their turns ({live['requests']} requests), each hash "
            f"id {live['hash_tokens']} tokens (lengths / {live['scale']}), answers capped at {live['max_output']} "
            f"tokens, arrivals {live['time_scale']:g}x faster ({live['arrival_span_s']:.0f} s; load average "
            f"{live['load_average_at_start']:.1f} on the machine's 2 cores at the start: shared), streaming "
            f"/v1/completions with token-id prompts to a fresh stack (preset `{live['preset']}`, 1 engine, "
            f"unbounded volumes). {errors}. Hit ratio **{live['hit_ratio']:.1%}**. The index model predicts "
            f"{live['predicted_hit_ratio']:.1%} if every save landed before the next arrival, and "
            f"{live['timed_predicted_hit_ratio']:.1%} with each save landing when this run's request got its "
            f"first token (prompt blocks) or ended (answer blocks): "
            f"{live['requests_matching_timed_prediction']} of {live['requests'] - live['errors']} requests hit "
            f"exactly the tokens it predicts. Throughput over {live['wall_s']:.0f} s: "
            f"{tp['requests_per_s']:.2f} req/s, {tp['prompt_tokens_per_s']:,.0f} prompt tok/s, "
            f"{tp['completion_tokens_per_s']:.1f} answer tok/s. A request counts as a hit when >= "
            f"{hit_fraction:.0%} of its prompt came from the cache.\n\n{table}")


def assessment(result: dict) -> str:
    """Where DeepInfer stands against the trace's ceiling, with this run's numbers."""
    index = result["index"]
    ceiling = index["ceiling"]["hit_ratio"]
    by_label = {r["label"]: r for r in index["capacity"]}
    unbounded = by_label.get("unbounded")
    bounded = [r for r in index["capacity"] if r["capacity_tokens"] is not None]
    v3_row = index["capacity"][0]["bytes"]["deepseek-v3"]["read_bytes_per_hit_token"]
    lines = ["**Where DeepInfer stands.**"]
    if unbounded:
        lines.append(f"With room for everything, DeepInfer's rules reach {unbounded['hit_ratio']:.2%} of prompt "
                     f"tokens against the trace's ceiling of {ceiling:.2%} ({unbounded['hit_tokens']:,} vs "
                     f"{index['ceiling']['hit_tokens']:,} tokens): the only losses are the token always left to "
                     f"prefill and partial last blocks, so 64-token blocks and the lookup rules cost next to "
                     f"nothing. It needs {unbounded['live_blocks'] * 64 / 1e6:,.0f}M tokens of latents "
                     f"for the hour ({unbounded['live_blocks'] * 64 * v3_row / 1e12:,.1f} TB at DeepSeek-V3's "
                     f"{v3_row:,} B per token) and reads "
                     f"{unbounded['bytes']['deepseek-v3']['read_GBps_avg']:.2f} GB/s on average for V3.")
    if bounded:
        lines.append("Capacity is what decides: " + ", ".join(
            f"{r['label']} tokens keep {r['hit_ratio']:.1%} ({r['hit_ratio'] / ceiling:.0%} of the ceiling)"
            for r in bounded) + ". Eviction works on whole segments by last hit, per volume; a segment "
                               "evicted from the middle of a chain cuts off the segments after it (a lookup "
                               "stops at the first gap), but the prompt tokens still stored behind such a gap "
                               "are few (" + ", ".join(
            f"{r['stranded_tokens'] / r['input_tokens']:.1%} at {r['label']}" for r in bounded) + " of prompt "
            "tokens), so the gap to the ceiling is capacity itself: the trace's reuse reaches back further "
            "than a small store remembers.")
    if bounded:
        small = bounded[0]["bytes"]["deepseek-v3"]
        lines.append(f"Writes outweigh reads at every capacity: at {bounded[0]['label']} tokens a V3 store would "
                     f"write {small['bytes_written'] / 1e12:,.1f} TB in the hour to serve "
                     f"{small['bytes_read'] / 1e12:,.2f} TB of hits ({small['written_GBps_avg']:.1f} GB/s of "
                     f"writes on average), because every missed block is saved, while {1 - ceiling:.0%} of prompt "
                     f"tokens are never seen again and, at small capacities, most of the rest is evicted before "
                     f"its reuse. An admission rule (say, save a block only when it is seen a second time) might cut "
                     f"that; it is not measured here and not what DeepInfer does today.")
    lines.append("What this replay cannot see, both of which would raise DeepInfer's real hit ratio above "
                 "these numbers (and the ceiling with it): answer tokens have no hash ids in the trace, so a next "
                 "turn's copy of the previous answer is a miss here, although DeepInfer saves answer blocks and "
                 "would hit them if the next prompt repeats the answer tokens exactly; and the trace's ids are "
                 "512-token blocks, so where a new id begins with tokens an earlier request had (the previous "
                 "turn's partial last block, continued), DeepInfer's 64-token blocks would hit up to 448 of them "
                 "and the trace cannot show it. Saves are assumed to land before the next request arrives; "
                 "retention TTLs (chat: 7 days) never expire within the hour.")
    if "live" in result:
        live = result["live"]
        lines.append(f"The live slice checks the index model end to end: given when each save really "
                     f"started, it predicts {live['requests_matching_timed_prediction']} of "
                     f"{live['requests'] - live['errors']} live requests' hit tokens exactly; the gap to the "
                     f"unloaded prediction ({live['predicted_hit_ratio']:.1%} vs {live['hit_ratio']:.1%} live) is "
                     f"later turns arriving while an earlier turn of theirs is still queued or running, which a "
                     f"slow engine makes more likely. Its TTFTs are the `{live['preset']}` model on this "
                     f"shared CPU, including queueing behind the opening burst and first-time compilation of new "
                     f"prompt shapes: a functional check, not a speed claim.")
    return " ".join(lines)


def write_report(result: dict, hit_fraction: float) -> None:
    index = result["index"]
    plot_hit_ratio(index)
    parts = [f"Command: `{result['command']}`", f"Machine: {result['machine']}.", index_section(index),
             f"![trace hit ratio](bench/results/{HIT_PLOT.name})"]
    if "live" in result:
        plot_ttft(result["live"], hit_fraction)
        parts += [live_section(result["live"], hit_fraction), f"![trace TTFT](bench/results/{TTFT_PLOT.name})"]
    parts.append(assessment(result))
    report.update_section(TITLE, "\n\n".join(parts))
