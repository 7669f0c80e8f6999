"""The FP8 attention forward kernel: in Mosaic GPU's interpreter against its XLA twin, and
compiled deviceless for the H200 (FP8 wgmma in its code, one FP8 GEMM in the report)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import numerics
from fp8jax.kernels import attention as kernel
from fp8jax.kernels import attention_backward
from fp8jax.ops import attention as op
from mosaic_gpu_testing import h200_compiles_with_dumps, one_compile_per_thread_body


@pytest.fixture(scope="module", autouse=True)
def _one_compile_per_thread_body():
    with one_compile_per_thread_body():  # its docstring says why
        yield


# The operands and the XLA twin's results as one jitted program each, kept per shape: made
# eagerly, each of their ops compiled on its own for each new shape (0.4-0.8 s a test), and
# three builds below take the same causal operands and twin's results (the forward interpret
# tests: 9.4 s -> 7.3 s).
@functools.cache
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _operands(tq, tk, heads, kv_heads, d):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, tq, heads, d)).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (1, tk, kv_heads, d)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (1, tk, kv_heads, d))
    # V's key blocks a power of two apart (1, 8, 1/4, 2, ...), so their scales differ: PV
    # in place rescales the accumulator by their ratios, which equal blocks would hide.
    factors = jnp.array([1.0, 8.0, 0.25, 2.0])[jnp.arange(tk) // kernel.BLOCK % 4]
    v = (v * factors[None, :, None, None]).astype(jnp.bfloat16)
    return op.kernel_operands(q, k, v, d**-0.5)[0]


@functools.cache
def _xla_forward(dims, causal, fma_exp2=0):
    """``kernel.xla_forward`` on ``_operands(*dims)``: the (out, lse) the kernel must give."""
    twin = functools.partial(kernel.xla_forward, causal=causal, fma_exp2=fma_exp2)
    return jax.jit(twin)(*_operands(*dims))


# Interpretation is slow (a Python callback per shared-memory access): one CTA
# under causality, and GQA's two groups of two heads over three key blocks, more
# blocks than the two shared-memory slots, so slots are reused after their
# consumption. Two kv heads of two query heads each tell h // group (right)
# from h % kv_heads (wrong); one kv head could not.
@pytest.mark.parametrize(
    "tq, tk, heads, kv_heads, d, causal",
    [(128, 128, 1, 1, 64, True), (128, 384, 4, 2, 64, False)],
    ids=["causal-one-block", "gqa-three-blocks"],
)
def test_kernel_in_interpret_mode_matches_its_xla_twin(tq, tk, heads, kv_heads, d, causal):
    """Same FP8 products, same f32 softmax steps: the output bitwise, the logsumexp to f32 order."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    operands = _operands(tq, tk, heads, kv_heads, d)
    out, lse = kernel.mosaic_forward(*operands, causal=causal, interpret=InterpretGPUParams())
    want_out, want_lse = _xla_forward((tq, tk, heads, kv_heads, d), causal)
    np.testing.assert_array_equal(out, want_out)
    # lse = m + log2(l): the same f32 operations, which XLA may fuse in another order.
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2.0**-16)


# Each build option on a shape that exercises it: under causality one CTA with
# a single (masked) block and one with an unmasked block before the diagonal
# (the overlap's prologue, both loops, its epilogue); unmasked, 3 or 4 blocks
# so that slots are reused (with 3 stages, 4 blocks), and a GQA group.
CAUSAL, GQA, FOUR = (
    (256, 256, 1, 1, 64, True),
    (128, 384, 2, 1, 64, False),
    (128, 512, 1, 1, 64, False),
)
BUILDS = {
    "overlap": (kernel.ForwardConfig(overlap=True), CAUSAL),
    "overlap-in-place-p-registers": (
        kernel.ForwardConfig(overlap=True, pv_in_place=True, p_registers=True), CAUSAL),
    "overlap-in-place": (
        kernel.ForwardConfig(overlap=True, pv_in_place=True, row_scales=True), GQA),
    "in-place": (kernel.ForwardConfig(pv_in_place=True), CAUSAL),
    "in-place-p-registers": (
        kernel.ForwardConfig(pv_in_place=True, p_registers=True, row_scales=True), CAUSAL),
    "longest-first": (kernel.ForwardConfig(longest_first=True), CAUSAL),
    "stages3-p-registers": (kernel.ForwardConfig(stages=3, pingpong=False, registers=240,
                                                 p_registers=True), FOUR),
    # The cubic exp2 for the last 48 scores of each row, and for all of them.
    "fma-exp2": (kernel.ForwardConfig(fma_exp2=48), CAUSAL),
    "fma-exp2-all-overlap-in-place-p-registers": (kernel.ForwardConfig(
        fma_exp2=128, overlap=True, pv_in_place=True, p_registers=True), GQA),
}  # fmt: skip


