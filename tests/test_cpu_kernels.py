"""The CPU kernels (model/cpu_kernels.py) against float64 references, and their contracts: a sequence's
decode attention depends on its own pages and length alone, and a row's few-row product on that row
alone, bit for bit."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def kernel():
    ok, why = cpu_kernels.available("cpu")
    assert ok, f"the decode kernel must build on the test machine: {why}"


def make(rng, B, N, A, C, T, P, Q, dtype, q_dtype=None):
    pool = jnp.asarray(rng.standard_normal((P, T, A)), dtype)
    bits = jax.lax.bitcast_convert_type(pool, jnp.uint16 if dtype == jnp.bfloat16 else jnp.uint32)
    # queries at the attention dtype's precision, as the runner gives them (the cache's unless served in float32)
    q = np.asarray(jnp.asarray(rng.standard_normal((B, N, A)), q_dtype or dtype).astype(jnp.float32))
    fresh = rng.standard_normal((B, A)).astype(np.float32)
    tables = rng.integers(0, P, (B, Q)).astype(np.int32)
    lengths = rng.integers(0, Q * T + 1, B).astype(np.int32)
    lengths[0], lengths[-1] = 0, Q * T  # only its own latent; every row of its table
    return np.asarray(pool.astype(jnp.float32)), bits, q, tables, lengths, fresh


def reference(pool, q, tables, lengths, fresh, scale, C):
    out = []
    for b in range(q.shape[0]):
        kv = np.concatenate([pool[tables[b]].reshape(-1, pool.shape[-1])[:lengths[b]], fresh[b][None]])
        s = q[b].astype(np.float64) @ kv.T.astype(np.float64) * scale
        w = np.exp(s - s.max(-1, keepdims=True))
        out.append((w / w.sum(-1, keepdims=True)) @ kv[:, :C])
    return np.stack(out)


def call(q, bits, tables, lengths, fresh, scale, C, path="auto"):
    return np.asarray(jax.jit(cpu_kernels.paged_mla_decode, static_argnums=(5, 6, 7))(
        q, bits, tables, lengths, fresh, scale, C, path))


def paths(dtype, A, C, T) -> list[str]:
    """The decode kernel's paths for these widths on the test machine (AMX where Linux grants it)."""
    amx = dtype == jnp.bfloat16 and A % 32 == 0 and C % 32 == 0 and T % 32 == 0
    return ["float32"] + ["amx"] * (amx and cpu_kernels.decode_amx_available())


CASES = [
    (5, 8, 576, 512, 64, 40, 7, jnp.bfloat16),  # mini's widths
    (3, 4, 48, 32, 64, 10, 3, jnp.float32),  # tiny's, served in float32
    (4, 13, 48, 32, 16, 10, 5, jnp.bfloat16),  # head groups of 8, 4 and 1; short pages
    (2, 1, 32, 16, 8, 4, 3, jnp.float32),
    (3, 8, 576, 512, 64, 100, 100, jnp.bfloat16),  # up to 6,400 rows: pieces of 2,048 folded
    (4, 13, 576, 512, 16, 30, 9, jnp.bfloat16),  # pages of 16 rows: float32 only; 13 heads: groups of 8, 4, 1
    (3, 20, 576, 512, 32, 30, 6, jnp.bfloat16),  # pages of one 32-row step; 20 heads: two tiles of 16 on AMX
]


@pytest.mark.parametrize("B, N, A, C, T, P, Q, dtype, path", [
    (*case, path) for case in CASES for path in paths(case[-1], *case[2:5])])
def test_matches_a_float64_reference(B, N, A, C, T, P, Q, dtype, path):
    pool, bits, q, tables, lengths, fresh = make(np.random.default_rng(B * N), B, N, A, C, T, P, Q, dtype)
    got = call(q, bits, tables, lengths, fresh, 0.07, C, path)
    want = reference(pool, q, tables, lengths, fresh, 0.07, C)
    # the AMX path rounds the softmax weights to bfloat16 before the values product (as XLA's path does)
    np.testing.assert_allclose(got, want, atol=(2e-6 if path == "float32" else 5e-3) * np.abs(want).max(), rtol=0)
    # "auto" is the best path the widths allow here, and no other
    assert np.array_equal(got, call(q, bits, tables, lengths, fresh, 0.07, C)) == (path == paths(dtype, A, C, T)[-1])


