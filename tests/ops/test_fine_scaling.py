"""RowwiseScaling and BlockScaling: FP8 error budgets, outliers, the block kernel, routing.

The budgets are numerics.gemm_error_bound's, with each element's own scale:
per row (or column) under RowwiseScaling, per 1x128 tile or 128x128 block
under BlockScaling, along the axis each GEMM quantizes its operand.
"""

import functools
import pathlib
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fine_references as fine
import fp8jax
from fp8jax.kernels import block_gemm
from fp8jax.ops.fine_quantize import quantize_blocks, quantize_tiles
from numerics import assert_within, gemm_error_bound
from references import assert_close

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
B = 128  # BlockScaling's tile


def _scale(amax, fmt, power_of_two=False):
    scale = np.where(amax > 0, FP8_MAX[fmt] / np.where(amax > 0, amax, 1.0), 1.0)
    return np.exp2(np.floor(np.log2(scale))) if power_of_two else scale


def row_scales(v, fmt, axis):
    """Each element's scale when ``v`` is scaled per slice along ``axis`` (a row or a column)."""
    return np.broadcast_to(_scale(np.max(np.abs(v), axis=axis, keepdims=True), fmt), v.shape)


def tile_scales(v, fmt, axis, power_of_two=False):
    """Each element's scale for 1x128 tiles of 2-D ``v`` along ``axis``."""
    t = np.moveaxis(v, axis, -1)
    amax = np.max(np.abs(t.reshape(*t.shape[:-1], -1, B)), axis=-1)
    s = np.repeat(_scale(amax, fmt, power_of_two), B, axis=-1)
    return np.moveaxis(s, -1, axis)


