"""The MLP activations: each one defined once, with both of its formulas.

:func:`fp8jax.layernorm_mlp` computes an activation in one of two places,
and each place has its own formula for it (:class:`Activation`):

* ``xla``: the f32 function XLA evaluates, and differentiates (``jax.vjp``),
  where the activation kernels do not run.
* ``value_and_slope``: the value and the derivative written out, as the
  Pallas kernels (:mod:`fp8jax.kernels.activation_cast`) compute them from
  elementary functions they are handed (:class:`XlaMath` off the GPU, the
  GPU's approximate ``ex2`` and ``rcp`` on it).

The two formulas differ on purpose and are kept exactly as each path
measured best, so that a path's values do not change with this module:
XLA's gelu writes ``Phi`` through ``erf`` (:func:`gelu`), which its fusions
recompute cheaply, and its gelu_tanh is ``jax.nn.gelu``'s ``tanh`` form;
the kernels write both through the logistic function and ``erfc``, which
keep f32's relative precision in the negative tail where ``1 + tanh`` and
``1 + erf`` cancel (x = -4.8: gelu_tanh's slope is -3e-6, and the tanh
form's f32 error is 20% of it). ``kernel`` says whether
:func:`fp8jax.layernorm_mlp` sends the activation to the kernels at all:
only those that measured faster there (below).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

_SQRT_HALF = 0.7071067811865476
_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715
_RSQRT_2 = 1 / math.sqrt(2)
_RSQRT_2PI = 1 / math.sqrt(2 * math.pi)


class XlaMath:
    """The elementary functions the kernels' formulas use, as XLA computes them.

    What :attr:`Activation.value_and_slope` gets off the GPU (interpret mode,
    the kernels' XLA twins); the GPU's approximate instructions are
    :mod:`fp8jax.kernels.activation_cast`'s.
    """

    exp = staticmethod(jnp.exp)
    erfc = staticmethod(lax.erfc)

    @staticmethod
    def rcp(v):
        return 1 / v


def gelu(x):
    """Exact gelu, ``x * Phi(x)``, with Phi written through ``erf``.

    ``jax.nn.gelu(approximate=False)`` writes Phi through ``erfc``, which XLA
    expands into several polynomials, an ``exp`` and selects, costly enough
    that XLA kept its f32 value alive for the backward rather than recompute
    it. XLA's f32 ``erf`` is one rational polynomial, cheap enough to
    recompute, so gelu takes the same path as every other activation
    (docs/design.md#gelu-through-erf has the measurement). ``erfc`` is
    more accurate only in the negative tail, where ``1 + erf`` cancels: in
    f32 this form stays within 1.1e-6 of the exact value over [-12, 12],
    under a thousandth of bf16's spacing at 1, 2**-7 (tests/ops/test_layernorm_mlp.py).
    """
    return x * (1 + lax.erf(x * _SQRT_HALF)) * 0.5


def _sigmoid(z, m):
    # Where exp overflows, rcp of infinity gives 0, the limit.
    return m.rcp(1 + m.exp(-z))


def _gelu_tanh_kernel(x, m):
    # 0.5 * (1 + tanh(u)) is sigmoid(2u): see the module docstring.
    two_u_slope = 2 * _GELU_C * (1 + 3 * _GELU_A * x * x)
    s = _sigmoid(2 * _GELU_C * (x + _GELU_A * x * x * x), m)
    return x * s, s + x * s * (1 - s) * two_u_slope


def _gelu_kernel(x, m):
    # Phi(x) through erfc, not 1 + erf, for the same reason.
    phi = 0.5 * m.erfc(-x * _RSQRT_2)
    return x * phi, phi + x * _RSQRT_2PI * m.exp(-0.5 * x * x)


def _relu_kernel(x, m):
    del m
    return jnp.maximum(x, 0.0), jnp.where(x > 0, 1.0, 0.0).astype(x.dtype)


def _silu_kernel(x, m):
    s = _sigmoid(x, m)
    return x * s, s * (1 + x * (1 - s))


def _linear_kernel(x, m):
    del m
    return x, jnp.ones_like(x)


@dataclasses.dataclass(frozen=True)
class Activation:
    """One activation: its name, its two formulas, and whether the kernels serve it.

    Attributes:
      name: the name the ops and modules take (``activations=``).
      xla: f32 -> f32, XLA's path; its derivative is JAX's (``jax.vjp``).
      value_and_slope: ``(x, math) -> (act(x), act'(x))`` in f32, the
        kernels' formula from ``math``'s ``exp``, ``erfc`` and ``rcp``.
      kernel: whether :func:`fp8jax.layernorm_mlp` computes it in the
        activation kernels, by measurement (see :data:`REGISTRY`).
    """

    name: str
    xla: Callable[[jax.Array], jax.Array]
    value_and_slope: Callable[..., tuple[jax.Array, jax.Array]]
    kernel: bool


# kernel=True: the activations that measured faster in the kernels than on
# XLA's path, alternating in one process on the H200 (gelu_tanh in the
# transformer layer, SwiGLU in its MLP block and the GPT step, relu alone).
# Not erf's gelu, whose erfc costs the kernels more math than XLA's fusions
# (docs/design.md#the-activation-inside-the-cast-kernels).
REGISTRY: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("gelu", gelu, _gelu_kernel, kernel=False),
        Activation("gelu_tanh", functools.partial(jax.nn.gelu, approximate=True),
                   _gelu_tanh_kernel, kernel=True),
        Activation("relu", jax.nn.relu, _relu_kernel, kernel=True),
        Activation("silu", jax.nn.silu, _silu_kernel, kernel=True),
        Activation("linear", lambda x: x, _linear_kernel, kernel=True),
    )
}  # fmt: skip
NAMES = tuple(sorted(REGISTRY))


def check(value, owner: str | None = None) -> tuple[str, ...]:
    """``value`` (a name, or one or two names) as a tuple of registered activation names.

    One name is a plain MLP, two a gated one. ``owner``: the module or op
    named in the error.

    Raises:
      ValueError: for an unknown name, or none or more than two.
    """
    names = (value,) if isinstance(value, str) else tuple(value)
    if not 1 <= len(names) <= 2 or any(a not in REGISTRY for a in names):
        prefix = "" if owner is None else f"{owner}: "
        raise ValueError(
            f"{prefix}activations must be one or two names from {list(NAMES)}, e.g. "
            f"('gelu', 'linear') for GeGLU or ('silu', 'linear') for SwiGLU; got {value!r}."
        )
    return names


def gated(pre, names: tuple[str, ...], axis: int = -2, dtype=None) -> jax.Array:
    """The (gated) activation of ``pre`` by XLA's formulas (:attr:`Activation.xla`), in f32.

    ``pre``'s axis ``axis`` (of size ``len(names)``) picks the activation:
    ``(..., len(names), ffn)`` by default; the result drops that axis. With
    ``dtype`` the f32 result is rounded to it. The one gated activation of
    every XLA path: the fused MLP's, the fine-grained MLP's and the BF16
    baseline's.
    """
    pre32 = pre.astype(jnp.float32)
    h = REGISTRY[names[0]].xla(lax.index_in_dim(pre32, 0, axis, keepdims=False))
    for i, name in enumerate(names[1:], start=1):
        h = h * REGISTRY[name].xla(lax.index_in_dim(pre32, i, axis, keepdims=False))
    return h if dtype is None else h.astype(dtype)


def kernel_serves(names: tuple[str, ...]) -> bool:
    """Whether :func:`fp8jax.layernorm_mlp` computes ``names`` (checked) in the kernels."""
    return all(REGISTRY[a].kernel for a in names)
