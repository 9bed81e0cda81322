"""The engine process's heap settings (services/engine/allocator.py): when it restarts itself with them."""
import os
import subprocess
import sys

from services.engine.allocator import HEAP_TUNABLES, engine_environment


def test_the_engine_restarts_with_its_heap_settings_unless_they_or_the_operators_are_set():
    assert engine_environment({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": HEAP_TUNABLES}
    other = engine_environment({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"})
    assert other["GLIBC_TUNABLES"] == f"glibc.cpu.hwcaps=-AVX512F:{HEAP_TUNABLES}"  # kept, ours appended
    assert engine_environment({"GLIBC_TUNABLES": HEAP_TUNABLES}) is None  # already restarted: no loop
    assert engine_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}) is None  # the operator's heap
    assert engine_environment({"DEEPINFER_ENGINE_HEAP": "system"}) is None
    assert "glibc.malloc.arena_max=1" in HEAP_TUNABLES.split(":")


def test_the_engine_command_runs_through_the_restart():
    for heap in ("engine", "system"):
        out = subprocess.run([sys.executable, "-m", "services.engine", "--help"], capture_output=True, text=True,
                             env=os.environ | {"DEEPINFER_ENGINE_HEAP": heap}, timeout=120)
        assert out.returncode == 0 and "--model-dir" in out.stdout, out.stderr
