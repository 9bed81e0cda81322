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
    _line(ax, summary, "cold_hit", "DeepInfer hit, cold page cache", "s-")
    _line(ax, summary, "warm_hit", "DeepInfer hit, warm page cache", "^-")
    _line(ax, summary, "memory_hit", "DeepInfer hit, engine memory tier", "d-")
    x = [r["tokens"] for r in summary]
    ax.plot(x, [r["lower_bound_s"] for r in summary], "k--", label="hit lower bound max(load@raw, compute)")
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
    for key, label, style in (("speedup_cold", "DeepInfer miss / cold hit", "s-"),
                              ("speedup_warm", "DeepInfer miss / warm hit", "^-"),
                              ("hf_speedup", "transformers miss / cold hit", "o:")):
        pts = [(r["tokens"], r[key]) for r in summary if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
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
    """Stacked medians per length, cold and warm side by side; markers: the two lower-bound terms."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = np.arange(len(summary))
    colors = ("#bbbbbb", "#8fb3de", "#4c72b0", "#dd8452")
    for offset, kind, hatch in ((-0.2, "cold", "//"), (0.2, "warm", "")):
        bottom = np.zeros(len(summary))
        for (key, label), color in zip(BREAKDOWN, colors):
            values = np.array([r["breakdown"][kind][key] for r in summary])
            ax.bar(x + offset, values, 0.38, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                   label=f"{label}" if kind == "cold" else None)
            bottom += values
    ax.plot(x, [r["load_at_raw_s"] for r in summary], "kv", label="prefix bytes / raw device bandwidth")
    ax.plot(x, [r["compute"]["median"] for r in summary], "k*", label="suffix compute, prefix in RAM")
    ax.set_xticks(x, [f"{r['tokens'] // 1024}K\ncold | warm" if r["tokens"] >= 1024 else f"{r['tokens']}\ncold | warm"
                      for r in summary])
    ax.set_ylabel("seconds (medians)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
