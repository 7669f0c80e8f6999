"""FP8 formats: E4M3 for values, E5M2 for gradients, and the pairs recipes use.

The maxima are the largest finite values of the OCP FP8 formats that Hopper
tensor cores read: ``float8_e4m3fn`` (no infinities, max 448) and
``float8_e5m2`` (IEEE-like, max 57344).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding: its JAX dtype and its largest finite value.

    Attributes:
      name: short name, ``"e4m3"`` or ``"e5m2"``.
      dtype: the ``jnp`` dtype the data is stored in.
      max: largest finite magnitude; quantization saturates to it.

    Example:
      >>> from fp8jax import E4M3
      >>> E4M3.max, E4M3.dtype
      (448.0, dtype(float8_e4m3fn))
    """

    name: str
    dtype: np.dtype
    max: float

    def __repr__(self) -> str:
        return self.name.upper()


E4M3 = Fp8Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0)
E5M2 = Fp8Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0)

FP8_DTYPES = frozenset({jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)})


@dataclasses.dataclass(frozen=True)
class FormatPair:
    """Which format the forward operands and the gradients use.

    Attributes:
      forward: format of activations and kernels (forward and saved residuals).
      backward: format of the incoming gradient in dgrad and wgrad.

    Raises:
      ValueError: if ``forward`` is E5M2. Every GEMM pairs a forward operand
        with either another forward operand or a gradient, and cuBLASLt has no
        E5M2 x E5M2 kernel, so the forward format must be E4M3.
    """

    forward: Fp8Format
    backward: Fp8Format

    def __post_init__(self):
        for field in ("forward", "backward"):
            value = getattr(self, field)
            if not isinstance(value, Fp8Format):
                raise TypeError(
                    f"FormatPair.{field} must be fp8jax.E4M3 or fp8jax.E5M2, got {value!r}."
                )
        if self.forward == E5M2:
            raise ValueError(
                "FormatPair.forward=E5M2 would need an E5M2 x E5M2 GEMM, which cuBLASLt "
                "rejects; use forward=E4M3 (HYBRID keeps E5M2 for gradients)."
            )

    def __repr__(self) -> str:
        if self == HYBRID:
            return "HYBRID"
        return f"FormatPair(forward={self.forward!r}, backward={self.backward!r})"


HYBRID = FormatPair(E4M3, E5M2)
"""E4M3 forward, E5M2 gradients: the default, as in TransformerEngine."""

ALL_E4M3 = FormatPair(E4M3, E4M3)
"""E4M3 everywhere: more precision for gradients, less range."""


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is one of the two FP8 dtypes fp8jax computes with."""
    return jnp.dtype(dtype) in FP8_DTYPES
