"""Every attention backend held to the invariants model/attention/base.py states: causal and private reads,
precision against a float64 reference, no whole-context copy in decode, batch invariance, an explicit platform."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import cpu_kernels
from model.attention import make_backend
from model.config import preset
from model.latent_pool import bits_dtype
from model.mla import MLAttention

CFG = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)  # widths kernels take
PAGE, PAGES, Q = 64, 24, 8  # pool pages of 64 rows; tables of 8 pages (512 rows, one decode key block)


def backends() -> list[tuple[str, dict]]:
    out = [("xla", {}), ("pallas", {})]  # pallas: its GPU kernel in Pallas's interpret mode
    if cpu_kernels.available("cpu")[0]:
        out.append(("cpu", {"decode_kernel": True}))
    return out


BACKENDS = backends()
IDS = [name for name, _ in BACKENDS]


@pytest.fixture(scope="module")
def attn():
    return MLAttention(CFG, nnx.Rngs(params=2))


def pool_of(values_PBA: np.ndarray) -> jax.Array:
    """A pool of raw bfloat16 bits from float values."""
    return jax.lax.bitcast_convert_type(jnp.asarray(values_PBA, jnp.bfloat16), bits_dtype(jnp.bfloat16))


def random_pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((PAGES, PAGE, CFG.latent_dim)).astype(np.float32)


def queries(seed: int, B: int, attn) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q_BNA = jnp.asarray(rng.standard_normal((B, CFG.num_heads, CFG.latent_dim)), jnp.bfloat16)
    new_BA = jnp.asarray(rng.standard_normal((B, CFG.latent_dim)), jnp.bfloat16)
    return q_BNA, new_BA


def decode(name, options, attn, q_BNA, positions, pool, tables, new_BA) -> np.ndarray:
    backend = make_backend(name, CFG, "cpu", "bfloat16", **options)
    call = jax.jit(lambda q, p, pl, t, n: backend.decode(attn, q, p, pl, t, n))
    return np.asarray(call(q_BNA, jnp.asarray(positions, jnp.int32), pool, jnp.asarray(tables, jnp.int32), new_BA))


def decode_reference(attn, q_BNA, positions, values_PBA, tables, new_BA) -> np.ndarray:
    """float64 softmax over each row's pages [0, position) and its own latent, at the cache's (bfloat16) values."""
    values = np.asarray(jnp.asarray(values_PBA, jnp.bfloat16), np.float64)
    q, new = np.asarray(q_BNA, np.float64), np.asarray(new_BA, np.float64)
    out = []
    for b, p in enumerate(positions):
        rows = np.concatenate([values[page] for page in tables[b]])[:p]
        kv = np.concatenate([rows, new[b][None]])  # (p + 1, A)
        scores = q[b] @ kv.T * attn.scale  # (N, p + 1)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out.append((weights / weights.sum(-1, keepdims=True)) @ kv[:, :CFG.kv_lora_rank])
    return np.stack(out)


TABLES = [list(range(1, 9)), list(range(9, 17)), [17, 18, 0, 0, 0, 0, 0, 0]]  # the third padded with scratch
POSITIONS = [300, 1, 100]


@pytest.mark.parametrize("name, options", BACKENDS, ids=IDS)
def test_decode_matches_a_float64_reference_and_reads_only_each_rows_own_past(attn, name, options):
    values = random_pool(1)
    q_BNA, new_BA = queries(2, 3, attn)
    got = decode(name, options, attn, q_BNA, POSITIONS, pool_of(values), TABLES, new_BA)
    want = decode_reference(attn, q_BNA, POSITIONS, values, TABLES, new_BA)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)
    # Rows at or past each position in its pages, pages no table names, the scratch page: all changed (finite).
    changed = values.copy()
    for b, p in enumerate(POSITIONS):
        flat = np.concatenate([changed[page] for page in TABLES[b]])
        flat[p:] = 7.0 * np.sign(flat[p:]) + 3.0
        for i, page in enumerate(TABLES[b]):
            if page:
                changed[page] = flat[i * PAGE:(i + 1) * PAGE]
    changed[0], changed[19:] = 5.0, -9.0
    again = decode(name, options, attn, q_BNA, POSITIONS, pool_of(changed), TABLES, new_BA)
    np.testing.assert_array_equal(again, got)


@pytest.mark.parametrize("name, options", BACKENDS, ids=IDS)
def test_decode_rows_are_batch_invariant_whatever_shares_their_batch_or_their_tables_width(attn, name, options):
    """At one batch size (the runner pads every batch to one size in batch-invariant mode), a row's bits are the
    same whatever the other rows hold (padding, or a far longer context: the xla backend's key blocks follow the
    batch's longest position) and however wide the tables are."""
    values = pool_of(random_pool(3))
    q_BNA, new_BA = queries(4, 3, attn)
    together = decode(name, options, attn, q_BNA, POSITIONS, values, TABLES, new_BA)
    padding = [0] * 16
    for b in range(3):
        rows = [b, 0, 0]
        alone = decode(name, options, attn, q_BNA[np.asarray(rows)], [POSITIONS[b], 0, 0], values,
                       [TABLES[b] + [0] * 8, padding, padding], new_BA[np.asarray(rows)])
        np.testing.assert_array_equal(alone[0], together[b])
        longer = [19, 20, 21, 22, 23, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # 900 rows over two key blocks
        mixed = decode(name, options, attn, q_BNA[np.asarray(rows)], [POSITIONS[b], 900, 0], values,
                       [TABLES[b] + [0] * 8, longer, padding], new_BA[np.asarray(rows)])
        np.testing.assert_array_equal(mixed[0], together[b])


@pytest.mark.parametrize("name, options", BACKENDS, ids=IDS)
def test_prefill_tiles_read_their_own_pages_causally(attn, name, options):
    """Two tiles of one page each, each over its own table: the outputs follow each tile's causal rows only."""
    backend = make_backend(name, CFG, "cpu", "bfloat16", **options)
    form = backend.prefill_form(PAGE, 512, "absorbed")
    values = random_pool(5)
    rng = np.random.default_rng(6)
    N, T = CFG.num_heads, PAGE
    q_nope = jnp.asarray(rng.standard_normal((N, 2 * T, CFG.qk_nope_head_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((N, 2 * T, CFG.qk_rope_head_dim)), jnp.float32)
    positions_MT = np.stack([200 + np.arange(T), np.arange(T)]).astype(np.int32)
    tables_MQ = np.asarray([list(range(1, 9)), [9] + [0] * 7], np.int32)

    @jax.jit
    def attend(pool):
        context = backend.prefill_context(attn, pool, tables_MQ, jnp.int32(264), form.name, None)
        return backend.prefill_attend(attn, q_nope, q_pe, positions_MT, pool, tables_MQ, context, form.name)

    got = np.asarray(attend(pool_of(values)))
    changed = values.copy()
    changed[4, 200 - 3 * PAGE + T:] = 11.0  # tile 1: past its last row (263), on its 4th page
    changed[10:], changed[0] = -4.0, 6.0  # pages no table names, and the scratch page
    np.testing.assert_array_equal(np.asarray(attend(pool_of(changed))), got)
    changed[2, 5] = 13.0  # a row tile 1 reads
    assert not np.array_equal(np.asarray(attend(pool_of(changed)))[:T], got[:T])


@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 197], [197, 1, 64, 65, 63]], ids=["ascending", "mixed"])
def test_the_pallas_kernel_matches_xla_at_page_edges_in_mixed_batches(attn, lengths):
    """Contexts of 1, page - 1, page, page + 1 and 3 pages + 5 rows in one batch (each its own table): the pallas
    kernel (interpret mode) within 1e-2 of the output's scale of the xla backend."""
    values = pool_of(random_pool(7))
    q_BNA, new_BA = queries(8, len(lengths), attn)
    tables = [[1 + 4 * b + i for i in range(4)] + [0] * 4 for b in range(len(lengths))]
    want = decode("xla", {}, attn, q_BNA, lengths, values, tables, new_BA)
    got = decode("pallas", {}, attn, q_BNA, lengths, values, tables, new_BA)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_decode_over_xla_never_materialises_a_whole_context():
    """Lowered for a batch of 16 over tables of 160 pages (10K rows): no value of the decode has 16 x 10K x 512
    elements or more (a dense gather of every context)."""
    attn_ = MLAttention(CFG, nnx.Rngs(params=2))
    backend = make_backend("xla", CFG, "cuda", "bfloat16")
    B, Qw = 16, 160
    args = (jnp.zeros((B, CFG.num_heads, CFG.latent_dim), jnp.bfloat16), jnp.zeros(B, jnp.int32),
            jnp.zeros((Qw + 1, PAGE, CFG.latent_dim), jnp.uint16), jnp.zeros((B, Qw), jnp.int32),
            jnp.zeros((B, CFG.latent_dim), jnp.bfloat16))
    text = jax.jit(lambda *a: backend.decode(attn_, *a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    import re
    sizes = [np.prod([int(d) for d in shape.split("x")[:-1]]) for shape in re.findall(r"tensor<([0-9x]+x\w+)>", text)]
    assert sizes and max(sizes) < B * Qw * PAGE * CFG.kv_lora_rank


def test_backends_are_chosen_by_name_and_platform():
    assert make_backend("xla", CFG, "cuda", "bfloat16").platform == "cuda"  # traceable here for any platform
    with pytest.raises(ValueError, match="serves the cpu platform"):
        make_backend("cpu", CFG, "cuda", "bfloat16")
    with pytest.raises(ValueError, match="attention backend must be one of"):
        make_backend("tpu-magic", CFG, "cpu", "bfloat16")
    with pytest.raises(ValueError, match="on a TPU take xla"):
        make_backend("pallas", CFG, "tpu", "bfloat16")
    assert make_backend("pallas", CFG, "cpu", "bfloat16").interpret  # the CPU runs the GPU kernel interpreted
    assert make_backend("auto", CFG, "cuda", "bfloat16").name == "xla"
    assert make_backend("auto", CFG, "cpu", "bfloat16").name == ("cpu" if cpu_kernels.decode_serves()
                                                                 and cpu_kernels.available("cpu")[0] else "xla")