def test_the_float32_path_keeps_full_precision_queries_over_a_bfloat16_pool():
    """Float32 serving over the default bfloat16 cache: the runner names the float32 path, which rounds nothing."""
    pool, bits, q, tables, lengths, fresh = make(np.random.default_rng(4), 4, 8, 576, 512, 64, 30, 5, jnp.bfloat16,
                                                 q_dtype=jnp.float32)
    assert not np.array_equal(q, np.asarray(jnp.asarray(q, jnp.bfloat16), np.float32))
    want = reference(pool, q, tables, lengths, fresh, 0.07, 512)
    got = call(q, bits, tables, lengths, fresh, 0.07, 512, "float32")
    np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("path", paths(jnp.bfloat16, 576, 512, 64))
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_stale_rows_past_a_length_never_reach_the_result(path, poison):
    """Rows of a sequence's last page past its length hold whatever an earlier owner left (here NaN or inf):
    masked out of the scores and zeroed out of the values, they change nothing."""
    rng = np.random.default_rng(5)
    pool, bits, q, tables, lengths, fresh = make(rng, 6, 8, 576, 512, 64, 40, 4, jnp.bfloat16)
    tables = np.arange(1, 25, dtype=np.int32).reshape(6, 4)  # each sequence its own pages
    lengths = np.array([0, 1, 48, 63, 100, 255], np.int32)  # 48: a last page of whole 16-row blocks
    clean = call(q, bits, tables, lengths, fresh, 0.07, 512, path)
    dirty = np.asarray(bits).copy()
    stale = np.asarray(jnp.asarray(poison, jnp.bfloat16)[None].view(jnp.uint16))[0]
    for b, length in enumerate(lengths):
        page, row = tables[b, length // 64], length % 64
        dirty[page, row:] = stale
    got = call(q, jnp.asarray(dirty), tables, lengths, fresh, 0.07, 512, path)
    assert np.isfinite(got).all() and np.array_equal(got, clean)


@pytest.mark.parametrize("path", paths(jnp.bfloat16, 576, 512, 64))
def test_a_sequence_gets_the_same_bits_whatever_shares_its_batch_and_however_wide_its_table(path):
    rng = np.random.default_rng(1)
    pool, bits, q, tables, lengths, fresh = make(rng, 6, 8, 576, 512, 64, 40, 50, jnp.bfloat16)  # 1-2 pieces
    together = call(q, bits, tables, lengths, fresh, 0.1, 512, path)
    wide = np.concatenate([tables, rng.integers(0, 40, (6, 9)).astype(np.int32)], axis=1)  # padding entries
    for b in range(6):
        alone = call(q[b:b + 1], bits, wide[b:b + 1], lengths[b:b + 1], fresh[b:b + 1], 0.1, 512, path)
        assert np.array_equal(alone[0], together[b]), f"sequence {b} differs alone"


@pytest.mark.skipif(not cpu_kernels.decode_amx_available(), reason="without AMX every width is refused it")
@pytest.mark.parametrize("dtype, A, T, path", [(jnp.float32, 576, 64, "amx"), (jnp.bfloat16, 48, 64, "amx"),
                                                (jnp.bfloat16, 576, 16, "amx")])
def test_a_path_the_widths_do_not_allow_is_refused(dtype, A, T, path):
    pool, bits, q, tables, lengths, fresh = make(np.random.default_rng(3), 2, 8, A, 32, T, 10, 3, dtype)
    with pytest.raises(Exception, match="the asked-for path is unavailable"):
        call(q, bits, tables, lengths, fresh, 0.1, 32, path)


@pytest.mark.parametrize("page, length, why", [(40, 64, "a page id outside the pool"),
                                               (-1, 64, "a page id outside the pool"),
                                               (0, 4 * 64 + 1, "a length past its table")])
def test_a_bad_table_is_refused_not_read(page, length, why):
    pool, bits, q, tables, lengths, fresh = make(np.random.default_rng(2), 2, 8, 576, 512, 64, 40, 4, jnp.bfloat16)
    tables[1, 0], lengths[1] = page, length
    with pytest.raises(Exception, match=why):
        call(q, bits, tables, lengths, fresh, 0.1, 512)


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh process (the kernel's availability is decided once per process)."""
    return subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO)\n" + code],
                          env=os.environ | env, capture_output=True, text=True, timeout=300, cwd=ROOT)