@pytest.mark.parametrize("config, shape", BUILDS.values(), ids=BUILDS.keys())
def test_forward_builds_in_interpret_mode_match_the_xla_twin(config, shape):
    """Every build computes the default's f32 operations: the output bitwise, as the default's
    (with ``fma_exp2``, as the twin's with the same exp2 split).

    With P in registers the operand's keys and Vᵀ's are permuted alike, which
    moves no product; XLA's f32 dot on the CPU has summed them bitwise alike.
    PV in place rescales the accumulator by powers of two (V's scale ratios)
    times alpha: each rounding is the default's, scaled exactly.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    *dims, causal = shape
    operands = _operands(*dims)
    out, lse = kernel.mosaic_forward(*operands, causal=causal, config=config,
                                     interpret=InterpretGPUParams())  # fmt: skip
    want_out, want_lse = _xla_forward(tuple(dims), causal, config.fma_exp2)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2.0**-16)


def _fragment_columns(values_per_register: int):
    """PTX's wgmma fragments, by thread of a quad: the columns (of 16) its registers hold.

    The f32 accumulator (D, "wgmma-64N16-D"): 2 consecutive columns a thread
    in each 8; the 8-bit A operand ("wgmma-64N32-A"): 4 consecutive in each
    16. Listed in register order, a register's values in order.
    """
    per_tile = 4 * values_per_register
    return [[tile + values_per_register * c + e for tile in range(0, 16, per_tile)
             for e in range(values_per_register)] for c in range(4)]  # fmt: skip


def test_p_register_operand_pairs_each_threads_keys_with_vts_permuted_keys():
    """Reading the accumulator's registers as FP8 A registers relabels P's keys by KEY_ORDER.

    A thread's accumulator registers (two keys each, 8-key tiles 2i and 2i+1)
    concatenated are its A registers (four keys, 16-key tile i): A's key ``a``
    of the thread's quad position holds the accumulator's key at the same
    position, which must be ``KEY_ORDER[a]``; Vᵀ permuted by
    :func:`permuted_keys` puts key ``KEY_ORDER[a]`` at ``a``.
    """
    acc, a_operand = _fragment_columns(2), _fragment_columns(4)
    for c in range(4):
        for held, a in zip(acc[c], a_operand[c], strict=True):
            assert kernel.KEY_ORDER[a] == held, (c, a, held)
    assert sorted(kernel.KEY_ORDER) == list(range(16))
    keys = jnp.arange(32)
    want = np.concatenate([np.array(kernel.KEY_ORDER), 16 + np.array(kernel.KEY_ORDER)])
    np.testing.assert_array_equal(kernel.permuted_keys(keys), want)
    # Mosaic GPU's layouts, whose registers the kernel pairs: the same tiles.
    import jax.experimental.mosaic.gpu as mgpu

    assert (mgpu.WGMMA_LAYOUT.vector_length, mgpu.WGMMA_LAYOUT_8BIT.vector_length) == (2, 4)
    assert mgpu.WGMMA_LAYOUT.registers_shape((64, 128))[:2] == (1, 16)
    assert mgpu.WGMMA_LAYOUT_8BIT.registers_shape((64, 128))[:2] == (1, 8)


def test_forward_config_refuses_builds_it_has_not():
    with pytest.raises(ValueError, match=r"stages=\.\.\.\) must be in \[2, 4\], got 5"):
        kernel.ForwardConfig(stages=5)
    with pytest.raises(TypeError, match=r"overlap=\.\.\.\) must be a bool, got 1"):
        kernel.ForwardConfig(overlap=1)
    with pytest.raises(TypeError, match=r"longest_first=\.\.\.\) must be a bool, got .yes."):
        kernel.ForwardConfig(longest_first="yes")
    with pytest.raises(ValueError, match=r"registers=\.\.\.\) must be 232 or 240, got 256"):
        kernel.ForwardConfig(registers=256)
    for fma in (12, 136, -8, 32.0, True):  # the accumulator's 8-column tiles of 128 keys
        with pytest.raises(ValueError, match=rf"fma_exp2=\.\.\.\) must be a multiple of 8 in "
                                             rf"\[0, 128\] .*got {fma!r}"):  # fmt: skip
            kernel.ForwardConfig(fma_exp2=fma)
    q = jnp.ones((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="forward_config must be None or a"):
        fp8jax.dot_product_attention(q, q, q, forward_config={"overlap": True})
    # A build is a static part of the jit key: equal configs are one key.
    assert hash(kernel.ForwardConfig(overlap=True)) == hash(kernel.ForwardConfig(overlap=True))


def test_backward_config_refuses_builds_it_has_not():
    with pytest.raises(ValueError, match=r"stages=\.\.\.\) must be in \[2, 3\], got 4"):
        attention_backward.BackwardConfig(stages=4)
    with pytest.raises(TypeError, match=r"stages=\.\.\.\) must be an int, got 2.0"):
        attention_backward.BackwardConfig(stages=2.0)
    with pytest.raises(TypeError, match=r"paired=\.\.\.\) must be a bool, got 1"):
        attention_backward.BackwardConfig(paired=1)
    with pytest.raises(TypeError, match=r"fused=\.\.\.\) must be a bool, got 1"):
        attention_backward.BackwardConfig(fused=1)
    q = jnp.ones((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="backward_config must be None or a"):
        fp8jax.dot_product_attention(q, q, q, backward_config=kernel.ForwardConfig())


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))  # one program, as _operands
def _backward_operands(tq, tk, heads, kv_heads, d, causal):
    """The backward kernels' operands, as the op's backward makes them."""
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (1, tq, heads, d)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, tk, kv_heads, d)).astype(jnp.bfloat16) for key in keys[1:3])
    g = jax.random.normal(keys[3], (1, tq, heads, d)).astype(jnp.bfloat16)
    operands, ((q8, qs), (k8, ks), (v8, vs)) = op.kernel_operands(q, k, v, d**-0.5)
    out, lse2 = kernel.xla_forward(*operands, causal=causal)
    delta = jnp.sum(g.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return (q8, k8, operands[3], operands[4], op._dequantized(q8, qs), op._dequantized(k8, ks),
            op._dequantized(v8, vs), g, lse2, jnp.swapaxes(delta, 1, 2))  # fmt: skip


@functools.cache
def _interpreted_backward(dims, causal, build=()):
    """``mosaic_backward`` in interpret mode on ``_backward_operands(*dims, causal)``, with the
    ``BackwardConfig`` fields ``build`` (pairs): (dq, dk, dv) as f32 numpy arrays.

    Kept per build: the default at (256, 256, 2, 1, 64, causal) is the twin test's
    ``causal-two-tiles-gqa`` case and both builds' reference, about 2.5 s of
    interpretation each time on a 2-core machine.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    operands = _backward_operands(*dims, causal)
    grads = attention_backward.mosaic_backward(
        *operands, causal=causal, scale=dims[-1] ** -0.5, **dict(build),
        interpret=InterpretGPUParams(),
    )  # fmt: skip
    return tuple(np.asarray(x, np.float32) for x in grads)


