"""TransformerLayer(attention_implementation="fp8"): Linen and NNX use fp8jax's FP8 attention."""

import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx

CURRENT = fp8jax.CurrentScaling()


def _linen(implementation):
    return fnn.TransformerLayer(4, 256, causal=True, use_rope=True, recipe=CURRENT,
                                attention_implementation=implementation)  # fmt: skip


def test_linen_and_nnx_fp8_attention_agree_and_stay_near_bf16_attention():
    """4 heads of 64 over 128 tokens: the FP8 core replaces only the attention core."""
    x = jax.random.normal(jax.random.key(0), (2, 128, 256))
    variables = ref.init(_linen("fp8"), x)
    fp8 = jax.jit(_linen("fp8").apply)(variables, x)
    xla = jax.jit(_linen("xla").apply)(variables, x)
    # The attention output errs by at most 2**-4 of its magnitude P|V| per element
    # (tests/ops/test_attention.py); through the output projection and the
    # residual the layer's relative difference stays well below that.
    diff = float(jnp.linalg.norm(fp8 - xla) / jnp.linalg.norm(xla))
    assert 0 < diff < 2**-4, diff

    abstract = nnx.eval_shape(
        lambda: fnnx.TransformerLayer(4, 256, 256, causal=True, use_rope=True, recipe=CURRENT,
                                      attention_implementation="fp8", rngs=nnx.Rngs(0))
    )  # fmt: skip
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, ref.linen_to_nnx_dict(variables))
    model = nnx.merge(graphdef, state)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), fp8, rtol=1e-6, atol=1e-6)


def test_fp8_attention_refuses_a_mask():
    x = jnp.ones((1, 128, 256))
    layer = fnn.MultiHeadAttention(4, attention_implementation="fp8")
    mask = jnp.ones((1, 1, 128, 128), bool)
    with pytest.raises(ValueError, match="attention_implementation='fp8' takes no mask"):
        ref.init(layer, x, mask)


def test_attention_hadamard_reaches_the_op_in_linen_and_nnx(monkeypatch):
    """attention_hadamard=True is the op's hadamard=True, and only that.

    The rotated layer equals the plain layer whose op is made to rotate; it
    differs from the unrotated one by FP8 rounding only: the rotation is
    exact in real arithmetic (tests/ops/test_attention.py), so both stay
    within the 2**-4 budget of the XLA layer above.
    """
    from fp8jax.flax import _attention

    x = jax.random.normal(jax.random.key(0), (2, 128, 256))
    variables = ref.init(_linen("fp8"), x)

    def rotated(**kw):
        return fnn.TransformerLayer(4, 256, causal=True, use_rope=True, recipe=CURRENT,
                                    attention_implementation="fp8", **kw)  # fmt: skip

    got = jax.jit(rotated(attention_hadamard=True).apply)(variables, x)
    plain = jax.jit(rotated().apply)(variables, x)
    xla = jax.jit(_linen("xla").apply)(variables, x)
    assert not np.array_equal(got, plain)
    for y in (got, plain):
        assert float(jnp.linalg.norm(y - xla) / jnp.linalg.norm(xla)) < 2**-4

    op, calls = _attention.dot_product_attention, []

    def always_rotating(q, k, v, *, causal, hadamard):
        calls.append(hadamard)
        return op(q, k, v, causal=causal, hadamard=True)

    monkeypatch.setattr(_attention, "dot_product_attention", always_rotating)
    forced = jax.jit(rotated().apply)(variables, x)
    assert calls == [False]
    np.testing.assert_array_equal(forced, got)
    monkeypatch.undo()

    abstract = nnx.eval_shape(
        lambda: fnnx.TransformerLayer(4, 256, 256, causal=True, use_rope=True, recipe=CURRENT,
                                      attention_implementation="fp8", attention_hadamard=True,
                                      rngs=nnx.Rngs(0))
    )  # fmt: skip
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, ref.linen_to_nnx_dict(variables))
    model = nnx.merge(graphdef, state)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"attention_hadamard": True}, ValueError,
         r"attention_hadamard=True .* needs attention_implementation='fp8', got None"),
        ({"attention_hadamard": True, "attention_implementation": "xla"}, ValueError,
         r"attention_hadamard=True .* needs attention_implementation='fp8', got 'xla'"),
        ({"attention_hadamard": 1, "attention_implementation": "fp8"}, TypeError,
         r"attention_hadamard must be a bool, got 1"),
    ],
)  # fmt: skip
def test_attention_hadamard_is_refused_without_the_fp8_attention(kw, error, match):
    x = jnp.ones((1, 128, 256))
    with pytest.raises(error, match="MultiHeadAttention." + match):
        ref.init(fnn.MultiHeadAttention(4, **kw), x)
    with pytest.raises(error, match="TransformerLayer." + match):
        ref.init(fnn.TransformerLayer(4, 256, **kw), x)
    with pytest.raises(error, match="TransformerLayer." + match):
        fnnx.TransformerLayer(4, 256, 256, rngs=nnx.Rngs(0), **kw)
    with pytest.raises(error, match="MultiHeadAttention." + match):
        fnnx.MultiHeadAttention(4, 256, rngs=nnx.Rngs(0), **kw)