ASK = "from model import cpu_kernels; print(cpu_kernels.available('cpu'))"


def test_the_kernel_is_built_once_per_machine_and_loaded_after(tmp_path):
    cache = str(tmp_path / "kernels")
    first = python(ASK, DEEPINFER_KERNEL_CACHE=cache)
    assert first.stdout.strip() == "(True, '')" and "building the CPU kernels" in first.stderr
    [built] = list((tmp_path / "kernels").glob("deepinfer-kernels-*.so"))  # no temporary file left behind
    second = python(ASK, DEEPINFER_KERNEL_CACHE=cache)
    assert second.stdout.strip() == "(True, '')" and "building" not in second.stderr
    assert list((tmp_path / "kernels").glob("*")) == [built]


@pytest.mark.parametrize("env, why", [({"DEEPINFER_CPU_KERNELS": "0"}, "disabled by DEEPINFER_CPU_KERNELS=0"),
                                      ({"CXX": "/nonexistent/g++"}, "build failed")])
def test_without_the_kernel_the_xla_backend_serves_and_says_why(tmp_path, env, why):
    done = python(ASK + "\nfrom model.config import preset\nfrom model.attention import make_backend\n"
                  "from model.serving import serving_model\nfrom model.weights import init_model\ncfg = preset('tiny')\n"
                  "model = serving_model(init_model(cfg), 'bfloat16')\n"
                  "print(make_backend('auto', cfg, 'cpu', 'bfloat16').name, model.head.lm_head.few_rows)",
                  DEEPINFER_KERNEL_CACHE=str(tmp_path / "kernels"), **env)
    verdict, kernels = done.stdout.strip().splitlines()
    assert verdict.startswith("(False, ") and why in verdict and kernels == "xla False"
    assert done.stderr.count("CPU kernels unavailable") == 1  # the operator is told, once


def test_a_gpu_or_tpu_pool_never_takes_the_cpu_kernel():
    assert cpu_kernels.available("gpu") == (False, "a CPU kernel; the pool is on gpu")


def few_rows(x, w):
    return np.asarray(jax.jit(cpu_kernels.few_row_product)(x, w))


@pytest.mark.parametrize("M, O, I", [(1, 129, 1024), (2, 7, 64), (3, 518, 384), (4, 1030, 2816), (2, 3, 32),
                                     (16, 1030, 1024), (17, 100, 64), (32, 2051, 1024)])
def test_few_row_product_matches_a_float64_reference(M, O, I):
    """x rounded to bfloat16 as `x.astype(bfloat16)` does, times bfloat16 weights, summed in float32; O not a
    multiple of the kernel's blocks (4 rows for one x row, 32 with AMX), nor of its threads' shares."""
    if M > cpu_kernels.few_rows_max():
        pytest.skip(f"{M} rows take AMX, AVX-512 or AVX2, which this CPU lacks")
    rng = np.random.default_rng(M * O)
    x = rng.standard_normal((M, I)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((O, I)), jnp.bfloat16)
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64) @ np.asarray(w, np.float64).T
    got = few_rows(x, w)
    assert got.shape == (M, O) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6 * np.sqrt(I) * np.abs(want).max(), rtol=0)


