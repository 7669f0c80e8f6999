"""The ops under Explicit mesh axes: gradients sharded like their primals, results as under Auto.

Under ``AxisType.Explicit`` shardings are types, and ``lax.dot_general``
rejects the FSDP dgrad ``g[batch@fsdp] . w[embed@fsdp]`` ("illegally sharded
result") unless it is told the output sharding; the ops tell it. The same
program on Auto axes is the reference: the scales are identical and only
f32 summation order may differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs

RTOL = 1e-5


def _grads(fn, args, specs, axis_types):
    mesh = fs.make_mesh(dp=2, fsdp=2, tp=2, axis_types=axis_types)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    with jax.set_mesh(mesh):
        grad = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(args)))))
        return grad(*args)


def _compare(fn, args, specs):
    loss, grads = _grads(fn, args, specs, AxisType.Explicit)
    want_loss, want = _grads(fn, args, specs, AxisType.Auto)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    for g, w, spec in zip(grads, want, specs, strict=True):
        assert g.sharding.spec == spec  # the cotangent is typed like its primal
        err = np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert err < 1e-3  # summation order, and a rare FP8 rounding flip it causes


def _x(shape):
    return jax.random.normal(jax.random.key(0), shape)


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_fsdp_dense(delayed):
    recipe = fp8jax.DelayedScaling(amax_history_len=4) if delayed else None
    state = fp8jax.init_state(recipe) if delayed else None

    def loss(x, w, b):
        y = fp8jax.dense(x, w, b, recipe=recipe, state=state)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    args = (_x((16, 64)), _x((64, 32)) * 0.1, _x((32,)))
    _compare(loss, args, (P(("dp", "fsdp"), None), P("fsdp", "tp"), P("tp")))


def test_row_parallel_einsum_with_fsdp_output_axis():
    # The attention output projection: contracting heads split over tp (both
    # operands), the kernel's output axis split over fsdp like the batch.
    def loss(o, w):
        return jnp.sum(jnp.square(fp8jax.einsum("bshd,hde->bse", o, w)))

    args = (_x((8, 4, 4, 16)), _x((4, 16, 64)) * 0.1)
    _compare(loss, args, (P(("dp", "fsdp"), None, "tp", None), P("tp", None, "fsdp")))


def test_sequence_parallel_mlp():
    # Megatron SP: the sequence split over tp, the MLP width too; norm params
    # and biases FSDP-split, meeting a batch split over the same axis.
    def loss(x, gamma, beta, k1, b1, k2, b2):
        y = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, b1, b2)
        return jnp.sum(jnp.square(y))

    args = (
        _x((8, 8, 64)), jnp.ones(64), jnp.zeros(64), _x((64, 2, 128)) * 0.1,
        jnp.zeros((2, 128)), _x((128, 64)) * 0.1, jnp.zeros(64),
    )  # fmt: skip
    specs = (
        P(("dp", "fsdp"), "tp", None), P("fsdp"), P("fsdp"), P("fsdp", None, "tp"),
        P(None, "tp"), P("tp", "fsdp"), P("fsdp"),
    )  # fmt: skip
    _compare(loss, args, specs)


# Under these meshes the grouped-GEMM kernel stays off (tensor parallelism splits n);
# its warning is tested in tests/ops/test_ragged_dot.py.
@pytest.mark.filterwarnings("ignore:fp8jax.ragged_dot. the grouped-GEMM kernel")
@pytest.mark.parametrize("permuted", [False, True], ids=["ragged_dot", "permuted_ragged_dot"])
def test_grouped_gemms_with_fsdp_experts(permuted):
    # Tokens over dp and fsdp, each expert's k over fsdp and n over tp: the
    # grouped GEMMs run with the axes Auto inside, the result sharded like the
    # tokens' rows and the weights' n.
    sizes = jnp.array([16, 0, 24, 24], jnp.int32)
    order = jax.random.permutation(jax.random.key(2), 64)

    def loss(x, w):
        if permuted:
            y = fp8jax.permuted_ragged_dot(x, w, sizes, lhs_slots=order, repeats=2,
                                           out_slots=order)  # fmt: skip
        else:
            y = fp8jax.ragged_dot(x, w, sizes)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    rows = 32 if permuted else 64
    args = (_x((rows, 64)), _x((4, 64, 32)) * 0.1)
    _compare(loss, args, (P(("dp", "fsdp"), None), P(None, "fsdp", "tp")))
