"""The served model (model/serving.py): projections re-laid (out, in) at the serving dtype, the checkpoint
untouched, and logits within bfloat16's tolerance of the checkpoint's own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import cpu_kernels, reference
from model.attention import make_backend
from model.config import preset
from model.latent_pool import LatentPool
from model.layers import Linear
from model.runner import Runner, Segment
from model.serving import WIDE_ROWS, ServingLinear, serving_model
from model.weights import init_model
from services.engine.config import EngineConfig


@pytest.fixture(scope="module")
def checkpoint():
    return init_model(preset("tiny"))


def test_float32_serving_of_a_float32_checkpoint_is_the_checkpoint_itself(checkpoint):
    assert serving_model(checkpoint, "float32") is checkpoint


def test_bfloat16_serving_relays_every_projection_and_leaves_the_checkpoint_as_it_was(checkpoint):
    served = serving_model(checkpoint, "bfloat16")
    layer, original = served.layers[1], checkpoint.layers[1]
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"):
        linear = getattr(layer.attn, name)
        kernel = getattr(original.attn, name).kernel[...]
        assert isinstance(linear, ServingLinear) and isinstance(getattr(original.attn, name), Linear)
        assert linear.weight[...].dtype == jnp.bfloat16 and linear.weight[...].shape == kernel.shape[::-1]
        np.testing.assert_array_equal(np.asarray(linear.weight[...], np.float32),
                                      np.asarray(kernel.T.astype(jnp.bfloat16), np.float32))
    assert isinstance(served.head.lm_head, ServingLinear)
    assert layer.attn.w_uk[...].dtype == jnp.bfloat16 and original.attn.w_uk[...].dtype == jnp.float32
    assert layer.input_norm.weight[...] is original.input_norm.weight[...]  # shared, not copied


def test_one_row_and_many_rows_give_the_same_row(checkpoint):
    linear = serving_model(checkpoint, "bfloat16").head.lm_head
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    alone, together = np.asarray(linear(x[:1])), np.asarray(linear(x))
    assert alone.shape == (1, linear.weight[...].shape[0]) and alone.dtype == np.float32
    np.testing.assert_allclose(alone[0], together[0], rtol=1e-6, atol=1e-6)


def test_without_the_kernel_one_row_is_computed_as_two_and_agrees(checkpoint):
    """XLA's path (GPUs, TPUs, CPUs without our kernels): a one-row bfloat16 product computed as two rows."""
    linear = ServingLinear(serving_model(checkpoint, "bfloat16").head.lm_head.weight[...], few_rows=False)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 64)), jnp.float32)
    assert "deepinfer_few_row_product" not in jax.jit(linear).lower(x[:1]).as_text()
    np.testing.assert_allclose(np.asarray(linear(x[:1]))[0], np.asarray(linear(x))[0], rtol=1e-6, atol=1e-6)


def test_a_few_rows_take_the_cpu_kernel_and_agree_with_xlas_product(checkpoint):
    """On a CPU with AVX-512, AMX, or AVX2 and FMA, a few rows (up to 32) are our few-row kernel (the weights streamed once),
    more rows XLA's product; on other CPUs XLA's product serves every row count."""
    linear = serving_model(checkpoint, "bfloat16").head.lm_head
    if not cpu_kernels.few_rows_serve():
        assert not linear.few_rows and cpu_kernels.few_rows_max() == 4  # built, tested in test_cpu_kernels
        x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 64)), jnp.float32)
        assert "deepinfer_few_row_product" not in jax.jit(linear).lower(x).as_text()
        pytest.skip("the few-row kernel serves on a CPU with AVX-512, AMX, or AVX2 and FMA")
    most = cpu_kernels.few_rows_max()
    assert linear.few_rows and most >= 4
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, 64)), jnp.float32)
    assert "deepinfer_few_row_product" in jax.jit(linear).lower(x[:most]).as_text()
    assert "deepinfer_few_row_product" not in jax.jit(linear).lower(x[:most + 1]).as_text()
    many = np.asarray(linear(x))
    for rows in sorted({1, 2, 3, 4, most}):
        np.testing.assert_allclose(np.asarray(linear(x[:rows])), many[:rows], rtol=1e-5, atol=1e-5)