def test_a_row_gets_the_same_bits_whatever_other_rows_share_its_product():
    """Within a path (one row; several rows: AMX tiles where the CPU has them, else float32 FMAs): one row alone
    is its own path."""
    rng = np.random.default_rng(3)
    most = cpu_kernels.few_rows_max()
    x = rng.standard_normal((most, 1024)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((2051, 1024)), jnp.bfloat16)
    together = few_rows(x, w)
    for m in range(min(most, 6)):
        others = [m, (m + 1) % most, (m + 3) % most]
        assert np.array_equal(few_rows(x[others], w)[0], together[m]), f"row {m} differs among 3 rows"
        assert np.array_equal(few_rows(x[[m, (m + 2) % most]], w)[0], together[m]), f"row {m} differs in a pair"
        np.testing.assert_allclose(few_rows(x[m:m + 1], w)[0], together[m], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("N, M, O, I", [(8, 1, 512, 128), (8, 16, 128, 512), (3, 5, 100, 64), (2, 32, 64, 96),
                                        (8, 32, 64, 1024), (16, 17, 40, 1024)])
def test_a_batch_of_few_row_products_is_each_product_alone(N, M, O, I):
    """x (N, M, I) and w (N, O, I), as decode's absorbed attention calls it per head: each batch's bits are its
    own product's alone (O not a multiple of the blocks: 100 with AMX's 32-row blocks; the last two cases' x is
    large enough to be prepared on every thread, the second with a last group of one row)."""
    if M > cpu_kernels.few_rows_max():
        pytest.skip(f"{M} rows take AMX, AVX-512 or AVX2, which this CPU lacks")
    rng = np.random.default_rng(N * M * O)
    x = rng.standard_normal((N, M, I)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((N, O, I)), jnp.bfloat16)
    got = few_rows(x, w)
    assert got.shape == (N, M, O) and got.dtype == np.float32
    for n in range(N):
        assert np.array_equal(got[n], few_rows(x[n], w[n])), f"batch {n}"
    want = np.einsum("nmi,noi->nmo", np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64),
                     np.asarray(w, np.float64))
    np.testing.assert_allclose(got, want, atol=1e-6 * np.sqrt(I) * np.abs(want).max(), rtol=0)
    with pytest.raises(Exception, match="mismatched shapes"):
        few_rows(x, w[:-1])


def test_few_row_product_refuses_what_it_cannot_compute():
    too_many = cpu_kernels.few_rows_max() + 1
    for x, w, why in [
        (np.ones((too_many, 64), np.float32), jnp.ones((8, 64), jnp.bfloat16), "rows of a multiple of 32 columns"),
        (np.ones((2, 48), np.float32), jnp.ones((8, 48), jnp.bfloat16), "rows of a multiple of 32 columns"),
        (np.ones((2, 64), np.float32), jnp.ones((8, 64), jnp.float32), "the weights must be bfloat16"),
    ]:
        assert not cpu_kernels.few_rows_supported(*x.shape) or w.dtype != jnp.bfloat16
        with pytest.raises(Exception, match=why):
            few_rows(x, w)


def test_few_rows_reach_32_with_amx_avx512_or_avx2_and_4_without_where_xla_serves_them():
    flags = Path("/proc/cpuinfo").read_text().split()
    vector = "amx_bf16" in flags or "avx512f" in flags or ("avx2" in flags and "fma" in flags)
    assert cpu_kernels.few_rows_max() == (32 if vector else 4) and cpu_kernels.few_rows_serve() == vector


LOAD_ELSEWHERE = """
import ctypes, sys
import jax, jax.numpy as jnp, numpy as np
library = ctypes.cdll.LoadLibrary(sys.argv[1])
library.FewRowProductMaxRows.restype = ctypes.c_int64
jax.ffi.register_ffi_target("few_rows_elsewhere", jax.ffi.pycapsule(library.FewRowProduct), platform="cpu")
most = library.FewRowProductMaxRows()
rng = np.random.default_rng(0)
x = rng.standard_normal((most, 96)).astype(np.float32)
w = jnp.asarray(rng.standard_normal((37, 96)), jnp.bfloat16)
def product(rows):
    shape = jax.ShapeDtypeStruct((len(rows), 37), jnp.float32)
    return np.asarray(jax.ffi.ffi_call("few_rows_elsewhere", shape)(x[rows], w))
want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64) @ np.asarray(w, np.float64).T
together = product(list(range(most)))
np.testing.assert_allclose(together, want, atol=1e-5 * np.abs(want).max(), rtol=0)
assert np.array_equal(product([2, 0, most - 1]), together[[2, 0, most - 1]])  # a row's bits whoever shares it
np.testing.assert_allclose(product([1])[0], want[1], atol=1e-5 * np.abs(want).max(), rtol=0)
print(most)
"""


NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


@pytest.mark.parametrize("flags, most, needs", [
    (NO_AMX, 32, "avx512f"), (NO_AMX + ["-mno-avx512bf16"], 32, "avx512f"), (["-mno-avx512f"], 32, "avx2"),
    (["-mno-avx512f", "-mno-avx2", "-mno-fma"], 4, "")])