# (tq, tk, heads, kv_heads, d, causal): head_dim 128 (P and dS as register operands
# beside two 128-wide accumulators) over a GQA group of two under causality; the
# last, steps before the diagonal (unmasked) and on it, per head of a group.
TWIN_SHAPES = [
    (128, 128, 1, 1, 64, True),
    (128, 128, 4, 2, 64, False),
    (128, 128, 2, 1, 128, True),
    (256, 256, 2, 1, 64, True),
]
TWIN_IDS = ["causal-one-block", "gqa-two-groups", "d128-causal-gqa", "causal-two-tiles-gqa"]


@pytest.mark.parametrize("tq, tk, heads, kv_heads, d, causal", TWIN_SHAPES, ids=TWIN_IDS)
def test_backward_kernels_in_interpret_mode_match_their_xla_twin(tq, tk, heads, kv_heads, d,
                                                                 causal):  # fmt: skip
    """The same FP8 scores and BF16 products; only f32 summation order differs.

    dQ and dK each sum over keys or queries (and dK, dV over a GQA group) in
    another order than XLA's einsums, which can move a BF16 result by one
    step (2**-8 relative) where the f32 sum lies near a rounding boundary.
    """
    operands = _backward_operands(tq, tk, heads, kv_heads, d, causal)
    scale = d**-0.5
    got = _interpreted_backward((tq, tk, heads, kv_heads, d), causal)
    twin = functools.partial(attention_backward.xla_backward, causal=causal, scale=scale)
    want = jax.jit(twin)(*operands)
    for name, x, y in zip(("dq", "dk", "dv"), got, want, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape, name
        np.testing.assert_allclose(x, y, rtol=2.0**-8, atol=2.0**-16, err_msg=name)
        assert np.mean(x == y) > 0.99, name  # bitwise but for rare boundary cases


@pytest.mark.parametrize("build", [{"stages": 3}, {"paired": True}], ids=["stages3", "paired"])
def test_backward_builds_are_bitwise_the_default_in_interpret_mode(build):
    """``BackwardConfig(stages=3)``: a third slot of the streamed blocks; ``paired``: the
    step's independent products issued together. The same products and sums either way."""
    dims, causal = (256, 256, 2, 1, 64), True  # 3 to 8 steps a CTA
    default = _interpreted_backward(dims, causal)
    built = _interpreted_backward(dims, causal, tuple(build.items()))
    for name, x, y in zip(("dq", "dk", "dv"), built, default, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=name)


def _dq_magnitudes(operands, causal, scale):
    """``scale * |dS| . |K|`` per dQ element, dS as the twin makes it: the magnitude of
    the f32 sum over keys whose order the fused build changes."""
    q8, k8, q_scale, k_scale, _, k, v, do, lse2, delta = operands
    group = q8.shape[2] // k8.shape[2]

    def per_query_head(x):  # (B, T, Hkv, D) -> (B, T, H, D): query head h reads kv head h // group
        return jnp.repeat(x.astype(jnp.float32), group, axis=2)

    scores = jnp.einsum("bqhd,bkhd->bhqk", q8.astype(jnp.float32), per_query_head(k8))
    factor = q_scale[..., None] * jnp.repeat(k_scale, group, axis=1)[:, :, None, :]
    p = jnp.exp2(scores * factor - lse2[..., None])
    if causal:
        p = jnp.where(jnp.tril(jnp.ones(p.shape[-2:], bool)), p, 0.0)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do.astype(jnp.float32), per_query_head(v))
    ds = (p * (dp - delta[..., None])).astype(jnp.bfloat16).astype(jnp.float32)
    return scale * jnp.einsum("bhqk,bkhd->bqhd", jnp.abs(ds), jnp.abs(per_query_head(k)))


