"""The serving benchmarks run end to end on the tiny preset (their numbers are for BENCHMARKS.md, not here)."""
import json
import math

import pytest

from bench import report, serve_bench, serve_report
from bench.lab import decode_attention_bench, decode_bench, few_rows_bench, prefill_kernel_bench, prefill_passes
from bench.serve_client import Result, percentiles, summarize
from model import cpu_kernels


def test_serving_metrics_are_vllms_definitions():
    ok = Result(10, 4, 0, 0.0, 0.5, 2.0, (0.5, 1.0, 1.5, 2.0), "")
    failed = Result(10, 0, 0, 0.0, math.nan, 1.0, (), "HTTP 503")
    assert ok.itl_s == [0.5, 0.5, 0.5] and ok.tpot_s == 0.5
    s = summarize([ok, ok, failed], duration_s=4.0)
    assert s["completed"] == 2 and s["errors"] == 1 and s["first_error"] == "HTTP 503"
    assert s["request_throughput"] == 0.5 and s["output_token_throughput"] == 2.0
    assert percentiles([1, 2, 3, 4], qs=(50, 99)) == {"mean": 2.5, "p50": 2, "p99": 4}


def test_a_chunk_of_several_tokens_counts_as_that_many_gaps_per_token():
    arrivals = [[0.0, 0.1, 0.3, 0.4], [0.05, 0.15]]
    brought = [[1, 1, 2, 1], [1, 3]]
    gaps = serve_bench.per_token_gaps(arrivals, brought, (0.1, 0.35))  # the chunks that arrived at 0.1, 0.3 and 0.15
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1 / 3, 0.1 / 3, 0.1 / 3])


def test_serve_bench_runs_sessions_through_a_real_stack(tmp_path):
    assert serve_bench.main(["--preset", "tiny", "--models-dir", str(tmp_path / "models"), "--dir", str(tmp_path),
                             "--sessions", "12", "--concurrency", "1,2", "--cache-concurrency", "2",
                             "--min-sessions", "2", "--warm-sessions", "2", "--max-turns", "2", "--max-output", "4", "--rate", "4",
                             "--rate-requests", "3", "--phases", "sweep,cache,streams", "--stream-users", "2",
                             "--stream-requests", "2", "--stream-prompt", "16", "--stream-tokens", "4",
                             "--name", "serve_smoke", "--no-report"]) == 0
    result = json.loads((report.OUT / "serve_smoke.json").read_text())
    for run in (result["sweep"]["1"], result["sweep"]["2"], result["poisson"], result["cache_off"]["2"]):
        assert run["completed"] == run["requests"] > 0, run["first_error"]
        assert run["output_token_throughput"] > 0 and run["ttft_s"]["p50"] > 0
    for run in (result["sweep"]["1"], result["sweep"]["2"], result["cache_off"]["2"]):  # the engine's accounting
        engine = run["engine"]
        assert 0 < engine["prefill_s"] + engine["decode_s"] <= engine["busy_s"] and engine["compile_s"] >= 0
    # Second turns extend first turns: with the cache on they hit, with it off nothing does.
    assert result["sweep"]["2"]["hit_tokens"] > 0 and result["cache_off"]["2"]["hit_tokens"] == 0
    # The streams phase: fresh short prompts at 1 and 2 users, every answer whole.
    levels = result["streams"]["levels"]
    for c in ("1", "2"):
        assert levels[c]["completed"] == levels[c]["requests"] == 2 * int(c), levels[c]["first_error"]
        assert 0 < levels[c]["total_output_tokens"] <= 4 * 2 * int(c) and levels[c]["hit_tokens"] == 0
    goals = serve_report.goals(result)
    assert any("short prompts" in line and "2 users / 1 user" in line for line in goals)
    assert any("cache on / off" in line and "ceiling on this workload" in line for line in goals)


def test_decode_bench_measures_both_modes():
    assert decode_bench.main(["--preset", "tiny", "--batches", "1,2", "--context", "64", "--max-batch", "4",
                              "--prefill", "128", "--solo-tokens", "128", "--step-tokens", "64", "--repeats", "1",
                              "--no-report"]) == 0
    result = json.loads((report.OUT / "decode_bench.json").read_text())
    assert set(result["decode"]) == {"1", "2"} and all(d[mode] > 0 for d in result["decode"].values()
                                                       for mode in decode_bench.MODES)
    assert all(d["dispatch_s"] > 0 and d["greedy_s"] > 0 and d["argmax_s"] > 0 for d in result["decode"].values())
    # default decode attention is the cpu backend's kernel where the CPU has AVX-512, AMX, or AVX2 and FMA;
    # xla_attention (the xla backend) its comparison
    assert result["decode_kernel"] == cpu_kernels.decode_serves()
    assert result["backend"] == ("cpu" if cpu_kernels.decode_serves() else "xla")
    # xla_products: XLA's products of a few rows, beside the few-row kernel where it serves
    assert result["few_row_kernel"] == cpu_kernels.few_rows_serve()
    assert result["few_rows_max"] == cpu_kernels.few_rows_max()
    assert result["prefill"]["solo"]["seconds"] > 0 and result["prefill"]["invariant"]["segment_tokens"] == 64


def test_decode_attention_bench_times_every_path_this_machine_has():
    assert decode_attention_bench.main(["--quick", "--repeats", "1", "--no-report"]) == 0
    result = json.loads((report.OUT / "decode_attention_bench.json").read_text())
    # on a CPU with AVX2 alone, the portable build beside its AVX2 path
    assert result["paths"] == (["portable"] * (cpu_kernels.cpu_kind() == "avx2") + ["float32"]
                               + ["amx"] * cpu_kernels.decode_amx_available())
    assert [(c["sequences"], c["context"]) for c in result["cases"]] == list(decode_attention_bench.QUICK)
    assert all(c["seconds"][p] > 0 for c in result["cases"] for p in result["paths"])


def test_few_rows_bench_measures_every_projection_shape_at_each_row_count():
    assert few_rows_bench.main(["--preset", "tiny", "--repeats", "1", "--no-report"]) == 0
    result = json.loads((report.OUT / "few_rows_bench.json").read_text())
    shapes = {(p["out"], p["in"]) for p in result["products"]}
    assert (129_280, 64) in shapes and len(result["products"]) == len(shapes) * len(result["rows"])
    assert all(p["kernel"] > 0 and p["xla"] > 0 for p in result["products"])


def test_prefill_kernel_bench_measures_the_kernel_beside_xla():
    if not cpu_kernels.prefill_attention_available():
        pytest.skip("the prefill attention kernel needs AMX")
    assert prefill_kernel_bench.main(["--preset", "mini", "--quick", "--repeats", "1", "--no-report"]) == 0
    result = json.loads((report.OUT / "prefill_kernel_bench.json").read_text())
    assert [(r["tokens"], r["context"]) for r in result["layer"]] == list(prefill_kernel_bench.QUICK)
    assert [(r["tokens"], r["context"]) for r in result["segments"]] == list(prefill_kernel_bench.QUICK)
    assert all(r["kernel"] > 0 and r["xla"] > 0 for r in result["layer"] + result["segments"])


def test_prefill_passes_measures_one_pass_against_one_by_one():
    assert prefill_passes.main(["--preset", "tiny", "--repeats", "1", "--no-report"]) == 0
    result = json.loads((report.OUT / "prefill_passes.json").read_text())
    assert set(result["cases"]) == set(prefill_passes.CASES)
    assert all(c["pass_s"] > 0 and c["alone_s"] > 0 and c["tokens"] == sum(n for n, _ in c["segments"])
               for c in result["cases"].values())
