"""The verifier counts fp8jax.ragged_dot's grouped GEMMs (Pallas kernels), deviceless."""

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
def hlo():
    args = (
        jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16),
        jax.ShapeDtypeStruct((G,), jnp.int32),
        jax.ShapeDtypeStruct((M, N), jnp.bfloat16),
    )
    return verify.compile_for(_fwd_bwd, *args, target="h100")


def test_grouped_gemms_are_reported_fp8_with_their_operand_dtypes(hlo):
    # Forward E4M3 x E4M3, dgrad and wgrad E5M2 x E5M2 (the weights and the
    # input converted to the gradient's format, one element type per dot),
    # each a Pallas kernel: no dense GEMM over all groups (XLA's lowering of
    # lax.ragged_dot) and no other GEMM anywhere.
    report = verify.gemm_report(hlo)
    rows = sorted((g.target, g.lhs_dtype, g.rhs_dtype, g.out_shape) for g in report.gemms)
    tile = grouped_gemm.TILES.m
    padded = -(-(M + G * (tile - 1)) // tile) * tile  # the kernels' padded rows
    assert rows == [
        ("fp8jax_grouped_gemm", "f8e4m3fn", "f8e4m3fn", (padded, N)),
        ("fp8jax_grouped_gemm", "f8e5m2", "f8e5m2", (padded, K)),
        ("fp8jax_grouped_gemm_wgrad", "f8e5m2", "f8e5m2", (G, K, N)),
    ]
    assert {g.backend for g in report.gemms} == {"pallas-fp8"}
    assert len(report.fp8_gemms) == 3
    verify.assert_fp8_gemms(hlo=hlo, expect=3)


def test_a_grouped_gemm_on_wider_operands_is_not_fp8(hlo):
    # The same kernels reading bf16 operands are GEMMs the report judges not FP8.
    report = verify.gemm_report(hlo.replace("f8e5m2", "bf16"))
    assert len(report.gemms) == 3
    assert sorted(g.backend for g in report.gemms) == ["pallas", "pallas", "pallas-fp8"]
    assert len(report.non_fp8_gemms) == 2
