"""The kernel dispatcher: the switch is in the jit key, and mesh locality needs no Flax."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import fp8jax
import fp8jax.sharding as fs
from fp8jax import kernels
from fp8jax.kernels import _options
from fp8jax.kernels import cast_transpose as ct


def _cast(g):
    return ct.cast_transpose(g, jnp.float32(1.0), fp8jax.E5M2).q


def _has_kernel(jaxpr) -> bool:
    return "pallas_call" in str(jaxpr)


def test_flipping_the_switch_after_a_trace_retraces_and_changes_the_program():
    traces = []

    @jax.jit
    def step(g):
        traces.append(_has_kernel(jax.make_jaxpr(_cast)(g)))
        return _cast(g)

    g = jnp.ones((ct.BLOCK_ROWS, ct.BLOCK_COLS), jnp.bfloat16)
    want = step(g)
    with kernels.use_pallas(False):
        got_off = step(g)
    step(g)  # back on: the first trace again, from the cache
    assert traces == [True, False]
    # XLA's twin computes the same bytes (on the CPU the kernel's branch is not taken).
    assert jnp.array_equal(want.view(jnp.uint8), got_off.view(jnp.uint8))


def test_the_switch_is_a_jax_config_option():
    assert kernels.enabled()
    kernels.set_pallas(False)
    try:
        assert not kernels.enabled()
        assert jax.config.fp8jax_pallas is False
    finally:
        kernels.set_pallas(True)
    assert kernels.enabled()


def test_the_switch_takes_a_bool():
    with pytest.raises(TypeError, match="must be a bool"):
        kernels.use_pallas("0")


def test_a_bad_environment_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FP8JAX_TEST_FLAG", "maybe")
    with pytest.raises(ValueError, match="FP8JAX_TEST_FLAG must be 0 or 1"):
        _options._env_flag("FP8JAX_TEST_FLAG", True)
    monkeypatch.setenv("FP8JAX_TEST_FLAG", "0")
    assert _options._env_flag("FP8JAX_TEST_FLAG", True) is False


_FALLBACK_RUN = """
import jax
from fp8jax.kernels import _options

option = _options._Fallback(True)
traces = []

@jax.jit
def f(x):
    traces.append(option.value)
    return x + 1 if option.value else x - 1

values = [float(f(1.0))]
with option(False):
    values.append(float(f(1.0)))
values.append(float(f(1.0)))
print(values, traces)
"""


def test_the_fallback_option_retraces_too():
    # Where JAX's private config API is missing, changes clear JAX's caches. In a process
    # of its own: jax.clear_caches() in this one dropped every program the pytest worker
    # had compiled (10 s to free them late in a suite run, and each later test compiled
    # its programs again).
    src = os.path.dirname(os.path.dirname(os.path.abspath(fp8jax.__file__)))
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": src}
    run = subprocess.run([sys.executable, "-c", _FALLBACK_RUN], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[2.0, 0.0, 2.0] [True, False, True]", run.stdout


def _anywhere(**kwargs) -> kernels.Placement:
    """The placement of a kernel that takes any share of rows."""
    return kernels.decide(lambda shards: True, **kwargs)


def test_data_parallel_rows_are_declared_not_taken_from_flax_rules():
    mesh = fs.make_mesh(fsdp=8)
    # No mesh: local on the CPU (the kernel, on whole arrays) where Pallas has Triton.
    assert _anywhere() in (kernels.Placement(kernel=True), kernels.XLA)
    with jax.set_mesh(mesh):
        assert _anywhere() == kernels.XLA  # a mesh whose roles nobody declared
        with kernels.data_parallel(("dp", "fsdp")):
            assert _anywhere() == kernels.Placement(kernel=True, row_axes=("fsdp",))
            assert _anywhere(rows_are_tokens=False) == kernels.XLA  # a weight's rows
            with kernels.use_pallas(False):
                assert _anywhere() == kernels.XLA
    with jax.set_mesh(fs.make_mesh(fsdp=4, tp=2)), kernels.data_parallel(("fsdp",)):
        assert _anywhere() == kernels.XLA  # tp splits columns


def test_plain_jax_under_a_declared_mesh_runs_the_kernel_per_device():
    # No Flax anywhere: jax.set_mesh and the declaration put the cast kernel
    # in shard_map over the batch axis.
    x = jnp.ones((8 * ct.BLOCK_ROWS, ct.BLOCK_COLS), jnp.bfloat16)
    w = jnp.ones((ct.BLOCK_COLS, ct.BLOCK_COLS), jnp.bfloat16)

    def loss(x, w):
        return jnp.sum(fp8jax.dense(x, w).astype(jnp.float32))

    with jax.set_mesh(fs.make_mesh(dp=8)):
        plain = str(jax.make_jaxpr(jax.grad(loss))(x, w))
        with kernels.data_parallel("dp"):
            declared = str(jax.make_jaxpr(jax.grad(loss))(x, w))
    assert "pallas_call" not in plain
    assert "pallas_call" in declared and "shard_map" in declared


def test_decide_asks_the_kernel_about_its_share_of_rows():
    with jax.set_mesh(fs.make_mesh(dp=8)), kernels.data_parallel("dp"):
        seen = []
        placement = kernels.decide(lambda shards: seen.append(shards) or True)
        assert placement == kernels.Placement(kernel=True, row_axes=("dp",))
        assert kernels.decide(lambda shards: False) == kernels.XLA
    assert seen == [8]
