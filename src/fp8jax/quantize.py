"""Saturating FP8 quantization with native XLA ops.

Everything here is plain ``jnp`` so that XLA fuses the amax reduction, the
scaling, the clip and the cast into the producer's kernel. No custom calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.formats import Fp8Format, is_fp8
from fp8jax.recipes import check_margin
from fp8jax.scaling import scale_from_amax


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["data", "scale_inv"], meta_fields=["format"]
)
@dataclasses.dataclass(frozen=True)
class Fp8Array:
    """An FP8 tensor and the factor that maps it back: ``value ~= data * scale_inv``.

    Attributes:
      data: the FP8 values (1 byte per element).
      scale_inv: f32 scalar, the reciprocal of the scale used to quantize.
      format: the :class:`~fp8jax.formats.Fp8Format` of ``data`` (static).
    """

    data: jax.Array
    scale_inv: jax.Array
    format: Fp8Format

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape


# Rows shorter than this are merged with the axis before them for the row maxima.
_SHORT_ROW = 128
# Rows of fewer elements than this take in the axes before them too, down to
# the third (a (batch, tokens, heads, ..., head_dim) gradient's row becomes the
# token's): fused into the QKV gradient's RoPE backward, XLA's reduction over
# 128-element rows moved 0.56 TB/s on an H200, over a token's 3072 elements
# 1.3 TB/s (docs/design.md#the-amax-over-rows-of-a-token).
_MIN_ROW = 1024


def _row_axes(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The trailing axes whose maxima :func:`amax` takes first."""
    ndim = len(shape)
    row = [ndim - 1]
    if ndim >= 3 and shape[-1] < _SHORT_ROW:
        row.insert(0, ndim - 2)
    while row[0] > 2 and math.prod(shape[a] for a in row) < _MIN_ROW:
        row.insert(0, row[0] - 1)
    return tuple(row)


def amax(x: jax.Array) -> jax.Array:
    """Largest magnitude of ``x`` as an f32 scalar (NaN if ``x`` holds a NaN, 0 if it is empty)."""
    if x.size == 0:
        # An empty MoE group or batch holds no values: amax 0 (no information),
        # which current scaling turns into scale 1 and delayed scaling ignores.
        return jnp.zeros((), jnp.float32)
    magnitude = jnp.abs(x)
    if x.ndim >= 2:
        # Row maxima first: a row reduction fuses into XLA's GPU normalization
        # fusions (LayerNorm), a full reduction does not and made XLA write
        # |x| to HBM in f32 before reducing it. A short last axis joins the
        # row: over the interleaved gated pre-activation's (..., ffn, 2) the
        # row maxima would be half as large as x itself; short rows take in
        # the axes before them (_row_axes).
        magnitude = jax.lax.optimization_barrier(jnp.max(magnitude, axis=_row_axes(x.shape)))
    return jnp.max(magnitude).astype(jnp.float32)


def check_high_precision(name: str, x) -> None:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or is_fp8(dtype):
        raise TypeError(
            f"{name} must be a float32, bfloat16 or float16 array, got "
            f"{'a ' + type(x).__name__ if dtype is None else 'dtype ' + str(dtype)}. "
            "fp8jax quantizes high-precision inputs itself; pass the unquantized tensor."
        )


def quantize_with_scale(x: jax.Array, fmt: Fp8Format, scale: jax.Array) -> Fp8Array:
    """Saturating cast of ``x * scale`` to ``fmt`` (no validation; for op internals)."""
    scale = scale.astype(jnp.float32)
    x32 = x.astype(jnp.float32)
    scaled = x32 * scale
    # XLA's f32->f8 convert maps out-of-range values to NaN (e4m3fn) or Inf
    # (e5m2); clipping first makes finite overflow saturate instead. A
    # non-finite input becomes NaN, so that the caller's NaN/Inf checks see
    # it: an Inf would not survive, as the GPU's conversion (cvt .satfinite)
    # saturates infinities, and Triton's minimum and maximum (the Pallas
    # kernels call this) may drop a NaN in the clip. One compare and select
    # per element, fused into the cast.
    clipped = jnp.clip(scaled, -fmt.max, fmt.max)
    clipped = jnp.where(jnp.abs(x32) < jnp.inf, clipped, jnp.float32(jnp.nan))
    return Fp8Array(clipped.astype(fmt.dtype), 1.0 / scale, fmt)


