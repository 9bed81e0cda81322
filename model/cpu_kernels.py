"""CPU kernels of our own as XLA FFI custom calls, built on first use (one library, `$CXX` or g++ at -march=native,
cached by everything that shapes the binary; without a compiler, or with DEEPINFER_CPU_KERNELS=0, XLA's paths serve).
- `paged_mla_decode`: decode attention read in place from the paged pool.
- `few_row_product`: a few rows times bfloat16 weights, streaming them once (XLA:CPU's runs below memory speed).
- AMX only: `mla_prefill_attention` and `mla_prefill_paged_attention`, absorbed prefill attention over a view or
  over pages in place; `mla_expand_pages` and `mla_prefill_expanded_attention`, the expanded form.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("kernels") / name for name in ("paged_mla_decode.cc", "few_row_product.cc",
                                                                                 "mla_prefill_attention.cc"))
HEADERS = tuple(Path(__file__).with_name("kernels") / name for name in ("parallel.h", "amx.h"))  # included by them
TARGET = "deepinfer_paged_mla_decode"
FEW_ROWS_TARGET = "deepinfer_few_row_product"
PREFILL_TARGET = "deepinfer_mla_prefill_attention"
PAGED_PREFILL_TARGET = "deepinfer_mla_prefill_paged_attention"
EXPANDED_PREFILL_TARGET = "deepinfer_mla_prefill_expanded_attention"
EXPAND_PAGES_TARGET = "deepinfer_mla_expand_pages"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
LANES = 16  # the kernel works in vectors of 16 floats: its A and C must be multiples

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once decided, "why": the reason when not


def _cache_dir() -> Path:
    jax_cache = os.environ.get("DEEPINFER_JAX_CACHE", os.path.expanduser("~/.cache/deepinfer/jax"))
    return Path(os.environ.get("DEEPINFER_KERNEL_CACHE", os.path.join(jax_cache, "kernels")))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def has_amx() -> bool:
    """Whether this CPU's flags list AMX's bfloat16 tiles (whether the OS grants them is the kernels' check)."""
    return "amx_bf16" in _cpu_flags().split()


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler, JAX and CPU: from the cache, else compiled into it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    include = jax.ffi.include_dir()
    texts = [path.read_text() for path in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, compiler, version, " ".join(FLAGS), jax.__version__,
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"deepinfer-kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the CPU kernels (once per machine): %s", out)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{include}", *map(str, SOURCES), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: engines starting together each build, one file wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> tuple[bool, str]:
    if os.environ.get("DEEPINFER_CPU_KERNELS", "1") == "0":
        return False, "disabled by DEEPINFER_CPU_KERNELS=0"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return False, "no C++ compiler (set CXX or install g++)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        for target, symbol in ((TARGET, "PagedMlaDecode"), (FEW_ROWS_TARGET, "FewRowProduct"),
                               (PREFILL_TARGET, "MlaPrefillAttention"),
                               (PAGED_PREFILL_TARGET, "MlaPrefillPagedAttention"),
                               (EXPANDED_PREFILL_TARGET, "MlaPrefillExpandedAttention"),
                               (EXPAND_PAGES_TARGET, "MlaExpandPages")):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        library.FewRowProductMaxRows.restype = ctypes.c_int64
        _state["few_rows"] = int(library.FewRowProductMaxRows())
        _state["prefill"] = bool(library.MlaPrefillAttentionAvailable())  # AMX only
        _state["decode_amx"] = bool(library.PagedMlaDecodeAmxAvailable())
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, f"build failed: {e}"
    return True, ""


def available(platform_name: str) -> tuple[bool, str]:
    """Whether the kernels serve arrays on this platform, and if not, why (built once per process)."""
    if platform_name != "cpu":
        return False, f"a CPU kernel; the pool is on {platform_name}"
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
            if not _state["ok"]:
                log.warning("CPU kernels unavailable (%s): decode uses XLA's products", _state["why"])
    return bool(_state["ok"]), str(_state["why"])


