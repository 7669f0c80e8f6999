"""fp8jax.flax.linen.MultiHeadAttention against Flax's attention."""

import flax.linen as nn
import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.flax import linen as fnn
from fp8jax.verify.jaxpr_dots import jaxpr_dots

CASES = [
    # num_heads, num_kv_heads, causal, use_rope, input_layernorm
    (4, None, False, False, False),  # plain MHA: Flax's MultiHeadDotProductAttention itself
    (4, None, True, False, True),
    (4, 2, True, True, True),  # GQA + RoPE: Flax's attention core on repeated heads
    (4, 1, False, True, True),  # multi-query
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "causal", "use_rope", "ln"), CASES)
def test_matches_flax_attention(num_heads, num_kv_heads, causal, use_rope, ln):
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.MultiHeadAttention(
        num_heads, num_kv_heads=num_kv_heads, causal=causal, use_rope=use_rope, input_layernorm=ln
    )
    params = ref.init_params(layer, x)
    y = ref.apply(layer, {"params": params}, x)
    want = ref.run(
        ref.attention, params, x, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
        rope_base=10000.0 if use_rope else None, input_layernorm=ln,
    )  # fmt: skip
    # Two FP8 GEMMs (QKV, output), four E4M3 operands; the core is f32 here.
    assert ref.relative_error(y, want) < ref.fp8_budget(4)


def test_reference_core_path_is_flax_module():
    # The GQA/RoPE reference path equals Flax's own module where both apply.
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.MultiHeadAttention(4, causal=True)
    params = nn.unbox(ref.init(layer, x))["params"]
    a = ref.run(ref.attention, params, x, num_heads=4, causal=True, use_flax_module=True)
    b = ref.run(ref.attention, params, x, num_heads=4, causal=True, use_flax_module=False)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_kernel_layout_and_logical_axes():
    layer = fnn.MultiHeadAttention(8, num_kv_heads=2, head_dim=16)
    variables = ref.init(layer, jnp.ones((1, 4, 32)))
    params = nn.unbox(variables)["params"]
    assert params["qkv"]["kernel"].shape == (32, 2, 4 + 2, 16)
    assert params["out"]["kernel"].shape == (8, 16, 32)
    specs = nn.get_partition_spec(variables)["params"]
    P = jax.sharding.PartitionSpec
    assert specs["qkv"]["kernel"] == P("embed", "heads", "qkv", "kv")
    assert specs["out"]["kernel"] == P("heads", "kv", "embed")


def test_mask_and_positions_are_used():
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.MultiHeadAttention(4, use_rope=True)
    variables = ref.init(layer, x)
    causal_mask = jnp.tril(jnp.ones((8, 8), jnp.bool_)).reshape(1, 1, 8, 8)
    masked = ref.apply(layer, variables, x, mask=causal_mask)
    causal = ref.apply(fnn.MultiHeadAttention(4, use_rope=True, causal=True), variables, x)
    np.testing.assert_allclose(masked, causal, rtol=1e-6, atol=1e-6)
    plain = ref.apply(layer, variables, x)
    # RoPE scores depend on position differences only: a shift changes nothing...
    shifted = ref.apply(layer, variables, x, positions=jnp.arange(8) + 3)
    np.testing.assert_allclose(shifted, plain, rtol=1e-4, atol=1e-4)
    # ...and stretched positions do.
    assert not np.allclose(ref.apply(layer, variables, x, positions=jnp.arange(8) * 3), plain)


def test_dropout_needs_rng_only_when_not_deterministic():
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.MultiHeadAttention(4, dropout_rate=0.5)
    variables = ref.init(layer, x, deterministic=True)
    kept = ref.apply(layer, variables, x, deterministic=True)
    dropped = ref.apply(
        layer, variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)}
    )
    assert float(jnp.mean((dropped == 0).astype(jnp.float32))) > 0.3
    assert not np.allclose(kept, dropped)


def test_bf16_attention_core_stays_high_precision():
    x = jnp.ones((2, 8, 32), jnp.bfloat16)
    layer = fnn.MultiHeadAttention(4, causal=True, dtype=jnp.bfloat16)
    variables = ref.init(layer, x)
    dots = jaxpr_dots(lambda v: layer.apply(v, x), variables)
    fp8 = [d for d in dots if d.is_fp8]
    core = [d for d in dots if not d.is_fp8]
    assert len(fp8) == 2 and len(core) == 2
    assert all(d.lhs_dtype == "bfloat16" for d in core)