def block_scales(v, fmt, power_of_two=False):
    r, c = v.shape
    amax = np.max(np.abs(v.reshape(r // B, B, c // B, B)), axis=(1, 3))
    return np.repeat(np.repeat(_scale(amax, fmt, power_of_two), B, 0), B, 1)


def _data(m=256, k=256, n=128, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    # Magnitudes over a few binades, so that subnormals and rounding both matter.
    x = jax.random.normal(kx, (m, k)) * jnp.exp2(
        jax.random.randint(kx, (m, k), -3, 3).astype(jnp.float32)
    )
    w = jax.random.normal(kw, (k, n)) * 0.05
    g = jax.random.normal(kg, (m, n))
    return x, w, g


# Jitted: eager dispatch compiles every small op on its own, which is slow on the CPU.
dense = jax.jit(fp8jax.dense, static_argnames="recipe")


@functools.partial(jax.jit, static_argnames="recipe")
def dense_and_grads(x, w, g, recipe):
    y, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=recipe), x, w)
    return y, *vjp(g)


def _run(recipe, x, w, g, dtype):
    x, w, g = x.astype(dtype), w.astype(dtype), g.astype(dtype)
    y, dx, dw = dense_and_grads(x, w, g, recipe)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    return [np.asarray(v, np.float64) for v in (x, w, g, y, dx, dw)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rowwise_dense_within_fp8_bound(dtype):
    xs, ws, gs, y, dx, dw = _run(fp8jax.RowwiseScaling(), *_data(), dtype)
    e4, e5 = "e4m3", "e5m2"
    # forward: x per token, w per output channel; dgrad: g per token, w per
    # input row; wgrad: x and g per feature column.
    fwd = gemm_error_bound(xs, ws, e4, e4, row_scales(xs, e4, 1), row_scales(ws, e4, 0),
                           "mk,kn->mn", dtype)  # fmt: skip
    assert_within(y, xs @ ws, fwd, "forward")
    dgrad = gemm_error_bound(gs, ws, e5, e4, row_scales(gs, e5, 1), row_scales(ws, e4, 1),
                             "mn,kn->mk", dtype)  # fmt: skip
    assert_within(dx, gs @ ws.T, dgrad, "dgrad")
    wgrad = gemm_error_bound(xs, gs, e4, e5, row_scales(xs, e4, 0), row_scales(gs, e5, 0),
                             "mk,mn->kn", dtype)  # fmt: skip
    assert_within(dw, xs.T @ gs, wgrad, "wgrad")


@pytest.mark.parametrize(
    ("power_of_two", "formats"),
    [(False, fp8jax.ALL_E4M3), (True, fp8jax.ALL_E4M3), (False, fp8jax.HYBRID)],
)
def test_block_dense_within_fp8_bound(power_of_two, formats):
    recipe = fp8jax.BlockScaling(power_of_two_scales=power_of_two, formats=formats)
    xs, ws, gs, y, dx, dw = _run(recipe, *_data(), jnp.float32)
    e4, p2 = "e4m3", power_of_two
    eg = "e4m3" if formats == fp8jax.ALL_E4M3 else "e5m2"  # the gradient's format
    wb = block_scales(ws, e4, p2)
    fwd = gemm_error_bound(xs, ws, e4, e4, tile_scales(xs, e4, 1, p2), wb, "mk,kn->mn",
                           jnp.float32)  # fmt: skip
    assert_within(y, xs @ ws, fwd, "forward")
    dgrad = gemm_error_bound(gs, ws, eg, e4, tile_scales(gs, eg, 1, p2), wb, "mn,kn->mk",
                             jnp.float32)  # fmt: skip
    assert_within(dx, gs @ ws.T, dgrad, "dgrad")
    wgrad = gemm_error_bound(xs, gs, e4, eg, tile_scales(xs, e4, 0, p2),
                             tile_scales(gs, eg, 0, p2), "mk,mn->kn", jnp.float32)  # fmt: skip
    assert_within(dw, xs.T @ gs, wgrad, "wgrad")


def test_rowwise_float16_output_does_not_overflow_before_its_scales():
    """Unscaled, a GEMM of full-range E4M3 rows reaches 448**2 * K, beyond float16's 65504."""
    x = jnp.ones((16, 256), jnp.float16)
    y = dense(x, jnp.ones((256, 16), jnp.float16), recipe=fp8jax.RowwiseScaling())
    np.testing.assert_array_equal(y, np.full((16, 16), 256.0, np.float16))


# The example: (256 x 1024) @ (1024 x 384); outliers 3e4 times the rest put
# per-tensor scaling's other values near E4M3's subnormals (about 15% error there).
OUTLIER = 3e4


def _error(recipe, x, w, keep_rows=slice(None), keep_cols=slice(None)):
    y = np.asarray(dense(x, w, recipe=recipe), np.float64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    d, r = (y - ref)[keep_rows][:, keep_cols], ref[keep_rows][:, keep_cols]
    return np.linalg.norm(d) / np.linalg.norm(r)


@pytest.fixture(scope="module")
def outlier_data():
    kx, kw = jax.random.split(jax.random.key(3))
    return jax.random.normal(kx, (256, 1024)), jax.random.normal(kw, (1024, 384)) * 0.03


def test_outlier_tokens_rowwise_and_block_halve_per_tensor_error(outlier_data):
    x, w = outlier_data
    tokens = np.array([3, 50, 100, 200])
    x = x.at[tokens].multiply(OUTLIER)
    others = np.setdiff1d(np.arange(256), tokens)
    per_tensor = _error(fp8jax.CurrentScaling(), x, w, others)
    for recipe in (fp8jax.RowwiseScaling(), fp8jax.BlockScaling()):
        assert _error(recipe, x, w, others) <= per_tensor / 2, (recipe, per_tensor)


def test_outlier_channels_halve_per_tensor_error(outlier_data):
    x, w = outlier_data
    channels = np.array([7, 99])
    # Outlier output channels of the weight: RowwiseScaling scales them apart.
    w_out = w.at[:, channels].multiply(OUTLIER)
    others = np.setdiff1d(np.arange(384), channels)
    per_tensor = _error(fp8jax.CurrentScaling(), x, w_out, keep_cols=others)
    assert _error(fp8jax.RowwiseScaling(), x, w_out, keep_cols=others) <= per_tensor / 2
    # Outlier input channels of the activation (LLMs' usual kind) swamp the
    # output either way; they cost the weight gradient of the other channels,
    # which both recipes quantize per feature column (tiles) of x.
    x_in = x.at[:, channels].multiply(OUTLIER)
    g = jax.random.normal(jax.random.key(8), (256, 384))
    keep = np.setdiff1d(np.arange(1024), channels)
    ref = (np.asarray(x_in, np.float64).T @ np.asarray(g, np.float64))[keep]

    def wgrad_error(recipe):
        dw = np.asarray(dense_and_grads(x_in, w, g, recipe)[2], np.float64)[keep]
        return np.linalg.norm(dw - ref) / np.linalg.norm(ref)

    per_tensor = wgrad_error(fp8jax.CurrentScaling())
    for recipe in (fp8jax.RowwiseScaling(), fp8jax.BlockScaling()):
        assert wgrad_error(recipe) <= per_tensor / 2, (recipe, per_tensor)


def _block_operands(batch, m, k, n, seed=4, fmt=fp8jax.E4M3):
    kx, kw = jax.random.split(jax.random.key(seed))
    a = quantize_tiles(jax.random.normal(kx, (batch, m, k)), fmt, B)
    b = quantize_blocks(jax.random.normal(kw, (batch, n, k)) * 0.1, fmt, B)
    return a.data, b.data, a.scale_inv, block_gemm.expand_blocks(b.scale_inv, B)


def test_xla_block_matmul_is_the_scaled_sum_over_k_slices():
    qa, qb, sa, sb = _block_operands(2, 128, 384, 128)
    y = block_gemm.xla_block_matmul(qa, qb, sa, sb, out_dtype=jnp.float32)
    a = np.asarray(qa, np.float64).reshape(2, 128, 3, B) * np.asarray(sa)[..., None]
    b = np.asarray(qb, np.float64).reshape(2, 128, 3, B) * np.asarray(sb)[..., None]
    expected = np.einsum("zmsk,znsk->zmn", a, b)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_xla_block_matmul_takes_a_weights_block_scales():
    # b_blocks: b's scales one per 128 x 128 block, the same sums as repeated per row.
    kx, kw = jax.random.split(jax.random.key(5))
    a = quantize_tiles(jax.random.normal(kx, (1, 128, 256)), fp8jax.E4M3, B)
    b = quantize_blocks(jax.random.normal(kw, (1, 256, 256)) * 0.1, fp8jax.E4M3, B)
    qa, sa, qb, sb = a.data, a.scale_inv, b.data, b.scale_inv
    expanded = block_gemm.expand_blocks(sb, B)
    per_row = block_gemm.xla_block_matmul(qa, qb, sa, expanded, out_dtype=jnp.float32)
    xla = block_gemm.xla_block_matmul(qa, qb, sa, sb, out_dtype=jnp.float32, b_blocks=True)
    np.testing.assert_array_equal(xla, per_row)


def _kernel_args(batch, m, n, k, b_blocks, dtype=jnp.float8_e4m3fn):
    b_scales = (batch, n // B, k // B) if b_blocks else (batch, n, k // B)
    return (jax.ShapeDtypeStruct((batch, m, k), dtype), jax.ShapeDtypeStruct((batch, n, k), dtype),
            jax.ShapeDtypeStruct((batch, m, k // B), jnp.float32),
            jax.ShapeDtypeStruct(b_scales, jnp.float32))  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("b_blocks", [False, True], ids=["row-scales", "block-scales"])
def test_deviceless_block_kernel_is_one_fp8_wgmma_gemm(b_blocks):
    """A batch of two lowers to the one Mosaic GPU kernel on FP8 tensor cores (H200 target)."""
    from fp8jax import verify

    fn = functools.partial(block_gemm.block_scaled_matmul, out_dtype=jnp.bfloat16,
                           b_blocks=b_blocks)  # fmt: skip
    hlo = verify.compile_for(fn, *_kernel_args(2, 256, 384, 512, b_blocks), target="h200")
    report = verify.gemm_report(hlo)
    assert [(g.backend, g.target, g.lhs_shape, g.rhs_shape, g.out_shape) for g in report.gemms] == [
        ("pallas-fp8", block_gemm.KERNEL_NAME, (2, 256, 512), (2, 384, 512), (2, 256, 384))
    ], str(report)  # fmt: skip
    # The kernel's own instructions ride in the custom call: Hopper's FP8 wgmma,
    # 64 rows a warpgroup, the tile's columns, 32 of K an instruction. Twelve
    # tiles of 128 leave most SMs idle: the shape table takes 64.
    tile_n = block_gemm.tile_n_for(256, 384, b_blocks, batch=2)
    assert tile_n == 64
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k32\.f32\.e4m3\.e4m3", hlo)


def test_block_kernel_takes_only_whole_tiles_of_one_fp8_type():
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    assert block_gemm.fits((1, 256, 384), (1, 128, 384), e4, e4)
    assert block_gemm.fits((1, 256, 384), (1, 128, 384), e5, e5)
    assert not block_gemm.fits((1, 256, 384), (1, 128, 384), e5, e4)  # HYBRID's dgrad
    assert not block_gemm.fits((1, 192, 384), (1, 128, 384), e4, e4)  # two warpgroups of 64 rows
    assert not block_gemm.fits((1, 256, 384), (1, 192, 384), e4, e4)
    assert not block_gemm.fits((1, 256, 320), (1, 128, 320), e4, e4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("sms", [None, 5], ids=["all-sms", "5-ctas"])
def test_block_kernel_matches_xla_on_the_gpu(sms, fmt):
    """On FP8 tensor cores each 128-slice is summed at the tensor core's precision first.

    A batch of two, 4 x 3 tiles each: with 5 CTAs each walks several tiles.
    """
    ops = _block_operands(2, 512, 1024, 384, fmt=fmt)
    kernel = jax.jit(functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.float32,
                                       sms=sms))  # fmt: skip
    xla = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32))
    y, expected = kernel(*ops), xla(*ops)
    # b's block scales, applied as one scalar per tile and step.
    qa, qb, sa, _ = ops
    blocks = jnp.max(ops[3].reshape(2, -1, B, ops[3].shape[-1]), axis=2)  # one per block
    by_block = jax.jit(functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.float32,
                                         sms=sms, b_blocks=True))  # fmt: skip
    y_blocks = by_block(qa, qb, sa, blocks)
    # Hopper's FP8 accumulation keeps fewer bits than f32 (DeepSeek-V3's reason to
    # promote every 128), and XLA's batched dot may accumulate fast too; both
    # stay far below E4M3's own rounding, 2**-4.
    for out in (y, y_blocks):
        assert float(jnp.max(jnp.abs(out - expected)) / jnp.max(jnp.abs(expected))) < 2**-10


RECIPES = [fp8jax.RowwiseScaling(), fp8jax.BlockScaling()]


@pytest.mark.parametrize("recipe", RECIPES, ids=["row", "block"])
def test_unaligned_batched_dot_general_and_einsum(recipe):
    """Batch axes, several contracted axes, extents off the 128 grid (padded under blocks).

    Each batch element is the 2-D GEMM of its merged axes, x (40, 6 * 30) by
    w (6 * 30, 20): values and both gradients against the fake-quant reference
    of tests/fine_references.py (zero-padded to whole blocks under
    BlockScaling), within its f32 slack (references.gemm_slack). A group
    taken over the wrong axes, or across the batch, moves its rounding grid.
    """
    from test_fine_references import _reference

    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (2, 40, 6, 30))
    w = jax.random.normal(kw, (2, 6, 30, 20)) * 0.1
    w = w.at[1].multiply(5.0)  # the batch elements' scales differ
    g = jax.random.normal(kg, (2, 40, 20))
    dims = (((2, 3), (1, 2)), ((0,), (0,)))

    @jax.jit
    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp8jax.dot_general(x, w, dims, recipe=recipe), x, w)
        e = fp8jax.einsum("bmhk,bhkn->bnm", x, w, recipe=recipe)
        return y, e, vjp(g)

    y, e, (dx, dw) = run(x, w, g)
    assert y.shape == (2, 40, 20) and dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_array_equal(e, jnp.swapaxes(y, 1, 2))
    pad_to = 1 if isinstance(recipe, fp8jax.RowwiseScaling) else B
    f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
    for b in range(2):
        want = _reference(recipe, f32(x[b]).reshape(40, 180), f32(w[b]).reshape(180, 20),
                          f32(g[b]), pad_to)  # fmt: skip
        for name, got in (("y", y[b]), ("dx", dx[b]), ("dw", dw[b])):
            value, slack = want[name]
            assert_close(np.asarray(got).reshape(value.shape), value, slack, f"{name}[{b}]")


# The fused ops against the fine-grained fake-quant reference (tests/fine_references.py),
# normwise: the op's normalized input and activation differ from the reference's
# by f32 roundoff, which moves an FP8 rounding by one step (2**-3 of an element,
# E4M3) now and then, as in tests/ops/test_recipe_references.py: 2**-8 allows a
# few such flips in the 64 x 128 tensors here; an E5M2 operand in an E4M3 role
# errs by about 2**-3.8 normwise, a scale of the wrong group by more.
FUSED_RTOL = 2.0**-8


def _relative(got, want, what):
    for name, value in want.items():
        err = float(np.linalg.norm(np.asarray(got[name], np.float64) - value)
                    / np.linalg.norm(value))  # fmt: skip
        assert err <= FUSED_RTOL, f"{what} {name}: {err:.3g} from the reference"


@pytest.mark.parametrize("recipe", RECIPES, ids=["row", "block"])
def test_fused_ops_are_norm_then_fine_grained_dense(recipe):
    """layernorm_dense and layernorm_mlp under these recipes: the norm, then their GEMMs."""
    ks = jax.random.split(jax.random.key(6), 7)
    x = jax.random.normal(ks[0], (2, 32, 128)) * 2 + 0.5
    gamma = 1.0 + 0.1 * jax.random.normal(ks[1], (128,))
    beta = 0.1 * jax.random.normal(ks[6], (128,))
    k = jax.random.normal(ks[2], (128, 3, 64)) * 0.1
    k1 = jax.random.normal(ks[3], (128, 2, 128)) * 0.1
    k2 = jax.random.normal(ks[4], (128, 128)) * 0.1
    c_qkv, c_mlp = jax.random.normal(ks[5], (2, 32, 192)), jax.random.normal(ks[6], x.shape)
    swiglu = ("silu", "linear")

    @jax.jit
    def run(x, gamma, beta, k, k1, k2):
        normed = fp8jax.layernorm(x, gamma, beta)
        qkv = fp8jax.layernorm_dense(x, gamma, beta, k, recipe=recipe, split=(1, 1, 1))
        whole = fp8jax.dense(normed, k, recipe=recipe)
        y = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=swiglu, recipe=recipe)
        pre = fp8jax.dense(normed, k1, recipe=recipe)
        h = jax.nn.silu(pre[..., 0, :]) * pre[..., 1, :]
        composed = fp8jax.dense(h, k2, recipe=recipe)

        def ln_dense(x, gamma, beta, k):
            return fp8jax.layernorm_dense(x, gamma, beta, k, recipe=recipe).reshape(c_qkv.shape)

        def mlp(x, gamma, beta, k1, k2):
            return fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=swiglu,
                                        recipe=recipe)  # fmt: skip

        y_qkv, vjp = jax.vjp(ln_dense, x, gamma, beta, k)
        d_qkv = vjp(c_qkv)
        _, vjp = jax.vjp(mlp, x, gamma, beta, k1, k2)
        return jnp.concatenate(qkv, axis=-2), whole, y, composed, y_qkv, d_qkv, vjp(c_mlp)

    qkv, whole, y, composed, y_qkv, d_qkv, d_mlp = run(x, gamma, beta, k, k1, k2)
    np.testing.assert_allclose(qkv, whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, composed, rtol=1e-6, atol=1e-6)
    kw = {"kind": "rowwise" if isinstance(recipe, fp8jax.RowwiseScaling) else "block",
          "forward": recipe.formats.forward.name, "backward": recipe.formats.backward.name,
          "pad_to": 1 if isinstance(recipe, fp8jax.RowwiseScaling) else B}  # fmt: skip
    rows = lambda v: np.asarray(v, np.float32).reshape(64, -1)  # noqa: E731
    want_y, want = fine.layernorm_dense(rows(x), gamma, beta, np.asarray(k).reshape(128, -1),
                                        rows(c_qkv), **kw)  # fmt: skip
    got = dict(zip(("x", "gamma", "beta", "kernel"), d_qkv, strict=True))
    got = {n: v.reshape(want[n].shape) for n, v in got.items()}
    _relative({"y": rows(y_qkv), **got}, {"y": want_y, **want}, "layernorm_dense")
    act = lambda p: jax.nn.silu(p[:, 0]) * p[:, 1]  # noqa: E731
    want_y, want = fine.layernorm_mlp(rows(x), gamma, beta, np.asarray(k1).reshape(128, -1), k2,
                                      rows(c_mlp), act, **kw)  # fmt: skip
    got = dict(zip(("x", "gamma", "beta", "kernel_1", "kernel_2"), d_mlp, strict=True))
    got = {n: np.asarray(v).reshape(want[n].shape) for n, v in got.items()}
    _relative({"y": rows(y), **got}, {"y": want_y, **want}, "layernorm_mlp")


