"""ttft_bench's results: the per-length summary (medians, spreads, bounds, ratios), its one table, notes computed
from it, and its figure (TTFT vs prompt length, hit speed-up, where a hit's time goes)."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from bench import report

TITLE = "TTFT: miss and hits through the gateway (ttft_bench)"
GOAL_SPEEDUP_16K = 26.0
GOAL_BOUND_RATIO = 1.25  # memory and disk hits within 1.25x of their physical lower bound
HITS = ("first_hit", "cold_hit", "warm_hit", "memory_hit")
HIT_NAMES = {"first_hit": "first hit (fresh stack)", "cold_hit": "cold hit (fresh stack)",
             "warm_hit": "warm disk hit", "memory_hit": "memory hit"}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Where each hit's prefix bytes come from, for its physical bound: the device, or RAM (page cache, pool).
FROM_DEVICE = {"first_hit": True, "cold_hit": True, "warm_hit": False, "memory_hit": False}


def spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict | None, digits: int = 2) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _breakdown(hits: list[dict]) -> dict | None:
    """Medians of a hit's parts: client = client - gateway TTFT; gateway = gateway - engine TTFT;
    compute = engine TTFT - stall; stall; the engine's CPU seconds."""
    if not hits:
        return None

    def med(f):
        values = [f(h) for h in hits]
        return statistics.median(values) if None not in values else None
    return {"client_s": med(lambda h: h["client_ttft_s"] - h["gateway_ttft_s"]),
            "gateway_s": med(lambda h: h["gateway_ttft_s"] - h["engine_ttft_s"]),
            "compute_s": med(lambda h: h["engine_ttft_s"] - h["stall_s"]),
            "stall_s": med(lambda h: h["stall_s"]),
            "engine_ttft_s": med(lambda h: h["engine_ttft_s"]),
            "engine_cpu_s": med(lambda h: h.get("engine_cpu_s"))}


