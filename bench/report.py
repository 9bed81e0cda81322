"""What every benchmark writes: its JSON under bench/out/, its PNGs under bench/results/, and its sections of
BENCHMARKS.md in one format (`section`), through one command-line tail (`main`)."""
from __future__ import annotations

import argparse
import json
import textwrap
import os
import platform
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "bench" / "out"
BENCHMARKS = ROOT / "BENCHMARKS.md"
NOTE_WIDTH = 116  # a section's notes are wrapped: BENCHMARKS.md keeps lines outside code under 160 characters
# The CPU kernels' paths differ by kind of CPU (model.cpu_kernels.cpu_kind): benchmarks of them report each kind
# in its own section of BENCHMARKS.md and its own plot, so one machine's rows never overwrite another's.
CPU_SECTIONS = {"amx": "", "avx512": ", a CPU without AMX", "avx2": ", a CPU with AVX2 alone",
                "portable": ", a CPU without AVX2"}
CPU_FIGURES = {"amx": "", "avx512": "_no_amx", "avx2": "_avx2", "portable": "_portable"}


def cpu_kind(result: dict) -> str:
    """The kind of CPU a result was measured on (its "cpu_kind"; older results say only whether AMX)."""
    return result.get("cpu_kind") or ("amx" if result.get("amx", True) else "avx512")


def machine() -> str:
    """CPU model, cores, RAM and the load average now: called as a run starts, it is that run's machine line."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    try:
        mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem_kib = 0
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem_kib / 2**20:.0f} GiB RAM; "
            f"load average {load} (1/5/15 min) at the start")


def write_json(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def section_body(command: str, machine: str, table: str, figure: str | None = None, notes: Iterable[str] = ()) -> str:
    """The body of a benchmark's section: the command (in backticks, ending in a hard line break; a shell block when
    long), a "Machine:" line, ONE table, the figure (a file name under bench/results/), then notes computed from the
    run's own numbers, one bullet each, wrapped."""
    shown = f"`{command}`\\\n" if len(command) < NOTE_WIDTH else f"```sh\n{command}\n```\n\n"
    parts = [f"{shown}Machine: {machine}", table.strip()]
    if figure:
        parts.append(f"![{Path(figure).stem}](bench/results/{figure})")
    notes = [textwrap.fill(note, NOTE_WIDTH, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False,
                           break_long_words=False) for note in notes]
    if notes:
        parts.append("\n".join(notes))
    return "\n\n".join(parts)


def section(title: str, command: str, machine: str, table: str, figure: str | None = None,
            notes: Iterable[str] = ()) -> None:
    """Writes `## title` of BENCHMARKS.md in the one format every benchmark uses (`section_body`)."""
    update_section(title, section_body(command, machine, table, figure, notes))


def update_section(title: str, body: str, path: Path | None = None) -> None:
    """Replaces (or appends) the `## {title}` section of BENCHMARKS.md, leaving the others alone."""
    path = path or BENCHMARKS
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text)


def command_line(command: str, argv: list[str] | None) -> str:
    """The command a run was started with: `command` and its arguments (argv, or this process's), less the flags
    that only choose what is written (--no-report, --report-from, --name)."""
    given = list(argv if argv is not None else sys.argv[1:])
    shown, skip = [], False
    for arg in given:
        if skip:
            skip = False
        elif arg in ("--report-from", "--name"):
            skip = True
        elif arg != "--no-report" and not arg.startswith(("--report-from=", "--name=")):
            shown.append(arg)
    return " ".join([command, *shown])


def save_figure(fig, filename: str | Path, dpi: int = 110) -> str:
    """Writes a finished matplotlib figure under bench/results (or at `filename` where it is an absolute path) and
    closes it; returns the file name."""
    import matplotlib.pyplot as plt

    path = RESULTS / filename
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path.name


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def main(parser: argparse.ArgumentParser, measure: Callable[[argparse.Namespace], dict],
         write: Callable[[dict], None], *, name: str, command: str, argv: list[str] | None = None,
         shown: str = "", done: Callable[[dict], int] | None = None) -> int:
    """The command-line tail every benchmark shares. Adds --name, --no-report and --report-from to `parser`; runs
    `measure(args)` (the machine line taken before it starts), writes bench/out/<name>.json with "command",
    "machine" and "name" added, then `write(result)` (its sections and PNGs) unless --no-report; --report-from
    FILE re-renders an earlier run's JSON, measuring nothing. `shown`: the command to report, where a wrapper
    (bench.llama_peer) started this one. `done(result)`: prints a summary and returns the exit status (0)."""
    parser.add_argument("--name", default=name, help=f"JSON name under bench/out/ (default {name})")
    parser.add_argument("--no-report", action="store_true", help="write the JSON only: no BENCHMARKS.md, no PNGs")
    parser.add_argument("--report-from", default="", help="re-render the report from this JSON; measures nothing")
    args = parser.parse_args(argv)
    if args.report_from:
        result = json.loads(Path(args.report_from).read_text())
    else:
        started = machine()
        measured = measure(args)
        result = {"command": shown or command_line(command, argv), "machine": started, "name": args.name, **measured}
        path = write_json(args.name, result)
        print(f"wrote {path}", file=sys.stderr)
    if not args.no_report:
        write(result)
    return done(result) if done is not None else 0
