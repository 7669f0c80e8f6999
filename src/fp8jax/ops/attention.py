"""FP8 scaled dot-product attention: the forward on E4M3 tensor cores, a 16-bit backward.

``fp8jax.dot_product_attention`` takes ``jax.nn.dot_product_attention``'s
layout, (batch, seq, heads, head_dim), with grouped keys and values (GQA).
Q, K and V are quantized to E4M3 with one current power-of-two scale per
128 rows and head (:data:`fp8jax.kernels.attention.BLOCK`), then
:func:`fp8jax.kernels.attention.forward` runs the flash-attention forward
(the Mosaic GPU kernel on a Hopper GPU, its exact XLA twin elsewhere) and
saves the base-2 logsumexp.

The backward recomputes P block by block from the saved FP8 Q and K and the
logsumexp (FlashAttention's), never forming a Tq x Tk array, and takes
dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K and dK = dSᵀ Q with BF16 operands and f32
sums, in XLA. The quantization is straight-through: the gradients are those
of attention on the dequantized Q, K and V. dS keeps 16 bits because most of
FP8 attention's backward error lives there (SageAttention's training
papers); an FP8 dV and its kernel are future work.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import attention as kernel

IMPLEMENTATIONS = (None, "xla")


@dataclasses.dataclass(frozen=True)
class _Config:
    """The op's static configuration."""

    causal: bool
    scale: float
    xla_only: bool
    dtypes: tuple  # q's, k's and v's, for their gradients


def dot_product_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                          recipe=None, implementation: str | None = None) -> jax.Array:  # fmt: skip
    """Scaled dot-product attention with QKᵀ and PV in FP8 (E4M3), per-block current scales.

    Args:
      q: (batch, q_seq, heads, head_dim) queries, floating point.
      k, v: (batch, kv_seq, kv_heads, head_dim); ``kv_heads`` divides ``heads``
        (query head ``h`` reads kv head ``h // (heads // kv_heads)``, as
        ``jax.nn.dot_product_attention``'s GQA does).
      causal: each query attends to keys at or before its position (then
        ``q_seq == kv_seq``).
      scale: the logits' scale; None: ``1 / sqrt(head_dim)``.
      recipe: reserved for other scaling schemes; None: E4M3 with one current
        scale per 128 rows and head of Q, K and V.
      implementation: None (the Mosaic GPU kernel where it runs, else its XLA
        twin) or ``"xla"`` (the twin always).

    Returns:
      The (batch, q_seq, heads, head_dim) output in ``q``'s dtype (BF16 in
      training; the kernel writes BF16).

    Raises:
      ValueError: head_dim other than 64 or 128, sequence lengths not a
        multiple of 128, mismatched shapes, or causal with ``q_seq != kv_seq``.
      TypeError: a recipe other than None, or non-floating inputs.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> q = k = v = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
      >>> fp8jax.dot_product_attention(q, k, v, causal=True).shape
      (1, 128, 2, 64)
    """
    _validate(q, k, v, causal, recipe, implementation)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    config = _Config(causal=bool(causal), scale=scale, xla_only=implementation == "xla",
                     dtypes=(q.dtype, k.dtype, v.dtype))  # fmt: skip
    return _attention(q, k, v, config).astype(q.dtype)


