"""fp8jax.ragged_dot under BlockScaling: values, gradients and scales against fine_references.

The reference (``fine_references.block_ragged_dot``) is the dense block
recipe's fake quantization applied to each group's rows: tokens per 1x128
tile along K, each expert's weight per 128x128 block, the wgrad's operands
per 128 tokens from the group's first row. Its operands are exactly the
op's FP8 values, so the op differs only by its f32 arithmetic, within
``references.gemm_slack``'s ``(2 K + 8) 2**-24`` of the magnitude sum: a
wrong group (a tile spanning two experts, a block's scale from another
expert) moves a whole group's rounding grid by hundreds of FP8 steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fine_references as fr
import fp8jax
from fp8jax.ops import _partitioning, block_ragged, fine_grained
from fp8jax.ops import ragged_dot as rd
from fp8jax.ops.fine_grained import FineDotConfig

F32 = jnp.float32


def _inputs(m, k, n, sizes, *, seed=0, outlier=None):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, k))
    w = jax.random.normal(keys[1], (len(sizes), k, n)) * k**-0.5
    if (
        outlier is not None
    ):  # one expert's weights and one of its tokens far out of the rest's range
        w = w.at[outlier, 3, 5].set(300.0).at[outlier].multiply(50.0)
        first = int(np.sum(sizes[:outlier]))
        x = x.at[first, 7].set(-2e4)
    return x, w, jnp.array(sizes, jnp.int32), jax.random.normal(keys[2], (m, n))


def _value_and_grads(x, w, gs, g, recipe, **kw):
    def f(x, w):
        return fp8jax.ragged_dot(x, w, gs, recipe=recipe, preferred_element_type=F32, **kw)

    y, vjp = jax.vjp(jax.jit(f), x, w)
    return (y, *vjp(g))


CASES = {
    # empty groups, boundaries off the 128 grid, rows past the groups, K and N off it
    "ragged": (300, 200, 136, [130, 0, 5, 128, 20], {}),
    "first-and-last-empty": (260, 128, 256, [0, 257, 0], {}),
    "outlier-expert": (280, 256, 128, [60, 140, 80], {"outlier": 1}),
    # rounds of 3 tiles a group: group 0's 5 tiles take two, the second one short
    "multi-tile-rounds": (600, 128, 256, [520, 60], {}),
}
RECIPES = {
    "e4m3": fp8jax.BlockScaling(),
    "hybrid-margin": fp8jax.BlockScaling(formats=fp8jax.HYBRID, margin=1),
    "power-of-two": fp8jax.BlockScaling(power_of_two_scales=True),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_the_per_group_block_reference(case, recipe):
    m, k, n, sizes, kw = CASES[case]
    r = RECIPES[recipe]
    x, w, gs, g = _inputs(m, k, n, sizes, **kw)
    got = dict(zip(("y", "d_lhs", "d_rhs"), _value_and_grads(x, w, gs, g, r), strict=True))
    want = fr.block_ragged_dot(x, w, sizes, g, forward=r.formats.forward.name.lower(),
                               backward=r.formats.backward.name.lower(), margin=r.margin,
                               power_of_two=r.power_of_two_scales)  # fmt: skip
    for name, (value, slack) in want.items():
        err = np.abs(np.asarray(got[name], np.float64) - value)
        worst = np.unravel_index(np.argmax(err - slack), err.shape)
        assert (err <= slack).all(), f"{name} at {worst}: {err[worst]} > {slack[worst]}"
    rows_past = int(np.sum(sizes))
    assert not np.asarray(got["y"][rows_past:]).any()
    assert not np.asarray(got["d_lhs"][rows_past:]).any()
    for i in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.asarray(got["d_rhs"][i]).any()


@pytest.mark.parametrize("sizes,rounds", [([100, 50, 128], 1), ([130, 0, 5, 128, 20], 2)])
def test_a_bf16_weight_gradient_is_the_f32_one_rounded(sizes, rounds):
    # One round writes the kernel's sum in bf16 directly; more add rounds in
    # f32 and cast: both the same rounding of the same f32 sum.
    tiles = block_ragged.round_tiles(300, len(sizes))
    assert -(-max(-(-s // 128) for s in sizes) // tiles) == rounds
    x, w, gs, g = _inputs(300, 256, 128, sizes)
    w16 = w.astype(jnp.bfloat16)
    recipe = fp8jax.BlockScaling()
    *_, dw16 = _value_and_grads(x, w16, gs, g, recipe)
    *_, dw32 = _value_and_grads(x, w16.astype(F32), gs, g, recipe)
    assert dw16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dw16), np.asarray(dw32.astype(jnp.bfloat16)))


def test_the_reference_tells_block_scaling_from_per_tensor_scaling():
    # The outlier expert's blocks: one block scale against the per-expert one
    # moves that expert's other blocks by far more than the slack.
    m, k, n, sizes, kw = CASES["outlier-expert"]
    x, w, gs, g = _inputs(m, k, n, sizes, **kw)
    per_tensor = _value_and_grads(x, w, gs, g, fp8jax.CurrentScaling())
    want = fr.block_ragged_dot(x, w, sizes, g)
    for got, (value, slack) in zip(per_tensor, want.values(), strict=True):
        assert (np.abs(np.asarray(got, np.float64) - value) > slack).any()


def test_forward_and_dgrad_are_the_dense_block_gemm_on_each_groups_rows_bit_for_bit():
    # The same XLA expression per row (the tokens' tiles lie along K, so a
    # row's product depends on no other row); the wgrad adds its token tiles
    # one at a time, in order, and is checked against the reference above.
    m, k, n, sizes, _ = 300, 256, 256, [130, 0, 5, 128, 37], {}
    x, w, gs, g = _inputs(m, k, n, sizes)
    recipe = fp8jax.BlockScaling(formats=fp8jax.HYBRID)
    y, dx, _ = _value_and_grads(x, w, gs, g, recipe)

    # Each group's dense GEMM and its dgrad, jitted: run eagerly, its primitives
    # were compiled one by one for each padded row count (2 s of the test's 3.4 s).
    @jax.jit
    def dense(a, b, ga):
        config = FineDotConfig(recipe, jnp.dtype(F32), jnp.dtype(F32), jnp.dtype(F32),
                               _partitioning.input_types(a, b))  # fmt: skip
        yi, vjp = jax.vjp(lambda a, b: fine_grained.fine_dot(a, b, config), a, b)
        return yi, vjp(ga)[0]

    start = 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + size)
        start += size
        if not size:
            continue
        pad = ((0, -size % 128), (0, 0))
        a, b = jnp.pad(x[rows], pad)[None], jnp.swapaxes(w[i], 0, 1)[None]
        yi, dai = dense(a, b, jnp.pad(g[rows], pad)[None])
        np.testing.assert_array_equal(np.asarray(y[rows]), np.asarray(yi[0, :size]))
        np.testing.assert_array_equal(np.asarray(dx[rows]), np.asarray(dai[0, :size]))


def test_a_round_takes_a_quarter_more_than_a_balanced_share_of_tiles():
    assert block_ragged.round_tiles(600, 2) == 3  # 300 rows a group: 2.35 tiles, 2.9 with 1/4 more
    assert block_ragged.round_tiles(16384 * 6, 64) == 15  # DeepSeek's routed rows: 12 tiles each
    assert block_ragged.round_tiles(96, 4) == 1


def test_token_tiles_start_at_each_groups_first_row():
    tiles = block_ragged.token_tiles(jnp.array([130, 0, 5, 128], jnp.int32), 270)
    want = np.concatenate([np.zeros(128), [1, 1], [2] * 5, [3] * 128, [6] * 7])
    assert block_ragged.tile_count(270, 4) == 6
    np.testing.assert_array_equal(np.asarray(tiles), want)


@pytest.mark.parametrize("margin,power_of_two", [(0, False), (1, False), (0, True)])
def test_every_scale_bit_for_bit(margin, power_of_two):
    sizes, k, n = [130, 0, 5, 128, 37], 256, 384
    x, w, gs, _ = _inputs(330, k, n, sizes, outlier=3)
    fmt = fp8jax.E4M3
    num_tiles = block_ragged.tile_count(x.shape[0], len(sizes))

    # One jitted program, as the op runs them (eagerly, each step compiled on its own).
    @jax.jit
    def quantized(x, gs):
        tiles = block_ragged.token_tiles(gs, x.shape[0])
        return tiles, *block_ragged.quantize_token_tiles(x, tiles, num_tiles, fmt, margin,
                                                         power_of_two)  # fmt: skip

    tiles, data, scale_inv = quantized(x, gs)
    want, start = [], 0
    for size in sizes:
        rows = np.pad(np.asarray(x[start : start + size]), ((0, -size % 128), (0, 0)))
        start += size
        want.append(fr.group_scales(fr.group_amax(rows, (128, 1)), "e4m3", margin, power_of_two))
    want = np.concatenate(want)
    used = want.shape[0]
    np.testing.assert_array_equal(np.asarray(scale_inv[:used]), np.float32(1) / want)
    np.testing.assert_array_equal(np.asarray(scale_inv[used:]), 1.0)  # tiles no group needed
    # The data at each row's tile scale: the reference's cast of the same value.
    tiles = np.asarray(tiles)
    real = tiles < num_tiles
    np.testing.assert_array_equal(
        np.asarray(data[real]).astype(np.float32),
        fr.cast(np.asarray(x[real]), "e4m3", want[tiles[real]]),
    )
    recipe = fp8jax.BlockScaling(margin=margin, power_of_two_scales=power_of_two)
    weight_blocks = jax.jit(block_ragged.quantize_weight_blocks, static_argnums=(1, 2))
    _, block_inv = weight_blocks(w, fmt, recipe)
    for i in range(len(sizes)):  # [n / 128, k / 128] per expert: the blocks of w[i]^T
        blocks = fr.group_scales(fr.group_amax(w[i], (128, 128)), "e4m3", margin, power_of_two)
        np.testing.assert_array_equal(np.asarray(block_inv[i]), (np.float32(1) / blocks).T)


def test_permuted_ragged_dot_equals_ragged_dot_on_permuted_copies():
    # Tokens are tiled along K, so quantizing them before the gather is the
    # copies' quantization; the wgrad's token tiles are the grouped rows' in
    # both, and a row of lhs sums its repeats' gradients in f32 in both.
    t, top_k, experts = 150, 2, 5
    x, w, _, g = _inputs(t, 200, 136, [0] * experts)
    g = jnp.concatenate([g, g])[: t * top_k]
    expert = jax.random.randint(jax.random.key(3), (t * top_k,), 0, experts - 1)
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
    inverse = rd.inverse_permutation(order)
    recipe = fp8jax.BlockScaling()

    def permuted(x, w):
        return fp8jax.permuted_ragged_dot(x, w, sizes, lhs_slots=order, repeats=top_k,
                                          out_slots=order, recipe=recipe)  # fmt: skip

    def copies(x, w):
        xs = jnp.take(x, order // top_k, axis=0)
        return jnp.take(fp8jax.ragged_dot(xs, w, sizes, recipe=recipe), inverse, axis=0)

    y1, vjp1 = jax.vjp(jax.jit(permuted), x, w)
    y2, vjp2 = jax.vjp(jax.jit(copies), x, w)
    for a, b in zip((y1, *vjp1(g)), (y2, *vjp2(g)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_rows_give_empty_outputs_and_zero_weight_gradients():
    x, w, gs = jnp.ones((0, 64)), jnp.ones((3, 64, 32)), jnp.zeros((3,), jnp.int32)
    recipe = fp8jax.BlockScaling()

    @jax.jit  # run eagerly, its primitives were compiled one by one (1.8 s)
    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp8jax.ragged_dot(x, w, gs, recipe=recipe), x, w)
        return y, *vjp(g)

    y, dx, dw = step(x, w, jnp.ones((0, 32)))
    assert y.shape == (0, 32) and dx.shape == (0, 64)
    assert dw.shape == w.shape and not np.asarray(dw).any()


def test_fsdp_shards_of_partial_blocks_are_refused():
    with pytest.raises(
        ValueError, match=r"whole 128x128 blocks.*got a shard of shape \(2, 64, 256\)"
    ):
        block_ragged.check_shard("fp8jax.ragged_dot", (2, 64, 256), (1, ("fsdp",)))
    block_ragged.check_shard("fp8jax.ragged_dot", (2, 128, 256), (1, ("fsdp",)))


@pytest.mark.gpu
def test_the_block_kernel_rounds_match_xlas_on_the_gpu():
    # The rounds' GEMMs on the block-scaled Mosaic GPU kernel (ALL_E4M3: one
    # FP8 type) against the same rounds on XLA's per-slice dots: the same FP8
    # operands and scales, summed at the tensor cores' precision within each
    # 128-slice, far below E4M3's own rounding (test_fine_scaling's bound).
    m, k, n, sizes, _ = 1000, 1024, 384, [300, 0, 257, 300, 123], {}
    x, w, gs, g = _inputs(m, k, n, sizes, seed=7)
    recipe = fp8jax.BlockScaling()
    got = _value_and_grads(x, w, gs, g, recipe)
    with fp8jax.kernels.use_pallas(False):
        want = _value_and_grads(x, w, gs, g, recipe)
    for name, a, b in zip(("y", "d_lhs", "d_rhs"), got, want, strict=True):
        peak = float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(a - b))) / peak < 2**-10, name
    assert not np.asarray(got[0][980:]).any() and not np.asarray(got[1][980:]).any()
