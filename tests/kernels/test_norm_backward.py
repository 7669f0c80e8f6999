"""fp8jax.kernels.norm_backward: the one-pass norm backward (interpret, XLA, live) against f64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.kernels import norm_backward
from fp8jax.ops import norm
from fp8jax.ops.norm import NormConfig

ROWS, HIDDEN = 2 * norm_backward.ROWS_PER_PROGRAM, 256
CASES = [("layernorm", False), ("layernorm", True), ("rmsnorm", False), ("rmsnorm", True)]
CASE_IDS = ["layernorm", "layernorm-residual", "rmsnorm", "rmsnorm-residual"]


def _inputs(norm_type, seed=0, hidden=HIDDEN):
    k = jax.random.split(jax.random.key(seed), 5)
    x = (jax.random.normal(k[0], (ROWS, hidden)) * 2 + 0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(k[1], (ROWS, hidden)).astype(jnp.bfloat16)
    residual = jax.random.normal(k[2], (ROWS, hidden)).astype(jnp.bfloat16)
    gamma = jax.random.normal(k[3], (hidden,)) * 0.1 + 1
    beta = jax.random.normal(k[4], (hidden,)) * 0.1 if norm_type == "layernorm" else None
    return x, dy, residual, gamma, beta


def _reference(norm_type, x, dy, residual, gamma):
    """dx (+ residual), dgamma, dbeta in f64 from the inputs, by the textbook formulas."""
    x, dy, g = (np.asarray(a, np.float64) for a in (x, dy, gamma))
    centred = x - x.mean(-1, keepdims=True) if norm_type == "layernorm" else x
    rstd = 1 / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6)
    xhat = centred * rstd
    dxhat = dy * g
    dx = dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    if norm_type == "layernorm":
        dx = dx - dxhat.mean(-1, keepdims=True)
    dx = rstd * dx
    if residual is not None:
        dx = dx + np.asarray(residual, np.float64)
    return dx, (dy * xhat).sum(0), dy.sum(0)


def _check(norm_type, residual, dx, dgamma, dbeta, x, dy, gamma):
    want_dx, want_dgamma, want_dbeta = _reference(norm_type, x, dy, residual, gamma)
    # dx is rounded once to bf16 (8 significant bits: relative error <= 2**-8)
    # after f32 arithmetic whose error, over a row of HIDDEN terms of size
    # about |dy| * |gamma| * |xhat| <= 8, stays below 1e-4 absolute.
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=2**-8, atol=1e-4)
    # f32 column sums of ROWS terms each below 8 in size: 1e-4 absolute covers
    # ROWS * 8 * 2**-24 (and x's statistics recomputed in f32 for the reference).
    np.testing.assert_allclose(np.asarray(dgamma, np.float64), want_dgamma, rtol=1e-5, atol=1e-4)
    if dbeta is not None:
        np.testing.assert_allclose(np.asarray(dbeta, np.float64), want_dbeta, rtol=1e-5, atol=1e-4)


def _statistics(x, gamma, beta, norm_type):
    _, mean, rstd = norm.normalize(x, gamma, beta, NormConfig(norm_type))
    return mean, rstd


@pytest.mark.parametrize("hidden", [HIDDEN, 384])  # 384: padded to 512 and stored masked
@pytest.mark.parametrize(("norm_type", "with_residual"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("path", ["interpret", "xla"])
def test_kernel_and_xla_path_match_the_f64_backward(norm_type, with_residual, path, hidden):
    x, dy, residual, gamma, beta = _inputs(norm_type, hidden=hidden)
    residual = residual if with_residual else None
    mean, rstd = _statistics(x, gamma, beta, norm_type)
    if path == "interpret":
        dx, *sums = norm_backward._pallas(
            dy, x, mean, rstd, residual, gamma[None], beta is not None, interpret=True
        )
    else:
        dx, *sums = norm_backward._xla(dy, x, mean, rstd, residual, gamma[None], beta is not None)
    # One row of column sums per program of ROWS_PER_PROGRAM rows.
    assert all(s.shape == (ROWS // norm_backward.ROWS_PER_PROGRAM, hidden) for s in sums)
    assert len(sums) == (2 if beta is not None else 1)
    assert dx.dtype == x.dtype
    dbeta = sums[1].sum(0) if beta is not None else None
    _check(norm_type, residual, dx, sums[0].sum(0), dbeta, x, dy, gamma)


@pytest.mark.parametrize(("norm_type", "with_residual"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_normalize_backward_matches_the_norms_own(norm_type, with_residual, zero_centered_gamma):
    # The dispatching function (here XLA's path, on the CPU) against
    # fp8jax.ops.norm.normalize_backward, which the unfused norm uses: the same
    # f32 formulas, so only dx's rounding differs. It is rounded to bf16 once,
    # after the residual's sum, where the reference rounds the norm's dx first:
    # each rounding is within 2**-8 of what it rounds (8 significant bits).
    x, dy, residual, gamma, beta = _inputs(norm_type, seed=1)
    residual = residual.reshape(2, ROWS // 2, HIDDEN) if with_residual else None
    x, dy = x.reshape(2, ROWS // 2, HIDDEN), dy.reshape(2, ROWS // 2, HIDDEN)
    config = NormConfig(norm_type, zero_centered_gamma)
    _, mean, rstd = norm.normalize(x, gamma, beta, config)
    got = norm.fused_normalize_backward(dy, x, mean, rstd, gamma, beta, config, residual)
    want = norm.normalize_backward(dy, x, mean, rstd, gamma, beta, config)
    want_dx = want[0].astype(jnp.float32)
    if residual is not None:
        want_dx = want_dx + residual.astype(jnp.float32)
    assert got[0].shape == x.shape and got[0].dtype == x.dtype
    error = np.abs(np.asarray(got[0], np.float64) - np.asarray(want_dx, np.float64))
    bound = 2**-8 * (np.abs(np.asarray(want[0], np.float64)) + np.abs(np.asarray(want_dx))) + 1e-4
    assert np.all(error <= bound), float(np.max(error - bound))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)
    if beta is None:
        assert got[2] is None
    else:
        np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_xla_fallback_rounds_dx_once_with_the_residual(norm_type):
    # Rows the kernel does not take (96, not whole programs of 64) go to
    # fp8jax.ops.norm.normalize_backward. dx plus the residual's gradient
    # must be rounded to bf16 once: within bf16's unit roundoff (2**-8
    # relative, 8 significant bits) of the f64 sum, plus the f32 arithmetic's
    # 1e-4 (see _check). Rounding dx to bf16 first and then the sum errs by up
    # to twice that where dx dominates, which the 73728 entries here reach.
    rows, hidden = 96, 768
    assert not norm_backward.fits((rows, hidden))
    k = jax.random.split(jax.random.key(5), 4)
    x = (jax.random.normal(k[0], (rows, hidden)) * 2 + 0.5).astype(jnp.bfloat16)
    dy = (jax.random.normal(k[1], (rows, hidden)) * 8).astype(jnp.bfloat16)
    residual = (jax.random.normal(k[2], (rows, hidden)) * 0.01).astype(jnp.bfloat16)
    gamma = jax.random.normal(k[3], (hidden,)) * 0.1 + 1
    beta = jnp.zeros((hidden,)) if norm_type == "layernorm" else None
    config = NormConfig(norm_type)
    _, mean, rstd = norm.normalize(x, gamma, beta, config)
    dx = norm.fused_normalize_backward(dy, x, mean, rstd, gamma, beta, config, residual)[0]
    want = _reference(norm_type, x, dy, residual, gamma)[0]
    error = np.abs(np.asarray(dx, np.float64) - want)
    bound = 2.0**-8 * np.abs(want) + 1e-4
    assert np.all(error <= bound), float(np.max(error / bound))


P = norm_backward.ROWS_PER_PROGRAM


@pytest.mark.parametrize(
    ("shape", "shards", "fits"),
    [
        ((2 * P, 4096), 1, True),
        ((2 * P, 4096), 2, True),
        ((2 * P, 4096), 4, False),  # half a program's rows a device
        ((P + P // 2, 4096), 1, False),
        ((P, 768), 1, True),  # padded to 1024
        ((P, 64), 1, False),  # below MIN_HIDDEN
        ((P, 32768), 1, False),  # above MAX_HIDDEN
    ],
)
def test_fits(shape, shards, fits):
    assert norm_backward.fits(shape, shards) is fits


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [HIDDEN, 384])
@pytest.mark.parametrize(("norm_type", "with_residual"), CASES, ids=CASE_IDS)
@pytest.mark.usefixtures("one_device")
def test_live_kernel_matches_the_f64_backward(norm_type, with_residual, hidden):
    device = jax.devices()[0]
    assert device.platform == "gpu"
    x, dy, residual, gamma, beta = jax.device_put(_inputs(norm_type, hidden=hidden), device)
    residual = residual if with_residual else None
    config = NormConfig(norm_type)
    mean, rstd = _statistics(x, gamma, beta, norm_type)
    step = jax.jit(norm.fused_normalize_backward, static_argnums=(6,))
    hlo = step.lower(dy, x, mean, rstd, gamma, beta, config, residual).as_text()
    assert "fp8jax_norm_backward" in hlo
    dx, dgamma, dbeta = step(dy, x, mean, rstd, gamma, beta, config, residual)
    _check(norm_type, residual, dx, dgamma, dbeta, x, dy, gamma)
