"""ttft_bench end to end, bounded: the tiny preset, one short prompt length, one repeat, a real stack
(Valkey, kvstore, engine, gateway processes) restarted for the cold hits, the transformers baseline, the
in-process and the physical lower bounds."""
import json

import pytest

from bench import report, ttft_bench, ttft_report
from bench.ttft_bounds import matmul_peak, memcpy_gbps, suffix_flops
from model.config import preset


def test_parse_lengths_reads_k_suffixes_and_sorts():
    assert ttft_bench.parse_lengths("16K, 1k,4096") == [1024, 4096, 16384]


def test_lengths_must_leave_a_whole_number_of_blocks_before_the_suffix(tmp_path):
    with pytest.raises(SystemExit, match="multiple of 64"):
        ttft_bench.main(["--preset", "tiny", "--lengths", "100", "--dir", str(tmp_path / "w"), "--no-report"])


def test_absorbed_attention_is_the_cheaper_form_only_over_a_long_prefix():
    cfg = preset("mini")
    # Expanding c_kv costs kv_b for every prefix token; absorbed attention is wider per (query, key) pair.
    assert suffix_flops(cfg, 0, 64).form == "expanded"
    long = suffix_flops(cfg, 8128, 64)
    assert long.form == "absorbed" and long.cheaper == long.absorbed < long.expanded
    # Attention grows linearly with the prefix: per extra prefix token, per suffix token, per layer and head,
    # q.[c_kv|k_pe] and p.c_kv multiply-adds.
    step = suffix_flops(cfg, 8192, 64).absorbed - suffix_flops(cfg, 8128, 64).absorbed
    assert step == 2 * 64 * 64 * cfg.num_layers * cfg.num_heads * (cfg.latent_dim + cfg.kv_lora_rank)


def test_moe_flops_count_the_routed_experts_a_token_uses_not_all_of_them():
    cfg = preset("tiny")
    more_experts = cfg.replace(n_routed_experts=64)
    moe_layers = cfg.num_layers - cfg.first_k_dense
    # Only the router grows with the number of experts: 60 more router columns per token and MoE layer.
    assert (suffix_flops(more_experts, 128, 64).absorbed - suffix_flops(cfg, 128, 64).absorbed
            == 2 * 64 * moe_layers * cfg.hidden_size * 60)


def test_machine_peaks_are_measured_positive():
    peak = matmul_peak(size=256, repeats=2)
    assert peak.float32_gflops > 0 and peak.bfloat16_gflops > 0 and peak.gflops == max(peak[1:])
    assert memcpy_gbps(size_mib=8, repeats=2) > 0


@pytest.mark.timeout(400)
def test_tiny_run_measures_miss_fresh_stack_hits_bounds_and_baseline(tmp_path):
    name = "ttft_bench_smoke"
    assert ttft_bench.main(["--preset", "tiny", "--lengths", "320", "--repeats", "1", "--no-drop",
                            "--dd-mib", "8", "--dir", str(tmp_path / "work"), "--name", name, "--no-report"]) == 0
    result = json.loads((report.OUT / f"{name}.json").read_text())
    assert not (tmp_path / "work").exists()  # the stack's temp data is gone
    assert result["lengths"] == [320] and result["same_weights"] and not result["cold_is_cold"]
    n = 320
    requests = result["requests"][str(n)]
    assert len(requests["miss"]) == 2 and all(m["cached_tokens"] == 0 for m in requests["miss"])
    # One restart per repeat: every process new, the index kept (the hits below are hits).
    [restart] = requests["restarts"]
    assert restart["start_s"] > 0 and restart["stop_s"] > 0 and not restart["dropped"]
    for kind in ttft_report.HITS:
        [hit] = requests[kind]
        assert hit["cached_tokens"] == hit["loaded_tokens"] == n - 64
        assert hit["client_ttft_s"] >= hit["gateway_ttft_s"] >= hit["engine_ttft_s"] > 0
        # Disk hits read tokens x layers x latent dims x bf16; a memory hit reads nothing.
        assert hit["loaded_bytes"] == (0 if kind == "memory_hit" else (n - 64) * 2 * 48 * 2)
    assert requests["engine_peak_rss_bytes"] > 0
    diy = result["transformers"][str(n)]["repeats"][0]
    assert diy["miss_s"] > 0 and diy["cold_hit_s"] > 0 and diy["cache_file_bytes"] > 0
    [row] = result["summary"]
    assert row["prefix_bytes"] == row["loaded_bytes"] == 256 * 2 * 48 * 2
    assert row["in_process_s"] >= row["compute"]["median"] > 0
    assert row["physical_device_s"] >= row["load_at_raw_s"] > 0
    assert row["physical_ram_s"] >= row["compute_at_peak_s"] > 0
    assert set(row["ratios"]) == set(ttft_report.HITS)
    for kind, ratio in row["ratios"].items():
        assert ratio["vs_physical"] > 0 and ratio["vs_in_process"] > 0 and ratio["speedup"] > 0
        assert ratio["physical_s"] == (row["physical_device_s"] if kind in ("first_hit", "cold_hit")
                                       else row["physical_ram_s"])
    ttft_report.plot(result, tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").stat().st_size > 1000
    table = ttft_report.table(result)
    assert table.count("\n| 320 |") == 1 and max(map(len, table.splitlines())) < 200
    assert any("physical bound" in line and "goal" in line for line in ttft_report.notes(result))
