"""fp8jax.kernels.cast_transpose: the Pallas kernel (in interpret mode) against XLA's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import cast_transpose as ct
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


@pytest.mark.parametrize("through", ["kernel", "pieces_kernel", "xla"])
def test_without_column_sums_the_same_bytes_and_maxima_come_out(through):
    # A GEMM input or kernel has no bias to sum for: the kernel (interpret
    # mode; from one matrix or from pieces) and XLA's path then return no
    # sums and, bit for bit, the same q, q_t and maxima as with them.
    g = jax.random.normal(jax.random.key(3), (2 * ct.BLOCK_ROWS, 2 * ct.BLOCK_COLS)) * 4
    g, scale, fmt = g.astype(jnp.bfloat16), jnp.float32(100.0), fp8jax.E4M3
    if through == "pieces_kernel":
        g = _interleaved(2 * ct.BLOCK_ROWS, 2, (128, 256))
    if through != "xla":
        run = jax.jit(ct._pallas_partials, static_argnames=("fmt", "interpret", "column_sums"))
        q, q_t, sums, maxima = run(g, scale, fmt=fmt, interpret=True)
        without = run(g, scale, fmt=fmt, interpret=True, column_sums=False)
    else:
        run = jax.jit(ct.cast_transpose, static_argnums=2, static_argnames="column_sums")
        q, q_t, sums, maxima = run(g, scale, fmt)
        without = run(g, scale, fmt, column_sums=False)
        assert without.column_sums is None
        without = (without.q, without.q_t, without.maxima)
    assert sums is not None and len(without) == 3
    for got, want in zip(without, (q, q_t, maxima), strict=True):
        np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))


@pytest.mark.parametrize("through", ["kernel", "xla"])
def test_branch_major_transposed_copy_holds_each_branchs_rows_together(through):
    # A gated pair's gradient (columns (ffn, 2), interleaved) is given to
    # kernel_1's wgrad branch-major: row k * ffn + f of the transposed copy is
    # column 2 * f + k of q, so the GEMM writes the parameter's (hidden, 2, ffn)
    # layout. q, the column sums and the maxima stay as without branches.
    rows, cols = 2 * ct.BLOCK_ROWS, 3 * ct.BLOCK_COLS
    g = (jax.random.normal(jax.random.key(4), (rows, cols)) * 4).astype(jnp.bfloat16)
    scale, fmt = jnp.float32(fp8jax.E5M2.max / 8), fp8jax.E5M2
    if through == "kernel":
        run = jax.jit(ct._pallas_partials, static_argnames=("fmt", "interpret", "branches"))
        plain = run(g, scale, fmt=fmt, interpret=True)
        paired = run(g, scale, fmt=fmt, interpret=True, branches=2)
    else:
        run = jax.jit(ct.cast_transpose, static_argnums=2, static_argnames="branches")
        plain, paired = run(g, scale, fmt), run(g, scale, fmt, branches=2)
    q = np.asarray(plain[0].astype(jnp.float32))
    want_t = np.concatenate([q[:, 0::2].T, q[:, 1::2].T])
    np.testing.assert_array_equal(np.asarray(paired[1].astype(jnp.float32)), want_t)
    for i in (0, 2, 3):
        np.testing.assert_array_equal(
            np.asarray(paired[i]).astype(np.float32), np.asarray(plain[i]).astype(np.float32)
        )


@pytest.mark.parametrize("branches", [0, 3])
def test_branches_other_than_one_or_a_pair_are_refused(branches):
    g = jnp.zeros((ct.BLOCK_ROWS, 3 * ct.BLOCK_COLS), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"branches must be 1 or 2.*got {branches}"):
        ct.cast_transpose(g, jnp.float32(1.0), fp8jax.E5M2, branches=branches)


def test_off_gpu_the_same_values_come_from_xla():
    g = jax.random.normal(jax.random.key(1), (ct.BLOCK_ROWS, ct.BLOCK_COLS)).astype(jnp.bfloat16)
    scale = jnp.float32(3.0)
    q, q_t, sums, maxima = jax.jit(ct.cast_transpose, static_argnums=2)(g, scale, fp8jax.E5M2)
    want = quantize_with_scale(g, fp8jax.E5M2, scale).data
    np.testing.assert_array_equal(q.astype(jnp.float32), want.astype(jnp.float32))
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want.T.astype(jnp.float32))
    np.testing.assert_allclose(sums, g.astype(jnp.float32).sum(axis=0), rtol=1e-6, atol=1e-5)
    # One maximum per tile (here one tile), as the kernel writes them.
    assert maxima.shape == (1, 1)
    assert float(maxima[0, 0]) == float(jnp.max(jnp.abs(g.astype(jnp.float32))))


def _interleaved(rows, periods, widths, seed=2):
    keys = jax.random.split(jax.random.key(seed), len(widths))
    return ct.Interleaved(
        tuple(
            (jax.random.normal(k, (rows, periods * w)) * 4).astype(jnp.bfloat16)
            for k, w in zip(keys, widths, strict=True)
        ),
        periods,
    )


@pytest.mark.parametrize(
    ("periods", "widths"), [(2, (256, 128, 128)), (1, (128, 128, 128)), (3, (128,))], ids=str
)
def test_pieces_kernel_writes_the_joined_matrix_bytes(periods, widths):
    # A fused QKV's gradient comes as dq, dk, dv; the kernel reads each column
    # tile from the piece it lies in (periods: key/value heads; widths: the
    # group's query heads, then k and v, times head_dim). Every result must be
    # exactly the one-matrix kernel's on the joined matrix (same tiles, same
    # order of f32 additions within each tile), which the test above checks
    # against quantize_with_scale and f64 sums.
    g = _interleaved(2 * ct.BLOCK_ROWS, periods, widths)
    joined = g.joined()
    assert joined.shape == g.shape
    np.testing.assert_array_equal(  # the layout Interleaved documents
        np.asarray(joined).reshape(g.shape[0], periods, -1)[:, -1, -widths[-1] :],
        np.asarray(g.pieces[-1]).reshape(g.shape[0], periods, -1)[:, -1],
    )
    fmt, scale = fp8jax.E5M2, jnp.float32(fp8jax.E5M2.max / 8)
    run = jax.jit(ct._pallas, static_argnames=("fmt", "interpret"))
    from_pieces = run(g, scale, fmt=fmt, interpret=True)
    from_joined = run(joined, scale, fmt=fmt, interpret=True)
    for got, want in zip(from_pieces, from_joined, strict=True):
        np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))


def test_off_gpu_pieces_are_joined_by_xla():
    g = _interleaved(ct.BLOCK_ROWS, 2, (128, 256))
    scale = jnp.float32(3.0)
    q, q_t, sums, maxima = jax.jit(ct.cast_transpose, static_argnums=2)(g, scale, fp8jax.E5M2)
    want = quantize_with_scale(g.joined(), fp8jax.E5M2, scale).data.astype(jnp.float32)
    np.testing.assert_array_equal(q.astype(jnp.float32), want)
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want.T)
    np.testing.assert_array_equal(sums, g.joined().astype(jnp.float32).sum(axis=0))
    want_amax = max(float(jnp.max(jnp.abs(p.astype(jnp.float32)))) for p in g.pieces)
    assert float(jnp.max(maxima)) == want_amax


@pytest.mark.parametrize(
    ("rows", "widths", "message"),
    [
        (ct.BLOCK_ROWS, (32, 96, 128), r"multiples of 64 and rows a multiple of 128, got 64 rows"),
        (ct.BLOCK_ROWS, (64, 64, 128), r"multiples of 64 and rows a multiple of 128, got 64 rows"),
    ],
    ids=["widths", "rows"],
)
def test_pieces_that_split_tiles_are_refused(rows, widths, message):
    # Pieces 64 wide get tiles half as wide and twice as tall (ct._tile).
    g = _interleaved(rows, 2, widths)
    assert not g.tiles_fit()
    with pytest.raises(ValueError, match=message):
        ct.cast_transpose(g, jnp.float32(1), fp8jax.E5M2)


@pytest.mark.parametrize(("periods", "widths"), [(2, (128, 64, 64)), (16, (64, 64, 64))], ids=str)
def test_pieces_64_wide_are_cast_in_narrow_tiles(periods, widths):
    # A head_dim of 64 (the small and medium presets) makes every piece's share
    # of a period 64 columns wide: the kernel reads 128 x 64 tiles. Bytes and
    # amax are exactly quantize_with_scale's and the maximum; the column sums
    # add the same terms as the one-matrix kernel in another grouping, so they
    # are held to the f32 bound of the first test.
    g = _interleaved(2 * 128, periods, widths)
    assert ct._tile(g) == (128, 64)
    fmt, scale = fp8jax.E5M2, jnp.float32(fp8jax.E5M2.max / 8)
    q, q_t, sums, g_amax = jax.jit(ct._pallas, static_argnames=("fmt", "interpret"))(
        g, scale, fmt=fmt, interpret=True
    )
    want = quantize_with_scale(g.joined(), fmt, scale).data.astype(jnp.float32)
    np.testing.assert_array_equal(q.astype(jnp.float32), want)
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want.T)
    g64 = np.asarray(g.joined(), np.float64)
    bound = g64.shape[0] * 2.0**-24 * np.abs(g64).sum(axis=0)
    np.testing.assert_array_less(np.abs(np.asarray(sums, np.float64) - g64.sum(axis=0)), bound)
    assert float(g_amax) == np.abs(g64).max()


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
    # dispatch.is_local: a jit without a mesh in context may get sharded
    # inputs, which tracing cannot see; a pallas_call there would make XLA
    # gather its operands in bf16. So with several GPUs and no mesh the
    # kernels stay off; on the CPU (the deviceless compiles) they may run.
    from fp8jax.kernels import dispatch

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(jax, "device_count", lambda: devices)
    assert dispatch.is_local() is whole
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert dispatch.is_local() is False
