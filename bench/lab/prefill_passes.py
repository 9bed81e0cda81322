"""prefill_passes: several sequences' prefill segments in one pass (`Runner.prefill` of all of them) against the
same segments computed one by one (`Runner.prefill` of each), in-process, on the engine's bfloat16-served model.

    python -m bench.lab.prefill_passes [--preset mini] [--repeats 5]

Each case is a list of segments (tokens, start: the sequence's earlier tokens are already in its pages).
Both ways run side by side in one process, alternating; every number is the median over --repeats runs.
This is what sets which segments the engine batches (`Runner.batchable`): short ones. Where the cpu backend's
prefill attention kernel reads the pages in place (the engine's default on a CPU with AMX), both ways also run
with the kernel off, over xla's gathered views (each tile's pages gathered into a view per layer).
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from bench import report
from bench.lab.moe_bench import median_seconds
from model.attention import make_backend
from model.config import preset
from model.latent_pool import LatentPool
from model.runner import Runner, Segment
from model.serving import serving_model
from model.weights import init_model

COMMAND = "python -m bench.lab.prefill_passes"
PAGE = 64
CASES = {  # name -> [(segment tokens, start)]
    "8 x 64 at 0": [(64, 0)] * 8,
    "8 x 30..64 at 0..700": [(40, 0), (64, 64), (60, 128), (50, 300), (50, 700), (64, 0), (30, 200), (45, 500)],
    "3 x 100..150 at 100": [(150, 100), (150, 100), (100, 100)],
    "5 x 64 at 1000": [(64, 1000)] * 5,
    "3 x 40..64 at 300": [(40, 300), (64, 300), (50, 300)],
    "2 x 192 at 0": [(192, 0), (192, 0)],
    "1 x 512 at 0": [(512, 0)],
    "2 x 256 at 512": [(256, 512), (256, 512)],
}


def measure(args) -> dict:
    cfg = preset(args.preset)
    model, pool = serving_model(init_model(cfg), "bfloat16"), LatentPool(cfg, 256, PAGE)
    backend = make_backend("auto", cfg, "cpu", "bfloat16", page_tokens=PAGE)
    runner = Runner(model, cfg, pool, backend)
    in_place = getattr(backend, "prefill_kernel", False)
    views = (Runner(model, cfg, pool, make_backend("cpu", cfg, "cpu", "bfloat16", page_tokens=PAGE,
                                                   prefill_kernel=False)) if in_place else None)
    rng = np.random.default_rng(0)
    out = {"preset": args.preset, "machine": report.machine(), "load_average_start": os.getloadavg()[0],
           "backend": backend.name, "in_place": in_place, "cases": {}}
    for name, specs in CASES.items():
        segments, page = [], 1
        for n, start in specs:
            pages = list(range(page, page + -(-(start + n) // PAGE)))
            page += len(pages)
            tokens = rng.integers(0, cfg.vocab_size, start + n)
            if start:
                runner.prefill([Segment(tokens[:start], 0, pages)], want_logits=False).run()
            segments.append(Segment(tokens[start:], start, pages))

        def one_pass(r=runner):
            return r.prefill(segments).run()

        def alone(r=runner):
            return [r.prefill([s]).run() for s in segments]

        tokens = sum(n for n, _ in specs)
        case = {"segments": specs, "tokens": tokens, "pass_s": median_seconds(one_pass, args.repeats),
                "alone_s": median_seconds(alone, args.repeats)}
        if views is not None:
            case |= {"pass_views_s": median_seconds(lambda: one_pass(views), args.repeats),
                     "alone_views_s": median_seconds(lambda: alone(views), args.repeats)}
        out["cases"][name] = case
        print(f"{name}: one pass {case['pass_s'] * 1000:.0f} ms (gathered views "
              f"{case.get('pass_views_s', float('nan')) * 1000:.0f}), one by one {case['alone_s'] * 1000:.0f} ms "
              f"(gathered views {case.get('alone_views_s', float('nan')) * 1000:.0f}); "
              f"{case['alone_s'] / case['pass_s']:.2f}x", flush=True)
    out["load_average_end"] = os.getloadavg()[0]
    return out


def write(result: dict) -> None:
    def views(c: dict, key: str) -> list[str]:  # the gathered-view column and its ratio, where measured
        if key not in c:
            return ["-", "-"]
        return [f"{c[key] * 1000:.0f}", f"{c[key] / c[key.replace('_views', '')]:.2f}x"]

    rows = [[name, c["tokens"], f"{c['pass_s'] * 1000:.0f}", f"{c['pass_s'] / c['tokens'] * 1e6:.0f}",
             *views(c, "pass_views_s"), f"{c['alone_s'] * 1000:.0f}", f"{c['alone_s'] / c['tokens'] * 1e6:.0f}",
             *views(c, "alone_views_s"), f"{c['alone_s'] / c['pass_s']:.2f}x"] for name, c in result["cases"].items()]
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.",
            f"Model `{result['preset']}` served in bfloat16; segments (tokens at a start position, the earlier "
            "tokens already in the sequence's pages) in one `Runner.prefill` pass of all of them against one pass "
            "each; medians, side by side in one process. Attention: "
            + ("the cpu backend's prefill kernel reading the pages in place (the engine's default), and beside it "
               "the same backend with the kernel off: each tile's pages gathered into a view, in XLA's loop."
               if result.get("in_place") else f"the {result.get('backend', 'xla')} backend's, each tile's pages "
               "gathered into a view (the prefill kernel does not serve here)."), "",
            report.markdown_table(["segments", "tokens", "one pass ms", "us/token", "one pass, gathered views ms",
                                   "views / in place", "one by one ms", "us/token", "one by one, gathered views ms",
                                   "views / in place", "one by one / one pass"], rows),
            f"\n![prefill_passes](bench/results/{plot(result)})"]
    report.update_section("Prefill passes (prefill_passes)", "\n".join(body))


def plot(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["cases"])
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 4))
    for offset, key, label in ((-0.2, "pass_s", "one pass"), (0.2, "alone_s", "one by one")):
        ax.bar(x + offset, [result["cases"][n][key] / result["cases"][n]["tokens"] * 1e6 for n in names], 0.4,
               label=label)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("microseconds per prefill token")
    ax.set_title(f"prefill_passes, {result['preset']} (bfloat16)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    return report.save_figure(fig, "prefill_passes.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_passes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--repeats", type=int, default=5)
    return report.main(p, measure, write, name="prefill_passes", command=COMMAND, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
