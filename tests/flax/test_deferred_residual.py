"""A stack of pre-norm layers adds each residual in the pass of the norm that reads the sum.

``TransformerLayer(defer_residual_add=True)`` returns ``(h, m)`` unsummed and the
next layer takes ``branch=m``, adding it in its attention norm's kernel pass
(``fp8jax.layernorm_dense(residual=)``). Through the Pallas kernels (interpret
mode), which read the sum rounded to bf16 as the GPU does, that is the layer of
the sum, bitwise, forward and backward. (XLA's twins may keep the sum in f32 where
they fuse the add into the norm, its excess precision, with or without the fold.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.flax import linen as fnn
from fp8jax.kernels import dispatch
from fp8jax.models.gpt import Gpt, GptConfig

LAYER = {"num_heads": 4, "intermediate_dim": 128, "activations": ("silu", "linear"),
         "norm_type": "rmsnorm", "causal": True, "use_rope": True, "use_bias": False,
         "dtype": jnp.bfloat16}  # fmt: skip


@pytest.fixture
def interpret(monkeypatch):
    """The kernels in Pallas interpret mode where the dispatcher runs them (as in
    tests/ops/test_fused_kernels_reference.py); yields the kernels traced."""
    called = []

    def on_each_device(pallas_fn, xla_fn, operands, n_row_split, out_layouts, row_axes=()):
        fn = getattr(pallas_fn, "func", pallas_fn)
        called.append(f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}")
        return pallas_fn(*operands, interpret=True)

    monkeypatch.setattr(dispatch, "on_each_device", on_each_device)
    return called


def _value_and_grads(fn, *args):
    def loss(*args):
        return jnp.sum(jnp.square(fn(*args).astype(jnp.float32)))

    # The model's own promotion (the GPT's train step runs under "standard" too).
    with jax.numpy_dtype_promotion("standard"):
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))(*args)


def test_a_deferred_add_is_the_layer_of_the_sum_bitwise(interpret):
    layer = fnn.TransformerLayer(**LAYER)
    deferred = fnn.TransformerLayer(**LAYER, defer_residual_add=True)
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (2, 64, 128)).astype(jnp.bfloat16)
    m = jax.random.normal(k[1], (2, 64, 128)).astype(jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        variables = layer.init(k[2], h)

    def folded(v, h, m):
        stream, branch = deferred.apply(v, h, branch=m)
        return jax.lax.optimization_barrier(stream + branch)

    def summed(v, h, m):
        # The barrier makes XLA round the sum to bf16, as the kernels read it.
        return jax.lax.optimization_barrier(layer.apply(v, jax.lax.optimization_barrier(h + m)))

    got, want = _value_and_grads(folded, variables, h, m), _value_and_grads(summed, variables, h, m)
    assert "norm_forward._pallas" in interpret
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "kwargs", [{"norm_position": "post"}, {"residual_from_norm": True}], ids=["post", "from_norm"]
)
def test_deferring_the_add_needs_a_pre_norm_layer_that_passes_its_residual(kwargs):
    layer = fnn.TransformerLayer(**LAYER, **kwargs, defer_residual_add=True)
    x = jnp.ones((2, 64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs norm_position='pre' and residual_from_norm=False"):
        layer.init(jax.random.key(0), x)


def test_the_fp8_gpt_defers_each_layers_add_to_the_next_norm(monkeypatch):
    """Every layer's attention norm gets the previous branch (the first a zero one)."""
    import fp8jax

    seen = []
    original = fp8jax.layernorm_dense

    def spy(*args, **kwargs):
        seen.append(kwargs.get("residual") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8jax, "layernorm_dense", spy)
    model = Gpt(config=GptConfig(hidden=64, layers=3, heads=4, ffn=128))
    tokens = jnp.zeros((2, 16), jnp.int32)
    jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert seen and all(seen)