def test_fine_recipes_validate_and_keep_no_state():
    with pytest.raises(ValueError, match="RowwiseScaling.margin"):
        fp8jax.RowwiseScaling(margin=-1)
    with pytest.raises(TypeError, match="BlockScaling.formats"):
        fp8jax.BlockScaling(formats="e4m3")
    with pytest.raises(TypeError, match="power_of_two_scales"):
        fp8jax.BlockScaling(power_of_two_scales=1)
    assert fp8jax.init_state(fp8jax.BlockScaling()) is None
    state = fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=2))
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="None with RowwiseScaling"):
        fp8jax.dense(x, x.T, recipe=fp8jax.RowwiseScaling(), state=state)


@functools.cache
def _deviceless_reports():
    from fp8jax import verify

    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 384), jnp.float32)
    g = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)

    def step(recipe):
        def f(x, w, g):
            def dense(x, w):  # computing in the activations' dtype, as a module does
                return fp8jax.dense(x, w, recipe=recipe, preferred_element_type=x.dtype)

            y, vjp = jax.vjp(dense, x, w)
            return y, vjp(g)

        return f

    calls = [(step(r), (x, w, g)) for r in RECIPES]
    dump = tempfile.mkdtemp(prefix="fp8jax_fine_scaling_")
    flags = f"{fp8jax.xla_options.as_xla_flags()} --xla_dump_to={dump}"
    texts = verify.compile_many(calls, target="h100", xla_flags=flags)
    # The GPU code of every kernel: only the block kernel's dots run on tensor cores
    # here (cuBLASLt's GEMMs are library calls, and XLA's Triton GEMMs are off).
    ptx = "".join(path.read_text() for path in pathlib.Path(dump).glob("*.ptx"))
    shutil.rmtree(dump, ignore_errors=True)
    untiled = [[r for r in verify.fp8_relayouts(t) if r.untiled_transpose] for t in texts]
    # Mosaic GPU kernels carry their instructions in the custom call, not in XLA's PTX.
    return [verify.gemm_report(t) for t in texts], ptx + "".join(texts), untiled, texts