def test_few_row_product_on_cpus_without_amx_or_avx512_bf16(tmp_path, flags, most, needs):
    """The kernel's other paths, built here as they would be on another CPU: AVX-512 without AMX (up to 32
    rows, float32 FMAs; one row by AVX-512 BF16 dot products, or without them by the portable loop), AVX2 and
    FMA alone (1-32 rows, float32 FMAs in 8-float registers), and the portable loop (up to 4 rows). Each
    checked, where this CPU can run it, at its most rows, a row's bits whatever rows share it."""
    library = tmp_path / "few_rows.so"
    built = subprocess.run(["g++", *cpu_kernels.FLAGS, *flags, f"-I{jax.ffi.include_dir()}",
                            str(cpu_kernels.SOURCES[1]), "-o", str(library)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    if needs and needs not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"this CPU has no {needs} to run that build")
    done = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, str(library)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(most)


DECODE_ELSEWHERE = """
import ctypes, sys
import jax, jax.numpy as jnp, numpy as np
library = ctypes.cdll.LoadLibrary(sys.argv[1])
jax.ffi.register_ffi_target("decode_elsewhere", jax.ffi.pycapsule(library.PagedMlaDecode), platform="cpu")
rng = np.random.default_rng(0)
B, N, A, C, T, P, Q = 4, 13, 576, 512, 64, 50, 40  # 13 heads: groups of 4 (AVX2) or 8 and 4, and 1
pool = jnp.asarray(rng.standard_normal((P, T, A)), jnp.bfloat16)
bits = jax.lax.bitcast_convert_type(pool, jnp.uint16)
q = np.asarray(jnp.asarray(rng.standard_normal((B, N, A)), jnp.bfloat16), np.float32)
fresh = rng.standard_normal((B, A)).astype(np.float32)
tables = rng.integers(0, P, (B, Q)).astype(np.int32)
lengths = np.array([0, 1, 2049, Q * T], np.int32)  # its own latent only; one row; two pieces; every row
def decode(rows):
    shape = jax.ShapeDtypeStruct((len(rows), N, C), jnp.float32)
    call = jax.ffi.ffi_call("decode_elsewhere", shape)
    return np.asarray(call(q[rows], bits, tables[rows], lengths[rows], fresh[rows], scale=np.float32(0.07),
                           path=np.int32(1)))
got = decode([0, 1, 2, 3])
pool64 = np.asarray(pool.astype(jnp.float32), np.float64)
for b in range(B):
    kv = np.concatenate([pool64[tables[b]].reshape(-1, A)[:lengths[b]], fresh[b][None]])
    s = q[b].astype(np.float64) @ kv.T * 0.07
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ kv[:, :C]
    np.testing.assert_allclose(got[b], want, atol=2e-6 * np.abs(want).max(), rtol=0)
assert np.array_equal(decode([3, 1]), got[[3, 1]])  # a sequence's bits whatever shares its batch
print("ok")
"""


@pytest.mark.parametrize("flags, needs", [(NO_AMX, "avx512f"), (["-mno-avx512f"], "avx2"),
                                          (["-mno-avx512f", "-mno-avx2", "-mno-fma"], "")])
def test_the_decode_kernel_on_cpus_without_amx_or_avx512(tmp_path, flags, needs):
    """Its float32 path (tested above by name) as other CPUs build it: with AVX-512 but no AMX, with AVX2 and
    FMA alone (4 heads at a time in 8-float registers), and GCC's portable vectors; each run here, where this
    CPU can, against a float64 reference, a sequence's bits whatever shares its batch."""
    library = tmp_path / "decode.so"
    built = subprocess.run(["g++", *cpu_kernels.FLAGS, *flags, f"-I{jax.ffi.include_dir()}",
                            str(cpu_kernels.SOURCES[0]), "-o", str(library)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    if needs and needs not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"this CPU has no {needs} to run that build")
    done = subprocess.run([sys.executable, "-c", DECODE_ELSEWHERE, str(library)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def attention_reference(q, kv, pos, scale, view, C):
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)[:view]
    s = np.einsum("nta,sa->nts", q, kv) * scale
    s = np.where(np.arange(view)[None, None, :] <= np.asarray(pos)[None, :, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ kv[:, :C]


def prefill_attention(q, bits, pos, scale, view, C):
    return np.asarray(jax.jit(cpu_kernels.mla_prefill_attention, static_argnums=(3, 4, 5))(q, bits, pos, scale, view,
                                                                                          C))


def latents(rng, S, A):
    kv = jnp.asarray(rng.standard_normal((S, A)), jnp.bfloat16)
    return kv, jax.lax.bitcast_convert_type(kv, jnp.uint16)


needs_amx = pytest.mark.skipif(not cpu_kernels.prefill_attention_available(), reason="the prefill kernel needs AMX")


@needs_amx
@pytest.mark.parametrize("N, T, S, view, start, A, C", [
    (8, 64, 2048, 2048, 1984, 576, 512),  # mini's widths: a short chunk at the end of a long view
    (8, 37, 700, 650, 600, 576, 512),     # T not a multiple of 16
    (8, 37, 700, 650, 640, 576, 512),     # positions past the view: the last step's rows zero-filled
    (4, 16, 128, 128, 0, 64, 32),         # the first chunk of a prompt: each query sees itself and before
    (3, 130, 320, 300, 10, 96, 64),       # several groups of 256 rows; positions cross steps of 64
])
def test_prefill_attention_matches_a_float64_reference(N, T, S, view, start, A, C):
    rng = np.random.default_rng(T)
    q = jnp.asarray(rng.standard_normal((N, T, A)) * 0.2, jnp.bfloat16)
    kv, bits = latents(rng, S, A)
    pos = np.asarray(start + np.arange(T), np.int32)
    got = prefill_attention(q, bits, pos, 0.1, view, C)
    want = attention_reference(q, kv, np.minimum(pos, view - 1), 0.1, view, C)
    assert got.shape == (N, T, C) and got.dtype == np.float32
    # probabilities are rounded to bfloat16 before the values, as XLA's path rounds them
    np.testing.assert_allclose(got, want, atol=8e-3 * np.abs(want).max(), rtol=0)


@needs_amx
def test_a_query_gets_the_same_bits_whatever_else_shares_its_call():
    """Its own query, position and view alone: not the other tokens or heads of the chunk, nor how the chunk is
    cut (blocks of 64 view rows from row 0 whatever T is)."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((8, 48, 576)) * 0.2, jnp.bfloat16)
    _, bits = latents(rng, 1024, 576)
    pos = np.asarray(900 + np.arange(48), np.int32)
    together = prefill_attention(q, bits, pos, 0.07, 1000, 512)
    for t in (0, 17, 47):
        alone = prefill_attention(q[3:4, t:t + 1], bits, pos[t:t + 1], 0.07, 1000, 512)
        assert np.array_equal(alone[0, 0], together[3, t]), f"token {t} differs alone"
    half = prefill_attention(q[:, 16:], bits, pos[16:], 0.07, 1000, 512)
    assert np.array_equal(half, together[:, 16:])


@needs_amx
@pytest.mark.parametrize("q_shape, S, C, why", [((2, 4, 48), 64, 32, "multiples of 32"),
                                                ((2, 4, 64), 64, 96, "multiples of 32, C <= A"),
                                                ((2, 4, 64), 32, 32, "valid <= S")])
def test_prefill_attention_refuses_what_it_cannot_compute(q_shape, S, C, why):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal(q_shape), jnp.bfloat16)
    _, bits = latents(rng, S, q_shape[-1])
    with pytest.raises(Exception, match=why):
        prefill_attention(q, bits, np.arange(q_shape[1], dtype=np.int32), 0.1, 64, C)


def paged_prefill_attention(q, pool, tables, pos, scale, view, C):
    return np.asarray(jax.jit(cpu_kernels.mla_prefill_paged_attention, static_argnums=(4, 5, 6))(
        q, pool, tables, pos, scale, view, C))


@needs_amx
@pytest.mark.parametrize("page, T", [(64, 64), (128, 37)])  # 37: tiles of query rows that are not whole 16s
def test_paged_prefill_attention_gives_each_tile_the_bits_of_its_gathered_view(page, T):
    """Tiles of several sequences in one call, each over its own pages read in place (shared pages too, as a
    prefix kept hot; two tiles of one sequence, laid out once), give each tile what the single-view call gives
    it over its pages gathered; the result also stays within tolerance of a float64 reference."""
    rng = np.random.default_rng(page)
    N, A, C, P, Q = 8, 576, 512, 24, 4
    pool_kv, pool = latents(rng, P * page, A)
    pool, pool_kv = pool.reshape(P, page, A), pool_kv.reshape(P, page, A)
    tables = np.stack([rng.choice(np.arange(1, P), Q, replace=False) for _ in range(4)]).astype(np.int32)
    tables[3, :2] = tables[0, :2]  # a prefix two sequences share
    tables[2] = tables[1]  # one sequence's segment of two tiles
    view = Q * page - 40  # rows past it are never read, whatever the positions
    pos = np.stack([s + np.arange(T) for s in (0, 100, view - T, view - 10)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((N, 4 * T, A)) * 0.2, jnp.bfloat16)
    got = paged_prefill_attention(q, pool, tables, pos, 0.07, view, C)
    assert got.shape == (N, 4 * T, C) and got.dtype == np.float32
    for m in range(4):
        rows = slice(m * T, (m + 1) * T)
        alone = prefill_attention(q[:, rows], pool[tables[m]].reshape(-1, A), pos[m], 0.07, view, C)
        assert np.array_equal(got[:, rows], alone), f"tile {m} differs from its gathered view"
        want = attention_reference(q[:, rows], pool_kv[tables[m]].reshape(-1, A), np.minimum(pos[m], view - 1),
                                   0.07, view, C)
        np.testing.assert_allclose(got[:, rows], want, atol=8e-3 * np.abs(want).max(), rtol=0)


@needs_amx
@pytest.mark.parametrize("page, table_page, view, why", [(64, 9, 128, "outside the pool"),
                                                         (64, -1, 128, "outside the pool"),
                                                         (32, 1, 64, "multiple of 64"),
                                                         (64, 1, 192, "valid <= Q \\* B")])
def test_paged_prefill_attention_refuses_a_table_or_pool_it_cannot_read(page, table_page, view, why):
    rng = np.random.default_rng(1)
    _, pool = latents(rng, 8 * page, 64)
    tables = np.asarray([[1, table_page]], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.bfloat16)
    with pytest.raises(Exception, match=why):
        paged_prefill_attention(q, pool.reshape(8, page, 64), tables, np.arange(16, dtype=np.int32)[None] + 64,
                                0.1, view, 32)


def expanded_prefill_attention(q, pool, table, pos, w_uk, w_uv, scale, view, end=None):
    """The expanded form's two calls: the keys and values of the first `end` rows (the view by default) laid out
    in a buffer of `view` rows, rounded up to 64, then the attention over them."""
    into = jnp.zeros((q.shape[0], -(-view // 64) * 64, q.shape[-1] + w_uv.shape[-1]), jnp.uint16)
    laid = jax.jit(cpu_kernels.mla_expand_pages, donate_argnums=(5,))(pool, table, np.int32(end or view), w_uk, w_uv,
                                                                       into)
    return np.asarray(jax.jit(cpu_kernels.mla_prefill_expanded_attention, static_argnums=(3,))(q, laid, pos, scale))


def expanded_problem(rng, N, T, page, P, Q, Cl=512, R=64, H=128, V=128):
    """A pool of random latents, a table of Q of its pages, MLA's up-projections and queries (bfloat16)."""
    pool_kv, pool = latents(rng, P * page, Cl + R)
    table = rng.choice(np.arange(1, P), Q, replace=False).astype(np.int32)
    w_uk = jnp.asarray(rng.standard_normal((Cl, N, H)) * 0.05, jnp.bfloat16)
    w_uv = jnp.asarray(rng.standard_normal((Cl, N, V)) * 0.05, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((N, T, H + R)) * 0.3, jnp.bfloat16)
    return pool_kv.reshape(P, page, -1), pool.reshape(P, page, -1), table, w_uk, w_uv, q


def expanded_reference(q, kv, w_uk, w_uv, pos, scale, view):
    """Keys [c_kv @ W_UK | k_pe] and values c_kv @ W_UV rounded to bfloat16 (as the expanded form keeps them),
    then attention in float64."""
    kv = np.asarray(jnp.asarray(kv).astype(jnp.float32), np.float64)[:view]
    Cl = w_uk.shape[0]
    w_uk, w_uv = np.asarray(w_uk.astype(jnp.float32), np.float64), np.asarray(w_uv.astype(jnp.float32), np.float64)
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    k_nope = bf16(np.einsum("sc,cnh->nsh", kv[:, :Cl], w_uk))
    keys = np.concatenate([k_nope, np.broadcast_to(kv[None, :, Cl:], (k_nope.shape[0], view, kv.shape[1] - Cl))], -1)
    values = bf16(np.einsum("sc,cnv->nsv", kv[:, :Cl], w_uv))
    s = np.einsum("ntk,nsk->nts", np.asarray(q.astype(jnp.float32), np.float64), keys) * scale
    s = np.where(np.arange(view)[None, None, :] <= np.asarray(pos)[None, :, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nts,nsv->ntv", w / w.sum(-1, keepdims=True), values)


@needs_amx
@pytest.mark.parametrize("N, T, page, view, start", [
    (8, 64, 64, 1024, 960),   # mini's widths: a chunk at the end of its view
    (8, 37, 64, 650, 600),    # T not a multiple of 16; the last step's rows past the view zero-filled
    (2, 300, 128, 700, 0),    # the first chunk of a prompt over several groups of 256 rows; pages of 128 rows
])
def test_expanded_prefill_attention_matches_a_float64_reference(N, T, page, view, start):
    """Each head's keys and values computed from the pages' latents inside the kernel, then its attention."""
    rng = np.random.default_rng(T)
    pool_kv, pool, table, w_uk, w_uv, q = expanded_problem(rng, N, T, page, P=24, Q=-(-view // page))
    pos = np.minimum(start + np.arange(T), view - 1).astype(np.int32)  # positions below the expanded rows
    got = expanded_prefill_attention(q, pool, table, pos, w_uk, w_uv, 0.07, view)
    want = expanded_reference(q, pool_kv[table].reshape(-1, pool.shape[-1]), w_uk, w_uv, pos, 0.07, view)
    assert got.shape == (N, T, 128) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=8e-3 * np.abs(want).max(), rtol=0)


@needs_amx
def test_expanded_prefill_attention_gives_a_query_the_same_bits_whatever_else_shares_its_call():
    """Its own query, position and pages alone: not the other tokens or heads, nor how the chunk is cut, nor how
    many rows past its position were expanded."""
    rng = np.random.default_rng(3)
    _, pool, table, w_uk, w_uv, q = expanded_problem(rng, 4, 48, 64, P=20, Q=16)
    pos = np.asarray(900 + np.arange(48), np.int32)
    together = expanded_prefill_attention(q, pool, table, pos, w_uk, w_uv, 0.07, 1000)
    half = expanded_prefill_attention(q[:, 16:], pool, table, pos[16:], w_uk, w_uv, 0.07, 1000)
    assert np.array_equal(half, together[:, 16:])
    one = expanded_prefill_attention(q[:, 47:], pool, table, pos[47:], w_uk, w_uv, 0.07, 1000)
    assert np.array_equal(one[:, 0], together[:, 47])
    fewer = expanded_prefill_attention(q[:, :16], pool, table, pos[:16], w_uk, w_uv, 0.07, 1000, end=916)
    assert np.array_equal(fewer, together[:, :16])


@needs_amx
@pytest.mark.parametrize("table_page, view, why", [(30, 128, "outside the pool"), (-1, 128, "outside the pool"),
                                                   (1, 192, "end <= Q \\* B")])
def test_expanded_prefill_attention_refuses_a_table_it_cannot_read(table_page, view, why):
    rng = np.random.default_rng(1)
    _, pool, _, w_uk, w_uv, q = expanded_problem(rng, 2, 16, 64, P=8, Q=2)
    with pytest.raises(Exception, match=why):
        expanded_prefill_attention(q, pool, np.asarray([1, table_page], np.int32), np.arange(16, dtype=np.int32) + 64,
                                   w_uk, w_uv, 0.1, view)
