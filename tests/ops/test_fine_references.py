"""The row, block and MX recipes and per-expert ragged_dot against fake-quant references.

The references (tests/fine_references.py) quantize each group of each GEMM
operand on ``ml_dtypes`` casts, so the op must match them to within f32
roundoff of its GEMMs (``references.gemm_slack``): values and both
gradients, and through them every scale (a scale's error moves its whole
group's rounding grid). The inputs put an outlier where a wrong group would
show: one per 1x128 tile (and 1x32 block) at a position that cycles through
the tile, one per 128x128 weight block in a different quadrant of each (so
that an amax over half a block misses it in half the blocks), rows and
columns whose magnitudes span 2**12 (a scale per tensor, or another row's,
pushes the small ones into the subnormals), an all-zero row, and elements
2**14 to 2**34 below their group's amax, in the subnormals of E4M3 and E5M2,
where a margin (a power of two of the scale) changes the rounding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fine_references as fine
import fp8jax
from references import assert_close, gemm_slack

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def _spread(key, shape) -> np.ndarray:
    """Gaussian values, about 8% of them 2**14 to 2**34 smaller (the FP8 subnormals)."""
    k1, k2, k3 = jax.random.split(key, 3)
    v = np.asarray(jax.random.normal(k1, shape), np.float32)
    tiny = np.asarray(jax.random.uniform(k2, shape)) < 0.08
    depth = np.asarray(jax.random.randint(k3, shape, 14, 35)).astype(np.float32)
    return np.where(tiny, v * np.exp2(-depth), v).astype(np.float32)


def _tile_outliers(v, tile: int, salt: int) -> np.ndarray:
    """One outlier per 1 x ``tile`` group of each row, at a position cycling through the tile."""
    v = v.copy()
    rows, cols = v.shape
    for r in range(rows):
        for t in range(cols // tile):
            pos = (r * 37 + t * 61 + salt) % tile
            v[r, t * tile + pos] *= np.float32(8 * (1 + (r + t + salt) % 5))
    return v


def _block_outliers(v, block: int = 128) -> np.ndarray:
    """One outlier per ``block`` x ``block`` block, in quadrant (its index mod 4) of the block."""
    v = v.copy()
    nr, nc = v.shape[0] // block, v.shape[1] // block
    half = block // 2
    for bi in range(nr):
        for bj in range(nc):
            q = (bi * nc + bj) % 4
            r = bi * block + (q // 2) * half + (bi * 13 + bj * 7) % half
            c = bj * block + (q % 2) * half + (bi * 5 + bj * 11) % half
            v[r, c] = np.float32(60 * (1 + bi * nc + bj)) * np.sign(v[r, c] or 1)
    return v


def _magnitudes(n: int, period: int, span: int) -> np.ndarray:
    """Per-row (or column) factors over ``span`` binades, distinct within ``period``."""
    return np.exp2((np.arange(n) * 5 % period) * span / (period - 1) - span / 2).astype(np.float32)


def operands(m, k, n, seed=0):
    """``(x (m, k), w (k, n), g (m, n))`` f32 with the outliers of the module docstring."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = _spread(kx, (m, k)) * _magnitudes(m, 13, 12)[:, None] * _magnitudes(k, 7, 4)[None]
    x = _tile_outliers(_tile_outliers(x, 128 if k % 128 == 0 else k, 0), 32 if k % 32 == 0 else k,
                       3)  # fmt: skip
    x[m // 3] = 0.0  # an all-zero row: its scale is 1
    w = 0.05 * _spread(kw, (k, n)) * _magnitudes(n, 9, 8)[None]
    if k % 128 == 0 and n % 128 == 0:
        w = _block_outliers(w)
    w = _tile_outliers(w, 32 if n % 32 == 0 else n, 5)
    g = _spread(kg, (m, n)) * _magnitudes(m, 11, 10)[:, None]
    g = _tile_outliers(g, 128 if n % 128 == 0 else n, 1)
    g[:, n // 2] *= 300.0  # an outlier column: the wgrad's per-column scales
    return x, w, g


@functools.partial(jax.jit, static_argnames="recipe")
def dense_and_grads(x, w, g, recipe):
    y, vjp = jax.vjp(lambda x, w: fp8jax.dense(x, w, recipe=recipe), x, w)
    return y, *vjp(g)


def _kind(recipe):
    return {fp8jax.RowwiseScaling: "rowwise", fp8jax.BlockScaling: "block",
            fp8jax.MXFP8Scaling: "mx"}[type(recipe)]  # fmt: skip


def _reference(recipe, x, w, g, pad_to=1):
    """The reference's ``{name: (value, slack)}``; block recipes pad with zeros, as the op does."""
    m, k = x.shape
    n = w.shape[1]
    up = lambda v: -v % pad_to  # noqa: E731
    x = np.pad(x, ((0, up(m)), (0, up(k))))
    w = np.pad(w, ((0, up(k)), (0, up(n))))
    g = np.pad(g, ((0, up(m)), (0, up(n))))
    out = fine.dense(x, w, g, kind=_kind(recipe), forward=recipe.formats.forward.name,
                     backward=recipe.formats.backward.name,
                     margin=getattr(recipe, "margin", 0),
                     power_of_two=getattr(recipe, "power_of_two_scales", _kind(recipe) == "mx"),
                     block=recipe.BLOCK if hasattr(recipe, "BLOCK") else 128)  # fmt: skip
    crop = {"y": (m, n), "dx": (m, k), "dw": (k, n)}
    return {name: (v[: crop[name][0], : crop[name][1]], s[: crop[name][0], : crop[name][1]])
            for name, (v, s) in out.items()}  # fmt: skip


def _check(recipe, x, w, g, dtype=F32, pad_to=1):
    x, w, g = (jnp.asarray(v).astype(dtype) for v in (x, w, g))
    got = dict(zip(("y", "dx", "dw"), dense_and_grads(x, w, g, recipe), strict=True))
    as32 = lambda v: np.asarray(jnp.asarray(v).astype(jnp.float32))  # noqa: E731
    want = _reference(recipe, as32(x), as32(w), as32(g), pad_to)
    for name, (value, slack) in want.items():
        assert got[name].dtype == dtype, (name, got[name].dtype)
        if dtype != F32:  # the output rounds, and a bf16 GEMM before the epilogue
            slack = gemm_slack(0, 1, dtype, value) + slack * (1 + 3 * 2.0**-8)
        assert_close(got[name], value, slack, f"{type(recipe).__name__} {name}")


ROWWISE = {"rowwise": fp8jax.RowwiseScaling(), "rowwise-margin1": fp8jax.RowwiseScaling(margin=1)}


@pytest.mark.parametrize("recipe", ROWWISE.values(), ids=ROWWISE.keys())
@pytest.mark.parametrize("shape", [(256, 256, 128), (48, 80, 40)], ids=["tiles", "unaligned"])
def test_rowwise_dense_matches_fake_quant_reference(recipe, shape):
    _check(recipe, *operands(*shape))


def test_rowwise_bf16_dense_matches_fake_quant_reference():
    _check(ROWWISE["rowwise"], *operands(128, 256, 128, seed=1), dtype=BF16)


BLOCK = {
    "block": fp8jax.BlockScaling(),
    "block-hybrid-pow2-margin1": fp8jax.BlockScaling(margin=1, power_of_two_scales=True,
                                                     formats=fp8jax.HYBRID),
}  # fmt: skip


@pytest.mark.parametrize("recipe", BLOCK.values(), ids=BLOCK.keys())
def test_block_dense_matches_fake_quant_reference(recipe):
    # 256 x 256 weights: four blocks, the outlier in a different quadrant of each.
    _check(recipe, *operands(256, 256, 256))


def test_block_dense_off_the_grid_matches_the_zero_padded_reference():
    _check(BLOCK["block"], *operands(200, 160, 136, seed=2), pad_to=128)


MX = {"mx": fp8jax.MXFP8Scaling(), "mx-hybrid": fp8jax.MXFP8Scaling(formats=fp8jax.HYBRID)}


@pytest.mark.parametrize("recipe", MX.values(), ids=MX.keys())
def test_mxfp8_dense_matches_fake_quant_reference(recipe):
    _check(recipe, *operands(128, 256, 128, seed=3))


def test_reference_groups_are_not_interchangeable():
    """The inputs tell the groups apart: every wrong grouping errs far beyond the slack."""
    x, w, g = operands(256, 256, 256)
    right = fine.dense(x, w, g, kind="block", forward="e4m3", backward="e4m3")
    wrong = {
        # A weight block's amax over its first 64 rows only.
        "half block": lambda v: fine.group_amax(v[np.arange(v.shape[0]) % 128 < 64], (64, 128)),
        "per tensor": lambda v: np.full((2, 2), np.max(np.abs(v)), np.float32),
    }
    for name, amax in wrong.items():
        scale = fine.expand(fine.group_scales(amax(w), "e4m3"), w.shape, (128, 128))
        wq = fine._dequantized(w, "e4m3", scale)
        xq, _ = fine.qdq(x, "e4m3", (1, 128))
        excess = np.abs(xq @ wq - right["y"][0]) - right["y"][1]
        assert np.max(excess) > 0, name


# --- ragged_dot: a scale per expert ---------------------------------------------------------

SIZES = np.array([7, 0, 9, 1, 5], np.int32)  # 22 of 24 rows; expert 1 empty
# Experts' weights over seven binades: one scale for all would flush expert 2's.
EXPERT_FACTORS = np.array([1.0, 1e3, 3e-4, 30.0, 0.5], np.float32)


def _ragged_operands(seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    m, k, n = 24, 64, 32
    lhs = _spread(kx, (m, k))
    g = _spread(kg, (m, n))
    ends = np.cumsum(SIZES)
    starts = ends - SIZES
    # The rows at each group's boundaries are outliers, each its own size:
    # a boundary off by one multiplies one by another expert's weights.
    for i, row in enumerate(sorted({*starts[SIZES > 0], *(ends[SIZES > 0] - 1)})):
        lhs[row] *= np.float32(4 + 3 * i)
        g[row] *= np.float32(5 + 2 * i)
    lhs[22:] *= 50.0  # rows past the groups: no output, no gradient, but in the amax
    rhs = 0.1 * _spread(kw, (len(SIZES), k, n)) * EXPERT_FACTORS[:, None, None]
    return lhs, rhs, g


RAGGED = {"current": fp8jax.CurrentScaling(), "margin1": fp8jax.CurrentScaling(margin=1)}


@functools.partial(jax.jit, static_argnames="recipe")
def ragged_and_grads(lhs, rhs, sizes, g, recipe):
    y, vjp = jax.vjp(lambda a, b: fp8jax.ragged_dot(a, b, sizes, recipe=recipe), lhs, rhs)
    return y, *vjp(g)


@pytest.mark.parametrize("recipe", RAGGED.values(), ids=RAGGED.keys())
@pytest.mark.parametrize("path", ["xla", "interpret"])
def test_ragged_dot_matches_per_expert_fake_quant_reference(recipe, path):
    from fp8jax.ops import ragged_dot as ragged_ops

    lhs, rhs, g = _ragged_operands()
    run = functools.partial(ragged_and_grads, lhs, rhs, jnp.asarray(SIZES), g, recipe)
    if path == "interpret":
        with ragged_ops.interpret_kernels():
            got = run()
    else:
        got = run()
    want = fine.ragged_dot(lhs, rhs, SIZES, g, margin=recipe.margin)
    for name, value, (expected, slack) in zip(("y", "d_lhs", "d_rhs"), got, want.values(),
                                              strict=True):  # fmt: skip
        assert_close(value, expected, slack, f"ragged_dot {name} ({path})")
    y, d_lhs, d_rhs = got
    # The empty expert and the rows past the groups: exactly zero.
    assert not np.asarray(d_rhs[1]).any()
    assert not np.asarray(y[22:]).any() and not np.asarray(d_lhs[22:]).any()


def test_permuted_ragged_dot_matches_the_gathered_reference():
    """Top-2 routing: rows gathered by slot, results scattered back, gradients summed per token."""
    lhs, rhs, g = _ragged_operands(seed=1)
    tokens, repeats = 12, 2
    lhs = lhs[:tokens]
    rng = np.random.default_rng(0)
    # Each token's two experts, distinct; expert 1 gets none (an empty group).
    experts = np.stack([rng.choice([0, 2, 3, 4], 2, replace=False) for _ in range(tokens)])
    slots_expert = experts.reshape(-1)
    order = np.argsort(slots_expert, kind="stable").astype(np.int32)
    sizes = np.bincount(slots_expert, minlength=len(SIZES)).astype(np.int32)
    g = g[: tokens * repeats]

    @jax.jit
    def run(lhs, rhs, g):
        slots = jnp.asarray(order)

        def f(a, b):
            return fp8jax.permuted_ragged_dot(a, b, jnp.asarray(sizes), lhs_slots=slots,
                                              repeats=repeats, out_slots=slots)  # fmt: skip

        y, vjp = jax.vjp(f, lhs, rhs)
        return y, *vjp(g)

    y, d_lhs, d_rhs = run(lhs, rhs, g)
    want = fine.ragged_dot(lhs[order // repeats], rhs, sizes, g[order])
    (wy, sy), (wd, sd), (wr, sr) = want.values()
    scattered = np.zeros_like(wy), np.zeros_like(sy)
    scattered[0][order], scattered[1][order] = wy, sy
    assert_close(y, scattered[0], scattered[1], "permuted_ragged_dot y")
    per_token, slack = np.zeros(lhs.shape), np.zeros(lhs.shape)
    np.add.at(per_token, order // repeats, wd)
    np.add.at(slack, order // repeats, sd)
    # The two slots' gradients are summed in f32: one rounding more.
    assert_close(d_lhs, per_token, slack + 2.0**-24 * np.abs(per_token), "d_lhs")
    assert_close(d_rhs, wr, sr, "d_rhs")
    assert not np.asarray(d_rhs[1]).any()


# --- every scale, bit for bit ------------------------------------------------------------


def test_every_group_scale_is_the_references():
    """The scales the row, tile, block and expert casts take: exactly the reference's.

    The values above already move with any scale of the wrong size; this pins
    each scale down to the bit, power-of-two rounding and margin included.
    """
    from fp8jax.ops import fine_quantize as fq
    from fp8jax.ops import ragged_dot as ragged_ops

    x, w, _ = operands(256, 256, 256)
    x3 = jnp.asarray(x)[None]
    e4m3, e5m2 = fp8jax.E4M3, fp8jax.E5M2
    cases = {
        "rows": (jax.jit(fq.quantize_rows, static_argnums=(1, 2))(x3, e5m2, 1)[1][0],
                 fine.group_amax(x, (1, None)), "e5m2", 1, False),
        "tiles": (jax.jit(fq.quantize_tiles, static_argnums=(1, 2, 3, 4))(x3, e4m3, 128, 2,
                                                                          True)[1][0],
                  fine.group_amax(x, (1, 128)), "e4m3", 2, True),
        "mx": (jax.jit(fq.quantize_tiles, static_argnums=(1, 2, 3, 4))(x3, e4m3, 32, 0,
                                                                       True)[1][0],
               fine.group_amax(x, (1, 32)), "e4m3", 0, True),
        "blocks": (jax.jit(fq.quantize_blocks, static_argnums=(1, 2, 3))(jnp.asarray(w)[None],
                                                                         e4m3, 128, 1)[1][0],
                   fine.group_amax(w, (128, 128)), "e4m3", 1, False),
    }  # fmt: skip
    for name, (scale_inv, amax, fmt, margin, pow2) in cases.items():
        want = np.float32(1) / fine.group_scales(amax, fmt, margin, pow2)
        np.testing.assert_array_equal(np.asarray(scale_inv).reshape(want.shape), want, name)
    _, rhs, _ = _ragged_operands()
    recipe = fp8jax.CurrentScaling(margin=1)
    _, _, scale_inv = jax.jit(ragged_ops.quantize_per_expert, static_argnums=(1, 2, 3))(
        jnp.asarray(rhs), e4m3, e5m2, recipe
    )
    amax = np.abs(rhs).reshape(len(SIZES), -1).max(1)
    want = np.float32(1) / fine.group_scales(amax, "e4m3", 1)
    np.testing.assert_array_equal(np.asarray(scale_inv), want, "experts")