def summarize(result: dict) -> list[dict]:
    raw_gbps, memcpy_gbps = result["raw_device"]["gbps"], result["memcpy_gbps"]
    peak = max(result["matmul_peak"]["float32_gflops"], result["matmul_peak"]["bfloat16_gflops"])
    cfg = result["model_config"]
    token_bytes = (cfg["num_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
                   * DTYPE_BYTES[cfg["cache_dtype"]])  # one latent per layer
    rows = []
    for n in result["lengths"]:
        if str(n) not in result.get("requests", {}):
            continue  # a run cut short
        req, comp, diy = result["requests"][str(n)], result["suffix_compute"][str(n)], result["transformers"][str(n)]
        flops = result["suffix_flops"][str(n)]
        prefix_bytes = comp["prefix_tokens"] * token_bytes
        row = {"tokens": n, "prefix_tokens": comp["prefix_tokens"], "prefix_bytes": prefix_bytes,
               "loaded_bytes": statistics.median(h["loaded_bytes"] for h in req["cold_hit"]),
               "miss": spread([r["client_ttft_s"] for r in req["miss"]]),
               **{kind: spread([r["client_ttft_s"] for r in req.get(kind, [])]) for kind in HITS},
               "restart": {part: spread([r[part] for r in req.get("restarts", [])])
                           for part in ("stop_s", "start_s", "reconcile_s")},
               "compute": spread(comp["compute_s"]), "placed": spread(comp["placed_s"]),
               "compute_cpu": spread(comp.get("compute_cpu_s") or []),
               "miss_cpu": spread([r.get("engine_cpu_s") for r in req["miss"]]),
               "flops_absorbed": flops["absorbed"], "flops_expanded": flops["expanded"],
               "flops": min(flops["absorbed"], flops["expanded"]),
               "flops_form": "absorbed" if flops["absorbed"] <= flops["expanded"] else "expanded",
               "load_at_raw_s": prefix_bytes / (raw_gbps * 1e9),
               "load_at_memcpy_s": prefix_bytes / (memcpy_gbps * 1e9),
               "breakdown": {kind: _breakdown(req.get(kind, [])) for kind in HITS},
               "engine_peak_rss_bytes": req.get("engine_peak_rss_bytes"),
               "fallbacks": sum(h["fallbacks"] for kind in HITS for h in req.get(kind, []))}
        row["compute_at_peak_s"] = row["flops"] / (peak * 1e9)
        row["physical_device_s"] = max(row["load_at_raw_s"], row["compute_at_peak_s"])
        row["physical_ram_s"] = max(row["load_at_memcpy_s"], row["compute_at_peak_s"])
        row["in_process_s"] = max(row["load_at_raw_s"], row["compute"]["median"])
        row["ratios"] = {}
        for kind in HITS:
            if row[kind]:
                ttft = row[kind]["median"]
                physical = row["physical_device_s"] if FROM_DEVICE[kind] else row["physical_ram_s"]
                row["ratios"][kind] = {"physical_s": physical, "vs_physical": ttft / physical,
                                       "vs_in_process": ttft / row["in_process_s"],
                                       "speedup": row["miss"]["median"] / ttft}
        reps = diy.get("repeats") or []
        row["hf_skipped"] = diy.get("skipped")
        if reps:
            row["hf_miss"] = spread([r["miss_s"] for r in reps])
            row["hf_cold_hit"] = spread([r["cold_hit_s"] for r in reps])
            row["hf_warm_hit"] = spread([r["warm_hit_s"] for r in reps])
            row["hf_cache_file_bytes"] = reps[0]["cache_file_bytes"]
            row["hf_speedup"] = row["hf_miss"]["median"] / row["hf_cold_hit"]["median"]
        rows.append(row)
    return rows


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _s(spread_: dict | None) -> str:
    return "-" if not spread_ else f"{spread_['median']:.3f}"


def table(result: dict) -> str:
    """One row per prompt length: medians of the miss and each hit, the bounds, the transformers baseline."""
    rows = []
    for r in result["summary"]:
        hf = "-" if r["hf_skipped"] else f"{_s(r.get('hf_miss'))} / {_s(r.get('hf_cold_hit'))}"
        rows.append([_k(r["tokens"]), _s(r["miss"]), *(_s(r[kind]) for kind in HITS),
                     f"{r['ratios']['cold_hit']['speedup']:.1f}x" if "cold_hit" in r["ratios"] else "-",
                     f"{r['physical_device_s']:.3f} / {r['physical_ram_s']:.3f}", f"{r['in_process_s']:.3f}", hf])
    return report.markdown_table(
        ["prompt", "miss s", "first hit s", "cold hit s", "warm hit s", "memory hit s", "miss / cold hit",
         "bound s (disk / RAM)", "in-process s", "transformers miss / hit s"], rows)


def goals(result: dict) -> list[str]:
    """The goals, with the numbers this run measured: one line for the hits against their bounds at every length."""
    parts, met, extra = [], True, []
    for r in result["summary"]:
        x = r["ratios"]
        within = [kind for kind in ("memory_hit", "cold_hit", "warm_hit") if kind in x]
        met = met and all(x[kind]["vs_physical"] <= GOAL_BOUND_RATIO for kind in within)
        parts.append(f"{_k(r['tokens'])} " + ", ".join(f"{HIT_NAMES[kind]} {x[kind]['vs_physical']:.2f}x"
                                                        for kind in within))
        if r["tokens"] == 16384 and "cold_hit" in x:
            extra.append(f"16K miss / cold hit {x['cold_hit']['speedup']:.1f}x (goal >= {GOAL_SPEEDUP_16K:g}x: "
                         f"{'met' if x['cold_hit']['speedup'] >= GOAL_SPEEDUP_16K else 'not met'})")
    line = (f"TTFT / physical bound: {'; '.join(parts)} (goal <= {GOAL_BOUND_RATIO:g}x: {'met' if met else 'not met'})")
    return [line, *extra] if parts else extra


def notes(result: dict) -> list[str]:
    """A few lines, each computed from this run: goals, what was not cold, restarts, cut-short hits."""
    s = result["summary"]
    lines = goals(result)
    spreads = [r[k]["max"] / r[k]["min"] for r in s for k in ("miss", *HITS) if r.get(k) and r[k]["min"] > 0]
    lines.append(f"medians of {result['repeats']} repeats; the widest spread (max / min) of a cell: "
                 + (f"{max(spreads):.2f}x" if spreads else "-")
                 + ("" if result["cold_is_cold"] else "; the page cache was not dropped (cold = warm)"))
    restarts = [r["restart"]["start_s"]["median"] for r in s if r["restart"]["start_s"]]
    if restarts:
        lines.append(f"a fresh stack's start (not in any TTFT): {statistics.median(restarts):.1f} s median")
    cut = [f"{_k(r['tokens'])} {r['fallbacks']:.0f}" for r in s if r["fallbacks"]]
    if cut:
        lines.append("hits the engine cut short and recomputed: " + ", ".join(cut))
    return lines


def write(result: dict) -> None:
    result["summary"] = summarize(result)  # a run cut short (its _partial JSON, --report-from) has none yet
    figure = plot(result, f"{result.get('name', 'ttft_bench')}.png")
    report.section(TITLE, result["command"], result["machine"], table(result), figure, notes(result))


# -- the figure --

def _line(ax, summary: list[dict], key: str, label: str, style: str) -> None:
    rows = [r for r in summary if r.get(key)]
    if rows:
        mid = [r[key]["median"] for r in rows]
        low, high = np.subtract(mid, [r[key]["min"] for r in rows]), np.subtract([r[key]["max"] for r in rows], mid)
        ax.errorbar([r["tokens"] for r in rows], mid, yerr=[low, high], fmt=style, label=label, capsize=3)


def _lengths_axis(ax, summary: list[dict]) -> list[int]:
    x = [r["tokens"] for r in summary]
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [_k(t) for t in x])
    ax.set_xlabel("prompt tokens (the last ones a new suffix)")
    return x