# The twin test's shapes (their default-build results are kept), and at head_dim 128
# unmasked over two key tiles, whose CTAs add into the same dQ rows.
@pytest.mark.parametrize(
    "tq, tk, heads, kv_heads, d, causal",
    [*TWIN_SHAPES, (128, 256, 2, 1, 128, False)],
    ids=[*TWIN_IDS, "d128-two-tiles-gqa"],
)
def test_fused_backward_in_interpret_mode_within_dq_order_budget(tq, tk, heads, kv_heads, d,
                                                                 causal):  # fmt: skip
    """``BackwardConfig(fused=True)``: dK and dV bitwise the default build's (the same code
    makes them); dQ the twin's but for the order of its f32 sum over keys.

    dQ's terms are dS x K products of BF16 values, exact in f32; the fused
    build sums them by 64-key wgmma halves and adds each CTA's 128 keys into
    f32 dQ in CTA order, the twin by 128-key einsums in key order. Two f32 sums
    of ``tk`` terms in any orders differ by at most ``2 tk u`` times the sum
    of the terms' magnitudes (u = 2**-24), the scale's multiply adds ``2 u``
    of it, and rounding both to BF16 moves each by at most 2**-8 of itself.
    """
    dims = (tq, tk, heads, kv_heads, d)
    operands = _backward_operands(*dims, causal)
    scale = d**-0.5
    dq, dk, dv = _interpreted_backward(dims, causal, (("fused", True),))
    _, want_dk, want_dv = _interpreted_backward(dims, causal)
    np.testing.assert_array_equal(dk, want_dk, err_msg="dk")
    np.testing.assert_array_equal(dv, want_dv, err_msg="dv")
    twin = functools.partial(attention_backward.xla_backward, causal=causal, scale=scale)
    want_dq = np.asarray(jax.jit(twin)(*operands)[0], np.float32)
    magnitudes = np.asarray(jax.jit(_dq_magnitudes, static_argnums=(1, 2))(operands, causal, scale))
    u = 2.0**-24
    bound = (2 * tk + 2) * u * magnitudes + 2.0**-8 * (np.abs(dq) + np.abs(want_dq))
    numerics.assert_within(dq, want_dq, bound, "dq")
    assert np.any(dq != 0), "dq"


