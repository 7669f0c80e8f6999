"""Rotary position embeddings (RoPE), in plain ``jnp``.

The "rotate half" layout (GPT-NeoX, Llama): feature ``i`` of the first half of
a head is paired with feature ``i`` of the second half, and the pair is
rotated by ``position * base**(-2i / head_dim)``.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp


def valid_base(base) -> bool:
    """Whether ``base`` is a finite number > 0.

    The frequencies are base**(-2i / head_dim): a base <= 0, inf or NaN makes
    them inf or NaN, and every rotated query and key NaN, silently.
    """
    return not isinstance(base, bool) and isinstance(base, numbers.Real) and 0 < base < math.inf


def apply_rotary(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotates query or key heads by their positions.

    Args:
      x: ``(batch, seq, heads, head_dim)``; ``head_dim`` must be even.
      positions: integer positions, ``(seq,)`` or ``(batch, seq)``.
      base: the wavelength base (10000 in the RoPE paper).

    Returns:
      ``x`` rotated, in ``x.dtype``; the angles are computed in f32.

    Raises:
      ValueError: for an odd head_dim, positions that do not fit x, or a base
        that is not a finite number > 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from fp8jax.flax.rotary import apply_rotary
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> y = apply_rotary(x, jnp.arange(3))
      >>> bool(jnp.allclose(y[:, 0], x[:, 0]))  # position 0 is not rotated
      True
    """
    if not valid_base(base):
        raise ValueError(f"apply_rotary: base must be a finite number > 0, got {base!r}.")
    batch, seq, _, dim = x.shape
    if dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {dim}.")
    positions = jnp.asarray(positions)
    if positions.shape not in ((seq,), (batch, seq)):
        raise ValueError(
            f"positions must have shape ({seq},) or ({batch}, {seq}) to match x of shape "
            f"{tuple(x.shape)}, got {tuple(positions.shape)}."
        )
    half = dim // 2
    inv_freq = jnp.power(
        jnp.float32(base), -jnp.arange(half, dtype=jnp.float32) / jnp.float32(half)
    )
    pos = jnp.broadcast_to(positions, (batch, seq)).astype(jnp.float32)
    angle = pos.reshape(batch, seq, 1, 1) * inv_freq.reshape(1, 1, 1, half)
    return _rotary(x, jnp.sin(angle), jnp.cos(angle))


def _rotate(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """``x``'s feature pairs rotated by the angles whose sines and cosines are given, in f32."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    # The (.., 1, half) angle broadcasts over heads explicitly; rank promotion stays off.
    sin = jnp.broadcast_to(sin, x1.shape)
    cos = jnp.broadcast_to(cos, x1.shape)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# The backward is the rotation by the negative angle, written as the forward
# is. Autodiff's transpose of the halves' slices pads each half's gradient to
# the whole head and adds them; in the train step's QKV gradient that fusion
# moved its bytes at about a third of the forward rotation's rate
# (docs/design.md#the-rope-backward-as-a-rotation).
@jax.custom_vjp
def _rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    return _rotate(x, sin, cos)


def _rotary_fwd(x, sin, cos):
    return _rotate(x, sin, cos), (sin, cos)


def _rotary_bwd(residuals, g):
    sin, cos = residuals
    # The angles come from integer positions: nothing upstream takes their gradient.
    return _rotate(g, -sin, cos), jnp.zeros_like(sin), jnp.zeros_like(cos)


_rotary.defvjp(_rotary_fwd, _rotary_bwd)