def _validate(q, k, v, causal, recipe, implementation) -> None:
    if recipe is not None:
        raise TypeError(
            "dot_product_attention: recipe must be None (E4M3, one current scale per 128 rows "
            f"and head), got {recipe!r}."
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dot_product_attention: implementation must be one of {IMPLEMENTATIONS}, "
            f"got {implementation!r}."
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(
                f"dot_product_attention: {name} must be 4-D (batch, seq, heads, head_dim), "
                f"got shape {jnp.shape(x)}."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"dot_product_attention: {name} must be floating point, got {x.dtype}.")
    batch, tq, heads, d = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != d:
        raise ValueError(
            "dot_product_attention: k and v must both be (batch, kv_seq, kv_heads, head_dim) "
            f"with q's batch {batch} and head_dim {d}, got k {k.shape} and v {v.shape}."
        )
    if d not in kernel.HEAD_DIMS:
        raise ValueError(
            f"dot_product_attention: head_dim must be one of {kernel.HEAD_DIMS} (the FP8 "
            f"kernels' tiles), got {d}; use jax.nn.dot_product_attention for it."
        )
    if heads % k.shape[2]:
        raise ValueError(
            f"dot_product_attention: kv_heads ({k.shape[2]}) must divide heads ({heads})."
        )
    for name, length in (("q_seq", tq), ("kv_seq", k.shape[1])):
        if length % kernel.BLOCK:
            raise ValueError(
                f"dot_product_attention: {name} must be a multiple of {kernel.BLOCK} (one scale "
                f"per {kernel.BLOCK} rows), got {length}; pad the sequence."
            )
    if causal and tq != k.shape[1]:
        raise ValueError(
            f"dot_product_attention: causal needs q_seq == kv_seq, got {tq} and {k.shape[1]}."
        )


def quantize_blocks(x):
    """``x`` (B, T, H, D) in E4M3 and its f32 scales (B, H, T // 128): one per 128 rows and head.

    ``x ≈ x8 * scale``, ``scale`` the smallest power of two with ``amax / scale
    <= 448``: dividing by it is exact, so the one rounding is the cast's,
    round to nearest even. A scale that is not a power of two leaves many
    BF16 inputs within an f32 unit of an E4M3 tie, where the order of the
    division's arithmetic decides the rounding (docs: the op's module).
    """
    batch, t, heads, d = x.shape
    blocks = x.astype(jnp.float32).reshape(batch, t // kernel.BLOCK, kernel.BLOCK, heads, d)
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4), keepdims=True)
    # amax = m 2**e with m in [0.5, 1), and 448 = 0.875 * 2**9: no rounding anywhere.
    mantissa, exponent = jnp.frexp(amax)
    exponent = jnp.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    scale = jnp.ldexp(jnp.ones_like(amax), exponent)
    x8 = (blocks / scale).astype(kernel.FP8).reshape(x.shape)
    return x8, jnp.transpose(scale[:, :, 0, :, 0], (0, 2, 1))


def _expand(scale, times: int):
    """(B, H, blocks) -> (B, H, blocks * times): each block's scale repeated over its rows."""
    return jnp.repeat(scale, times, axis=-1)


def kernel_operands(q, k, v, scale: float):
    """The forward kernel's operands from Q, K, V: quantized, V transposed, scales expanded.

    Returns the operands of :func:`fp8jax.kernels.attention.forward` and the
    ``(x8, scale)`` pairs of Q, K and V for the backward.
    """
    (q8, qs), (k8, ks), (v8, vs) = quantize_blocks(q), quantize_blocks(k), quantize_blocks(v)
    vt8 = jnp.transpose(v8, (0, 2, 3, 1))  # keys minor: PV's FP8 wgmma takes V K-major
    d = q.shape[-1]
    operands = (
        q8, k8, vt8,
        _expand(qs * (scale * kernel.LOG2E), kernel.BLOCK),
        _expand(ks, kernel.BLOCK),
        jnp.broadcast_to((vs / kernel.P_SCALE)[..., None], (*vs.shape, d)),
    )  # fmt: skip
    return operands, ((q8, qs), (k8, ks), (v8, vs))


def _forward(q, k, v, config: _Config):
    """The quantized operands and the kernel's (or twin's) output and base-2 logsumexp."""
    operands, quantized = kernel_operands(q, k, v, config.scale)
    if config.xla_only:
        out, lse2 = kernel.xla_forward(*operands, causal=config.causal)
    else:
        out, lse2 = kernel.forward(*operands, causal=config.causal)
    return out, lse2, quantized


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, config: _Config):
    return _forward(q, k, v, config)[0]


def _attention_fwd(q, k, v, config: _Config):
    out, lse2, quantized = _forward(q, k, v, config)
    return out, (quantized, out, lse2)


