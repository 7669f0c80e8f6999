"""The norm's forward and the FP8 cast of its output in one pass (delayed scaling).

A fused op's norm feeds an FP8 GEMM: its output is needed only in FP8, with
its amax for the history, and the row statistics for the backward. XLA
reads ``x`` three times for that: a pass for the row means, one for the
centred variance, and one that normalizes, casts and takes the amax, with
two small kernels between them (deviceless H100 compile of the transformer
layer: five kernels a norm). The Pallas (Triton) kernel here reads each row
once, keeps it in registers for both statistics, and writes the FP8 output,
the statistics and one amax per program, in a little over half the time of
XLA's passes at the transformer layer's shape on the H200
(docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel).

The statistics are the two-pass ones :func:`fp8jax.ops.norm.normalize`
computes (the same code, :mod:`fp8jax.kernels.norm_rows`, runs on each
row), not ``E[x^2] - E[x]^2``, whose f32 cancellation loses the variance
of rows whose mean is large against their spread.

Under current scaling the scale depends on the amax of the whole output,
so the cast cannot share the pass: the same kernel runs twice, first
without the cast, writing only the maxima from which the scale comes
(:func:`output_maxima`), then with it; two reads of ``x`` where XLA's
passes make three or four (docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel).
The kernel's shape rules and its placement under a mesh are the backward's
(:mod:`fp8jax.kernels.norm_backward`). Off NVIDIA GPUs, and with the kernels
off (:mod:`fp8jax.kernels`), XLA runs the same arithmetic, its sums in its own
order (at the transformer layer's shape the FP8 bytes came out equal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.formats import Fp8Format
from fp8jax.kernels import cast_transpose, dispatch, norm_backward, norm_rows
from fp8jax.quantize import quantize_with_scale

# Rows a program normalizes, how many of them at a time, and its warps: the
# fastest on the H200 of 28 shapes (1-64 rows, 1-16 at a time, 2-16 warps),
# then of 12 with the next rows' loads issued ahead (below)
# (docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel).
ROWS_PER_PROGRAM, ROWS_PER_STEP, WARPS = 16, 1, 4


def fits(shape: tuple[int, int], row_shards: int = 1) -> bool:
    """Whether the kernel takes a (rows, hidden) norm input split over ``row_shards`` devices.

    Its hidden sizes are the backward kernel's
    (:func:`fp8jax.kernels.norm_backward.hidden_fits`).
    """
    rows, hidden = shape
    return norm_backward.hidden_fits(hidden) and rows % (row_shards * ROWS_PER_PROGRAM) == 0


def _kernel(fmt: Fp8Format | None, centred: bool, has_beta: bool, has_residual: bool,
            epsilon: float, *refs):  # fmt: skip
    """A program's rows: with ``fmt`` their FP8 cast, statistics and maximum; else the maximum.

    With ``has_residual`` the rows normalized are ``x + residual``, written out too.
    """
    from jax.experimental import pallas as pl

    refs = list(refs)
    x_ref, gamma_ref = refs.pop(0), refs.pop(0)
    beta = norm_backward.load_rows(refs.pop(0), 0, 1) if has_beta else None
    residual_ref = refs.pop(0) if has_residual else None
    cast = fmt is not None
    scale = refs.pop(0)[0] if cast else None
    q_ref = refs.pop(0) if cast else None
    mean_ref = refs.pop(0) if cast and centred else None
    rstd_ref = refs.pop(0) if cast else None
    total_ref = refs.pop(0) if has_residual else None
    (max_ref,) = refs
    gamma = norm_backward.load_rows(gamma_ref, 0, 1)
    width = norm_backward.true_width(x_ref.shape[1])

    steps = ROWS_PER_PROGRAM // ROWS_PER_STEP

    def load(i):
        start = jnp.minimum(i, steps - 1) * ROWS_PER_STEP
        x = norm_backward.load_rows(x_ref, start, ROWS_PER_STEP)
        if residual_ref is None:
            return x
        # The residual add rounded to the stream's dtype once, as XLA's add
        # of the unfused block rounds it: the norm reads the stream's value.
        residual = norm_backward.load_rows(residual_ref, start, ROWS_PER_STEP)
        return (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x_ref.dtype)

    # The next rows' load is issued before this step's statistics, so that
    # its latency overlaps them (as in fp8jax.kernels.norm_backward).
    def step(i, carry):
        amax, x = carry
        ahead = load(i + 1)
        rows = pl.ds(i * ROWS_PER_STEP, ROWS_PER_STEP)
        y, mean, rstd = norm_rows.normalize_rows(x.astype(jnp.float32), gamma, beta, centred,
                                                 epsilon, width)  # fmt: skip
        if total_ref is not None:
            norm_backward.store_rows(total_ref, i * ROWS_PER_STEP, x)
        if cast:
            q = quantize_with_scale(y, fmt, scale).data
            norm_backward.store_rows(q_ref, i * ROWS_PER_STEP, q)
            if mean_ref is not None:
                mean_ref[rows, :] = mean
            rstd_ref[rows, :] = rstd
        return jnp.maximum(amax, cast_transpose.tile_max(y)), ahead

    max_ref[...] = lax.fori_loop(0, steps, step, (jnp.zeros((1, 1), jnp.float32), load(0)))[0]


def _pallas(x, gamma, beta, scale, residual=None, *, fmt, centred, epsilon, interpret=False):
    """The kernel on (rows, hidden) ``x``: q, (mean,) rstd, and one amax per program.

    With ``fmt`` None (and ``scale`` None) only ``(maxima,)``: the first pass
    of current scaling (:func:`output_maxima`). With ``residual`` (rows like
    ``x``; or ``x`` the pair ``(x, residual)``) the norm is of ``x + residual``,
    returned before the maxima.
    """
    x, residual = x if isinstance(x, tuple) else (x, residual)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    rows, hidden = x.shape
    programs = rows // ROWS_PER_PROGRAM
    by_rows = pl.BlockSpec((ROWS_PER_PROGRAM, hidden), lambda i: (i, 0))
    stats = pl.BlockSpec((ROWS_PER_PROGRAM, 1), lambda i: (i, 0))
    whole_row = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    operands = (
        [x, gamma] + ([] if beta is None else [beta]) + ([] if residual is None else [residual])
    )
    in_specs = [by_rows, whole_row] + ([] if beta is None else [whole_row])
    in_specs += [] if residual is None else [by_rows]
    out_specs, out_shape = [], []
    if fmt is not None:
        operands.append(scale.reshape(1))
        in_specs.append(pl.BlockSpec((1,), lambda i: (0,)))
        n_stats = 2 if centred else 1
        out_specs = [by_rows] + [stats] * n_stats
        out_shape = [jax.ShapeDtypeStruct((rows, hidden), fmt.dtype)]
        out_shape += [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * n_stats
    if residual is not None:
        out_specs.append(by_rows)
        out_shape.append(jax.ShapeDtypeStruct((rows, hidden), x.dtype))
    out_specs.append(pl.BlockSpec((1, 1), lambda i: (i, 0)))
    out_shape.append(jax.ShapeDtypeStruct((programs, 1), jnp.float32))
    params = {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}
    outputs = dispatch.pallas_call(
        functools.partial(_kernel, fmt, centred, beta is not None, residual is not None, epsilon),
        grid=(programs,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="fp8jax_norm_forward" if fmt is not None else "fp8jax_norm_maxima",
        **params,
    )(*operands)
    return outputs


def _xla(x, gamma, beta, scale, residual=None, *, fmt, centred, epsilon):
    """:func:`_pallas`'s values from XLA, one amax per block of ROWS_PER_PROGRAM rows."""
    x, residual = x if isinstance(x, tuple) else (x, residual)
    total = () if residual is None else (x + residual,)
    x = x if residual is None else total[0]
    y, mean, rstd = norm_rows.normalize_rows(x.astype(jnp.float32), gamma, beta, centred,
                                             epsilon)  # fmt: skip
    maxima = cast_transpose.tile_maxima(y, (ROWS_PER_PROGRAM, x.shape[1]))
    if fmt is None:
        return (*total, maxima)
    q = quantize_with_scale(y, fmt, scale).data
    stats = (rstd,) if mean is None else (mean, rstd)
    return (q, *stats, *total, maxima)


