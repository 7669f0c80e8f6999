"""fp8jax.kernels.row_cast: RowwiseScaling's maxima and casts, the kernels against XLA's bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import row_cast as rc
from fp8jax.ops.fine_quantize import quantize_rows, quantize_rows_and_columns
from fp8jax.quantize import quantize_with_scale

ROWS, COLS = 3 * rc.TILE_ROWS, 2 * rc.TILE_COLS


def _pair(q):
    """A QuantizedOperand's ``(data, scale_inv)``."""
    return q.data, q.scale_inv


def _both(q):
    """A two-way QuantizedOperand's pairs: as itself, and its transposed copy."""
    return _pair(q), (q.transposed.data, q.transposed.scale_inv)


def _operand(seed=0, rows=ROWS, cols=COLS):
    """Normal values with one outlier row and one outlier column, so that scales differ."""
    x = jax.random.normal(jax.random.key(seed), (rows, cols))
    x = x.at[5].multiply(3e3).at[:, 7].multiply(-2e2)
    return x.astype(jnp.bfloat16)


def test_maxima_kernel_gives_every_row_and_column_maximum():
    # Interpret mode runs the kernel's body on the CPU, tile by tile. Maxima of
    # bf16 values are exact in f32, so the partials must equal XLA's bitwise,
    # and reduce to the true row and column maxima.
    x = _operand()
    kernel = jax.jit(functools.partial(rc._pallas_maxima, interpret=True))(x)
    xla = rc._xla_maxima(x)
    for got, want in zip(kernel, xla, strict=True):
        np.testing.assert_array_equal(got, want)
    rows, cols = rc.row_and_column_maxima(x)  # off the GPU: XLA's path
    a = np.abs(np.asarray(x, np.float32))
    np.testing.assert_array_equal(rows, a.max(axis=1))
    np.testing.assert_array_equal(cols, a.max(axis=0))
    assert np.argmax(rows) == 5 and np.argmax(cols) == 7


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=lambda f: f.name)
def test_cast_kernel_writes_quantize_with_scales_bytes_both_ways(fmt):
    # The scales are the rows' and columns' own, halved for a few of each so
    # that values saturate: the bytes must be quantize_with_scale's exactly.
    x = _operand(1)
    a = jnp.abs(x.astype(jnp.float32))
    row_scale = (fmt.max / jnp.max(a, axis=1, keepdims=True)).at[:4].multiply(2.0)
    col_scale = (fmt.max / jnp.max(a, axis=0, keepdims=True)).at[:, :4].multiply(2.0)
    q, q_t = jax.jit(functools.partial(rc._pallas_cast, fmt=fmt, interpret=True))(
        x, row_scale, col_scale
    )
    want = quantize_with_scale(x, fmt, row_scale).data
    want_t = quantize_with_scale(x.T, fmt, col_scale.T).data
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) == fmt.max  # saturated somewhere
    np.testing.assert_array_equal(q.view(jnp.uint8), want.view(jnp.uint8))
    np.testing.assert_array_equal(q_t.view(jnp.uint8), want_t.view(jnp.uint8))
    xla_q, xla_q_t = rc._xla_cast(x, row_scale, col_scale, fmt)
    np.testing.assert_array_equal(xla_q.view(jnp.uint8), want.view(jnp.uint8))
    np.testing.assert_array_equal(xla_q_t.view(jnp.uint8), want_t.view(jnp.uint8))


def _both_ways_through_kernels(x, fmt, interpret):
    """quantize_rows_and_columns's arithmetic with the kernels forced (interpret mode)."""
    rows, cols = (jnp.max(p, axis=0) for p in rc._pallas_maxima(x[0], interpret=interpret))
    from fp8jax.ops.fine_quantize import _scales

    row_scale = _scales(rows, fmt, 0, False)[:, None]
    col_scale = _scales(cols, fmt, 0, False)[None, :]
    q, q_t = rc._pallas_cast(x[0], row_scale, col_scale, fmt, interpret=interpret)
    return (q[None], (1.0 / row_scale)[None]), (q_t[None], (1.0 / col_scale).T[None])