def test_prefill_attention_takes_the_cpu_kernel_where_it_runs_and_agrees_with_xlas_path():
    """Latent widths the kernel takes (multiples of 32; tiny's 48 is not): a 300-token prompt's logits with the cpu
    backend's prefill attention kernel against the xla backend's path (each its own choice of form)."""
    if not cpu_kernels.prefill_attention_available():
        pytest.skip("the prefill attention kernel needs AMX")
    cfg = preset("tiny", kv_lora_rank=64, qk_rope_head_dim=32)
    model = serving_model(init_model(cfg), "bfloat16")
    backends = [make_backend(name, cfg, "cpu", "bfloat16") for name in ("cpu", "xla")]
    assert backends[0].prefill_kernel
    assert not make_backend("cpu", preset("tiny"), "cpu", "bfloat16").prefill_kernel  # A = 48
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, 300)
    got, want = (np.asarray(Runner(model, cfg, LatentPool(cfg, 8, 64), backend, chunk_tokens=128).prefill(
        [Segment(tokens, 0, [1, 2, 3, 4, 5])]).run())[0] for backend in backends)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    assert np.abs(got - want).max() > 0  # another path did compute it


def test_many_rows_widen_to_float32_where_the_cpu_has_no_amx_and_agree_with_bfloat16_products(checkpoint):
    """A CPU without AMX runs XLA's bfloat16 products slowly (model/serving.py): there products of WIDE_ROWS
    rows or more, and prefill attention, take float32 inputs (bfloat16-rounded values); elsewhere none do."""
    served = serving_model(checkpoint, "bfloat16")
    widened = not cpu_kernels.has_amx()
    assert served.head.lm_head.wide_rows == (WIDE_ROWS if widened else 0)
    assert served.layers[0].attn.wide == widened
    assert served.layers[0].attn.products_dtype() == (jnp.float32 if widened else jnp.bfloat16)
    narrow = serving_model(checkpoint, "bfloat16", wide=False)
    assert narrow.head.lm_head.wide_rows == 0 and not narrow.layers[0].attn.wide
    assert not serving_model(checkpoint, "float32").layers[0].attn.wide

    weight = served.head.lm_head.weight[...]
    wide, plain = ServingLinear(weight, wide_rows=WIDE_ROWS), ServingLinear(weight)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((WIDE_ROWS, 64)), jnp.float32)
    def products(rows):
        return [line for line in jax.jit(wide).lower(x[:rows]).as_text().splitlines() if "dot_general" in line]

    assert products(WIDE_ROWS) and not any("bf16" in line for line in products(WIDE_ROWS))  # float32 operands
    assert all("bf16" in line for line in products(WIDE_ROWS - 1))  # fewer rows stay bfloat16
    np.testing.assert_allclose(np.asarray(wide(x)), np.asarray(plain(x)), rtol=1e-5, atol=1e-5)
    # exact products of the same rounded inputs: only the order of float32 sums differs
    np.testing.assert_allclose(np.asarray(wide(x)), np.asarray(x.astype(jnp.bfloat16), np.float64)
                               @ np.asarray(weight, np.float64).T, rtol=1e-5, atol=1e-5)

    tokens = np.random.default_rng(6).integers(0, preset("tiny").vocab_size, 300)
    got, want = (reference.prompt_logits(serving_model(checkpoint, "bfloat16", wide=w), tokens)[-1] for w in (True, False))
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


def test_bfloat16_logits_stay_within_its_tolerance_of_the_checkpoints(checkpoint):
    tokens = np.random.default_rng(1).integers(0, preset("tiny").vocab_size, 40)
    want = reference.prompt_logits(checkpoint, tokens)[-1]
    got = reference.prompt_logits(serving_model(checkpoint, "bfloat16"), tokens)[-1]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 3e-2 * scale  # rounding each product's inputs to 8 bits
    assert np.abs(got - want).max() > 0  # it did serve at another dtype


def test_an_unknown_serving_dtype_is_refused(checkpoint):
    with pytest.raises(ValueError, match="serving dtype"):
        serving_model(checkpoint, "float16")
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
        EngineConfig(dtype="float16")
