"""bench/accelerator_check.py, the one prepared run for a lent accelerator, run on the CPU at small shapes
over 8 host devices (so its mesh section runs too): every section passes and writes its numbers."""
import json
import os
import subprocess
import sys
from pathlib import Path


def test_accelerator_check_runs_every_section_on_the_cpu(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "bench.accelerator_check", "--small", "--prefill", "256",
                             "--repeats", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                            env=env, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "accelerator_check.json").read_text())
    assert report["devices"]["count"] == 8 and report["devices"]["backend"] == "cpu"
    assert [r["tokens"] for r in report["moe"]["rows"]] == [1, 16, 512]
    assert all(r["max_error_over_scale"] <= 1e-5 for r in report["moe"]["rows"])
    assert report["parity"]["greedy_tokens_equal"] and report["parity"]["max_error_over_scale"] <= 1e-4
    assert report["sharded"]["mesh"] == {"tensor": 2, "expert": 4} and report["sharded"]["greedy_tokens_equal"]
    assert report["prefill"]["rows"][0]["tokens"] == 256 and report["prefill"]["rows"][0]["tokens_per_s"] > 0
    assert all(section.get("ok") is not False for section in report.values() if isinstance(section, dict))
