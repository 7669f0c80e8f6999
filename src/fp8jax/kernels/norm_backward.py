"""The norm's backward in one pass, with the residual stream's gradient joined in.

In a pre-norm transformer the norm's input ``x`` is also the residual
stream, so its gradient is the norm's backward plus the residual's gradient.
XLA computes :func:`fp8jax.ops.norm.normalize_backward` in three passes over
the (tokens, hidden) arrays: the row sums, the column sums (gamma's and
beta's gradients), then ``dx``, into which it fuses the residual's sum. The
Pallas (Triton) kernel here reads ``dy``, ``x`` and the residual's gradient
once and writes the sum, with per-program column sums that XLA adds up; on
the H200 it takes about 60% of XLA's time at the transformer layer's shape
(docs/design.md#the-norms-backward-in-one-pass). The residual's gradient
reaches it through the fused ops' ``return_residual``, where otherwise XLA
would add it to the kernel's output in a pass of its own. Writing ``dx``
over the residual's gradient (``input_output_aliases``) changed neither the
layer's peak memory nor its time, so it does not.

Each program takes :data:`ROWS_PER_PROGRAM` rows, a whole row at a time,
as the row sums need all of it. Triton's blocks have power-of-two sizes, so
a row of another hidden size (Llama-3.2-3B's 3072) is loaded padded with
zeros to the next power of two and stored masked (:func:`load_rows`,
:func:`store_rows`), and the row means divide by the true size; the padded
row must stay within :data:`MAX_HIDDEN` for it to fit in registers
(:func:`fits`). Off NVIDIA GPUs, and with the
kernels off (:mod:`fp8jax.kernels`), XLA computes the same values. Where the norm's rows are
split by data parallelism the kernel runs on each device's rows, as the
cast kernel does (:func:`fp8jax.kernels.dispatch.on_each_device`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import dispatch, norm_rows

# 64 rows a program and 4 warps (128 threads, 32 elements of a 4096-wide row
# each) were the fastest of 18 shapes on the H200: 16-64 rows, 4-16 warps,
# 1 or 3 pipeline stages (no difference).
ROWS_PER_PROGRAM, WARPS = 64, 4
MIN_HIDDEN, MAX_HIDDEN = 128, 16384


def hidden_fits(hidden: int) -> bool:
    """Whether the norm kernels take rows of ``hidden``: padded, a power of two registers hold."""
    return hidden >= MIN_HIDDEN and padded_width(hidden) <= MAX_HIDDEN


def padded_width(hidden: int) -> int:
    """The power of two a kernel's row of ``hidden`` is padded to (``hidden`` if it is one)."""
    return 1 << (hidden - 1).bit_length()


def load_rows(ref, start, count: int):
    """Rows ``start .. start + count`` of a (rows, hidden) block, zero-padded to a power of two.

    Triton loads only power-of-two shapes: a row of any other length is
    loaded masked, with zeros past ``hidden``. ``start`` may be traced.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    width = padded_width(ref.shape[1])
    if width == ref.shape[1]:
        return ref[pl.ds(start, count), :]
    rows, columns, mask = _padded_block(ref, start, count, width)
    return pallas_triton.load(ref.at[rows, columns], mask=mask, other=jnp.zeros((), ref.dtype))


def store_rows(ref, start, value) -> None:
    """Writes :func:`load_rows`'s padded ``value`` back to rows ``start ..``, the padding masked."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    count, width = value.shape
    if width == ref.shape[1]:
        ref[pl.ds(start, count), :] = value.astype(ref.dtype)
        return
    rows, columns, mask = _padded_block(ref, start, count, width)
    pallas_triton.store(ref.at[rows, columns], value.astype(ref.dtype), mask=mask)


def _padded_block(ref, start, count: int, width: int):
    """Indices of ``count`` rows from ``start``, ``width`` wide, and where ``ref`` has columns."""
    rows = start + lax.broadcasted_iota(jnp.int32, (count, 1), 0)
    columns = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    return rows, columns, jnp.broadcast_to(columns < ref.shape[1], (count, width))


def true_width(hidden: int) -> int | None:
    """``width`` for :func:`.norm_rows.normalize_rows` on a kernel's rows of ``hidden``."""
    return None if padded_width(hidden) == hidden else hidden


def fits(shape: tuple[int, int], row_shards: int = 1) -> bool:
    """Whether the kernel takes a (rows, hidden) norm input split over ``row_shards`` devices."""
    rows, hidden = shape
    return rows % (row_shards * ROWS_PER_PROGRAM) == 0 and hidden_fits(hidden)


def _row_gradients(dy, x, mean, rstd, gamma, width=None):
    """:func:`fp8jax.kernels.norm_rows.row_gradients` of a block of rows in any float dtype."""
    return norm_rows.row_gradients(dy.astype(jnp.float32), x.astype(jnp.float32), mean, rstd, gamma,
                              width)  # fmt: skip


