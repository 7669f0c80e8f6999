"""fp8jax.ops.cast_transpose: the Pallas kernel (in interpret mode) against XLA's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import cast_transpose as ct
from fp8jax.quantize import quantize_with_scale


@pytest.mark.parametrize("fmt", [fp8jax.E5M2, fp8jax.E4M3], ids=lambda f: f.name)
def test_kernel_matches_quantize_with_scale_and_f32_sums(fmt):
    # Interpret mode runs the kernel's own body on the CPU, tile by tile. The
    # FP8 bytes must be exactly quantize_with_scale's, the transposed copy
    # their transpose. The scale pushes some values past the format's maximum,
    # so saturation is exercised. Column sums: any order of f32 additions of
    # n terms errs by at most n * 2**-24 * sum(|g|). The amax is a maximum of
    # bf16 values, exact in f32.
    rows, cols = 2 * ct.BLOCK_ROWS, 3 * ct.BLOCK_COLS
    g = (jax.random.normal(jax.random.key(0), (rows, cols)) * 4).astype(jnp.bfloat16)
    scale = jnp.float32(fmt.max / 8)
    q, q_t, sums, g_amax = jax.jit(ct._pallas, static_argnames=("fmt", "interpret"))(
        g, scale, fmt=fmt, interpret=True
    )
    want = quantize_with_scale(g, fmt, scale).data.astype(jnp.float32)
    assert float(jnp.max(jnp.abs(want))) == fmt.max  # saturated somewhere
    np.testing.assert_array_equal(q.astype(jnp.float32), want)
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want.T)
    g64 = np.asarray(g, np.float64)
    bound = rows * 2.0**-24 * np.abs(g64).sum(axis=0)
    np.testing.assert_array_less(np.abs(np.asarray(sums, np.float64) - g64.sum(axis=0)), bound)
    assert float(g_amax) == np.abs(g64).max()


def test_off_gpu_the_same_values_come_from_xla():
    g = jax.random.normal(jax.random.key(1), (ct.BLOCK_ROWS, ct.BLOCK_COLS)).astype(jnp.bfloat16)
    scale = jnp.float32(3.0)
    q, q_t, sums, g_amax = jax.jit(ct.cast_transpose, static_argnums=2)(g, scale, fp8jax.E5M2)
    want = quantize_with_scale(g, fp8jax.E5M2, scale).data
    np.testing.assert_array_equal(q.astype(jnp.float32), want.astype(jnp.float32))
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want.T.astype(jnp.float32))
    np.testing.assert_allclose(sums, g.astype(jnp.float32).sum(axis=0), rtol=1e-6, atol=1e-5)
    assert float(g_amax) == float(jnp.max(jnp.abs(g.astype(jnp.float32))))


@pytest.mark.parametrize("shape", [(65, 128), (64, 96), (2, 64, 128)], ids=str)
def test_a_shape_that_does_not_split_into_tiles_is_refused(shape):
    g = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"g must be 2-D with rows a multiple of 64 .*got shape"):
        ct.cast_transpose(g, jnp.float32(1), fp8jax.E5M2)


@pytest.mark.parametrize(
    ("backend", "devices", "whole"),
    [("cpu", 8, True), ("gpu", 1, True), ("gpu", 2, False)],
)
def test_without_a_mesh_only_a_single_gpu_process_counts_arrays_as_whole(
    backend, devices, whole, monkeypatch
):
    # dense._kernel_is_local: a jit without a mesh in context may get sharded
    # inputs, which tracing cannot see; a pallas_call there would make XLA
    # gather its operands in bf16. So with several GPUs and no mesh the
    # kernels stay off; on the CPU (the deviceless compiles) they may run.
    from fp8jax.ops import dense

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(jax, "device_count", lambda: devices)
    assert dense._kernel_is_local() is whole
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert dense._kernel_is_local() is False
