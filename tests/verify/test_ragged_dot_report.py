"""The verifier counts fp8jax.ragged_dot's grouped GEMMs (Pallas kernels), deviceless."""

import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import verify
from fp8jax.kernels import grouped_gemm

M, K, N, G = 512, 256, 384, 4


def _fwd_bwd(x, w, sizes, g):
    y, vjp = jax.vjp(lambda x, w: fp8jax.ragged_dot(x, w, sizes), x, w)
    return y, vjp(g)


@pytest.fixture(scope="module")
def compiled():
    """The fwd+bwd's optimized HLO, and the PTX of every kernel in it."""
    args = (
        jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16),
        jax.ShapeDtypeStruct((G,), jnp.int32),
        jax.ShapeDtypeStruct((M, N), jnp.bfloat16),
    )
    dump = tempfile.mkdtemp(prefix="fp8jax_ragged_dot_")
    flags = f"{fp8jax.xla_options.as_xla_flags()} --xla_dump_to={dump}"
    try:
        hlo = verify.compile_for(_fwd_bwd, *args, target="h100", xla_flags=flags)
        ptx = verify.read_ptx(dump)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return hlo, ptx


@pytest.fixture(scope="module")
def hlo(compiled):
    return compiled[0]


def test_grouped_gemms_are_reported_fp8_with_their_operand_dtypes(hlo):
    # Forward E4M3 x E4M3, dgrad and wgrad E5M2 x E5M2 (the weights cast to
    # and the input converted to the gradient's format, one element type per dot),
    # each a Pallas kernel: no dense GEMM over all groups (XLA's lowering of
    # lax.ragged_dot) and no other GEMM anywhere.
    report = verify.gemm_report(hlo)
    rows = sorted((g.target, g.lhs_dtype, g.rhs_dtype, g.out_shape) for g in report.gemms)
    tiles = grouped_gemm.DEFAULT_TILES

    def whole(d, tile):  # whole output tiles, sliced after
        return -(-d // tile) * tile

    # The forward and dgrad kernels write their rows in place; the wgrad
    # kernel's [g, k, n] result is sliced from whole tiles.
    assert rows == [
        ("fp8jax_grouped_gemm", "f8e4m3fn", "f8e4m3fn", (M, N)),
        ("fp8jax_grouped_gemm", "f8e5m2", "f8e5m2", (M, K)),
        ("fp8jax_grouped_gemm_wgrad", "f8e5m2", "f8e5m2",
         (G, whole(K, tiles.wgrad_k), whole(N, tiles.wgrad_n))),
    ]  # fmt: skip
    assert {g.backend for g in report.gemms} == {"pallas-fp8"}
    assert len(report.fp8_gemms) == 3
    verify.assert_fp8_gemms(hlo=hlo, expect=3)


def test_a_grouped_gemm_on_wider_operands_is_not_fp8(hlo):
    # The same kernels reading bf16 operands are GEMMs the report judges not FP8.
    report = verify.gemm_report(hlo.replace("f8e5m2", "bf16"))
    assert len(report.gemms) == 3
    assert sorted(g.backend for g in report.gemms) == ["pallas", "pallas", "pallas-fp8"]
    assert len(report.non_fp8_gemms) == 2


def _kernels_ptx(ptx: dict[str, str], kernel: str) -> list[str]:
    """The PTX of each instance of a kernel (XLA numbers repeats: name, name__1, ...)."""
    return [t for t in ptx.values() if re.search(rf"\.entry {kernel}(__\d+)?\b", t)]


@pytest.mark.parametrize(
    "kernel, mmas",
    [
        ("fp8jax_grouped_gemm", ["e4m3.e4m3", "e5m2.e5m2"]),  # forward, dgrad
        ("fp8jax_grouped_gemm_wgrad", ["e5m2.e5m2"]),
    ],
)
def test_grouped_kernels_accumulate_on_fp8_tensor_cores(compiled, kernel, mmas):
    # Hopper's FP8 wgmma (not f16 mma.sync on operands converted in registers),
    # accumulating into the loop's accumulator on the tensor core: one MMA may
    # stay in flight while the next loads (wait_group 1), and no f32 add sums
    # the products with CUDA cores (fp8jax.kernels.triton_fp8_dot.accumulate).
    # The forward kernel reads its rows of the operand by index, and those
    # loads still go through the software pipeline (cp.async).
    texts = _kernels_ptx(compiled[1], kernel)
    mma = r"wgmma\.mma_async\S*\.f32\.(\w+\.\w+)"
    found = sorted(" ".join(sorted(set(re.findall(mma, t)))) for t in texts)
    assert found == sorted(mmas), kernel
    for text in texts:
        assert "mma.sync" not in text and "cvt.rn.f16x2" not in text
        assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", text)
        assert not re.search(r"\badd\.(rn\.)?f32\b", text)
        assert "cp.async.cg.shared.global" in text


def test_with_the_ptx_the_report_reads_the_grouped_kernels_fp8_from_their_code(compiled):
    # Given the compile's PTX, a Triton kernel is FP8 by its wgmma, not only by
    # its operands: the same kernels with BF16 MMAs in their code would be upcasts.
    hlo, ptx = compiled
    rows = [g for g in verify.gemm_report(hlo, ptx=ptx).gemms if g.target.startswith("fp8jax_")]
    assert len(rows) == 3 and all(g.fp8_mma and g.is_fp8 for g in rows), rows
    assert all(g.fp8_mma is None for g in verify.gemm_report(hlo).gemms)  # no PTX: unknown
    widened = {k: re.sub(r"\.e[45]m[23]\.e[45]m[23]\b", ".bf16.bf16", t) for k, t in ptx.items()}
    rows = [g for g in verify.gemm_report(hlo, ptx=widened).gemms if g.target.startswith("fp8jax_")]
    assert len(rows) == 3 and not any(g.is_fp8 for g in rows), rows
    assert all(g.backend == "pallas" and g.upcast_from_fp8 for g in rows), rows
