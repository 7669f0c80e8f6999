"""The FP8 ops inside shard_map: global amaxes, gradients of replicated inputs, state.

Inside shard_map each device sees its shard, so an amax is local unless the
recipe's ``amax_reduction_axes`` max-reduces it. With it, the program must
compute what the same ops compute under jit on the whole arrays: the same
scales, hence the same FP8 roundings, and results equal up to f32 summation
order (the shard_map sums per-device partial products).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs

# f32 partial sums over 8 devices, added in another order than one device's.
RTOL = 1e-5


def _x(shape, seed=0):
    # Rows of very different magnitude: a shard's amax is far from the whole tensor's.
    scale = jnp.arange(1, shape[0] + 1, dtype=jnp.float32).reshape(-1, *([1] * (len(shape) - 1)))
    return jax.random.normal(jax.random.key(seed), shape) * scale


def _dense_loss(recipe):
    def loss(x, w, state):
        return jnp.sum(jnp.square(fp8jax.dense(x, w, recipe=recipe, state=state)))

    return loss


# (x, kernel) shapes: too small for the Pallas kernels (XLA's casts), and taken
# by them (the weight's cast-transpose kernel, whose result must be typed for
# shard_map: fp8jax.kernels.dispatch.pallas_call).
SHAPES = {"xla": ((64, 32), (32, 16)), "kernels": ((128, 256), (256, 128))}


@pytest.mark.parametrize("shapes", sorted(SHAPES))
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_data_parallel_dense_matches_jit(delayed, shapes):
    mesh = fs.make_mesh(dp=8)
    axes = {"amax_history_len": 4} if delayed else {}
    recipe_cls = fp8jax.DelayedScaling if delayed else fp8jax.CurrentScaling
    recipe = recipe_cls(amax_reduction_axes=("dp",), **axes)
    state = fp8jax.init_state(recipe)
    x_shape, w_shape = SHAPES[shapes]
    x, w = _x(x_shape), jax.random.normal(jax.random.key(1), w_shape)
    grad = jax.value_and_grad(_dense_loss(recipe), argnums=(0, 1, 2))

    def per_device(x, w, state):
        loss, grads = grad(x, w, state)
        # w and state are replicated: their cotangents come back replicated
        # (the op sums w's over dp itself, as JAX's own transposes do).
        return jax.lax.psum(loss, "dp"), grads

    sharded = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P("dp"), P(), P()),
            out_specs=(P(), (P("dp"), P(), P())),
        )
    )
    want_recipe = recipe_cls(**axes)
    want_state = fp8jax.init_state(want_recipe)
    want = jax.jit(jax.value_and_grad(_dense_loss(want_recipe), argnums=(0, 1, 2)))(
        x, w, want_state
    )
    got = sharded(x, w, state)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    for g, wnt in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, wnt, rtol=RTOL, atol=RTOL * float(np.max(np.abs(wnt))))
    if delayed:
        # The x amax recorded is the whole batch's, not device 0's rows.
        new_x = got[1][2].x.amax_history[0]
        assert float(new_x) == float(jnp.max(jnp.abs(x)))


def test_tensor_parallel_mlp_matches_jit():
    """Megatron MLP by hand: x replicated, fc1 split by columns, fc2 by rows, then psum."""
    mesh = fs.make_mesh(tp=8)
    recipe = fp8jax.DelayedScaling(amax_history_len=4, amax_reduction_axes=("tp",))
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)
    x = _x((4, 8, 64))
    gamma, beta = jnp.ones(64) * 1.1, jnp.full((64,), 0.1)
    k1 = jax.random.normal(jax.random.key(1), (64, 2, 128)) * 0.1
    k2 = jax.random.normal(jax.random.key(2), (128, 64)) * 0.1

    def loss(recipe, reduce):
        def f(x, gamma, beta, k1, k2, state):
            y = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, recipe=recipe, state=state)
            return jnp.sum(jnp.square(reduce(y)))

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5))

    per_device = loss(recipe, lambda y: jax.lax.psum(y, "tp"))
    specs = (P(), P(), P(), P(None, None, "tp"), P("tp", None), P())
    sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=(P(), specs)))
    got = sharded(x, gamma, beta, k1, k2, state)
    want_recipe = fp8jax.DelayedScaling(amax_history_len=4)
    want = jax.jit(loss(want_recipe, lambda y: y))(
        x, gamma, beta, k1, k2, fp8jax.init_state(want_recipe, fp8jax.MlpScaleState)
    )
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    for g, wnt in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        # One FP8 rounding may flip where f32 reordering crosses a midpoint
        # (see test_sharded_train_step.py); normwise, far below an FP8 step.
        err = np.linalg.norm(np.asarray(g) - np.asarray(wnt)) / np.linalg.norm(np.asarray(wnt))
        assert err < 1e-3


def test_delayed_scaling_without_reduction_axes_says_how_to_fix():
    mesh = fs.make_mesh(dp=8)
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    grad = jax.grad(_dense_loss(recipe), argnums=(1, 2))
    step = jax.shard_map(grad, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=(P(), P()))
    x, w = _x((64, 32)), jnp.ones((32, 16))
    with pytest.raises(ValueError, match=r"amax_reduction_axes=\('dp',\)"):
        jax.jit(step)(x, w, fp8jax.init_state(recipe))


def test_reduction_axes_outside_shard_map_are_rejected():
    recipe = fp8jax.CurrentScaling(amax_reduction_axes=("dp",))
    with pytest.raises(ValueError, match="not bound here"):
        jax.jit(lambda x, w: fp8jax.dense(x, w, recipe=recipe))(
            jnp.ones((8, 16)), jnp.ones((16, 8))
        )


def test_reduction_axes_must_be_a_tuple_of_names():
    with pytest.raises(TypeError, match="amax_reduction_axes"):
        fp8jax.CurrentScaling(amax_reduction_axes="dp")


def test_global_amax_is_the_whole_tensors():
    mesh = fs.make_mesh(dp=2, fsdp=4)
    x = _x((16, 8))
    f = jax.shard_map(
        lambda s: (fs.global_amax(s, ("dp", "fsdp")), fs.global_amax(s).reshape(1)),
        mesh=mesh,
        in_specs=P(("dp", "fsdp")),
        out_specs=(P(), P(("dp", "fsdp"))),
    )
    whole, local = jax.jit(f)(x)
    assert float(whole) == float(jnp.max(jnp.abs(x)))
    # Without axes: each device's own shard (two rows), the last one the largest.
    assert float(local[-1]) == float(jnp.max(jnp.abs(x[-2:])))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["current", "block"])
def test_live_kernels_inside_shard_map_give_the_jit_values(name):
    # The Pallas kernels' results typed for shard_map (check_vma=True):
    # the fused MLP and a dense at kernel shapes, on a one-GPU mesh, against
    # the same ops under jit. One device: the same scales, the same kernels.
    # RowwiseScaling has no Pallas kernel (its GEMMs are XLA's scaled dots),
    # so it has nothing to show here; the CPU tests above cover it.
    recipes = {
        "current": (fp8jax.CurrentScaling(amax_reduction_axes=("dp",)), fp8jax.CurrentScaling()),
        "block": (fp8jax.BlockScaling(),) * 2,
    }
    inside, outside = recipes[name]
    keys = jax.random.split(jax.random.key(0), 5)
    tokens, hidden, ffn = 2048, 1024, 2048
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (hidden, hidden)) * 0.03).astype(jnp.bfloat16)
    k1 = (jax.random.normal(keys[2], (hidden, 2, ffn)) * 0.03).astype(jnp.bfloat16)
    k2 = (jax.random.normal(keys[3], (ffn, hidden)) * 0.03).astype(jnp.bfloat16)
    r = jax.random.normal(keys[4], (tokens, hidden), jnp.float32)  # a random output gradient
    gamma = jnp.ones((hidden,), jnp.float32)

    def loss(recipe, x, w, k1, k2, r):
        y = fp8jax.dense(x, w, recipe=recipe)
        z = fp8jax.layernorm_mlp(y, gamma, None, k1, k2, activations=("silu", "linear"),
                                 norm_type="rmsnorm", recipe=recipe)  # fmt: skip
        return jnp.sum(z.astype(jnp.float32) * r)

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4))
    mesh = jax.make_mesh((1,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = (P("dp"), P(), P(), P())  # of x, w, k1, k2 and of their gradients

    def per_device(*args):
        value, grads = grad(inside, *args)
        return jax.lax.psum(value, "dp"), grads

    sharded = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(*specs, P("dp")), out_specs=(P(), specs))
    )
    got = sharded(x, w, k1, k2, r)
    want = jax.jit(lambda *a: grad(outside, *a))(x, w, k1, k2, r)
    hlo = sharded.lower(x, w, k1, k2, r).compile().as_text()
    assert "fp8jax_" in hlo, "expected fp8jax's Pallas kernels in the shard_map program"
    for g, wnt in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(wnt, np.float32),
                                   rtol=RTOL, atol=RTOL * float(np.max(np.abs(wnt))))  # fmt: skip