BREAKDOWN = (("client_s", "client + SSE"), ("gateway_s", "gateway + HTTP"),
             ("compute_s", "engine compute (incl. placing latents)"), ("stall_s", "engine stall on disk"))


def plot(result: dict, path: Path | str) -> str:
    """Three panels: TTFT vs prompt length with the bounds and the transformers baseline; miss / hit; where each
    hit's time goes (stacked medians, the bounds marked)."""
    plt = report.pyplot()
    s = result["summary"]
    fig, (length, speedup, parts) = plt.subplots(1, 3, figsize=(21, 5))
    for key, label, style in (("miss", "miss", "o-"), ("first_hit", HIT_NAMES["first_hit"], "v-"),
                              ("cold_hit", HIT_NAMES["cold_hit"], "s-"), ("warm_hit", HIT_NAMES["warm_hit"], "^-"),
                              ("memory_hit", HIT_NAMES["memory_hit"], "d-"), ("hf_miss", "transformers miss", "o:"),
                              ("hf_cold_hit", "transformers hit (torch.load, cold)", "s:")):
        _line(length, s, key, label, style)
    x = _lengths_axis(length, s)
    length.plot(x, [r["in_process_s"] for r in s], "k--", label="in-process bound")
    length.plot(x, [r["physical_device_s"] for r in s], "k:", label="physical bound, prefix on disk")
    length.plot(x, [r["physical_ram_s"] for r in s], color="grey", ls=":", label="physical bound, prefix in RAM")
    length.set_yscale("log")
    length.set_ylabel("time to first token, s (log; median, min-max)")

    for kind, style in zip(HITS, ("v-", "s-", "^-", "d-")):
        points = [(r["tokens"], r["ratios"][kind]["speedup"]) for r in s if kind in r["ratios"]]
        if points:
            speedup.plot(*zip(*points), style, label=f"miss / {HIT_NAMES[kind]}")
    points = [(r["tokens"], r["hf_speedup"]) for r in s if r.get("hf_speedup")]
    if points:
        speedup.plot(*zip(*points), "o:", label="transformers miss / cold hit")
    speedup.axhline(GOAL_SPEEDUP_16K, color="red", lw=0.8, ls="--", label=f"goal {GOAL_SPEEDUP_16K:g}x at 16K")
    _lengths_axis(speedup, s)
    speedup.set_ylabel("miss TTFT / hit TTFT (x)")

    kinds = [k for k in HITS if any(r["breakdown"].get(k) for r in s)]
    width = 0.8 / max(1, len(kinds))
    at = np.arange(len(s))
    for i, kind in enumerate(kinds):
        offset = (i - (len(kinds) - 1) / 2) * width
        bottom = np.zeros(len(s))
        for (key, label), color in zip(BREAKDOWN, ("#bbbbbb", "#8fb3de", "#4c72b0", "#dd8452")):
            values = np.array([(r["breakdown"][kind] or {}).get(key) or 0.0 for r in s])
            parts.bar(at + offset, values, width * 0.95, bottom=bottom, color=color, edgecolor="white",
                      label=label if i == 0 else None)
            bottom += values
        parts.plot(at + offset, [r["ratios"][kind]["physical_s"] if kind in r["ratios"] else np.nan for r in s],
                   "kv", label="physical bound" if i == 0 else None)
        parts.plot(at + offset, [r["in_process_s"] for r in s], "k*", label="in-process bound" if i == 0 else None)
    short = {"first_hit": "first", "cold_hit": "cold", "warm_hit": "warm", "memory_hit": "mem"}
    parts.set_xticks(at, [_k(r["tokens"]) + "\n" + " | ".join(short[k] for k in kinds) for r in s])
    parts.set_ylabel("seconds (medians)")
    title = f"{result['preset']}, {result['suffix']}-token suffix"
    for ax, name in ((length, "TTFT"), (speedup, "hit speed-up"), (parts, "where a hit's time goes")):
        ax.set_title(f"{name}: {title}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return report.save_figure(fig, path)
