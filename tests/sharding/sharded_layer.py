"""One TransformerLayer train step, single-device or sharded over a mesh layout.

Shared by the numerics tests, the deviceless GPU compiles and the
multi-process worker, so all three run the same program.

Shapes are tiny (hidden 64, seq 16, batch 8). Eight heads rather than four:
``tp=8`` splits the heads eight ways. ``head_dim=16`` keeps every GEMM
dimension a multiple of 16 on each device, as FP8 GEMMs on Hopper want.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs
from fp8jax.flax import TrainState, make_train_step
from fp8jax.flax import linen as fnn

BATCH, SEQ, HIDDEN, HEADS, HEAD_DIM, FFN = 8, 16, 64, 8, 16, 128
STEPS = 2
TOL = 1e-3  # normwise; derived in test_sharded_train_step.py
RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
MEGATRON_SP = fs.ShardingConfig(sp="tp")
CONTEXT_SP = fs.ShardingConfig(sp="sp")

# name: (mesh sizes, roles). Every layout uses all 8 devices.
LAYOUTS = {
    "dp8": ({"dp": 8}, fs.DEFAULT),
    "fsdp8": ({"fsdp": 8}, fs.DEFAULT),
    "tp8": ({"tp": 8}, fs.DEFAULT),
    "fsdp4_tp2": ({"fsdp": 4, "tp": 2}, fs.DEFAULT),
    "dp2_fsdp2_tp2": ({"dp": 2, "fsdp": 2, "tp": 2}, fs.DEFAULT),
    # Megatron sequence parallelism: the sequence split over the tp axis.
    "fsdp2_tp4_sp": ({"fsdp": 2, "tp": 4}, MEGATRON_SP),
    # The sequence split over an axis of its own; attention gathers K and V.
    "dp2_sp4": ({"dp": 2, "sp": 4}, CONTEXT_SP),
}


def model(dtype=jnp.float32, recipe=RECIPE) -> fnn.TransformerLayer:
    return fnn.TransformerLayer(
        HEADS, FFN, head_dim=HEAD_DIM, causal=True, use_rope=True, recipe=recipe, dtype=dtype
    )


def batch(seed: int = 0, dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, HIDDEN), jnp.float32)
    return x.astype(dtype), jnp.roll(x, 1, axis=1) * 0.5


def make_step(layer: fnn.TransformerLayer):
    """The Linen train step (SGD: its update is the gradient, scaled)."""

    def loss_fn(variables, b):
        inputs, targets = b
        return jnp.mean(jnp.square(layer.apply(variables, inputs).astype(jnp.float32) - targets))

    return make_train_step(loss_fn, optax.sgd(0.1))


def init_state(layer: fnn.TransformerLayer) -> TrainState:
    x = jnp.zeros((BATCH, SEQ, HIDDEN), layer.dtype)
    return TrainState.create(nn.unbox(layer.init(jax.random.key(1), x)), optax.sgd(0.1))


def abstract_state(layer: fnn.TransformerLayer):
    """The TrainState's shapes, params still boxed with their logical axis names."""
    x = jnp.zeros((BATCH, SEQ, HIDDEN), layer.dtype)
    return jax.eval_shape(
        lambda: TrainState.create(layer.init(jax.random.key(1), x), optax.sgd(0.1))
    )


def shardings(layer, mesh, config):
    """(TrainState shardings, batch sharding) on ``mesh``."""
    state = fs.variable_shardings(abstract_state(layer), mesh, config)
    data = NamedSharding(mesh, fs.logical_spec(("batch", "length", None), config=config))
    return state, data


@functools.cache
def _single_device_programs(layer: fnn.TransformerLayer):
    """(jitted initial state, jitted train step) of ``layer`` on one device, made once per layer.

    Single-device runs of equal layers (the reference, and the tolerance test's runs of
    test_sharded_train_step.py on other data) share these and so their compiles.
    """
    return jax.jit(lambda: init_state(layer)), jax.jit(make_step(layer))


