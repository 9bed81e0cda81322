"""ttft_bench's PNGs: TTFT vs prompt length, hit speed-up vs length, where a hit's time goes."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(summary: list[dict], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(lengths, medians, lows, highs) of summary rows that have `key` ({median, min, max})."""
    rows = [r for r in summary if r.get(key)]
    return ([r["tokens"] for r in rows], [r[key]["median"] for r in rows], [r[key]["min"] for r in rows],
            [r[key]["max"] for r in rows])


def _line(ax, summary, key, label, style):
    x, mid, lo, hi = _series(summary, key)
    if x:
        ax.errorbar(x, mid, yerr=[np.subtract(mid, lo), np.subtract(hi, mid)], fmt=style, label=label, capsize=3)


def ttft_vs_length(summary: list[dict], path: Path, title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _line(ax, summary, "miss", "DeepInfer miss", "o-")
    _line(ax, summary, "first_hit", "DeepInfer hit, fresh stack's first request", "v-")
    _line(ax, summary, "cold_hit", "DeepInfer hit, fresh stack, cold page cache", "s-")
    _line(ax, summary, "warm_hit", "DeepInfer disk hit, warm page cache", "^-")
    _line(ax, summary, "memory_hit", "DeepInfer hit, engine memory tier", "d-")
    x = [r["tokens"] for r in summary]
    ax.plot(x, [r["in_process_s"] for r in summary], "k--", label="in-process bound max(load@raw, our compute)")
    ax.plot(x, [r["physical_device_s"] for r in summary], "k:", label="physical bound, prefix on disk")
    ax.plot(x, [r["physical_ram_s"] for r in summary], color="grey", ls=":", label="physical bound, prefix in RAM")
    _line(ax, summary, "hf_miss", "transformers miss", "o:")
    _line(ax, summary, "hf_cold_hit", "transformers hit (torch.load, cold)", "s:")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{t // 1024}K" if t >= 1024 else str(t) for t in x])
    ax.set_xlabel("prompt tokens (64 of them a new suffix)")
    ax.set_ylabel("time to first token, s (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hit_speedup(summary: list[dict], path: Path, title: str, goal: float) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["tokens"] for r in summary]
    for kind, label, style in (("first_hit", "DeepInfer miss / fresh stack's first hit", "v-"),
                               ("cold_hit", "DeepInfer miss / cold hit (fresh stack)", "s-"),
                               ("warm_hit", "DeepInfer miss / warm disk hit", "^-"),
                               ("memory_hit", "DeepInfer miss / memory hit", "d-")):
        pts = [(r["tokens"], r["ratios"][kind]["speedup"]) for r in summary if kind in r["ratios"]]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    pts = [(r["tokens"], r["hf_speedup"]) for r in summary if r.get("hf_speedup")]
    if pts:
        ax.plot(*zip(*pts), "o:", label="transformers miss / cold hit")
    ax.axhline(goal, color="red", lw=0.8, ls="--", label=f"goal {goal:g}x")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{t // 1024}K" if t >= 1024 else str(t) for t in x])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("miss TTFT / hit TTFT (x)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


BREAKDOWN = (("client_s", "client + SSE"), ("gateway_s", "gateway + HTTP (parse, hash, lookup, route)"),
             ("compute_s", "engine compute (incl. placing latents)"), ("stall_s", "engine stall on disk"))


def hit_breakdown(summary: list[dict], path: Path, title: str) -> None:
    """Stacked medians per length, one bar per hit kind; markers: each bar's physical and in-process bound."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.8))
    kinds = [k for k in ("first_hit", "cold_hit", "warm_hit", "memory_hit")
             if any(r["breakdown"].get(k) for r in summary)]
    width = 0.8 / len(kinds)
    x = np.arange(len(summary))
    colors = ("#bbbbbb", "#8fb3de", "#4c72b0", "#dd8452")
    for i, kind in enumerate(kinds):
        offset = (i - (len(kinds) - 1) / 2) * width
        bottom = np.zeros(len(summary))
        for (key, label), color in zip(BREAKDOWN, colors):
            values = np.array([(r["breakdown"][kind] or {}).get(key) or 0.0 for r in summary])
            ax.bar(x + offset, values, width * 0.95, bottom=bottom, color=color, edgecolor="white",
                   label=label if i == 0 else None)
            bottom += values
        ax.plot(x + offset, [r["ratios"][kind]["physical_s"] if kind in r["ratios"] else np.nan for r in summary],
                "kv", label="physical bound" if i == 0 else None)
        ax.plot(x + offset, [r["in_process_s"] for r in summary], "k*", label="in-process bound" if i == 0 else None)
    short = {"first_hit": "first", "cold_hit": "cold", "warm_hit": "warm", "memory_hit": "mem"}
    ax.set_xticks(x, [(f"{r['tokens'] // 1024}K" if r["tokens"] >= 1024 else str(r["tokens"]))
                      + "\n" + " | ".join(short[k] for k in kinds) for r in summary])
    ax.set_ylabel("seconds (medians)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
