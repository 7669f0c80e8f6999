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
from fp8jax.kernels import attention as kernel
from fp8jax.kernels import attention_backward
from fp8jax.ops import attention as op


def _operands(tq, tk, heads, kv_heads, d):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, tq, heads, d)).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (1, tk, kv_heads, d)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (1, tk, kv_heads, d)).astype(jnp.bfloat16)
    return op.kernel_operands(q, k, v, d**-0.5)[0]


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
    want_out, want_lse = kernel.xla_forward(*operands, causal=causal)
    np.testing.assert_array_equal(out, want_out)
    # lse = m + log2(l): the same f32 operations, which XLA may fuse in another order.
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2.0**-16)


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


# Head_dim 128 (P and dS as register operands beside two 128-wide accumulators)
# over a GQA group of two under causality.
@pytest.mark.parametrize(
    "tq, tk, heads, kv_heads, d, causal",
    [(128, 128, 1, 1, 64, True), (128, 128, 4, 2, 64, False), (128, 128, 2, 1, 128, True)],
    ids=["causal-one-block", "gqa-two-groups", "d128-causal-gqa"],
)
def test_backward_kernels_in_interpret_mode_match_their_xla_twin(tq, tk, heads, kv_heads, d,
                                                                 causal):  # fmt: skip
    """The same FP8 scores and BF16 products; only f32 summation order differs.

    dQ and dK each sum over keys or queries (and dK, dV over a GQA group) in
    another order than XLA's einsums, which can move a BF16 result by one
    step (2**-8 relative) where the f32 sum lies near a rounding boundary.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    operands = _backward_operands(tq, tk, heads, kv_heads, d, causal)
    scale = d**-0.5
    got = attention_backward.mosaic_backward(*operands, causal=causal, scale=scale,
                                             interpret=InterpretGPUParams())  # fmt: skip
    want = attention_backward.xla_backward(*operands, causal=causal, scale=scale)
    for name, x, y in zip(("dq", "dk", "dv"), got, want, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape, name
        np.testing.assert_allclose(x, y, rtol=2.0**-8, atol=2.0**-16, err_msg=name)
        assert np.mean(x == y) > 0.99, name  # bitwise but for rare boundary cases


def test_kernel_takes_whole_blocks_and_its_head_dims():
    assert kernel.fits((1, 512, 8, 128), (1, 512, 2, 128))
    assert kernel.fits((1, 128, 8, 64), (1, 384, 2, 64))
    assert not kernel.fits((1, 512, 8, 96), (1, 512, 2, 96))
    assert not kernel.fits((1, 192, 8, 128), (1, 512, 2, 128))  # a CTA takes 128 queries
    assert not kernel.fits((1, 512, 8, 128), (1, 448, 2, 128))


@pytest.mark.deviceless
@pytest.mark.parametrize("d", [64, 128])
def test_deviceless_attention_is_one_fp8_wgmma_kernel(d, tmp_path, monkeypatch):
    """The op's forward compiles for the H200 to the Mosaic GPU kernel on FP8 tensor cores.

    The compiling child inherits the environment, in which Mosaic GPU's
    compiler writes ptxas's report: the kernel keeps everything in registers.
    """
    from fp8jax import verify

    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))

    q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)
    fn = functools.partial(fp8jax.dot_product_attention, causal=True)
    hlo = verify.compile_for(fn, q, kv, kv, target="h200")
    report = verify.gemm_report(hlo)
    kernels = [g for g in report.gemms if g.target == kernel.KERNEL_NAME]
    assert [(g.backend, g.lhs_shape, g.rhs_shape) for g in kernels] == [
        ("pallas-fp8", (1, 512, 4, d), (1, 512, 2, d))
    ], str(report)
    # QKᵀ: 64 query rows by a 128-key block; PV: 64 rows by head_dim columns;
    # both E4M3 x E4M3 into f32, 32 of K an instruction.
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", hlo))
    assert shapes == {"128", str(d)}, shapes
    (ptxas,) = [p.read_text() for p in tmp_path.glob(f"{kernel.KERNEL_NAME}*.ptxas")]
    assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
    # Within the 232 registers a compute warpgroup asks for (setmaxnreg).
    assert int(re.search(r"Used (\d+) registers", ptxas).group(1)) <= 232, ptxas


@pytest.mark.deviceless
@pytest.mark.parametrize("d, causal", [(64, True), (128, True), (128, False)])
def test_deviceless_backward_compiles_to_fp8_scores_and_bf16_gradients(d, causal, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    """Forward and backward for the H200: FP8 wgmma for the scores, BF16 for the gradients.

    The report lists the forward as an FP8 GEMM and the two backward kernels as
    not FP8 (their gradient products take BF16 operands). No kernel spills a
    register to local memory: a spill is a round trip to L1 in the inner loop.
    """
    from fp8jax import verify

    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    q = jax.ShapeDtypeStruct((1, 512, 4, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)

    def step(q, k, v, g):
        attention = functools.partial(fp8jax.dot_product_attention, causal=causal)
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(g)

    hlo = verify.compile_for(step, q, kv, kv, q, target="h200")
    report = verify.gemm_report(hlo)
    assert sorted((g.target, g.backend) for g in report.gemms) == [
        (attention_backward.DKV_KERNEL, "pallas"),
        (attention_backward.DQ_KERNEL, "pallas"),
        (kernel.KERNEL_NAME, "pallas-fp8"),
    ], str(report)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.bf16\.bf16", hlo)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", hlo)
    for name in (kernel.KERNEL_NAME, attention_backward.DKV_KERNEL, attention_backward.DQ_KERNEL):
        (ptxas,) = [p.read_text() for p in tmp_path.glob(f"{name}*.ptxas")]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas
        assert int(re.search(r"Used (\d+) registers", ptxas).group(1)) <= 232, ptxas
    # P and dS enter dV, dK and dQ's products as wgmma's register operand (the
    # A operand in braces, not a shared-memory descriptor).
    register_a = r"wgmma\.mma_async\S*\.f32\.bf16\.bf16\s*\{[^}]*\},\s*\{"
    for name in (attention_backward.DKV_KERNEL, attention_backward.DQ_KERNEL):
        (ptx,) = [p.read_text() for p in tmp_path.glob(f"{name}*.ptx")]
        assert re.search(register_a, ptx), name


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