def _grouped(x, kv_heads: int):
    """(B, T, H, D) -> (B, Hkv, G, T, D): each kv head's group of query heads."""
    batch, t, heads, d = x.shape
    return jnp.transpose(x.reshape(batch, t, kv_heads, heads // kv_heads, d), (0, 2, 3, 1, 4))


def _dequantized(x8, scale):
    """(B, T, H, D) E4M3 with (B, H, T // 128) scales -> f32 values."""
    rows = jnp.transpose(_expand(scale, kernel.BLOCK), (0, 2, 1))[..., None]
    return x8.astype(jnp.float32) * rows


def _attention_bwd(config: _Config, residuals, g):
    ((q8, qs), (k8, ks), (v8, vs)), out, lse2 = residuals
    dtypes = config.dtypes
    batch, tq, heads, d = q8.shape
    kv_heads, tk = k8.shape[2], k8.shape[1]
    blocks, bf16 = tk // kernel.BLOCK, jnp.bfloat16

    def blocked(x):  # (B, Tk, Hkv, D) -> (blocks, B, Hkv, BLOCK, D)
        return jnp.transpose(x.reshape(batch, blocks, kernel.BLOCK, kv_heads, d), (1, 0, 3, 2, 4))

    q = _grouped(_dequantized(q8, qs), kv_heads).astype(bf16)
    # The forward's own scores: the same FP8 product and scales, in base-2 units.
    q8_grouped = _grouped(q8, kv_heads)
    q_rows = _grouped(jnp.transpose(_expand(qs, kernel.BLOCK), (0, 2, 1))[..., None], kv_heads)
    q_rows = q_rows * (config.scale * kernel.LOG2E)
    k_cols = jnp.moveaxis(ks, 2, 0)[..., None, None, None]  # (blocks, B, Hkv, 1, 1, 1)
    do = _grouped(g.astype(jnp.float32), kv_heads)
    delta = jnp.sum(do * _grouped(out.astype(jnp.float32), kv_heads), axis=-1, keepdims=True)
    do = do.astype(bf16)
    lse = lse2.reshape(batch, kv_heads, heads // kv_heads, tq, 1)
    k8_blocks = blocked(k8)
    k_blocks = blocked(_dequantized(k8, ks)).astype(bf16)
    v_blocks = blocked(_dequantized(v8, vs)).astype(bf16)
    rows = lax.broadcasted_iota(jnp.int32, (tq, kernel.BLOCK), 0)
    cols = lax.broadcasted_iota(jnp.int32, (tq, kernel.BLOCK), 1)

    def dot(spec, a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    def step(dq, xs):
        j, kb8, kscale, kb, vb = xs
        s = dot("bhgqd,bhkd->bhgqk", q8_grouped, kb8) * q_rows * kscale
        p = jnp.exp2(s - lse)
        if config.causal:
            p = jnp.where(rows >= cols + j * kernel.BLOCK, p, 0.0)
        dv = dot("bhgqk,bhgqd->bhkd", p.astype(bf16), do)
        dp = dot("bhgqd,bhkd->bhgqk", do, vb)
        ds = (p * (dp - delta) * config.scale).astype(bf16)
        dq = dq + dot("bhgqk,bhkd->bhgqd", ds, kb)
        dk = dot("bhgqk,bhgqd->bhkd", ds, q)
        return dq, (dk, dv)

    dq0 = jnp.zeros((batch, kv_heads, heads // kv_heads, tq, d), jnp.float32)
    xs = (jnp.arange(blocks, dtype=jnp.int32), k8_blocks, k_cols, k_blocks, v_blocks)
    dq, (dk, dv) = lax.scan(step, dq0, xs)
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4)).reshape(batch, tq, heads, d)

    def unblocked(x):  # (blocks, B, Hkv, BLOCK, D) -> (B, Tk, Hkv, D)
        return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(batch, tk, kv_heads, d)

    return dq.astype(dtypes[0]), unblocked(dk).astype(dtypes[1]), unblocked(dv).astype(dtypes[2])


_attention.defvjp(_attention_fwd, _attention_bwd)