def run(layer, steps: int, mesh=None, config=fs.DEFAULT, data=None):
    """``steps`` train steps from the same init; single-device without a mesh.

    ``data``: the (inputs, targets) of every step; :func:`batch` by default.
    Returns the final TrainState and the losses, as host numpy arrays.
    """
    step = make_step(layer)
    data = batch(dtype=layer.dtype) if data is None else data
    # JAX's XLA attention backward mixes bf16/f32 dtypes internally; see tests/flax/conftest.py.
    with jax.numpy_dtype_promotion("standard"):
        if mesh is None:
            device = jax.devices()[0]
            init, jitted = _single_device_programs(layer)
            state = jax.device_put(init(), device)
            data = jax.device_put(data, device)
            context = contextlib.nullcontext()
        else:
            state_sh, data_sh = shardings(layer, mesh, config)
            # Initialized outside the rules context: Linen's boxed params would
            # apply with_sharding_constraint, which asserts under Explicit axes.
            state = jax.jit(lambda: init_state(layer), out_shardings=state_sh)()
            # The same host batch on every process, each placing its own shards.
            data = jax.tree.map(lambda a: _put(np.asarray(a), data_sh), data)
            jitted = jax.jit(step, out_shardings=(state_sh, NamedSharding(mesh, P())))
            context = fs.use_mesh(mesh, config)
        losses = []
        with context:
            for _ in range(steps):
                state, loss = jitted(state, data)
                losses.append(loss)
    return state, np.asarray(losses)


def _put(host: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def abstract_args(layer, mesh, config):
    """(state, batch) as sharded ShapeDtypeStructs, for a deviceless compile."""
    state_sh, data_sh = shardings(layer, mesh, config)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.unbox(abstract_state(layer)),
        state_sh,
    )
    x = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), layer.dtype, sharding=data_sh)
    y = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.float32, sharding=data_sh)
    return state, (x, y)


def to_host(tree):
    """A pytree of (possibly sharded, multi-process) arrays as numpy arrays."""
    return jax.tree.map(np.asarray, tree)


def reference(recipe=RECIPE):
    """(initial params, state after STEPS, losses) of the single-device run, on the host."""
    layer = model(recipe=recipe)
    state, losses = run(layer, STEPS)
    params0 = jax.jit(lambda: init_state(layer).params)()
    return to_host(params0), to_host(state), losses


def _normwise(got, want, base=None) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = want if base is None else want - np.asarray(base, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(scale), 1e-30))


def _groups(fp8_state):
    return jax.tree.leaves(fp8_state, is_leaf=lambda n: isinstance(n, fp8jax.DotScaleState))


@dataclasses.dataclass(frozen=True)
class Tolerances:
    loss_rtol: float
    updates: float  # normwise, on each parameter's update
    fp8_state: float | None  # normwise, on amax histories and scales; None: not compared


# Derived in test_sharded_train_step.py.
CPU = Tolerances(loss_rtol=1e-5, updates=TOL, fp8_state=TOL)
GPU = Tolerances(loss_rtol=5e-3, updates=0.3, fp8_state=None)


def check_against_reference(state, losses, reference, tolerances: Tolerances = CPU):
    """A host-side run agrees with ``reference()`` (tolerances: test_sharded_train_step.py)."""
    params0, want, want_losses = reference
    np.testing.assert_allclose(losses, want_losses, rtol=tolerances.loss_rtol)
    # Compare updates, not params: the params themselves barely move in 2 steps.
    updates = jax.tree.map(lambda g, w, p: _normwise(g, w, p), state.params, want.params, params0)
    assert max(jax.tree.leaves(updates)) < tolerances.updates, updates
    for got, ref in zip(_groups(state.fp8_state), _groups(want.fp8_state), strict=True):
        if tolerances.fp8_state is not None:
            for role in ("x", "kernel", "grad"):
                g, w = getattr(got, role), getattr(ref, role)
                assert _normwise(g.amax_history, w.amax_history) < tolerances.fp8_state, role
                assert _normwise(g.scale, w.scale) < tolerances.fp8_state, role
        # Step 1's amax (history slot 1) of the kernel is a max over the
        # initial kernel's shards: exact, whatever the sharding.
        np.testing.assert_array_equal(got.kernel.amax_history[1], ref.kernel.amax_history[1])
