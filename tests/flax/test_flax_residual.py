"""Pre-norm TransformerLayers pass each residual through the fused op that norms it.

Then the residual's gradient reaches the op's backward, which adds it to the
norm's in one pass (fp8jax.kernels.norm_backward); added outside, XLA would sum
the two afterwards. This records what each norm backward is given.
"""

import flax_reference as ref
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx
from fp8jax.ops import norm


def _residual_given_per_norm(monkeypatch, grad_of_layer) -> list[bool]:
    seen = []
    original = norm.fused_normalize_backward

    def spy(*args, **kwargs):
        residual = args[7] if len(args) > 7 else kwargs.get("residual")
        seen.append(residual is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(norm, "fused_normalize_backward", spy)
    jax.eval_shape(grad_of_layer)
    return seen


# Pre-norm: both norms get the residual's gradient. Residuals taken from the
# norm's output, or post-norm (no fused norm before the attention), do not.
CASES = [({}, [True, True]), ({"residual_from_norm": True}, [False, False]),
         ({"norm_position": "post"}, [False])]  # fmt: skip
IDS = ["pre", "residual_from_norm", "post"]


@pytest.mark.parametrize(("kwargs", "want"), CASES, ids=IDS)
def test_linen_layer_passes_its_residuals(monkeypatch, kwargs, want):
    layer = fnn.TransformerLayer(4, 64, **kwargs)
    x = jnp.ones((2, 64, 32), jnp.bfloat16)
    variables = ref.init(layer, x)

    def grad_of_layer():
        return jax.grad(lambda v: jnp.sum(layer.apply(v, x).astype(jnp.float32)))(variables)

    assert sorted(_residual_given_per_norm(monkeypatch, grad_of_layer)) == sorted(want)


@pytest.mark.parametrize(("kwargs", "want"), CASES, ids=IDS)
def test_nnx_layer_passes_its_residuals(monkeypatch, kwargs, want):
    layer = fnnx.TransformerLayer(4, 32, 64, rngs=nnx.Rngs(0), **kwargs)
    x = jnp.ones((2, 64, 32), jnp.bfloat16)
    graph, state = nnx.split(layer)

    def grad_of_layer():
        def loss(state):
            return jnp.sum(nnx.merge(graph, state)(x).astype(jnp.float32))

        return jax.grad(loss)(state)

    assert sorted(_residual_given_per_norm(monkeypatch, grad_of_layer)) == sorted(want)