@pytest.mark.deviceless
def test_deviceless_h100_every_gemm_is_fp8():
    """Rowwise: three cuBLASLt FP8 GEMMs; block: three block-scaled Mosaic GPU kernels on f8."""
    (row, block), _, untiled, _ = _deviceless_reports()
    assert [g.backend for g in row.gemms] == ["cublaslt-fp8"] * 3, str(row)
    assert [g.backend for g in block.gemms] == ["pallas-fp8"] * 3, str(block)
    for report in (row, block):
        assert not report.non_fp8_gemms, str(report)
    # No FP8 data moved through XLA's slow untiled transposes
    # (docs/design.md#the-forward-kernel-transposed-in-the-program).
    assert untiled == [[], []], untiled


@pytest.mark.deviceless
def test_deviceless_block_kernel_multiplies_on_fp8_tensor_cores():
    """Hopper's FP8 wgmma, not f16 mma.sync on operands converted in registers."""
    from fp8jax.verify import _hlo

    (_, block), ptx, _, texts = _deviceless_reports()
    assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx), "no FP8 wgmma in the kernels"
    assert "mma.sync" not in ptx and "f16x2.e4m3x2" not in ptx
    # The forward, dgrad and wgrad GEMMs are three kernels, each carrying its own
    # instructions in its custom call: each must hold the FP8 wgmma (the search
    # above is met by any one of them alone).
    entry = _hlo.parse_module(texts[1]).entry
    wgmma = r"wgmma\.mma_async\S*\.e4m3\.e4m3"
    fp8_wgmma = [bool(re.search(wgmma, entry.instructions[g.name].attrs)) for g in block.gemms]
    assert fp8_wgmma == [True] * 3, (fp8_wgmma, str(block))


