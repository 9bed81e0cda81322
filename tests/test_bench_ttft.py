"""ttft_bench end to end, bounded: the tiny preset, two short prompt lengths, one repeat, a real stack
(Valkey, kvstore, engine, gateway processes), the transformers baseline and the in-process lower bound."""
import json

import pytest

from bench import report, ttft_bench, ttft_report


def test_parse_lengths_reads_k_suffixes_and_sorts():
    assert ttft_bench.parse_lengths("16K, 1k,4096") == [1024, 4096, 16384]


def test_lengths_must_leave_a_whole_number_of_blocks_before_the_suffix(tmp_path):
    with pytest.raises(SystemExit, match="multiple of 64"):
        ttft_bench.main(["--preset", "tiny", "--lengths", "100", "--dir", str(tmp_path / "w"), "--no-report"])


@pytest.mark.timeout(300)
def test_tiny_run_measures_miss_cold_and_warm_hits_bound_and_baseline(tmp_path):
    name = "ttft_bench_smoke"
    assert ttft_bench.main(["--preset", "tiny", "--lengths", "192,320", "--repeats", "1", "--no-drop",
                            "--dd-mib", "8", "--dir", str(tmp_path / "work"), "--name", name, "--no-report"]) == 0
    result = json.loads((report.OUT / f"{name}.json").read_text())
    assert not (tmp_path / "work").exists()  # the stack's temp data is gone
    assert result["lengths"] == [192, 320] and result["same_weights"] and not result["cold_is_cold"]
    for n in (192, 320):
        requests = result["requests"][str(n)]
        assert requests["miss"][0]["cached_tokens"] == 0
        for kind in ("cold_hit", "warm_hit", "memory_hit"):
            hit = requests[kind][0]
            assert hit["cached_tokens"] == hit["loaded_tokens"] == n - 64
            assert hit["client_ttft_s"] >= hit["gateway_ttft_s"] >= hit["engine_ttft_s"] > 0
            # Disk hits read tokens x layers x latent dims x bf16; a memory hit reads nothing.
            assert hit["loaded_bytes"] == (0 if kind == "memory_hit" else (n - 64) * 2 * 48 * 2)
        assert requests["engine_peak_rss_bytes"] > 0
        diy = result["transformers"][str(n)]["repeats"][0]
        assert diy["miss_s"] > 0 and diy["cold_hit_s"] > 0 and diy["cache_file_bytes"] > 0
    by_length = {row["tokens"]: row for row in result["summary"]}
    assert by_length[320]["lower_bound_s"] >= by_length[320]["compute"]["median"] > 0
    assert by_length[320]["speedup_cold"] > 0 and by_length[320]["cold_vs_bound"] > 0
    names = {"length": "a.png", "speedup": "b.png", "breakdown": "c.png"}
    paths = ttft_report.plot_all(result, tmp_path, names)
    assert all(p.stat().st_size > 1000 for p in paths)
    assert "| 320 |" in ttft_report.tables(result)
