"""fp8jax.sharding: roles, rules, meshes, shardings, constraints; NNX modules sharded."""

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sharded_layer as sl
from flax import nnx
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs
from fp8jax.flax import nnx as fnnx


def test_config_validates_roles():
    with pytest.raises(TypeError, match="ShardingConfig.tp"):
        fs.ShardingConfig(tp=3)
    with pytest.raises(ValueError, match="different mesh axes"):
        fs.ShardingConfig(dp="data", fsdp="data")
    with pytest.raises(ValueError, match="also a batch axis"):
        fs.ShardingConfig(sp="fsdp")


def test_rules_cover_every_name_the_modules_use():
    abstract = sl.abstract_state(sl.model())
    names = {
        name
        for spec in jax.tree.leaves(nn.get_partition_spec(abstract.params))
        for name in spec
        if name is not None
    }
    ruled = {logical for logical, _ in fs.DEFAULT.logical_rules()}
    assert names <= ruled
    assert {"batch", "length"} <= ruled  # the activation names


def test_tensor_parallel_names_take_precedence_over_the_sequence():
    # Megatron SP: sequence and heads share the tp axis; inside attention the
    # queries are split by heads, the residual stream by sequence.
    config = sl.MEGATRON_SP
    assert fs.logical_spec(("batch", "length", "heads", None), config=config) == P(
        ("dp", "fsdp"), None, "tp", None
    )
    assert fs.logical_spec(("batch", "length", None), config=config) == P(
        ("dp", "fsdp"), "tp", None
    )


def test_logical_spec_drops_missing_and_non_dividing_axes():
    mesh = fs.make_mesh(dp=2, fsdp=4)  # axes dp, fsdp, tp (size 1)
    assert fs.logical_spec(("batch", None), mesh=mesh) == P(("dp", "fsdp"), None)
    # A batch of 2 cannot split 8 ways: the inner axis is dropped.
    assert fs.logical_spec(("batch", None), mesh=mesh, shape=(2, 4)) == P("dp", None)
    assert fs.logical_spec(("length",), config=fs.ShardingConfig(sp="sp"), mesh=mesh) == P(None)


def test_names_must_be_one_per_axis():
    # A str was read as one name per character: P(None, None, None, None, None).
    with pytest.raises(TypeError, match=re.escape("logical_spec: names must be a sequence")):
        fs.logical_spec("embed")
    mesh = fs.make_mesh(dp=8)
    # With a shape: an extra name gave a spec JAX refused later, a missing one
    # left the axis unsplit silently.
    message = "names gives 1 logical names ('batch',) for an array of shape (8, 4) (rank 2)"
    with pytest.raises(ValueError, match=re.escape(message)):
        fs.named_sharding(mesh, ("batch",), shape=(8, 4))
    # constrain checks without a mesh too: a mismatch shows on one device.
    with pytest.raises(ValueError, match=re.escape("constrain: names gives 2 logical names")):
        fs.constrain(jnp.ones((8, 4, 2)), ("batch", None))


def test_make_mesh_orders_axes_outermost_first():
    mesh = fs.make_mesh(dp=2, fsdp=2, tp=2)
    assert mesh.axis_names == ("dp", "fsdp", "tp")
    # tp is innermost: its two devices are neighbours (one NVLink domain on a GPU node).
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]
    mesh = fs.make_mesh(fsdp=2, sp=2, tp=2, config=fs.ShardingConfig(sp="sp"))
    assert mesh.axis_names == ("dp", "fsdp", "sp", "tp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 4}, "use 4 devices, but 8"),
        ({"tp": 4, "sp": 2, "config": fs.ShardingConfig(sp="tp")}, "shares the 'tp' axis"),
        ({"fsdp": 8, "config": fs.ShardingConfig(fsdp=None)}, "config.fsdp is None"),
        ({"dp": 0}, "int >= 1"),
    ],
)
def test_make_mesh_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fs.make_mesh(**kwargs)


def test_variable_shardings_name_a_parameter_that_does_not_split():
    layer = sl.model().clone(num_heads=4)
    with pytest.raises(ValueError, match=r"\['kernel'\] has size 4 on axis \d \('heads'\)"):
        fs.variable_shardings(sl.abstract_state(layer), fs.make_mesh(tp=8))


def test_constrain_is_a_no_op_without_a_mesh_and_rules():
    def traced():
        # A new function each time: JAX's trace cache keys on the mesh but not
        # on Flax's rules, which are read at trace time.
        return str(jax.make_jaxpr(lambda x: fs.constrain(x, ("batch", None)))(jnp.ones((8, 4))))

    assert "sharding_constraint" not in traced()
    mesh = fs.make_mesh(dp=8)
    with jax.set_mesh(mesh):  # a mesh, but no rules
        assert "sharding_constraint" not in traced()
    with fs.use_mesh(mesh):
        assert "sharding_constraint" in traced()


def test_current_scaling_under_jit_uses_the_whole_tensors_amax():
    # Rows of very different magnitude: each device's rows have their own amax,
    # and a per-shard scale would round every element differently.
    x = jax.random.normal(jax.random.key(0), (64, 32)) * jnp.arange(1.0, 65.0)[:, None]
    w = jax.random.normal(jax.random.key(1), (32, 16))
    want = jax.jit(fp8jax.dense)(x, w)
    mesh = fs.make_mesh(dp=8)
    sharded = jax.device_put(x, fs.named_sharding(mesh, ("batch", None)))
    got = jax.jit(fp8jax.dense)(sharded, w)
    assert got.sharding.spec[0] == ("dp", "fsdp")
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _nnx_run(mesh=None, config=fs.DEFAULT, steps=2):
    model = fnnx.TransformerLayer(
        sl.HEADS, sl.HIDDEN, sl.FFN, head_dim=sl.HEAD_DIM, causal=True, use_rope=True,
        recipe=sl.RECIPE, rngs=nnx.Rngs(0),
    )  # fmt: skip
    batch = sl.batch()
    if mesh is not None:
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, fs.variable_shardings(state, mesh, config)))
        batch = jax.device_put(batch, fs.named_sharding(mesh, ("batch", "length", None), config))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(fnnx.train_step, static_argnames=("loss_fn",))

    def loss_fn(m, b):
        return jnp.mean(jnp.square(m(b[0]) - b[1]))

    losses = []
    context = fs.use_mesh(mesh, config) if mesh is not None else contextlib.nullcontext()
    with jax.numpy_dtype_promotion("standard"), context:
        for _ in range(steps):
            losses.append(float(step(model, optimizer, loss_fn, batch)))
    return model, np.asarray(losses)


def test_nnx_layer_sharded_matches_single_device():
    _, want = _nnx_run()
    sizes, config = sl.LAYOUTS["fsdp2_tp4_sp"]
    model, got = _nnx_run(fs.make_mesh(**sizes, config=config), config)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    kernel = model.mlp.kernel_1[...]
    assert kernel.sharding.spec == P("fsdp", None, "tp")
    scales = model.mlp.scales.get_value()
    assert scales.fc1.x.scale.sharding.is_fully_replicated
