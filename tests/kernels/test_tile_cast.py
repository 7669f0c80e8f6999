"""fp8jax.kernels.tile_cast: BlockScaling's two-way tile cast, the kernel against XLA's bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import tile_cast as tc
from fp8jax.ops.fine_quantize import quantize_tiles, quantize_tiles_both_ways

B = tc.BLOCK


def _operand(seed=0, rows=2 * B, cols=3 * B):
    """Normal values with an outlier row, an outlier column and an all-zero tile."""
    x = jax.random.normal(jax.random.key(seed), (rows, cols))
    x = x.at[5].multiply(3e3).at[:, 7].multiply(-2e2).at[B:, 2 * B :].set(0.0)
    return x.astype(jnp.bfloat16)


def _pair(q):
    """A QuantizedOperand's ``(data, scale_inv)``."""
    return q.data, q.scale_inv


def _both(q):
    """A two-way QuantizedOperand's pairs: as itself, and its transposed copy."""
    return _pair(q), (q.transposed.data, q.transposed.scale_inv)


def _assert_same(got, want):
    for (q, s), (want_q, want_s) in zip(got, want, strict=True):
        np.testing.assert_array_equal(q.view(jnp.uint8), want_q.view(jnp.uint8))
        np.testing.assert_array_equal(s, want_s)


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["f32", "pow2"])
def test_kernel_writes_quantize_tiles_bytes_both_ways(fmt, power_of_two):
    # Interpret mode runs the kernel's body on the CPU, block by block: each
    # block's row tiles and column tiles, scales and all, must be exactly what
    # quantize_tiles gives for x and for x^T (an all-zero tile gets scale 1).
    x = _operand()
    run = jax.jit(functools.partial(tc._pallas, fmt=fmt, margin=1, power_of_two=power_of_two,
                                    interpret=True))  # fmt: skip
    q, s, q_t, s_t = run(x)
    want = [_pair(quantize_tiles(v, fmt, B, 1, power_of_two)) for v in (x, x.T)]
    _assert_same(((q, s), (q_t, s_t)), want)
    xla_q, xla_s, xla_qt, xla_st = tc._xla(x, fmt, 1, power_of_two)  # the kernel's XLA twin
    _assert_same(((xla_q, xla_s), (xla_qt, xla_st)), want)
    assert s.shape == (2 * B, 3) and s_t.shape == (3 * B, 2)
    assert float(s_t[2 * B, 1]) == 1.0  # the zero tile


def test_off_the_grid_and_batched_operands_take_xlas_path():
    assert tc.fits((2 * B, B)) and not tc.fits((2 * B, B), row_shards=4)
    assert not tc.fits((B + 64, B)) and not tc.fits((1, B, B))
    fmt = fp8jax.E4M3
    x = jnp.stack([_operand(1), _operand(2)])
    got = _both(quantize_tiles_both_ways(x, fmt, B))
    want = (_pair(quantize_tiles(x, fmt, B)), _pair(quantize_tiles(jnp.swapaxes(x, 1, 2), fmt, B)))
    _assert_same(got, want)


@pytest.mark.deviceless
def test_deviceless_h200_block_dense_casts_activations_in_the_kernel():
    """x and the output gradient each in one two-way kernel; three block-scaled FP8 GEMMs."""
    from fp8jax import verify
    from fp8jax.verify import _hlo

    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=fp8jax.BlockScaling()), x, w)
        return y, vjp(g)

    hlo = verify.compile_for(step, x, w, g, target="h200",
                             xla_flags=fp8jax.xla_options.as_xla_flags())  # fmt: skip
    names = [
        inst.metadata.get("op_name", "")
        for inst in _hlo.parse_module(hlo).entry.instructions.values()
        if inst.custom_call_target == "__gpu$xla.gpu.triton"
    ]
    assert sum("fp8jax_cast_tiles_both_ways" in n for n in names) == 2, names
    report = verify.gemm_report(hlo)
    assert [gemm.backend for gemm in report.gemms] == ["pallas-fp8"] * 3, str(report)
    assert not [r for r in verify.fp8_relayouts(hlo) if r.untiled_transpose]


@pytest.mark.gpu
@pytest.mark.parametrize("power_of_two", [False, True], ids=["f32", "pow2"])
def test_on_the_gpu_the_kernel_gives_xlas_bytes(power_of_two):
    fmt = fp8jax.E4M3
    x = jnp.concatenate([_operand(3, 8 * B, 4 * B), _operand(4, 8 * B, 4 * B)])[None]
    run = functools.partial(quantize_tiles_both_ways, fmt=fmt, block=B,
                            power_of_two=power_of_two)  # fmt: skip
    assert "fp8jax_cast_tiles_both_ways" in jax.jit(run).lower(x).compile().as_text()
    got = _both(jax.jit(run)(x))
    with fp8jax.kernels.use_pallas(False):
        want = _both(jax.jit(run)(x))
    _assert_same(got, want)
