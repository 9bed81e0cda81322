"""ttft_bench's results: per-length summary (medians, spreads, ratios), markdown tables, the goals, the
BENCHMARKS.md section and the PNGs."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench import report

SECTION = "TTFT (ttft_bench)"
GOAL_SPEEDUP_16K = 26.0
GOAL_LOWER_BOUND_RATIO = 1.25


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


def _breakdown(hits: list[dict]) -> dict:
    """Medians of a hit's parts: client = client - gateway TTFT; gateway = gateway - engine TTFT;
    compute = engine TTFT - stall; stall."""
    def med(f):
        return statistics.median(f(h) for h in hits)
    return {"client_s": med(lambda h: h["client_ttft_s"] - h["gateway_ttft_s"]),
            "gateway_s": med(lambda h: h["gateway_ttft_s"] - h["engine_ttft_s"]),
            "compute_s": med(lambda h: h["engine_ttft_s"] - h["stall_s"]),
            "stall_s": med(lambda h: h["stall_s"]),
            "engine_ttft_s": med(lambda h: h["engine_ttft_s"])}


def summarize(result: dict) -> list[dict]:
    raw_gbps = result["raw_device"]["gbps"]
    rows = []
    for n in result["lengths"]:
        if str(n) not in result.get("requests", {}):
            continue  # a run cut short
        req, comp, diy = result["requests"][str(n)], result["suffix_compute"][str(n)], result["transformers"][str(n)]
        loaded = statistics.median(h["loaded_bytes"] for h in req["cold_hit"])
        row = {"tokens": n, "prefix_tokens": comp["prefix_tokens"], "loaded_bytes": loaded,
               "miss": spread([r["client_ttft_s"] for r in req["miss"]]),
               "cold_hit": spread([r["client_ttft_s"] for r in req["cold_hit"]]),
               "warm_hit": spread([r["client_ttft_s"] for r in req["warm_hit"]]),
               "memory_hit": spread([r["client_ttft_s"] for r in req.get("memory_hit", [])]),
               "cold_stall": spread([r["stall_s"] for r in req["cold_hit"]]),
               "warm_stall": spread([r["stall_s"] for r in req["warm_hit"]]),
               "compute": spread(comp["compute_s"]), "placed": spread(comp["placed_s"]),
               "compute_cpu": spread(comp.get("compute_cpu_s") or []),
               "miss_cpu": spread([r.get("engine_cpu_s") for r in req["miss"]]),
               "cold_cpu": spread([r.get("engine_cpu_s") for r in req["cold_hit"]]),
               "warm_cpu": spread([r.get("engine_cpu_s") for r in req["warm_hit"]]),
               "load_at_raw_s": loaded / (raw_gbps * 1e9),
               "breakdown": {"cold": _breakdown(req["cold_hit"]), "warm": _breakdown(req["warm_hit"])},
               "engine_peak_rss_bytes": req.get("engine_peak_rss_bytes")}
        row["lower_bound_s"] = max(row["load_at_raw_s"], row["compute"]["median"])
        row["speedup_cold"] = row["miss"]["median"] / row["cold_hit"]["median"]
        row["speedup_warm"] = row["miss"]["median"] / row["warm_hit"]["median"]
        row["cold_vs_bound"] = row["cold_hit"]["median"] / row["lower_bound_s"]
        row["warm_vs_bound"] = row["warm_hit"]["median"] / row["lower_bound_s"]
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


def tables(result: dict) -> str:
    s = result["summary"]
    ours = report.markdown_table(
        ["prompt", "miss s", "cold hit s", "warm hit s", "memory hit s", "miss / cold hit", "lower bound s (load@raw, compute)",
         "cold hit / bound", "warm hit / bound", "stall s cold / warm",
         "engine CPU s miss / cold / warm", "engine VmHWM GiB"],
        [[_k(r["tokens"]), fmt(r["miss"]), fmt(r["cold_hit"]), fmt(r["warm_hit"]), fmt(r["memory_hit"]),
          f"{r['speedup_cold']:.1f}x",
          f"{r['lower_bound_s']:.2f} ({r['load_at_raw_s']:.2f}, {r['compute']['median']:.2f})",
          f"{r['cold_vs_bound']:.2f}x", f"{r['warm_vs_bound']:.2f}x",
          f"{r['cold_stall']['median']:.2f} / {r['warm_stall']['median']:.2f}",
          " / ".join(f"{r[k]['median']:.1f}" if r.get(k) else "-" for k in ("miss_cpu", "cold_cpu", "warm_cpu")),
          f"{r['engine_peak_rss_bytes'] / 2**30:.1f}" if r["engine_peak_rss_bytes"] else "-"] for r in s])
    side = report.markdown_table(
        ["prompt", "DeepInfer miss s", "DeepInfer cold hit s", "transformers miss s", "transformers hit s cold / warm",
         "transformers miss / hit", "prefix cache on disk: ours / transformers MiB"],
        [[_k(r["tokens"]), fmt(r["miss"]), fmt(r["cold_hit"]), fmt(r.get("hf_miss")) if not r["hf_skipped"] else
          f"skipped: {r['hf_skipped']}",
          f"{fmt(r['hf_cold_hit'])} / {fmt(r['hf_warm_hit'])}" if r.get("hf_cold_hit") else "-",
          f"{r['hf_speedup']:.1f}x" if r.get("hf_speedup") else "-",
          f"{r['loaded_bytes'] / 2**20:.0f} / " + (f"{r['hf_cache_file_bytes'] / 2**20:.0f}"
                                                  if r.get("hf_cache_file_bytes") else "-")] for r in s])
    parts = report.markdown_table(
        ["prompt", "hit", "client + SSE s", "gateway + HTTP s", "engine compute s", "engine stall s",
         "in-process, prefix in RAM: compute s (its CPU s) / with placing s"],
        [[_k(r["tokens"]), kind, f"{b['client_s']:.3f}", f"{b['gateway_s']:.3f}", f"{b['compute_s']:.3f}",
          f"{b['stall_s']:.3f}", f"{r['compute']['median']:.3f} ("
          + (f"{r['compute_cpu']['median']:.2f}" if r.get("compute_cpu") else "-")
          + f") / {r['placed']['median']:.3f}"]
         for r in s for kind, b in r["breakdown"].items()])
    return ours + "\n\n" + side + "\n\nWhere a hit's time goes (medians):\n\n" + parts


def goals(result: dict) -> list[str]:
    s = {r["tokens"]: r for r in result["summary"]}
    lines = []
    if 16384 in s:
        r = s[16384]
        lines.append(f"- 16K: hit **{r['speedup_cold']:.1f}x** (cold) / **{r['speedup_warm']:.1f}x** (warm) faster "
                     f"than a miss; goal >= {GOAL_SPEEDUP_16K:g}x: "
                     f"{'met' if r['speedup_cold'] >= GOAL_SPEEDUP_16K else 'NOT met'} (cold)")
    worst = max(result["summary"], key=lambda r: r["cold_vs_bound"])
    cold = ", ".join(f"{_k(r['tokens'])} {r['cold_vs_bound']:.2f}x" for r in result["summary"])
    warm = ", ".join(f"{_k(r['tokens'])} {r['warm_vs_bound']:.2f}x" for r in result["summary"])
    cpu = [(r, r["cold_cpu"]["median"] / r["compute_cpu"]["median"]) for r in result["summary"]
           if r.get("cold_cpu") and r.get("compute_cpu")]
    # Doing the same work, the engine cannot need much less CPU than the in-process bound run did.
    bound_ok = all(x >= 0.8 for _, x in cpu)
    verdict = ("met" if worst["cold_vs_bound"] <= GOAL_LOWER_BOUND_RATIO else "NOT met") + " everywhere (cold)"
    lines.append(f"- hit TTFT / lower bound: cold {cold}; warm {warm}; goal <= {GOAL_LOWER_BOUND_RATIO:g}x: "
                 + (verdict if bound_ok else "not judged: the in-process compute that sets the bound used more CPU "
                    "than the engine's whole hit, so the bound is not one in this run"))
    if cpu:
        lines.append("- CPU-second check (less bent by other work than wall time, not immune to it): engine during a "
                     "cold hit / in-process suffix compute with the prefix in RAM: "
                     + ", ".join(f"{_k(r['tokens'])} {x:.2f}x" for r, x in cpu)
                     + " (1 = the hit costs exactly the suffix compute; loading adds nothing on the CPU)")
    if any(r["cold_vs_bound"] < 1 for r in result["summary"]):
        lines.append("- a ratio to the bound below 1 is not a hit beating physics: the bound's compute term is "
                     "wall time measured in-process minutes earlier, under a different load from other work on "
                     "this shared machine; the CPU-second check above is the steadier comparison "
                     "(where it is below 1 too, the in-process run itself was slower than the engine)")
    return lines


def _fewer_misses(result: dict) -> str:
    fewer = {n: m for n, m in result.get("misses", {}).items() if m < result["repeats"]}
    if not fewer:
        return ""
    return (" (misses: " + ", ".join(f"{m} at {_k(int(n))}" for n, m in fewer.items())
            + " for time; those lengths' hit repeats reuse the missed prefixes, each with a new suffix)")


def write_report(result: dict, command: str) -> None:
    names = {"length": "ttft_vs_length.png", "speedup": "ttft_hit_speedup.png", "breakdown": "ttft_hit_breakdown.png"}
    plot_all(result, report.RESULTS, names)
    raw = result["raw_device"]
    body = "\n".join([
        f"Time to first token through the gateway (client side, streamed, first chunk, `max_tokens` 1), "
        f"preset `{result['preset']}`, {result['engines'] or '?'} engine(s), bf16 latent cache; each prompt is "
        f"L - {result['suffix']} tokens of prefix + a {result['suffix']}-token new suffix, fresh random token ids "
        f"per repeat. Cold hit = page cache dropped first"
        + ("" if result["cold_is_cold"] else " (NOT dropped in this run: cold = warm)") + ". "
        f"Median (min-max) of {result['repeats']} repeats{_fewer_misses(result)}. "
        f"Lower bound = max(prefix bytes / raw device bandwidth ({raw['gbps']:.2f} GB/s, best of dd "
        f"iflag=direct {raw['dd_gbps']:.2f} and 8 parallel O_DIRECT readers {raw['parallel_gbps']:.2f}, "
        "same run, same device), suffix compute with the prefix already in RAM "
        "(in-process ModelRunner, same weights)). transformers = DeepseekV3ForCausalLM, CPU float32 sdpa, "
        + ("the same weights (converted with model/convert.py); " if result["same_weights"] else
           "same shapes, its own random weights; ")
        + "its hit = torch.load of the prefix's DynamicCache + prefill of the suffix.",
        "", "```", command, "```", "",
        tables(result), "",
        *goals(result),
        f"- machine: {result['machine']}; 1-minute load average {result['load_average_start']:.1f} at the start, "
        f"{result.get('load_average_end', float('nan')):.1f} at the end (shared machine); whole run "
        + (f"{result['wall_s'] / 60:.1f} min" if "wall_s" in result else "cut short (partial results)"),
        "- breakdown from metric deltas around each request (the engine's done-event timing is not passed on by "
        "the gateway): gateway + HTTP = gateway TTFT histogram - engine TTFT histogram; compute = engine TTFT - "
        "prefetch stall; client + SSE = client TTFT - gateway TTFT (sending the token-id prompt, SSE framing, "
        "detokenizing). The timed client is plain HTTP, as curl would be: the openai Python client alone spends "
        "~157 ms building a request of 16K token ids, which is not the serving stack's time.",
        *[f"- {note}" for note in result.get("notes", [])],
        "",
        f"![TTFT vs prompt length](bench/results/{names['length']})",
        f"![hit speed-up](bench/results/{names['speedup']})",
        f"![hit breakdown](bench/results/{names['breakdown']})",
    ])
    report.update_section(SECTION, body)


def plot_all(result: dict, directory: Path, names: dict[str, str]) -> list[Path]:
    from bench import ttft_plots
    directory.mkdir(parents=True, exist_ok=True)
    title = f"{result['preset']}, {result['suffix']}-token suffix, medians (min-max)"
    s = result["summary"]
    ttft_plots.ttft_vs_length(s, directory / names["length"], title)
    ttft_plots.hit_speedup(s, directory / names["speedup"], title, GOAL_SPEEDUP_16K)
    ttft_plots.hit_breakdown(s, directory / names["breakdown"], title + ": where a hit's time goes")
    return [directory / name for name in names.values()]


