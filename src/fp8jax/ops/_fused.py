"""What :mod:`fp8jax.ops.layernorm_dense` and :mod:`fp8jax.ops.layernorm_mlp` share.

Their static config, the norm's FP8 output and the statistics its backward
reads. The normalized input never reaches HBM in high precision: one kernel
computes the norm, its FP8 cast and its maxima from a single read of x
(:mod:`fp8jax.kernels.norm_forward`;
docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel), after a
maxima-only pass of the same kernel under current scaling; where the kernel
does not run it is quantized in the fusions that compute it, the amax pass
recomputing it from x.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import norm_forward
from fp8jax.ops import _partitioning
from fp8jax.ops.norm import NormConfig, normalize, normalize_and_cast, output_maxima
from fp8jax.ops.operand import QuantizedOperand, from_kernel, inverse
from fp8jax.ops.quantizing import amax_for_update, current_amax_and_scale, quantize_operand
from fp8jax.ops.split import Split
from fp8jax.quantize import Fp8Array
from fp8jax.recipes import Recipe
from fp8jax.scaling import ScaleState


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static settings of a fused op; its custom_vjp's only static argument."""

    norm: NormConfig
    recipe: Recipe
    x_dtype: jnp.dtype  # also the dtype of every activation the op outputs
    kernel_dtypes: tuple[jnp.dtype, ...]  # cotangents come back in these
    activations: tuple[str, ...] = ()
    return_normalized: bool = False
    return_residual: bool = False  # also return x, whose gradient then joins the norm's
    # What each input's cotangent must match: shard_map axes, Explicit sharding.
    inputs: tuple[_partitioning.InputType, ...] = ()
    bias_dtype: jnp.dtype | None = None  # layernorm_dense's bias, None without one
    split: Split | None = None  # layernorm_dense's output returned in pieces
    has_residual: bool = False  # the norm reads x + residual (the last input)


class NormSaved(NamedTuple):
    """What the norm's backward reads: its inputs and per-row statistics.

    ``scale``: the FP8 output's scale where the kernel cast it; the backward
    then casts it again from ``x`` (:func:`fp8_output`) instead of keeping it.
    """

    x: jax.Array
    gamma: jax.Array
    beta: jax.Array | None
    mean: jax.Array | None
    rstd: jax.Array
    scale: jax.Array | None = None


def normalized(x, gamma, beta, config: FusedConfig) -> jax.Array:
    """The norm's output, in f32."""
    return normalize(x, gamma, beta, config.norm)[0]


def normalize_and_quantize(
    x, gamma, beta, state: ScaleState | None, config: FusedConfig, residual=None
) -> tuple[QuantizedOperand, NormSaved]:
    """The norm's output in FP8, and what the norm's backward reads.

    With ``residual`` the norm is of ``x + residual`` (the residual add of a
    pre-norm block), which ``NormSaved.x`` holds: the kernel pass that reads
    ``x`` reads ``residual`` too and writes the sum, so the stream is not read
    by an add of its own first (docs/design.md#the-norms-forward-and-its-fp8-cast-in-one-kernel).

    In one kernel where it runs (:mod:`fp8jax.kernels.norm_forward`): at
    delayed scaling's stored scale (``state``, the output's ScaleState), or
    under current scaling after a first pass of the same kernel that only
    takes the output's maxima. Elsewhere XLA's passes, which fuse the norm
    into both the amax and the quantize pass, so that the value never
    reaches HBM in high precision.
    """
    recipe, fmt = config.recipe, config.recipe.formats.forward
    placement = norm_forward.decide(x)
    if placement.kernel:
        if state is None:
            maxima = output_maxima(x, gamma, beta, config.norm, placement.row_axes, residual)
            if residual is not None:
                (x, maxima), residual = maxima, None
            amax, scale = current_amax_and_scale(maxima, fmt, recipe)
        else:
            scale = state.scale
        q, maxima, mean, rstd, *total = normalize_and_cast(
            x, gamma, beta, config.norm, scale, fmt, placement.row_axes, residual
        )
        x = total[0] if total else x
        if state is not None:
            amax = amax_for_update(maxima, recipe)
        normed = from_kernel(q, inverse(scale), fmt, amax)
        return normed, NormSaved(x, gamma, beta, mean, rstd, scale)
    if residual is not None:
        x = x + residual  # XLA fuses the add into the norm's passes, writing the sum.
    _, mean, rstd = normalize(x, gamma, beta, config.norm)
    value = normalized(x, gamma, beta, config).astype(jnp.float32)
    return quantize_operand(value, fmt, state, recipe), NormSaved(x, gamma, beta, mean, rstd)


def check_residual(x, residual) -> None:
    """Raises a named ValueError unless ``residual`` is None or shaped and typed like ``x``."""
    if residual is None:
        return
    shape, dtype = getattr(residual, "shape", None), getattr(residual, "dtype", None)
    if shape is None or tuple(shape) != tuple(x.shape) or jnp.dtype(dtype) != jnp.dtype(x.dtype):
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)} and dtype {jnp.dtype(x.dtype)} (it "
            f"is added to x before the norm), got shape {shape} and dtype {dtype}; cast or "
            "reshape it first."
        )


def with_residual_cotangent(cotangents: tuple, dx, config: FusedConfig) -> tuple:
    """A fused op's matched cotangents and its last input's, ``residual``: ``dx`` or None.

    The norm read ``x + residual``, so both take the sum's gradient (``config.inputs[-1]``
    is the residual's type).
    """
    if not config.has_residual:
        return (*cotangents, None)
    return (*cotangents, _partitioning.match_cotangents((dx,), None, config.inputs[-1:])[0])


def saved_output(normed: QuantizedOperand, norm: NormSaved) -> Fp8Array | None:
    """What the forward keeps of the norm's FP8 output: None where the backward casts it again.

    XLA's rematerialization recomputes an XLA fusion when memory runs short,
    never a kernel's output: kept, the kernel's FP8 copy (and the transposed
    copy XLA makes of it for the weight gradient) stays in memory from the
    forward to the backward (docs/design.md#the-norms-fp8-output-cast-again-in-the-backward).
    """
    return None if norm.scale is not None else normed.fp8


def fp8_output(saved: Fp8Array | None, norm: NormSaved, config: FusedConfig, after) -> Fp8Array:
    """The norm's FP8 output in the backward: :func:`saved_output`'s, or cast again from ``x``.

    The kernel computes the forward's bytes again: same input, same scale,
    same arithmetic. Its inputs pass an ``optimization_barrier`` with
    ``after`` (a value of the backward, the output gradient), so that XLA
    neither merges the call with the forward's identical one (CSE) nor
    schedules it before the backward needs it.
    """
    if saved is not None:
        return saved
    x, gamma, beta, scale, _ = lax.optimization_barrier((norm.x, norm.gamma, norm.beta,
                                                         norm.scale, after))  # fmt: skip
    fmt = config.recipe.formats.forward
    q = normalize_and_cast(x, gamma, beta, config.norm, scale, fmt,
                           norm_forward.decide(x).row_axes)[0]  # fmt: skip
    return Fp8Array(q, inverse(scale), fmt)
