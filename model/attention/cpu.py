"""The `cpu` attention backend: our C++ kernels (model/cpu_kernels.py) where they serve, `xla`'s paths elsewhere.

Decode attention reads each sequence's pages in place, and W_UK / W_UV per head take the few-row kernel. With
AMX, prefill attention reads the pages in place too: absorbed, a pass's tiles in one call ("pages"); expanded, each
layer's keys and values laid out once and each chunk over them ("laid"). The kernels read only each row's own
range, so their tables have one width: one compiled shape per batch or chunk size.
"""
from __future__ import annotations

import jax.numpy as jnp

from model import cpu_kernels
from model.attention.base import Absorbed, PrefillForm
from model.attention.xla import KEY_BLOCK, XlaBackend
from model.mla import prefer_absorbed

LAID_ROWS = 4096  # the expanded form's keys and values buffer: rows, at least (then powers of two)


def cpu_serves(cfg) -> bool:
    """Whether the cpu backend is the best one here: our kernels build and decode attention takes them."""
    return (cpu_kernels.available("cpu")[0] and cpu_kernels.decode_serves()
            and cpu_kernels.supports(cfg.latent_dim, cfg.kv_lora_rank))


class CpuBackend(XlaBackend):
    name = "cpu"

    def __init__(self, cfg, platform: str, dtype: str, key_block: int = KEY_BLOCK, decode_kernel: bool | None = None,
                 decode_path: str | None = None, few_rows: bool | None = None, prefill_kernel: bool | None = None,
                 page_tokens: int = 64):
        """None decides by this CPU (what serves); benchmarks and tests name each kernel on or off."""
        super().__init__(cfg, platform, dtype, key_block)
        built, why = cpu_kernels.available("cpu")
        decodes = built and cpu_kernels.supports(cfg.latent_dim, cfg.kv_lora_rank)
        self.decode_kernel = decodes and cpu_kernels.decode_serves() if decode_kernel is None else decode_kernel
        if self.decode_kernel and not decodes:
            raise ValueError(f"the CPU decode kernel was asked for but is unavailable: {why or 'unsupported dims'}")
        # "auto" (AMX rounds to bfloat16, as xla's path does at a bfloat16 decode dtype), or float32 served in float32
        self.decode_path = decode_path or ("auto" if self.decode_dtype == jnp.bfloat16 else "float32")
        bf16 = self.dtype == jnp.bfloat16
        self.few_rows = built and bf16 and cpu_kernels.few_rows_serve() if few_rows is None else few_rows
        A, C = cfg.latent_dim, cfg.kv_lora_rank
        prefills = (built and bf16 and jnp.dtype(cfg.cache_dtype) == jnp.bfloat16 and page_tokens % 64 == 0
                    and cpu_kernels.prefill_attention_available() and cpu_kernels.prefill_attention_supports(A, C))
        self.prefill_kernel = prefills if prefill_kernel is None else prefill_kernel
        if self.prefill_kernel and not prefills:
            raise ValueError("the CPU prefill kernel was asked for but cannot read this pool here (it needs AMX, "
                             "bfloat16 and pages of whole 64-row steps)")
        H, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.expands_pages = (self.prefill_kernel and all(w % 32 == 0 for w in (H, R, V, C))
                              and V <= H + R <= 1024 and A <= 1024)
        self.decode_by_longest = not self.decode_kernel

    def absorbed(self, attn) -> Absorbed:
        """bfloat16 for the few-row kernel, else float32 (XLA:CPU's float32 products of a few rows are faster)."""
        return Absorbed.of(attn, jnp.bfloat16 if self.few_rows else jnp.float32)

    def per_head(self, x_NBI, w_NOI):
        """The few-row kernel over all heads where the rows allow (x rounded to bfloat16), else XLA's float32."""
        if not self.few_rows:
            return jnp.einsum("nbi,noi->nbo", x_NBI.astype(jnp.float32), w_NOI.astype(jnp.float32))
        if cpu_kernels.few_rows_supported(x_NBI.shape[1], x_NBI.shape[2]):
            return cpu_kernels.few_row_product(x_NBI, w_NOI)
        x_NBI = x_NBI.astype(w_NOI.dtype).astype(jnp.float32)
        return jnp.einsum("nbi,noi->nbo", x_NBI, w_NOI.astype(jnp.float32))

    def decode(self, attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA):
        if not self.decode_kernel:
            return super().decode(attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA)
        return cpu_kernels.paged_mla_decode(q_BNA, pool_PBA, tables_BQ, positions_B, latents_BA.astype(q_BNA.dtype),
                                            attn.scale, attn.kv_lora_rank, self.decode_path)

    def prefill_form(self, n, end, choice="auto", tiles=1):
        """The kernel's expanded form lays out one sequence's keys and values: a pass of several takes "pages"."""
        if not self.prefill_kernel or n == 1 or (choice == "expanded" and (tiles > 1 or not self.expands_pages)):
            return super().prefill_form(n, end, choice)
        # absorbed kernel alone: always absorbed (faster than XLA's expanded form); with both, xla's FLOP rule
        absorbed = (choice == "absorbed" or not self.expands_pages or tiles > 1 or choice == "auto"
                    and prefer_absorbed(self.cfg, n, end))
        return PrefillForm("pages", False, True) if absorbed else PrefillForm("laid", True, True)

    def context_buffer(self, form: str, end: int, previous):
        """The buffer of "laid" (N, rows, H + R + V) raw bits: the previous layer's when it fits, donated."""
        if form != "laid":
            return None
        cfg = self.cfg
        shape = (cfg.num_heads, max(LAID_ROWS, 1 << (end - 1).bit_length()),
                 cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        return previous if previous is not None and previous.shape == shape else jnp.empty(shape, jnp.uint16)

    def prefill_context(self, attn, pool_PBA, tables_MQ, end, form, into=None):
        if form == "pages":
            return None  # read in place by the attention itself
        if form == "laid":
            return cpu_kernels.mla_expand_pages(pool_PBA, tables_MQ[0], end, attn.w_uk[...], attn.w_uv[...], into)
        return super().prefill_context(attn, pool_PBA, tables_MQ, end, form, into)

    def prefill_attend(self, attn, q_nope_NRH, q_pe_NRR, positions_MT, pool_PBA, tables_MQ, context, form):
        dtype = attn.w_uk.dtype
        if form == "pages":
            q_NRA = attn.absorbed_queries(q_nope_NRH.astype(dtype), q_pe_NRR.astype(dtype))
            view = tables_MQ.shape[1] * pool_PBA.shape[1]
            out_NRC = cpu_kernels.mla_prefill_paged_attention(q_NRA, pool_PBA, tables_MQ, positions_MT, attn.scale,
                                                              view, attn.kv_lora_rank)
            return attn.output(attn.latent_values(out_NRC.astype(dtype)))
        if form == "laid":
            q_NTK = jnp.concatenate([q_nope_NRH.astype(dtype), q_pe_NRR.astype(dtype)], axis=-1)
            return attn.output(cpu_kernels.mla_prefill_expanded_attention(q_NTK, context, positions_MT[0], attn.scale))
        return super().prefill_attend(attn, q_nope_NRH, q_pe_NRR, positions_MT, pool_PBA, tables_MQ, context, form)
