"""fp8jax.compiler_options: what fp8jax compiles its own programs with, and its effect."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import xla_options


def test_compiler_options_turn_triton_gemms_off_and_are_a_fresh_dict_each_call():
    options = fp8jax.compiler_options()
    assert options == {"xla_gpu_enable_triton_gemm": False}
    options["xla_gpu_enable_triton_gemm"] = True  # a caller's edit must not leak into fp8jax
    assert fp8jax.compiler_options() == {"xla_gpu_enable_triton_gemm": False}
    assert xla_options.as_xla_flags() == "--xla_gpu_enable_triton_gemm=false"


def test_a_jit_with_the_options_computes_what_the_default_jit_computes():
    # On the CPU the GPU option is accepted and changes nothing.
    x = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32).astype(jnp.bfloat16)

    def step(x, w):
        return jax.value_and_grad(
            lambda x, w: fp8jax.dense(x, w).astype(jnp.float32).sum(), (0, 1)
        )(x, w)

    plain = jax.jit(step)(x, w)
    with_options = jax.jit(step, compiler_options=fp8jax.compiler_options())(x, w)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(with_options), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.deviceless
def test_with_the_options_every_fp8_gemm_of_a_dense_step_is_a_cublaslt_fp8_call():
    # What the live H200 compiled with the options (docs/design.md#first-compile-time):
    # no Triton GEMM fusion is left to autotune; without them every dot is a Triton fusion.
    from fp8jax import verify

    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)

    def step(x, w):
        return jax.value_and_grad(
            lambda x, w: fp8jax.dense(x, w).astype(jnp.float32).sum(), (0, 1)
        )(x, w)

    report = verify.gemm_report(
        verify.compile_for(step, x, w, target="h100", xla_flags=xla_options.as_xla_flags())
    )
    assert len(report.gemms) == 3
    assert {g.backend for g in report.gemms} == {"cublaslt-fp8"}
    assert {(g.lhs_dtype, g.rhs_dtype) for g in report.gemms} == {
        ("f8e4m3fn", "f8e4m3fn"),
        ("f8e5m2", "f8e4m3fn"),
        ("f8e4m3fn", "f8e5m2"),
    }