def test_the_kernels_quantize_as_quantize_rows_does():
    # What RowwiseScaling's GEMMs get: x per row, and x^T per row (x's columns).
    fmt = fp8jax.E4M3
    x = _operand(2)[None]
    (q, s), (q_t, s_t) = jax.jit(functools.partial(_both_ways_through_kernels, fmt=fmt,
                                                   interpret=True))(x)  # fmt: skip
    (want_q, want_s), (want_qt, want_st) = (
        _pair(quantize_rows(x, fmt)),
        _pair(quantize_rows(jnp.swapaxes(x, 1, 2), fmt)),
    )
    np.testing.assert_array_equal(q.view(jnp.uint8), want_q.view(jnp.uint8))
    np.testing.assert_array_equal(q_t.view(jnp.uint8), want_qt.view(jnp.uint8))
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(s_t, want_st)


def test_shapes_off_the_tiles_and_batches_take_xlas_path():
    # 96 rows are not whole 64-row tiles; a batch of two is not one matrix.
    assert not rc.fits((96, COLS)) and not rc.fits((ROWS, 64)) and not rc.fits((2, ROWS, COLS))
    assert rc.fits((ROWS, COLS)) and not rc.fits((ROWS, COLS), row_shards=2)
    fmt = fp8jax.E5M2
    for x in (_operand(3, 96, COLS)[None], jnp.stack([_operand(4), _operand(5)])):
        (q, s), (q_t, s_t) = _both(quantize_rows_and_columns(x, fmt))
        (want_q, want_s) = _pair(quantize_rows(x, fmt))
        np.testing.assert_array_equal(q.view(jnp.uint8), want_q.view(jnp.uint8))
        np.testing.assert_array_equal(s, want_s)
        assert q_t.shape == (x.shape[0], x.shape[2], x.shape[1]) and s_t.shape[-1] == 1


@pytest.mark.deviceless
def test_deviceless_h200_rowwise_dense_casts_in_the_kernels():
    """x, the kernel and the output gradient: each in one maxima and one cast kernel."""
    from fp8jax import verify
    from fp8jax.verify import _hlo

    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=fp8jax.RowwiseScaling()), x, w)
        return y, vjp(g)

    hlo = verify.compile_for(
        step, x, w, g, target="h200", xla_flags=fp8jax.xla_options.as_xla_flags()
    )
    names = [
        inst.metadata.get("op_name", "")
        for inst in _hlo.parse_module(hlo).entry.instructions.values()
        if inst.custom_call_target == "__gpu$xla.gpu.triton"
    ]
    assert sum("fp8jax_row_column_maxima" in n for n in names) == 3, names
    assert sum("fp8jax_cast_rows_and_columns" in n for n in names) == 3, names
    report = verify.gemm_report(hlo)
    assert [gemm.backend for gemm in report.gemms] == ["cublaslt-fp8"] * 3, str(report)
    assert not [r for r in verify.fp8_relayouts(hlo) if r.untiled_transpose]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=lambda f: f.name)
def test_on_the_gpu_the_kernels_give_xlas_bytes(fmt):
    x = jnp.concatenate([_operand(6, 1024, 512), _operand(7, 1024, 512)])[None]
    run = jax.jit(functools.partial(quantize_rows_and_columns, fmt=fmt))
    hlo = run.lower(x).compile().as_text()
    assert "fp8jax_cast_rows_and_columns" in hlo and "fp8jax_row_column_maxima" in hlo
    (q, s), (q_t, s_t) = _both(run(x))
    with fp8jax.kernels.use_pallas(False):
        (want_q, want_s), (want_qt, want_st) = _both(
            jax.jit(functools.partial(quantize_rows_and_columns, fmt=fmt))(x)
        )
    np.testing.assert_array_equal(q.view(jnp.uint8), want_q.view(jnp.uint8))
    np.testing.assert_array_equal(q_t.view(jnp.uint8), want_qt.view(jnp.uint8))
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(s_t, want_st)