def _kernel(centred: bool, has_beta: bool, has_residual: bool, *refs):
    from jax.experimental import pallas as pl

    refs = list(refs)
    dy_ref, x_ref = refs.pop(0), refs.pop(0)
    mean_ref = refs.pop(0) if centred else None
    rstd_ref, gamma_ref = refs.pop(0), refs.pop(0)
    residual_ref = refs.pop(0) if has_residual else None
    dx_ref, dgamma_ref = refs.pop(0), refs.pop(0)
    dbeta_ref = refs.pop(0) if has_beta else None
    hidden = x_ref.shape[1]
    width = true_width(hidden)
    gamma = load_rows(gamma_ref, 0, 1)

    def load(i):
        row = jnp.minimum(i, ROWS_PER_PROGRAM - 1)
        rows = pl.ds(row, 1)
        mean = None if mean_ref is None else mean_ref[rows, :]
        residual = None if residual_ref is None else load_rows(residual_ref, row, 1)
        dy, x = load_rows(dy_ref, row, 1), load_rows(x_ref, row, 1)
        return dy, x, mean, rstd_ref[rows, :], residual

    # Each row's loads are issued one row ahead, before the row sums of the
    # row before, so that their latency overlaps that row's math: (16384,
    # 4096) makes 256 programs of 4 warps for 132 SMs, too few warps to hide
    # it by switching between them. Same arithmetic, 5-7% faster at
    # (16384, 4096) on the H200 (docs/design.md#the-norms-backward-in-one-pass).
    def row(i, carry):
        sums, (dy, x, mean, rstd, residual) = carry
        ahead = load(i + 1)
        dx, dy_xhat = _row_gradients(dy, x, mean, rstd, gamma, width)
        if residual is not None:
            dx = dx + residual.astype(jnp.float32)
        store_rows(dx_ref, i, dx)
        return (sums[0] + dy_xhat, sums[1] + dy.astype(jnp.float32)), ahead

    zeros = jnp.zeros((1, padded_width(hidden)), jnp.float32)
    (dgamma, dbeta), _ = lax.fori_loop(0, ROWS_PER_PROGRAM, row, ((zeros, zeros), load(0)))
    store_rows(dgamma_ref, 0, dgamma)
    if dbeta_ref is not None:
        store_rows(dbeta_ref, 0, dbeta)


def _pallas(dy, x, mean, rstd, residual, gamma, has_beta: bool, interpret: bool = False):
    """The kernel on (rows, hidden) arrays: dx, and column sums per program."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    rows, hidden = x.shape
    programs = rows // ROWS_PER_PROGRAM
    by_rows = pl.BlockSpec((ROWS_PER_PROGRAM, hidden), lambda i: (i, 0))
    stats = pl.BlockSpec((ROWS_PER_PROGRAM, 1), lambda i: (i, 0))
    whole_row = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    partial = pl.BlockSpec((1, hidden), lambda i: (i, 0))
    operands = [dy, x] + ([] if mean is None else [mean]) + [rstd, gamma]
    in_specs = [by_rows, by_rows] + ([] if mean is None else [stats]) + [stats, whole_row]
    if residual is not None:
        operands.append(residual)
        in_specs.append(by_rows)
    n_sums = 2 if has_beta else 1
    params = {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}
    dx, *sums = dispatch.pallas_call(
        functools.partial(_kernel, mean is not None, has_beta, residual is not None),
        grid=(programs,),
        in_specs=in_specs,
        out_specs=[by_rows] + [partial] * n_sums,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), x.dtype)]
        + [jax.ShapeDtypeStruct((programs, hidden), jnp.float32)] * n_sums,
        interpret=interpret,
        name="fp8jax_norm_backward",
        **params,
    )(*operands)
    return (dx, *sums)


def _xla(dy, x, mean, rstd, residual, gamma, has_beta: bool):
    """:func:`_pallas`'s values from XLA, column sums per block of ROWS_PER_PROGRAM rows."""
    dx, dy_xhat = _row_gradients(dy, x, mean, rstd, gamma)
    if residual is not None:
        dx = dx + residual.astype(jnp.float32)
    rows, hidden = x.shape

    def per_program(v):
        return jnp.sum(v.reshape(rows // ROWS_PER_PROGRAM, ROWS_PER_PROGRAM, hidden), axis=1)

    sums = (per_program(dy_xhat),) + ((per_program(dy.astype(jnp.float32)),) if has_beta else ())
    return (dx.astype(x.dtype), *sums)


def norm_backward(dy, x, mean, rstd, gamma, has_beta: bool, residual=None, row_axes=()):
    """``(dx + residual, dgamma, dbeta)`` of a norm over (rows, hidden) arrays, in one pass.

    ``mean`` and ``rstd`` are the forward's (rows, 1) f32 row statistics
    (``mean`` None for RMSNorm); ``gamma`` is the effective (1, hidden) f32
    scale; ``residual`` is the residual stream's gradient, or None. ``dx``
    comes back in ``x.dtype``, summed with ``residual`` in f32 before it is
    rounded; dgamma and dbeta (None without a beta) in f32. ``row_axes``:
    as :func:`~fp8jax.kernels.cast_transpose.cast_transpose`'s. The caller
    checks :func:`fits`.
    """
    # The first five operands split along rows on each device; gamma is whole.
    operands = (dy, x, mean, rstd, residual, gamma)
    n_outputs = 3 if has_beta else 2
    dx, *sums = dispatch.on_each_device(
        functools.partial(_pallas, has_beta=has_beta), functools.partial(_xla, has_beta=has_beta),
        operands, 5, ("rows",) * n_outputs, tuple(row_axes),
    )  # fmt: skip
    dgamma = jnp.sum(sums[0], axis=0)
    dbeta = jnp.sum(sums[1], axis=0) if has_beta else None
    return dx, dgamma, dbeta


def decide(x, kernel_fits=fits) -> dispatch.Placement:
    """Where a norm kernel runs for the norm input ``x``: :func:`fp8jax.kernels.dispatch.decide`.

    ``kernel_fits``: the kernel's ``fits``; this module's by default.
    """
    if x.size == 0:  # an empty x fills no tile
        return dispatch.XLA
    matrix = (x.size // x.shape[-1], x.shape[-1])
    return dispatch.decide(lambda shards: kernel_fits(matrix, shards))
