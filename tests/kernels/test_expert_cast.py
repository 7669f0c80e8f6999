"""fp8jax.kernels.expert_cast: the experts' weights' two FP8 copies, the kernel against XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import expert_cast as ec


def _weights(g=3, k=2 * ec.TILE_K, n=3 * ec.TILE_N):
    w = jax.random.normal(jax.random.key(0), (g, k, n)) * 4
    return w.at[1].multiply(1e-4).astype(jnp.bfloat16)  # an expert 1e-4 times the others


@pytest.mark.parametrize("on", ["default", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_kernel_writes_xlas_bytes_in_both_layouts(on):
    # The kernel (interpret mode on the CPU; compiled on the GPU) and XLA round
    # the same f32 products: the bytes must be equal, the forward copy
    # transposed. The scales push some values past each format's maximum,
    # so saturation is exercised, and expert 1 has its own scale.
    w = _weights()
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))
    scale = fp8jax.E4M3.max / amax * jnp.array([2.0, 1.0, 0.5])
    run = jax.jit(ec._pallas, static_argnames=("forward", "backward", "interpret"))
    got = run(w, scale, forward=fp8jax.E4M3, backward=fp8jax.E5M2, interpret=on != "gpu")
    want = ec.cast_experts_xla(w, scale, fp8jax.E4M3, fp8jax.E5M2)
    assert float(jnp.max(jnp.abs(want[0][0].astype(jnp.float32)))) == fp8jax.E4M3.max
    assert got[0].dtype == jnp.float8_e4m3fn and got[1].dtype == jnp.float8_e5m2
    assert got[0].shape == (3, 3 * ec.TILE_N, 2 * ec.TILE_K)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))  # fmt: skip


def test_shapes_off_the_tiles_take_xlas_path():
    # 96 rows of k are not whole 64-row tiles: XLA casts (same values).
    w = _weights(k=96)
    scale = jnp.ones((3,))
    assert not ec.fits(w.shape) and ec.fits((3, 128, 256))
    got = jax.jit(ec.cast_experts, static_argnums=(2, 3))(w, scale, fp8jax.E4M3, fp8jax.E5M2)
    jaxpr = str(jax.make_jaxpr(ec.cast_experts, static_argnums=(2, 3))(
        w, scale, fp8jax.E4M3, fp8jax.E5M2))  # fmt: skip
    assert "pallas_call" not in jaxpr
    for a, b in zip(got, ec.cast_experts_xla(w, scale, fp8jax.E4M3, fp8jax.E5M2), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))  # fmt: skip
