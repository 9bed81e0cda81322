"""trace_bench's plots (bench/results/trace_*.png) and its BENCHMARKS.md sections (index, admission, live)."""
from __future__ import annotations

import math

from bench import report

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


def index_table(index: dict) -> str:
    rows = []
    for r in index["capacity"]:
        b = r["bytes"]
        rows.append([r["label"], f"{r['hit_ratio']:.1%}", f"{r['hit_ratio'] / index['ceiling']['hit_ratio']:.0%}",
                     f"{r['mostly_hit_requests']:,}", f"{r['stranded_tokens'] / r['input_tokens']:.1%}",
                     f"{r['evictions']:,}",
                     f"{_gb(b['mini']['bytes_read'])} / {_gb(b['mini']['bytes_written'])}",
                     f"{_gb(b['deepseek-v3']['bytes_read'])} / {_gb(b['deepseek-v3']['bytes_written'])}",
                     f"{b['deepseek-v3']['read_GBps_avg']:.2f} / {b['deepseek-v3']['written_GBps_avg']:.2f}"])
    return report.markdown_table(
        ["capacity (tokens)", "hit ratio", "of ceiling", ">= 50% hit", "behind a gap", "evicted",
         "mini GB read / written", "V3 GB read / written", "V3 GB/s read / write"], rows)


def index_notes(index: dict) -> list[str]:
    mini, v3 = (index["capacity"][0]["bytes"][g] for g in ("mini", "deepseek-v3"))
    notes = [f"whole trace: {index['requests']:,} requests, {index['input_tokens'] / 1e6:,.1f}M prompt tokens, "
             f"{index['output_tokens'] / 1e6:,.1f}M answer tokens over {index['trace_seconds'] / 60:.0f} min; "
             f"ceiling (every prompt token of a hash id seen before) {index['ceiling']['hit_ratio']:.1%}; capacity "
             f"split over {index['volumes']} volumes, sized with the {index['sizing_geometry']} geometry",
             f"a hit token reads {mini['read_bytes_per_hit_token']:,} B (mini) or {v3['read_bytes_per_hit_token']:,} B "
             f"(deepseek-v3); a missed token writes {v3['written_bytes_per_miss_token'] / 1e3:,.0f} kB for V3 at the "
             f"smallest capacity ({mini['written_bytes_per_miss_token'] / 1e3:,.1f} kB for mini)"]
    unbounded = next((r for r in index["capacity"] if r["capacity_tokens"] is None), None)
    if unbounded:
        notes.append(f"unbounded: {unbounded['hit_tokens']:,} hit tokens against the ceiling's "
                     f"{index['ceiling']['hit_tokens']:,}, in {unbounded['live_blocks'] * 64 / 1e6:,.0f}M tokens "
                     "of latents")
    return notes


def live_table(live: dict) -> str:
    t = live["ttft"]
    rows = [[name, t[name]["requests"], f"{t[name]['prompt_tokens_mean']:,.0f}", _s(t[name]["p50_s"]),
             _s(t[name]["p90_s"]), _s(t[name]["p99_s"])] for name in ("hit", "miss", "all")]
    return report.markdown_table(["requests", "count", "mean prompt tokens", "TTFT p50 (s)", "p90 (s)", "p99 (s)"],
                                 rows)


def live_notes(live: dict, hit_fraction: float) -> list[str]:
    tp = live["throughput"]
    errors = f"{live['errors']} errors" + (f" ({'; '.join(live['error_examples'])})" if live["errors"] else "")
    return [f"the first {live['sessions']} sessions of >= {live['min_turns']} requests, all their turns "
            f"({live['requests']} requests), a hash id = {live['hash_tokens']} tokens, answers capped at "
            f"{live['max_output']} tokens, arrivals {live['time_scale']:g}x faster ({live['arrival_span_s']:.0f} s), "
            f"preset `{live['preset']}`, one engine; a hit has >= {hit_fraction:.0%} of its prompt cached",
            f"hit ratio {live['hit_ratio']:.1%}; the index model predicts {live['predicted_hit_ratio']:.1%} unloaded, "
            f"{live['timed_predicted_hit_ratio']:.1%} with this run's save times, exact for "
            f"{live['requests_matching_timed_prediction']} of {live['requests'] - live['errors']} requests; {errors}",
            f"throughput over {live['wall_s']:.0f} s: {tp['requests_per_s']:.2f} req/s, "
            f"{tp['prompt_tokens_per_s']:,.0f} prompt tok/s, {tp['completion_tokens_per_s']:.1f} answer tok/s"]


