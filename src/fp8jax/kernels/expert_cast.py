"""The experts' weights in FP8 for their grouped GEMMs: both copies from one read, in one kernel.

:func:`fp8jax.ragged_dot` needs each expert's weights ``w [g, k, n]`` in
two FP8 layouts at that expert's own scale: the forward's copy transposed,
``[g, n, k]`` (the grouped kernel contracts ``k``, and FP8 tensor-core MMAs
read both operands with the contracting axis minor), and the dgrad's as
they are, ``[g, k, n]``, in the backward format. XLA writes both from one
read in a multi-output fusion, but moves the transposed 1-byte elements
through its transpose emitter slowly (docs/design.md#grouped-expert-gemms);
on NVIDIA GPUs :func:`cast_experts` is one Pallas (Triton) program per
(expert, tile) that reads its tile once and writes both copies, as
:mod:`fp8jax.kernels.cast_transpose` does for one matrix. Elsewhere, with
the kernels off, where the weights are sharded (the kernel sees whole
arrays) or where the tiles do not fit, XLA computes the same values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.kernels import dispatch
from fp8jax.quantize import quantize_with_scale

# A program's tile of one expert's (k, n) matrix, and its warps: cast_transpose's
# tile, the fastest of its sweep on the H200 (docs/design.md#cast-and-transpose-in-one-kernel).
TILE_K, TILE_N, WARPS = 64, 128, 4


def fits(shape: tuple[int, ...]) -> bool:
    """Whether the kernel takes weights of ``shape``: ``[g, k, n]`` in whole tiles."""
    return len(shape) == 3 and shape[1] % TILE_K == 0 and shape[2] % TILE_N == 0


def _kernel(forward: Fp8Format, backward: Fp8Format, scale_ref, w_ref, forward_t_ref,
            backward_ref):  # fmt: skip
    w = w_ref[...].astype(jnp.float32)
    scale = scale_ref[0]
    backward_ref[...] = quantize_with_scale(w, backward, scale).data
    forward_t_ref[...] = quantize_with_scale(w, forward, scale).data.T


def _pallas(w, scale, forward: Fp8Format, backward: Fp8Format, interpret: bool = False):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    g, k, n = w.shape
    params = {} if interpret else {"compiler_params": pallas_triton.CompilerParams(num_warps=WARPS)}
    return dispatch.pallas_call(
        functools.partial(_kernel, forward, backward),
        grid=(g, k // TILE_K, n // TILE_N),
        in_specs=[
            pl.BlockSpec((1,), lambda e, i, j: (e,)),
            pl.BlockSpec((None, TILE_K, TILE_N), lambda e, i, j: (e, i, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, TILE_N, TILE_K), lambda e, i, j: (e, j, i)),
            pl.BlockSpec((None, TILE_K, TILE_N), lambda e, i, j: (e, i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((g, n, k), forward.dtype),
            jax.ShapeDtypeStruct((g, k, n), backward.dtype),
        ],
        interpret=interpret,
        name="fp8jax_expert_cast",
        **params,
    )(scale.astype(jnp.float32), w)


def cast_experts_xla(w, scale, forward: Fp8Format, backward: Fp8Format):
    """:func:`cast_experts`'s values from XLA."""
    per_expert = scale.astype(jnp.float32).reshape(-1, 1, 1)
    forward_t = quantize_with_scale(jnp.swapaxes(w, 1, 2), forward, per_expert).data
    return forward_t, quantize_with_scale(w, backward, per_expert).data


def cast_experts(w, scale, forward: Fp8Format, backward: Fp8Format, interpret: bool = False):
    """``w [g, k, n]`` at ``scale [g]``, one per expert: ``(forward_t [g, n, k], backward)``.

    ``forward_t`` in ``forward``, transposed; ``backward [g, k, n]`` in ``backward``;
    both rounded once from ``w`` (saturating, as :func:`fp8jax.quantize.quantize_with_scale`).
    ``interpret``: the kernel in Pallas interpret mode (tests, on the CPU).
    """
    if interpret and fits(w.shape):
        return tuple(_pallas(w, scale, forward, backward, interpret=True))
    if not dispatch.decide(lambda _: fits(w.shape), rows_are_tokens=False).kernel:
        return cast_experts_xla(w, scale, forward, backward)
    return tuple(dispatch.on_each_device(
        functools.partial(_pallas, forward=forward, backward=backward),
        functools.partial(cast_experts_xla, forward=forward, backward=backward),
        (w, scale), 0, ("rows", "rows"),
    ))  # fmt: skip
