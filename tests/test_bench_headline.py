"""bench/headline.py at --small on the CPU, in-process (a real Valkey, real volumes under tmp_path): every measurement
is made and written, the hits come from the tier they are named after and answer as the miss did, and a miss of the
longest prompt takes longer than each of its hits. No speed is asserted beyond that ordering."""
import json

from bench import headline
from bench.report import BENCHMARKS


def test_the_small_headline_run_measures_every_path_length_and_batch(tmp_path):
    out = tmp_path / "headline.jsonl"
    before = BENCHMARKS.read_text()
    assert headline.main(["--small", "--no-report", "--out", str(out), "--dir", str(tmp_path)]) == 0
    assert BENCHMARKS.read_text() == before  # --no-report
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("headline-")]  # the work dir is removed

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({r["run"] for r in rows}) == 1 and not [r for r in rows if r["kind"] == "skipped"]
    of = {kind: [r for r in rows if r["kind"] == kind] for kind in ("setup", "limits", "bound", "ttft", "decode")}
    assert len(of["setup"]) == len(of["limits"]) == 1
    assert "cores" in of["setup"][0]["machine"] and "load average" in of["setup"][0]["machine"]
    limits = of["limits"][0]
    assert min(limits["disk"]["gbps"], limits["tflops"], limits["device_read_gbps"],
               limits["host_to_device_gbps"]) > 0

    lengths, repeats, batches = [1024, 2048, 4096], 3, [1, 4]
    small = headline.SMALL
    latent_bytes = small["num_layers"] * (small["kv_lora_rank"] + small["qk_rope_head_dim"]) * 2  # bf16, per token
    assert sorted(r["tokens"] for r in of["bound"]) == lengths
    for bound in of["bound"]:
        assert bound["prefix_tokens"] == bound["tokens"] - 64
        assert all(bound[path] > 0 for path in headline.PATHS)
    for n in lengths:
        for repeat in range(repeats):
            runs = {r["path"]: r for r in of["ttft"] if r["tokens"] == n and r["repeat"] == repeat}
            assert sorted(runs) == sorted(headline.PATHS), (n, repeat)
            prefix = n - 64
            assert all(r["ttft_s"] > 0 and r["engine_ttft_s"] > 0 for r in runs.values())
            assert runs["miss"]["tiers"] == {"memory": 0, "disk": 0}
            assert runs["disk_hit"]["tiers"] == runs["host_hit"]["tiers"] == {"memory": 0, "disk": prefix}
            assert runs["memory_hit"]["tiers"] == {"memory": prefix, "disk": 0}
            assert runs["disk_hit"]["loaded_bytes"] == prefix * latent_bytes
            assert 0 <= runs["disk_hit"]["resident_fraction"] <= 1 and runs["disk_hit"]["segment_files"] >= 1
            # greedy: the cached prefix answers as the computed one did; the three hits compute the same suffix
            assert len(runs["miss"]["answer"]) == headline.ANSWER_TOKENS
            assert runs["disk_hit"]["answer"] == runs["miss"]["answer"]
            assert runs["host_hit"]["answer"] == runs["memory_hit"]["answer"] == runs["disk_hit"]["answer"]

    records = headline.Records(tmp_path / "reread.jsonl", "reread")
    records.rows = rows
    longest = max(lengths)
    miss, _ = headline.ttft_median(records, "miss", longest)
    assert all(miss > headline.ttft_median(records, path, longest)[0] for path in headline.PATHS[1:])

    assert [r["batch"] for r in of["decode"]] == batches
    for r in of["decode"]:
        assert r["context"] == 1024 and r["step_s"] > 0 and r["tokens_per_s"] > 0
    summary = headline.summarize(records)
    assert summary.count("| 4,096 |") == 1 and "Pass mark on a GPU" in summary  # a row per length