def decide(x) -> dispatch.Placement:
    """Where the kernel runs for the norm input ``x``: :func:`fp8jax.kernels.dispatch.decide`."""
    return norm_backward.decide(x, fits)


def _on_each_device(matrix, residual, gamma, beta, scale, kwargs, row_axes):
    n_out = (1 if kwargs["fmt"] is None else 3 + kwargs["centred"]) + (residual is not None)
    # The residual travels with x as one operand, so that shard_map splits both by rows.
    rows = matrix if residual is None else (matrix, residual)
    return dispatch.on_each_device(
        functools.partial(_pallas, **kwargs), functools.partial(_xla, **kwargs),
        (rows, gamma, beta, scale), 1, ("rows",) * n_out, tuple(row_axes),
    )  # fmt: skip


def row_maxima(matrix, gamma, beta, *, centred: bool, epsilon: float, row_axes=(),
               residual=None):  # fmt: skip
    """The maxima of the norm's f32 output magnitude on (rows, hidden) ``matrix``, alone.

    One per ROWS_PER_PROGRAM rows: current scaling's first pass, whose
    scale goes to :func:`cast_rows`. ``gamma`` is the effective (1, hidden)
    f32 scale, ``beta`` (1, hidden) f32 or None. With ``residual`` (like
    ``matrix``) the norm is of ``matrix + residual``, and the result is
    ``(sum, maxima)``: the sum written by the same pass
    (docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel).
    """
    kwargs = {"fmt": None, "centred": centred, "epsilon": epsilon}
    out = _on_each_device(matrix, residual, gamma, beta, None, kwargs, row_axes)
    return out[0] if residual is None else out


def cast_rows(matrix, gamma, beta, scale, fmt: Fp8Format, *, centred: bool, epsilon: float,
              row_axes=(), residual=None):  # fmt: skip
    """The norm of (rows, hidden) ``matrix`` cast to ``fmt`` at ``scale``, in one pass.

    Returns the kernel's outputs: ``(q, mean, rstd, maxima)``, without
    ``mean`` uncentred; ``maxima`` one per ROWS_PER_PROGRAM rows. Arguments
    as for :func:`row_maxima`; ``row_axes``: :func:`decide`'s. With
    ``residual`` the norm is of ``matrix + residual``, the sum returned
    before ``maxima``.
    """
    kwargs = {"fmt": fmt, "centred": centred, "epsilon": epsilon}
    return _on_each_device(matrix, residual, gamma, beta, scale.astype(jnp.float32), kwargs,
                           row_axes)  # fmt: skip
