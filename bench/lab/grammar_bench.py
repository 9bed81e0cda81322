"""grammar_bench: what constrained decoding costs per decode step, and llguidance against xgrammar.

    python -m bench.lab.grammar_bench [--preset mini] [--batches 1,16] [--context 512] [--repeats 5]

Part 1, the grammar engines alone on the DeepSeek-V3 tokenizer (129,280 ids), on the same schemas: the
time to compile a request's grammar and the time of one next-token mask, median over a random walk
through the grammar (each step a uniformly drawn allowed token). Part 2, the engine's decode step on
--preset at batch 1 and 16: decode + greedy sampling, decode + sampling at temperature 1, and the same
with every row constrained by a JSON schema (host masks from llguidance, the mask applied on the device,
each token taken by the grammar), with the host mask time alone beside it. Medians of --repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from bench import report
from bench.lab.moe_bench import median_seconds
from model.attention import make_backend
from model.config import preset
from model.grammar import default_tokenizer_json, grammar_source, token_grammar
from model.latent_pool import LatentPool
from model.runner import DecodeRow, Runner, Segment
from model.sampling import SamplingParams, SamplingRow, sample_batch
from model.serving import serving_model
from model.weights import init_model

COMMAND = "python -m bench.lab.grammar_bench"
EOS = 1
SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
             "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "tags", "unit", "where"],
               "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                              "unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
                              "where": {"type": "object", "required": ["lat", "lon"], "additionalProperties": False,
                                        "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}}},
    "tools": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"enum": ["get_weather", "search", "send_email"]},
                             "arguments": {"anyOf": [
                                 {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
                                 {"type": "object", "required": ["query", "limit"],
                                  "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}]}}},
}
WALK = 48  # tokens per random walk


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def engines(vocab_size: int, repeats: int) -> dict:
    """Compile and mask times of llguidance and xgrammar on the same tokenizer and schemas."""
    tokenizer_json = default_tokenizer_json(None)
    begin = time.perf_counter()
    grammars = token_grammar(tokenizer_json, vocab_size, EOS)
    out = {"llguidance": {"tokenizer_s": time.perf_counter() - begin}, "xgrammar": {}}
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask
    for name, schema in SCHEMAS.items():
        source = grammar_source({"type": "json_schema", "schema": schema})
        compile_s = []
        for _ in range(repeats):
            begin = time.perf_counter()
            matcher = llguidance.LLMatcher(grammars.tokenizer, source, log_level=0)
            fill_next_token_bitmask(matcher, np.zeros((1, grammars.words), np.int32))  # first mask builds the lexer
            compile_s.append(time.perf_counter() - begin)
        rng, masks = np.random.default_rng(0), []
        matcher = llguidance.LLMatcher(grammars.tokenizer, source, log_level=0)
        row = np.zeros((1, grammars.words), np.int32)
        for _ in range(WALK):
            if matcher.is_stopped():
                matcher.reset()
            begin = time.perf_counter()
            fill_next_token_bitmask(matcher, row)
            masks.append(time.perf_counter() - begin)
            allowed = np.flatnonzero(np.unpackbits(row[0].view(np.uint8), bitorder="little"))
            token = int(rng.choice(allowed[allowed != EOS])) if (allowed != EOS).any() else EOS
            if token == EOS:
                matcher.reset()
            else:
                matcher.consume_token(token)
        out["llguidance"][name] = {"compile_ms": _median_ms(compile_s), "mask_ms": _median_ms(masks),
                                   "mask_p90_ms": float(np.percentile(masks, 90) * 1000)}
        print(f"llguidance {name}: compile {out['llguidance'][name]['compile_ms']:.2f} ms, "
              f"mask {out['llguidance'][name]['mask_ms']:.3f} ms", flush=True)
    try:
        out["xgrammar"] = _xgrammar(tokenizer_json, vocab_size, repeats)
    except ImportError as error:  # xgrammar is a dev dependency; the comparison is skipped without it
        out["xgrammar"] = {"error": repr(error)}
    return out


def _xgrammar(tokenizer_json, vocab_size: int, repeats: int) -> dict:
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    begin = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[EOS])
    out = {"tokenizer_s": time.perf_counter() - begin}
    for name, schema in SCHEMAS.items():
        compile_s = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            begin = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            compile_s.append(time.perf_counter() - begin)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        rng, masks = np.random.default_rng(0), []
        for _ in range(WALK):
            if matcher.is_terminated():
                matcher.reset()
            begin = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - begin)
            words = bitmask[0].numpy().view(np.uint8)
            allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[:vocab_size])
            token = int(rng.choice(allowed[allowed != EOS])) if (allowed != EOS).any() else EOS
            if token == EOS:
                matcher.reset()
            else:
                matcher.accept_token(token)
        out[name] = {"compile_ms": _median_ms(compile_s), "mask_ms": _median_ms(masks),
                     "mask_p90_ms": float(np.percentile(masks, 90) * 1000)}
        print(f"xgrammar {name}: compile {out[name]['compile_ms']:.2f} ms, mask {out[name]['mask_ms']:.3f} ms",
              flush=True)
    del torch
    return out


def steps(args) -> dict:
    """The decode step with and without grammar masks, at each batch size."""
    cfg = preset(args.preset)
    model = serving_model(init_model(cfg), "bfloat16")  # as the engine serves it
    B = 64
    pages_per_seq = -(-(args.context + 2 * args.repeats + 8) // B)
    n_max = max(args.batches)
    pool = LatentPool(cfg, 1 + n_max * pages_per_seq, B)
    runner = Runner(model, cfg, pool, make_backend("auto", cfg, "cpu", "bfloat16", page_tokens=B))
    tables = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(n_max)]
    rng = np.random.default_rng(0)
    for table in tables:
        runner.prefill([Segment(rng.integers(0, cfg.vocab_size, args.context), 0, table)], want_logits=False).run()
    grammars = token_grammar(default_tokenizer_json(None), cfg.vocab_size, EOS)
    # A long free string keeps every row inside the grammar for the whole measurement.
    source = grammar_source({"type": "json_schema", "schema": {
        "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}})
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    out = {}
    for n in sorted(args.batches):
        rows = [DecodeRow(5, args.context, tables[i]) for i in range(n)]
        plain = median_seconds(lambda: sample_batch(runner.decode(rows), [SamplingRow(greedy, 0, 0)] * n), args.repeats)
        warm = median_seconds(lambda: sample_batch(runner.decode(rows), [SamplingRow(sampled, i, 0) for i in range(n)]),
                              args.repeats)
        states = [grammars.state(source) for _ in range(n)]
        host: list[float] = []

        def constrained(params: SamplingParams):
            logits = runner.decode(rows)  # dispatched; the masks are computed while it runs
            begin = time.perf_counter()
            masks = [state.mask(10_000) for state in states]
            host.append(time.perf_counter() - begin)
            result = sample_batch(logits, [SamplingRow(params, i, 0, (), m) for i, m in enumerate(masks)])
            for i, state in enumerate(states):
                if result.tokens[i] != EOS:
                    state.take(int(result.tokens[i]), 10_000)
                if state.stopped:
                    states[i] = grammars.state(source)
            return result.tokens

        with_grammar = median_seconds(lambda: constrained(sampled), args.repeats)
        host_ms = _median_ms(host)
        host.clear()
        greedy_grammar = median_seconds(lambda: constrained(greedy), args.repeats)
        out[str(n)] = {"greedy_s": plain, "sampled_s": warm, "sampled_grammar_s": with_grammar,
                       "greedy_grammar_s": greedy_grammar, "host_mask_ms": host_ms,
                       "host_mask_greedy_ms": _median_ms(host)}
        print(f"batch {n}: greedy {plain * 1000:.1f} ms, sampled {warm * 1000:.1f} ms, greedy+grammar "
              f"{greedy_grammar * 1000:.1f} ms, sampled+grammar {with_grammar * 1000:.1f} ms, host masks "
              f"{host_ms:.2f} ms", flush=True)
    return out


def write(result: dict) -> None:
    llg, xg = result["engines"]["llguidance"], result["engines"]["xgrammar"]
    engine_rows = []
    for name in SCHEMAS:
        x = xg.get(name, {})
        engine_rows.append([name, f"{llg[name]['compile_ms']:.2f}", f"{x.get('compile_ms', float('nan')):.2f}",
                            f"{llg[name]['mask_ms']:.3f}", f"{llg[name]['mask_p90_ms']:.3f}",
                            f"{x.get('mask_ms', float('nan')):.3f}", f"{x.get('mask_p90_ms', float('nan')):.3f}"])
    step_rows = []
    for n, d in sorted(result["steps"].items(), key=lambda kv: int(kv[0])):
        step_rows.append([n, f"{d['greedy_s'] * 1000:.1f}", f"{d['greedy_grammar_s'] * 1000:.1f}",
                          f"{d['sampled_s'] * 1000:.1f}", f"{d['sampled_grammar_s'] * 1000:.1f}",
                          f"{d['host_mask_ms']:.2f}", f"{d['sampled_grammar_s'] / d['sampled_s']:.2f}x"])
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.", "",
            f"Grammar engines on the DeepSeek-V3 tokenizer ({result['vocab_size']} ids), compact JSON (no free "
            f"whitespace), medians: compile = building a request's matcher (llguidance: up to its first mask; "
            f"xgrammar: compile_json_schema, cache off); mask = one next-token bitmask along a {WALK}-token random "
            f"walk. Tokenizer set-up: llguidance {llg['tokenizer_s']:.1f} s, xgrammar "
            f"{xg.get('tokenizer_s', float('nan')):.1f} s.", "",
            report.markdown_table(["schema", "llguidance compile ms", "xgrammar compile ms", "llguidance mask ms",
                                   "llguidance mask p90 ms", "xgrammar mask ms", "xgrammar mask p90 ms"],
                                  engine_rows), "",
            f"Decode step on `{result['preset']}` at {result['context']} tokens of context (decode + sampling; "
            "'+ grammar': every row constrained by a JSON schema, masks on the host while the step runs, applied "
            "on the device, each token taken by its grammar). Host masks = the grammar's host time per step for "
            "all rows.", "",
            report.markdown_table(["batch", "greedy ms", "greedy + grammar ms", "temperature 1 ms",
                                   "temperature 1 + grammar ms", "host masks ms", "grammar / plain (t=1)"],
                                  step_rows)]
    body.append(f"\n![grammar_bench](bench/results/{plot(result)})")
    report.update_section("Grammar masks per decode step (grammar_bench)", "\n".join(body))


def plot(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = sorted(result["steps"], key=int)
    kinds = [("greedy_s", "greedy"), ("greedy_grammar_s", "greedy + grammar"), ("sampled_s", "t=1"),
             ("sampled_grammar_s", "t=1 + grammar")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / (len(kinds) + 1)
    for k, (key, label) in enumerate(kinds):
        ax.bar([i + k * width for i in range(len(ns))], [result["steps"][n][key] * 1000 for n in ns], width,
               label=label)
    ax.bar([i + len(kinds) * width for i in range(len(ns))], [result["steps"][n]["host_mask_ms"] for n in ns], width,
           label="host masks alone", color="black")
    ax.set_xticks([i + 2 * width for i in range(len(ns))], [f"batch {n}" for n in ns])
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title(f"grammar_bench, {result['preset']}, context {result['context']}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return report.save_figure(fig, "grammar_bench.png")


def measure(args) -> dict:
    vocab_size = preset(args.preset).vocab_size
    result = {"preset": args.preset, "context": args.context, "vocab_size": vocab_size,
              "load_average_start": os.getloadavg()[0], "jax_backend": jax.default_backend()}
    result["engines"] = engines(vocab_size, args.repeats)
    result["steps"] = steps(args)
    result["load_average_end"] = os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grammar_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    return report.main(p, measure, write, name="grammar_bench", command=COMMAND, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
