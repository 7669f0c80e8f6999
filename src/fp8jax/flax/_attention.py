"""The attention core both APIs share: split the fused QKV, rotate, attend (BF16, or FP8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.flax._common import BATCH, HEADS, LENGTH
from fp8jax.flax.rotary import apply_rotary
from fp8jax.ops.attention import dot_product_attention
from fp8jax.sharding import constrain

# The attention cores: jax.nn.dot_product_attention's, and "fp8" (fp8jax's).
IMPLEMENTATIONS = (None, "xla", "cudnn", "fp8")


def check_hadamard(owner: str, hadamard, implementation: str | None) -> None:
    """``attention_implementation`` is a known core, and ``attention_hadamard`` a bool, True
    only with the FP8 attention that rotates."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{owner}.attention_implementation must be one of {IMPLEMENTATIONS}, "
            f"got {implementation!r}."
        )
    if not isinstance(hadamard, bool):
        raise TypeError(f"{owner}.attention_hadamard must be a bool, got {hadamard!r}.")
    if hadamard and implementation != "fp8":
        raise ValueError(
            f"{owner}.attention_hadamard=True rotates the FP8 attention's queries and keys "
            "before quantizing; it needs attention_implementation='fp8', got "
            f"{implementation!r}."
        )


def check_mask(mask, q, k) -> None:
    """``mask`` is None or a boolean array that broadcasts to ``(batch, heads, q_len, kv_len)``.

    JAX's own errors named no argument: "incompatible shapes for broadcasting"
    from inside its attention for a mask of the wrong shape.
    """
    if mask is None:
        return
    expected = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    shape, dtype = getattr(mask, "shape", None), getattr(mask, "dtype", None)
    try:
        fits = shape is not None and np.broadcast_shapes(tuple(shape), expected) == expected
    except ValueError:
        fits = False
    if not fits or dtype != jnp.bool_:
        given = type(mask).__name__ if shape is None else f"shape {tuple(shape)}, dtype {dtype}"
        raise ValueError(
            "MultiHeadAttention: mask must be a bool array that broadcasts to (batch, heads, "
            f"q_len, kv_len) = {expected} (True attends), got {given}."
        )


def attention_core(q, k, v, mask, causal: bool, implementation: str | None,
                   hadamard: bool = False) -> jax.Array:  # fmt: skip
    """``jax.nn.dot_product_attention`` in the inputs' dtype; ``"fp8"``: fp8jax's FP8 attention.

    ``hadamard``: the FP8 attention's ``hadamard`` option (``"fp8"`` only).
    """
    if implementation == "fp8":
        if mask is not None:
            raise ValueError(
                "attention_implementation='fp8' takes no mask (causal or none), got a mask "
                f"of shape {mask.shape}; use 'xla' or 'cudnn' for masked attention."
            )
        return dot_product_attention(q, k, v, causal=causal, hadamard=hadamard)
    check_hadamard("attention", hadamard, implementation)
    check_mask(mask, q, k)
    # JAX's XLA attention promotes bf16 logits against f32 internally, which a
    # process running strict dtype promotion rejects; that promotion is JAX's.
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, implementation=implementation
        )


def attend(
    qkv,
    *,
    num_heads: int,
    rope_base: float | None,
    positions,
    mask,
    causal,
    implementation,
    hadamard: bool = False,
):
    """Splits the fused QKV ``(b, s, kv_heads, group + 2, d)``, applies RoPE, attends.

    ``qkv`` may come split already (``layernorm_dense(..., split=(group, 1, 1))``):
    ``(q, k, v)`` of ``(b, s, kv_heads, group, d)``, ``(b, s, kv_heads, 1, d)`` twice.

    Query head ``h`` is group member ``h % group`` of key/value head
    ``h // group``, the grouping ``jax.nn.dot_product_attention`` uses for GQA.

    Under a mesh with logical axis rules (``fp8jax.sharding.use_mesh``),
    heads are split over the tensor-parallel axis, and queries and the output
    keep the sequence split of the residual stream while keys and values are
    gathered whole: every query sees every key.
    """
    if isinstance(qkv, tuple):
        q, k, v = qkv
        k, v = k[:, :, :, 0], v[:, :, :, 0]
    else:
        group = qkv.shape[3] - 2
        q, k, v = qkv[:, :, :, :group], qkv[:, :, :, group], qkv[:, :, :, group + 1]
    batch, seq, _, _, d = q.shape
    q = q.reshape(batch, seq, num_heads, d)
    if rope_base is not None:
        positions = jnp.arange(seq) if positions is None else positions
        q = apply_rotary(q, positions, base=rope_base)
        k = apply_rotary(k, positions, base=rope_base)
    q = constrain(q, (BATCH, LENGTH, HEADS, None))
    k, v = (constrain(t, (BATCH, None, HEADS, None)) for t in (k, v))
    o = attention_core(q, k, v, mask, causal, implementation, hadamard)
    return constrain(o, (BATCH, LENGTH, HEADS, None))