def test_kernel_takes_whole_blocks_and_its_head_dims():
    assert kernel.fits((1, 512, 8, 128), (1, 512, 2, 128))
    assert kernel.fits((1, 128, 8, 64), (1, 384, 2, 64))
    assert not kernel.fits((1, 512, 8, 96), (1, 512, 2, 96))
    assert not kernel.fits((1, 192, 8, 128), (1, 512, 2, 128))  # a CTA takes 128 queries
    assert not kernel.fits((1, 512, 8, 128), (1, 448, 2, 128))


@pytest.fixture(scope="module")
def h200_with_dumps(tmp_path_factory):
    """H200 compiles with each kernel's PTX and ptxas's report (mosaic_gpu_testing)."""
    return h200_compiles_with_dumps(tmp_path_factory, {"MOSAIC_GPU_DUMP_PTXAS": "1"})


@pytest.mark.deviceless
@pytest.mark.parametrize("d", [64, 128])
def test_deviceless_attention_is_one_fp8_wgmma_kernel(d, h200_with_dumps):
    """The op's forward compiles for the H200 to the Mosaic GPU kernel on FP8 tensor cores.

    The compiling child inherits the environment, in which Mosaic GPU's
    compiler writes ptxas's report: the kernel keeps everything in registers.
    """
    from fp8jax import verify

    q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)
    fn = functools.partial(fp8jax.dot_product_attention, causal=True)
    hlo, dumps = h200_with_dumps(fn, q, kv, kv, child="forward")
    report = verify.gemm_report(hlo)
    kernels = [g for g in report.gemms if g.target == kernel.KERNEL_NAME]
    assert [(g.backend, g.lhs_shape, g.rhs_shape) for g in kernels] == [
        ("pallas-fp8", (1, 512, 4, d), (1, 512, 2, d))
    ], str(report)
    assert kernels[0].fp8_mma, "the verifier found no FP8 wgmma in the kernel's code"
    # QKᵀ: 64 query rows by a 128-key block; PV: 64 rows by head_dim columns;
    # both E4M3 x E4M3 into f32, 32 of K an instruction.
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", hlo))
    assert shapes == {"128", str(d)}, shapes
    # At head_dim 128 both products are n128: count them in the kernel's PTX.
    # Each of the default build's two sites (the loop, the diagonal step)
    # issues QKᵀ's d / 32 instructions (n = 128 keys) and PV's 128 / 32 (n = d).
    (ptx,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptx")]
    issued = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", ptx)
    assert sorted(issued) == sorted(["128"] * (2 * d // 32) + [str(d)] * (2 * 4)), issued
    # The softmax's f32 work per score (docs/design.md#fp8-attention): one FMA
    # (the scales, the max and P's 2**8 folded into exp2's argument) and one
    # ex2; the accumulator's rescale and add cost two per output element. A
    # thread holds 64 scores and d / 2 output elements of its 64 x 128 and
    # 64 x d tiles, at each of the two sites; a few more go to per-row values.
    # Unfolded, the scores took three multiplies more each (711 at d 128).
    ex2 = len(re.findall(r"\bex2\.approx", ptx))
    assert ex2 == 2 * (64 + 2), ex2  # the scores' and, per row, alpha's
    multiplies = len(re.findall(r"\b(?:mul|fma\.rn)\.f32\b", ptx))
    assert multiplies <= 2 * (64 + 2 * d // 2) + 32, multiplies
    (ptxas,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptxas")]
    assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
    # Within the 232 registers a compute warpgroup asks for (setmaxnreg).
    assert int(re.search(r"Used (\d+) registers", ptxas).group(1)) <= 232, ptxas


@pytest.mark.deviceless
@pytest.mark.parametrize("fma_exp2", [32, 128])
def test_deviceless_fma_exp2_moves_its_share_of_exponentials_off_the_mufu(
    fma_exp2, h200_with_dumps
):
    """``fma_exp2`` of each row's 128 scores take the cubic: of a thread's 64 scores a
    site, 64 * fma_exp2 / 128 lose their ex2 and gain the cubic's exponent shift (a
    shift by 23, which ptxas fuses with the integer add into one LEA); no spills."""
    q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    config = kernel.ForwardConfig(fma_exp2=fma_exp2)
    fn = functools.partial(fp8jax.dot_product_attention, causal=True, forward_config=config)
    _, dumps = h200_with_dumps(fn, q, kv, kv, child="forward")
    (ptx,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptx")]
    moved = 64 * fma_exp2 // 128
    assert len(re.findall(r"\bex2\.approx", ptx)) == 2 * (64 - moved + 2)  # two sites, as above
    assert len(re.findall(r"\bshl\.b32\s+%r\d+, %r\d+, 23;", ptx)) == 2 * moved
    fp8_mma = r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3"
    assert len(re.findall(fp8_mma, ptx)) == 2 * (128 // 32 + 4)  # QKᵀ and PV, two sites
    (ptxas,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptxas")]
    assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
    assert int(re.search(r"Used (\d+) registers", ptxas).group(1)) <= config.registers, ptxas


@pytest.mark.deviceless
def test_deviceless_profiled_forward_reads_the_clock_at_its_regions_without_spilling(
    h200_with_dumps, monkeypatch
):
    """``mosaic_forward(profile_dir=...)`` (bench/attention_profile.py) compiles for the H200.

    Mosaic GPU's profiler stores a region's start and end with the SM's cycle
    counter: every region of the kernel's (ten names, each a site or more, two
    stores a site) reads it, and the kernel still fits its registers. The
    profiler's host callback, which writes the trace on a GPU, cannot lower
    without one and is stubbed here; it is outside the kernel.
    """
    from fp8jax.ops.attention import kernel_operands

    monkeypatch.setattr(jax.debug, "callback", lambda *args, **kwargs: None)
    d = 128
    q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)

    def profiled(q, k, v):
        operands, _ = kernel_operands(q, k, v, d**-0.5)
        return kernel.mosaic_forward(*operands, causal=True, profile_dir="/unused")

    _, dumps = h200_with_dumps(profiled, q, kv, kv, child="forward-profiled")
    (ptx,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptx")]
    (ptxas,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptxas")]
    stores = re.findall(r"st\.shared\.v2\.u32\s+\[[^\]]*\],\s*\{[^}]*%clock\}", ptx)
    assert len(stores) >= 2 * 10, len(stores)
    assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
    assert kernel.profiling(None, 32, per_step=16) == {}


# Builds that fit the registers: the overlap with a fresh PV tile only at
# head_dim 64 (at 128 ptxas spills it, 100-508 bytes a thread; bench/attention.py
# still times it), with PV in place at 128 too.
COMPILED_BUILDS = {
    "d64-overlap": (64, kernel.ForwardConfig(overlap=True, p_registers=True, row_scales=True)),
    "d128-p-registers": (128, kernel.ForwardConfig(p_registers=True, row_scales=True)),
    "d128-overlap-in-place-p-registers": (
        128, kernel.ForwardConfig(overlap=True, pv_in_place=True, p_registers=True)),
    "d128-in-place-stages3": (128, kernel.ForwardConfig(pv_in_place=True, stages=3)),
    "d128-stages4": (128, kernel.ForwardConfig(stages=4)),  # 4 K and Vᵀ slots fit shared memory
    "d128-in-place-p-registers-stages4": (
        128, kernel.ForwardConfig(pv_in_place=True, p_registers=True, row_scales=True, stages=4)),
}  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("d, config", COMPILED_BUILDS.values(), ids=COMPILED_BUILDS.keys())
def test_deviceless_forward_builds_keep_fp8_wgmma_and_registers(d, config, h200_with_dumps):
    """Each build compiles for the H200 with FP8 wgmma, within its registers, without spills.

    P in registers: the PV wgmma's A operand is registers (braces, not a
    shared-memory descriptor) and P's shared-memory stores are gone.
    """
    q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)
    fn = functools.partial(fp8jax.dot_product_attention, causal=True, forward_config=config)
    _, dumps = h200_with_dumps(fn, q, kv, kv, child="forward")
    (ptx,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptx")]
    (ptxas,) = [p.read_text() for p in dumps.glob(f"{kernel.KERNEL_NAME}*.ptxas")]
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
    assert int(re.search(r"Used (\d+) registers", ptxas).group(1)) <= config.registers, ptxas
    fp8 = r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3\s*\{[^}]*\},\s*(\{?)"
    issued = re.findall(fp8, ptx)
    assert {n for n, _ in issued} == {"128", str(d)}, issued
    # One k32 instruction per 32 of K: QKᵀ d / 32, PV 128 / 32, at each site:
    # the loop and the diagonal step, and with the overlap its prologue's QKᵀ
    # and epilogue's PV too.
    sites = 3 if config.overlap else 2
    assert len(issued) == sites * (d // 32 + 4), issued
    register_a = [n for n, brace in issued if brace]
    if config.p_registers:
        assert register_a == [str(d)] * (sites * 4), issued
        # P's E4M3 pairs went to shared memory 2 bytes a store (O's BF16 pairs go 4).
        assert "st.shared.b16" not in ptx, "P still stored to shared memory"
    else:
        assert not register_a, issued


@pytest.mark.deviceless
@pytest.mark.parametrize(
    "d, causal, fused",
    [(64, True, False), (128, True, False), (128, False, False),
     (64, False, True), (128, True, True), (128, False, True)],
    ids=["d64-causal", "d128-causal", "d128", "fused-d64", "fused-d128-causal", "fused-d128"],
)  # fmt: skip
def test_deviceless_backward_compiles_to_fp8_scores_and_bf16_gradients(
    d, causal, fused, h200_with_dumps
):
    """Forward and backward for the H200: FP8 wgmma for the scores, BF16 for the gradients.

    The report lists the forward as an FP8 GEMM and the backward kernels as
    not FP8 (their gradient products take BF16 operands): two, or with
    ``BackwardConfig(fused=True)`` the dK/dV kernel alone. No kernel spills a
    register to local memory: a spill is a round trip to L1 in the inner loop.
    """
    from fp8jax import verify
    from fp8jax.kernels.attention_backward import BackwardConfig

    q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)

    def step(q, k, v, g):
        attention = functools.partial(fp8jax.dot_product_attention, causal=causal,
                                      backward_config=BackwardConfig(fused=fused))  # fmt: skip
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(g)

    # Its forward kernel is one that test_deviceless_attention_is_one_fp8_wgmma_kernel
    # compiles too: another child, which compiles and dumps it again; the fused
    # builds' forwards are the others', so they have a child of their own.
    hlo, dumps = h200_with_dumps(step, q, kv, kv, q, child="fused" if fused else "backward")
    report = verify.gemm_report(hlo)
    backward = [attention_backward.DKV_KERNEL] + ([] if fused else [attention_backward.DQ_KERNEL])
    assert sorted((g.target, g.backend) for g in report.gemms) == sorted(
        [*((name, "pallas") for name in backward), (kernel.KERNEL_NAME, "pallas-fp8")]
    ), str(report)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.bf16\.bf16", hlo)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", hlo)
    for name in (kernel.KERNEL_NAME, *backward):
        (ptxas,) = [p.read_text() for p in dumps.glob(f"{name}*.ptxas")]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
        assert int(re.search(r"Used (\d+) registers", ptxas).group(1)) <= 232, ptxas
    # P and dS enter dV, dK and dQ's products as wgmma's register operand (the
    # A operand in braces, not a shared-memory descriptor).
    register_a = r"wgmma\.mma_async\S*\.f32\.bf16\.bf16\s*\{[^}]*\},\s*\{"
    for name in backward:
        (ptx,) = [p.read_text() for p in dumps.glob(f"{name}*.ptx")]
        assert re.search(register_a, ptx), name
        # Each recomputes the scores from the forward's FP8 operands on FP8 tensor
        # cores (the HLO-wide search above is met by the forward kernel alone).
        assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", ptx), name
    if fused:
        # dQ's half of the columns a warpgroup (n = d / 2) over the CTA's two
        # 64-key halves, k16 each: 8 instructions, dS and K both from shared
        # memory (at d 128 dPᵀ's d / 16 are n64 too); then one TMA reduce-add.
        (ptx,) = [p.read_text() for p in dumps.glob(f"{attention_backward.DKV_KERNEL}*.ptx")]
        shared_a = rf"m64n{d // 2}k16\.f32\.bf16\.bf16\s*\{{[^}}]*\}},\s*%rd"
        assert len(re.findall(shared_a, ptx)) == 8 + (d // 16 if d // 2 == 64 else 0)
        reduce_add = r"cp\.reduce\.async\.bulk\.tensor\.\w+\.global\.shared::cta\.add\b"
        assert len(re.findall(reduce_add, ptx)) == 1


@pytest.mark.deviceless
def test_deviceless_paired_backward_waits_for_the_tensor_cores_half_as_often(h200_with_dumps):
    """``BackwardConfig(paired=True)`` for the H200 at head_dim 128: the dK/dV kernel's step
    waits twice, not four times (scores with dP, dV with dK), and the dQ kernel's steps
    (unmasked and on the diagonal: two loops) twice each, not three times; in registers."""
    from fp8jax.kernels.attention_backward import BackwardConfig

    q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)

    def step(q, k, v, g):
        attention = functools.partial(fp8jax.dot_product_attention, causal=True,
                                      backward_config=BackwardConfig(paired=True))  # fmt: skip
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(g)

    _, dumps = h200_with_dumps(step, q, kv, kv, q, child="paired-backward")
    waits = {}
    for name in (attention_backward.DKV_KERNEL, attention_backward.DQ_KERNEL):
        (ptx,) = [p.read_text() for p in dumps.glob(f"{name}*.ptx")]
        waits[name] = len(re.findall(r"wgmma\.wait_group\.sync\.aligned", ptx))
        (ptxas,) = [p.read_text() for p in dumps.glob(f"{name}*.ptxas")]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
    assert waits == {attention_backward.DKV_KERNEL: 2, attention_backward.DQ_KERNEL: 4}, waits


def test_under_data_parallelism_each_device_attends_its_batch_rows():
    """A declared dp mesh puts both kernels in shard_map over the batch, with the same values."""
    import fp8jax.sharding as fs
    from fp8jax import kernels

    shape = (8, 128, 2, 64)
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, g = (jax.random.normal(key, shape).astype(jnp.bfloat16) for key in keys)

    def step(q, k, v, g):
        out, vjp = jax.vjp(functools.partial(fp8jax.dot_product_attention, causal=True), q, k, v)
        return out, vjp(g)

    alone = jax.jit(step)(q, k, v, g)
    with jax.set_mesh(fs.make_mesh(dp=8)), kernels.data_parallel("dp"):
        assert str(jax.make_jaxpr(step)(q, k, v, g)).count("shard_map") == 2
        split = jax.jit(step)(q, k, v, g)
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(alone), strict=True):
        np.testing.assert_array_equal(a, b)