def quantize(x: jax.Array, fmt: Fp8Format, scale: jax.Array | None = None, *, margin: float = 0):
    """Quantizes ``x`` to FP8, saturating finite overflow at the format's maximum.

    Finite values beyond the format's range saturate to ``±fmt.max``.
    Non-finite values propagate: a NaN or ±Inf becomes NaN (in both
    formats; on the GPU the FP8 conversion would saturate an Inf), so a
    NaN/Inf in an op's input or gradient gives a non-finite result in the
    rows it reaches, and the caller's overflow checks still fire. Every
    fp8jax op quantizes this way, on the XLA path and in the Pallas kernels.

    Args:
      x: a float32, bfloat16 or float16 array.
      fmt: ``fp8jax.E4M3`` or ``fp8jax.E5M2``.
      scale: f32 scalar to multiply by before the cast. None derives it from
        ``x``'s own amax (current scaling): ``fmt.max / amax / 2**margin``,
        or 1 if ``x`` is all zeros or holds a NaN/Inf.
      margin: headroom in powers of two, used only when ``scale`` is None.

    Returns:
      ``(q, amax)``: an :class:`Fp8Array` with the FP8 data and its
      ``scale_inv``, and ``x``'s amax as an f32 scalar.

    Raises:
      TypeError: if ``x`` is not a high-precision float array or ``fmt`` is not
        an FP8 format.
      ValueError: for a scale that is not a scalar, a concrete scale outside
        [2**-126, 2**126] (or a bool), or a margin outside [0, 32].

    Example:
      >>> import jax.numpy as jnp, fp8jax
      >>> q, amax = fp8jax.quantize(jnp.array([1.0, -2.0, 1000.0]), fp8jax.E4M3, jnp.float32(1.0))
      >>> q.data.astype(jnp.float32).tolist(), float(amax)
      ([1.0, -2.0, 448.0], 1000.0)
    """
    check_high_precision("x", x)
    if not isinstance(fmt, Fp8Format):
        raise TypeError(f"fmt must be fp8jax.E4M3 or fp8jax.E5M2, got {fmt!r}.")
    x_amax = amax(x)
    if scale is None:
        check_margin("quantize", margin)
        scale = scale_from_amax(x_amax, fmt.max, margin, fallback=1.0)
    elif jnp.shape(scale) != ():
        raise ValueError(f"scale must be a scalar, got shape {jnp.shape(scale)}.")
    elif not isinstance(scale, jax.core.Tracer):
        # A traced scale cannot be checked here; a concrete one can. A zero,
        # negative or non-finite scale gives a scale_inv that makes every
        # dequantized value NaN, Inf or of the wrong sign; so does one whose
        # f32 value or reciprocal is not a normal f32 (1e39 is inf there, and
        # devices flush subnormals to 0), such as 1e39, 1e38 or 1e-40.
        value = float(scale)
        tiny = float(np.finfo(np.float32).tiny)  # 2**-126
        if isinstance(scale, bool) or not tiny <= value <= 1 / tiny:
            raise ValueError(
                f"scale must be a finite number > 0, from 2**-126 to 2**126 (about 1.2e-38 to "
                f"8.5e37, so that it and its reciprocal are normal f32 numbers), got {scale!r}: "
                "it multiplies x before the cast. Pass scale=None to derive it from x's amax."
            )
    return quantize_with_scale(x, fmt, jnp.asarray(scale)), x_amax


def dequantize(q: Fp8Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of :func:`quantize`: ``q.data * q.scale_inv`` in ``dtype``, a high-precision float.

    Example:
      >>> import jax.numpy as jnp, fp8jax
      >>> q, _ = fp8jax.quantize(jnp.array([0.5, 3.0]), fp8jax.E4M3, jnp.float32(4.0))
      >>> fp8jax.dequantize(q).tolist()
      [0.5, 3.0]
    """
    if not isinstance(q, Fp8Array):
        raise TypeError(f"q must be an fp8jax.Fp8Array from fp8jax.quantize, got {type(q)}.")
    # An integer or FP8 dtype would round the values again, silently.
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or is_fp8(dtype):
        raise TypeError(
            "dtype must be a high-precision float dtype (float32, bfloat16 or float16), "
            f"got {dtype}."
        )
    return (q.data.astype(jnp.float32) * q.scale_inv).astype(dtype)
