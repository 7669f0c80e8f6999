"""The norm kernels (interpret mode) and their XLA twins where epsilon decides: against f64.

Rows of constant value (variance exactly 0: rstd is ``1 / sqrt(epsilon)``,
and without epsilon infinite), rows of 1e-4 scale (variance 1e-8, below
every epsilon here, which then sets the output's size), and ordinary rows,
at epsilon 1e-6 (the default) and 1e-2. A kernel that drops or misplaces
epsilon gives NaN or infinity on the constant rows and outputs some 10 to
1000 times too large on the small ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import norm_backward, norm_forward

ROWS, HIDDEN = 2 * norm_backward.ROWS_PER_PROGRAM, 256  # whole programs of both kernels
FMT = fp8jax.E4M3
SCALE = FMT.max / 32  # |y| stays below about 12: inside E4M3's range
CONSTANT, SMALL = slice(0, 8), slice(8, 40)  # the constant rows and the 1e-4 rows


def _inputs(norm_type, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (ROWS, HIDDEN)) * 2 + 0.5
    x = x.at[CONSTANT].set(jnp.arange(8, dtype=jnp.float32)[:, None] * 0.7 - 2.1)
    x = x.at[SMALL].multiply(5e-5)  # 1e-4 scale, and a mean of 2.5e-5
    x = x.astype(jnp.bfloat16)
    gamma = jax.random.normal(k[1], (HIDDEN,)) * 0.1 + 1
    beta = jax.random.normal(k[2], (HIDDEN,)) * 0.1 if norm_type == "layernorm" else None
    dy = jax.random.normal(k[3], (ROWS, HIDDEN)).astype(jnp.bfloat16)
    return x, gamma, beta, dy


def _reference(norm_type, x, gamma, beta, dy, epsilon):
    """``y``, ``rstd``, ``dx`` and ``dgamma`` in f64, by the textbook formulas."""
    x, gamma, dy = (np.asarray(a, np.float64) for a in (x, gamma, dy))
    centred = x - x.mean(-1, keepdims=True) if norm_type == "layernorm" else x
    rstd = 1 / np.sqrt((centred**2).mean(-1, keepdims=True) + epsilon)
    xhat = centred * rstd
    y = xhat * gamma + (0 if beta is None else np.asarray(beta, np.float64))
    dxhat = dy * gamma
    dx = dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    if norm_type == "layernorm":
        dx = dx - dxhat.mean(-1, keepdims=True)
    return y, rstd, rstd * dx, (dy * xhat).sum(0), rstd * np.abs(dxhat).max(-1, keepdims=True)


@pytest.mark.parametrize("epsilon", [1e-6, 1e-2])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("path", ["interpret", "xla"])
def test_norm_kernels_at_zero_variance_and_tiny_rows(path, norm_type, epsilon):
    x, gamma, beta, dy = _inputs(norm_type)
    centred = norm_type == "layernorm"
    kwargs = {"fmt": FMT, "centred": centred, "epsilon": epsilon}
    beta2 = None if beta is None else beta[None]
    if path == "interpret":
        q, *stats, _ = norm_forward._pallas(x, gamma[None], beta2, jnp.float32(SCALE),
                                            interpret=True, **kwargs)  # fmt: skip
    else:
        q, *stats, _ = norm_forward._xla(x, gamma[None], beta2, jnp.float32(SCALE), **kwargs)
    mean, rstd = (stats[0], stats[1]) if centred else (None, stats[0])
    want_y, want_rstd, want_dx, want_dgamma, dx_size = _reference(norm_type, x, gamma, beta, dy,
                                                                  epsilon)  # fmt: skip
    # rstd: f32 statistics of HIDDEN terms, a few 2**-24 per operation.
    np.testing.assert_allclose(np.asarray(rstd, np.float64), want_rstd, rtol=1e-5)
    # E4M3 rounds y to 4 significant bits (2**-4 |y|) above its subnormals and
    # by half a subnormal step (2**-10 in scaled units) below; f32 adds 1e-5.
    y = np.asarray(q.astype(jnp.float32), np.float64) / SCALE
    bound = 2**-4 * np.abs(want_y) + 1e-5 * (np.abs(want_y) + 1) + 2**-10 / SCALE
    excess = np.abs(y - want_y) - bound
    assert np.all(excess <= 0), ("y", np.unravel_index(np.argmax(excess), y.shape))
    if path == "interpret":
        dx, *sums = norm_backward._pallas(dy, x, mean, rstd, None, gamma[None], beta is not None,
                                          interpret=True)  # fmt: skip
    else:
        dx, *sums = norm_backward._xla(dy, x, mean, rstd, None, gamma[None], beta is not None)
    # dx rounds once to bf16 (2**-8 of itself) after f32 sums over the row,
    # within 2**-14 of the row's largest term rstd |dy gamma| (up to 1000 at
    # epsilon 1e-6 on the small rows).
    dx = np.asarray(dx, np.float64)
    excess = np.abs(dx - want_dx) - (2**-8 * np.abs(want_dx) + 2**-14 * dx_size)
    assert np.all(excess <= 0), ("dx", np.unravel_index(np.argmax(excess), dx.shape))
    np.testing.assert_allclose(np.asarray(sums[0], np.float64).sum(0), want_dgamma, rtol=1e-5,
                               atol=1e-4)  # fmt: skip
    # The constant rows normalize to exactly beta (0 for RMSNorm) and have finite gradients.
    np.testing.assert_allclose(y[CONSTANT], want_y[CONSTANT], atol=2**-10 / SCALE, rtol=2**-4)
    assert np.isfinite(dx[CONSTANT]).all()