@pytest.mark.parametrize("recipe", RECIPES, ids=["row", "block"])
def test_linen_and_nnx_modules_take_the_recipe(recipe):
    from flax import linen as nn
    from flax import nnx

    from fp8jax.flax import linen as fnn
    from fp8jax.flax import nnx as fnnx

    x = jax.random.normal(jax.random.key(9), (2, 16, 32))
    layer = fnn.DenseGeneral(features=48, recipe=recipe)
    variables = layer.init(jax.random.key(0), x)
    assert set(variables) == {"params"}  # no fp8_state: the recipe keeps none
    params = nn.unbox(variables["params"])  # logical-axis metadata off
    kernel, bias = params["kernel"], params["bias"]
    expected = dense(x, kernel, bias, recipe=recipe)
    np.testing.assert_allclose(layer.apply(variables, x), expected, rtol=1e-6, atol=1e-6)
    module = fnnx.DenseGeneral(32, 48, recipe=recipe, rngs=nnx.Rngs(0))
    expected = dense(x, module.kernel[...], module.bias[...], recipe=recipe)
    np.testing.assert_allclose(module(x), expected, rtol=1e-6, atol=1e-6)


def test_train_recipe_names():
    from fp8jax.training import config

    named = (("row", fp8jax.RowwiseScaling), ("block", fp8jax.BlockScaling),
             ("mxfp8", fp8jax.MXFP8Scaling))  # fmt: skip
    for name, cls in named:
        options = config.TrainOptions(out="unused", config="tiny", precision="fp8", recipe=name)
        assert isinstance(config.resolve(options).fp8_recipe(), cls)


def test_flax_drop_in_dot_general_takes_the_recipe():
    from fp8jax.flax import Fp8DotGeneral

    x, w, _ = _data()
    dims = (((1,), (0,)), ((), ()))
    # Both sides jitted: run eagerly, each recipe's primitives were compiled one by
    # one (172 compiles, 2.7 s); the two programs are the same ops on the same values.
    for recipe in (*RECIPES, fp8jax.MXFP8Scaling()):
        expected = jax.jit(lambda x, w, r=recipe: fp8jax.dot_general(x, w, dims, recipe=r))(x, w)
        got = jax.jit(lambda x, w, r=recipe: Fp8DotGeneral(recipe=r)(x, w, dims))(x, w)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("recipe", RECIPES, ids=["row", "block"])
def test_empty_batch_gives_empty_output_and_zero_gradient(recipe):
    w = jnp.ones((16, 8))
    y, vjp = jax.vjp(lambda w: fp8jax.dense(jnp.ones((0, 16)), w, recipe=recipe), w)
    assert y.shape == (0, 8)
    np.testing.assert_array_equal(vjp(y)[0], np.zeros((16, 8)))