def supports(latent_dim: int, value_dim: int) -> bool:
    return latent_dim % LANES == 0 and value_dim % LANES == 0 and value_dim <= latent_dim


DECODE_PATHS = {"auto": 0, "float32": 1, "amx": 2}  # kernels/paged_mla_decode.cc's paths


def paged_mla_decode(q_BNA: jax.Array, pool_PBA: jax.Array, tables_BQ: jax.Array, lengths_B: jax.Array,
                     fresh_BA: jax.Array, scale: float, value_dim: int, path: str = "auto") -> jax.Array:
    """Softmax-weighted values (B, N, value_dim) float32 of each query over rows [0, lengths_B[b]) of its pages (raw
    bits) and its own latent fresh_BA[b]; `path`: "auto" or one named. The AMX path rounds q to bfloat16."""
    B, N, _ = q_BNA.shape
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, N, value_dim), jnp.float32))(
        q_BNA.astype(jnp.float32), pool_PBA, tables_BQ.astype(jnp.int32), lengths_B.astype(jnp.int32),
        fresh_BA.astype(jnp.float32), scale=np.float32(scale), path=np.int32(DECODE_PATHS[path]))


def few_rows_max() -> int:
    """The most rows few_row_product takes on this CPU (0 without our kernels)."""
    return int(_state.get("few_rows", 0)) if available("cpu")[0] else 0


def cpu_kind() -> str:
    """Which of the kernels' vector paths this CPU takes: "amx", "avx512", "avx2" (with FMA) or "portable"."""
    flags = _cpu_flags().split()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags and "fma" in flags else "portable"


def decode_serves() -> bool:
    """Whether the decode kernel serves this CPU (where it builds): not on portable vectors, which lose to XLA."""
    return cpu_kind() != "portable"


def few_rows_serve() -> bool:
    """Whether serving takes the few-row kernel: where it builds, not on portable vectors, which lose to XLA."""
    return few_rows_max() > 0 and cpu_kind() != "portable"


def few_rows_supported(rows: int, in_dim: int) -> bool:
    return 1 <= rows <= few_rows_max() and in_dim % 32 == 0


def few_row_product(x_MI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """x_MI (1 to few_rows_max() rows, I a multiple of 32) @ w_OI.T for bfloat16 w_OI, reading each weight once:
    (M, O) float32 of x rounded to bfloat16; a leading batch N gives N products in one call, (N, M, O)."""
    *lead, M, _ = x_MI.shape
    O = w_OI.shape[-2]
    return jax.ffi.ffi_call(FEW_ROWS_TARGET, jax.ShapeDtypeStruct((*lead, M, O), jnp.float32),
                            vmap_method="sequential")(x_MI.astype(jnp.float32), w_OI)


def decode_amx_available() -> bool:
    """Whether paged_mla_decode has its AMX path (bfloat16 pools, widths of 32, pages of whole 32-row steps)."""
    return available("cpu")[0] and bool(_state.get("decode_amx", False))


def prefill_attention_available() -> bool:
    """Whether mla_prefill_attention runs on this CPU (our kernels built, and AMX granted)."""
    return available("cpu")[0] and bool(_state.get("prefill", False))


def prefill_attention_supports(latent_dim: int, value_dim: int) -> bool:
    return latent_dim % 32 == 0 and value_dim % 32 == 0 and value_dim <= latent_dim <= 1024


def mla_prefill_attention(q_NTA: jax.Array, view_SA: jax.Array, positions_T: jax.Array, scale: float, view: int,
                          value_dim: int) -> jax.Array:
    """Absorbed attention of T queries' N heads (bfloat16 q_NTA) over rows [0, min(position + 1, view)) of a latent
    view (raw bfloat16 bits): the normalised softmax-weighted latents (N, T, value_dim) float32."""
    N, T, _ = q_NTA.shape
    return jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct((N, T, value_dim), jnp.float32),
                            vmap_method="sequential")(
        q_NTA.astype(jnp.bfloat16), view_SA, positions_T.astype(jnp.int32), scale=np.float32(scale),
        valid=np.int64(view), C=np.int64(value_dim))