ADMISSION_PLOT = report.RESULTS / "trace_admission.png"


def admission_table(admission: dict) -> str:
    """A row per workload and capacity; each cell lists the values for N = the run's --admit-after values."""
    rows, ns = [], sorted({r["admit_after"] for w in admission["workloads"] for r in w["rows"]})
    for w in admission["workloads"]:
        for label in dict.fromkeys(r["label"] for r in w["rows"]):
            by_n = {r["admit_after"]: r for r in w["rows"] if r["label"] == label}
            first = by_n[1]
            rows.append([w["name"], label, " / ".join(f"{by_n[n]['hit_ratio']:.1%}" for n in ns),
                         " / ".join(f"{by_n[n]['hit_tokens'] / 1e6:,.1f}M" for n in ns),
                         " / ".join(_gb(by_n[n]["bytes_written"]) for n in ns),
                         " / ".join(f"{by_n[n]['bytes_written'] / first['bytes_written']:.2f}" for n in ns)])
    each = " / ".join(map(str, ns))
    return report.markdown_table(["workload", "capacity (tokens)", f"hit ratio, N = {each}", "hit tokens",
                                  f"{admission['geometry']} GB written", "writes vs N = 1"], rows)


def admission_notes(admission: dict) -> list[str]:
    sizes = "; ".join(f"{w['name']}: {w['requests']:,} requests, {w['input_tokens'] / 1e6:,.1f}M prompt tokens, "
                      f"ceiling {w['ceiling_hit_ratio']:.1%}" for w in admission["workloads"])
    return [sizes, f"suggested --admit-after: {admission['default']} (within 1 point of N = 1's hit ratio on every row, "
                   "fewest bytes written); the replay has no memory tier: an engine serves a block's early sightings "
                   "from memory while it still holds them"]


def plot_admission(admission: dict) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(admission["workloads"]), figsize=(11, 4.2))
    for ax, w in zip(axes, admission["workloads"]):
        for label in dict.fromkeys(r["label"] for r in w["rows"]):
            rows = [r for r in w["rows"] if r["label"] == label]
            ax.plot([r["bytes_written"] / 1e9 for r in rows], [100 * r["hit_ratio"] for r in rows], "o-",
                    label=f"capacity {label}")
            for r in rows:
                ax.annotate(f"N={r['admit_after']}", (r["bytes_written"] / 1e9, 100 * r["hit_ratio"]),
                            textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(f"GB written ({admission['geometry']} geometry)")
        ax.set_ylabel("prompt tokens served from disk (%)")
        ax.set_title(w["name"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    report.save_figure(fig, ADMISSION_PLOT)


def write_report(result: dict, hit_fraction: float) -> None:
    """Two sections, one table each: the whole trace at the index level, and the live slice."""
    index = result["index"]
    plot_hit_ratio(index)
    report.section("Trace replay: hit ratio against capacity (trace_bench)", result["command"], result["machine"],
                   index_table(index), HIT_PLOT.name, index_notes(index))
    if "admission" in result:
        plot_admission(result["admission"])
        report.section("Trace replay: admission to disk (trace_bench)", result["command"], result["machine"],
                       admission_table(result["admission"]), ADMISSION_PLOT.name, admission_notes(result["admission"]))
    if "live" in result:
        plot_ttft(result["live"], hit_fraction)
        report.section("Trace replay: a live slice through a stack (trace_bench)", result["command"],
                       result["machine"], live_table(result["live"]), TTFT_PLOT.name,
                       live_notes(result["live"], hit_fraction))
