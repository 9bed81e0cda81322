"""Writes benchmark results: JSON under bench/out/, PNG plots under bench/results/, a section of BENCHMARKS.md."""
from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "bench" / "out"
BENCHMARKS = ROOT / "BENCHMARKS.md"
# The CPU kernels' paths differ by kind of CPU (model.cpu_kernels.cpu_kind): benchmarks of them report each kind
# in its own section of BENCHMARKS.md and its own plot, so one machine's rows never overwrite another's.
CPU_SECTIONS = {"amx": "", "avx512": ", a CPU without AMX", "avx2": ", a CPU with AVX2 alone",
                "portable": ", a CPU without AVX2"}
CPU_FIGURES = {"amx": "", "avx512": "_no_amx", "avx2": "_avx2", "portable": "_portable"}


def cpu_kind(result: dict) -> str:
    """The kind of CPU a result was measured on (its "cpu_kind"; older results say only whether AMX)."""
    return result.get("cpu_kind") or ("amx" if result.get("amx", True) else "avx512")


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    mem_kib = next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return f"{cpu}, {cores} cores, {mem_kib / 2**20:.0f} GiB RAM, Python {platform.python_version()}"


def write_json(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def update_section(title: str, body: str) -> None:
    """Replaces (or appends) the `## {title}` section of BENCHMARKS.md, leaving the others alone."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    BENCHMARKS.write_text(text)


def command_line(command: str, argv: list[str] | None) -> str:
    """The command a run was started with: `command` and its arguments (argv, or this process's)."""
    return " ".join([command, *(argv if argv is not None else sys.argv[1:])])


def save_figure(fig, filename: str, dpi: int = 110) -> str:
    """Writes a finished matplotlib figure under bench/results and closes it; returns the file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / filename, dpi=dpi)
    plt.close(fig)
    return filename