def mla_expand_pages(pool_PBA: jax.Array, table_Q: jax.Array, end: jax.Array, w_uk_CNH: jax.Array,
                     w_uv_CNV: jax.Array, into_NSX: jax.Array) -> jax.Array:
    """Each head's keys [c_kv @ W_UK | k_pe] and values c_kv @ W_UV of the first `end` (traced) rows of one sequence's
    pages (raw bfloat16 bits, through table_Q), laid out for mla_prefill_expanded_attention: (N, rows, H + R + V) raw
    bits in into_NSX's memory (aliased: donate it). Rows past end's 64-row step are not written."""
    C, N, H = w_uk_CNH.shape
    V = w_uv_CNV.shape[-1]
    A = H + pool_PBA.shape[-1] - C
    # W_UK^T as A tiles (N, H / 16, C / 32, 16 dims, 32 latent columns); W_UV as B tiles (N, V / 16, C / 32, 16
    # column pairs, 16 value columns, 2): the products' operands as the tiles load them
    w_uk = w_uk_CNH.astype(jnp.bfloat16).reshape(C // 32, 32, N, H // 16, 16).transpose(2, 3, 0, 4, 1)
    w_uv = w_uv_CNV.astype(jnp.bfloat16).reshape(C // 32, 16, 2, N, V // 16, 16).transpose(3, 4, 0, 1, 5, 2)
    if into_NSX.shape[0] != N or into_NSX.shape[2] != A + V or into_NSX.dtype != jnp.uint16:
        raise ValueError(f"mla_expand_pages: into {into_NSX.shape} {into_NSX.dtype}, want (N, rows, {A + V}) uint16")
    return jax.ffi.ffi_call(EXPAND_PAGES_TARGET, jax.ShapeDtypeStruct(into_NSX.shape, jnp.uint16),
                            input_output_aliases={5: 0})(
        pool_PBA, table_Q.astype(jnp.int32), jnp.reshape(end, (1,)).astype(jnp.int32), w_uk, w_uv, into_NSX)


def mla_prefill_expanded_attention(q_NTK: jax.Array, laid_NSX: jax.Array, positions_T: jax.Array,
                                   scale: float) -> jax.Array:
    """Expanded MLA attention of T queries' N heads (q_NTK = [q_nope | q_pe], bfloat16) over rows [0, position]
    of each head's keys and values laid out by mla_expand_pages: the softmax-weighted values (N, T, V) float32."""
    N, T, A = q_NTK.shape
    return jax.ffi.ffi_call(EXPANDED_PREFILL_TARGET,
                            jax.ShapeDtypeStruct((N, T, laid_NSX.shape[-1] - A), jnp.float32))(
        q_NTK.astype(jnp.bfloat16), laid_NSX, positions_T.astype(jnp.int32), scale=np.float32(scale))


def mla_prefill_paged_attention(q_NRA: jax.Array, pool_PBA: jax.Array, tables_MQ: jax.Array, positions_MT: jax.Array,
                                scale: float, view: int, value_dim: int) -> jax.Array:
    """`mla_prefill_attention` of M tiles of T tokens (R = M * T rows per head), each over its own sequence's pages
    in place (tables_MQ[m], whole 64-row steps): (N, R, value_dim) float32, bit for bit the gathered view's."""
    N, R, _ = q_NRA.shape
    return jax.ffi.ffi_call(PAGED_PREFILL_TARGET, jax.ShapeDtypeStruct((N, R, value_dim), jnp.float32))(
        q_NRA.astype(jnp.bfloat16), pool_PBA, tables_MQ.astype(jnp.int32), positions_MT.astype(jnp.int32),
        scale=np.float32(scale), valid=np.int64(view), C=np.int64(value_dim))
