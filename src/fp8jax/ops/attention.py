"""FP8 scaled dot-product attention: the forward on E4M3 tensor cores, a 16-bit backward.

``fp8jax.dot_product_attention`` takes ``jax.nn.dot_product_attention``'s
layout, (batch, seq, heads, head_dim), with grouped keys and values (GQA).
Q, K and V are quantized to E4M3 with one current power-of-two scale per
128 rows and head (:data:`fp8jax.kernels.attention.BLOCK`), then
:func:`fp8jax.kernels.attention.forward` runs the flash-attention forward
(the Mosaic GPU kernel on a Hopper GPU, its exact XLA twin elsewhere) and
saves the base-2 logsumexp.

The backward (:mod:`fp8jax.kernels.attention_backward`: two Mosaic GPU
kernels, or their XLA twin) recomputes P block by block from the saved FP8
Q and K and the logsumexp (FlashAttention's), never forming a Tq x Tk
array, and takes dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K and dK = dSᵀ Q with BF16
operands and f32 sums. The quantization is straight-through: the gradients
are those of attention on the dequantized Q, K and V. dS keeps 16 bits
because most of FP8 attention's backward error lives there (SageAttention's
training papers); an FP8 dV is future work.

With ``hadamard=True`` each head's queries and keys are first rotated by one
fixed randomized Hadamard matrix (:func:`hadamard_rotation`), which leaves
the logits as they are (it is orthogonal) and spreads outlier channels over
all of head_dim, so that a block's scale no longer leaves the other channels
few E4M3 steps (FlashAttention-3's incoherent processing). The gradients flow
back through the rotation by autodiff.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.kernels import attention as kernel
from fp8jax.kernels import attention_backward as backward_kernels
from fp8jax.ops.residuals import saved_as_bits

IMPLEMENTATIONS = (None, "xla")


@dataclasses.dataclass(frozen=True)
class _Config:
    """The op's static configuration."""

    causal: bool
    scale: float
    xla_only: bool
    dtypes: tuple  # q's, k's and v's, for their gradients
    forward: kernel.ForwardConfig = kernel.DEFAULT_CONFIG
    backward: backward_kernels.BackwardConfig = backward_kernels.DEFAULT_CONFIG


def dot_product_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                          recipe=None, implementation: str | None = None,
                          hadamard: bool = False,
                          forward_config: kernel.ForwardConfig | None = None,
                          backward_config: backward_kernels.BackwardConfig | None = None,
                          ) -> jax.Array:  # fmt: skip
    """Scaled dot-product attention with QKᵀ and PV in FP8 (E4M3), per-block current scales.

    Args:
      q: (batch, q_seq, heads, head_dim) queries, floating point.
      k, v: (batch, kv_seq, kv_heads, head_dim); ``kv_heads`` divides ``heads``
        (query head ``h`` reads kv head ``h // (heads // kv_heads)``, as
        ``jax.nn.dot_product_attention``'s GQA does).
      causal: each query attends to keys at or before its position (then
        ``q_seq == kv_seq``).
      scale: the logits' scale, a finite nonzero Python number (static; a
        negative one negates Q exactly); None: ``1 / sqrt(head_dim)``.
      recipe: reserved for other scaling schemes; None: E4M3 with one current
        scale per 128 rows and head of Q, K and V.
      implementation: None (the Mosaic GPU kernel where it runs, else its XLA
        twin) or ``"xla"`` (the twin always).
      hadamard: rotate each head's queries and keys by a fixed randomized
        Hadamard matrix before quantizing (:func:`hadamard_rotation`): the
        same logits, less FP8 error where a few channels carry outliers; two
        small extra BF16 GEMMs per call and per gradient.
      forward_config: how the forward kernel is built
        (:class:`fp8jax.kernels.attention.ForwardConfig`, for A/B timing of
        its pipelines); None: the default build. The XLA twin ignores it.
      backward_config: how the backward kernels are built
        (:class:`fp8jax.kernels.attention_backward.BackwardConfig`), as
        ``forward_config``.

    Returns:
      The (batch, q_seq, heads, head_dim) output in ``q``'s dtype (BF16 in
      training; the kernel writes BF16). Within the FP8 error budgets for
      logits (``scale * q·k``) up to about 10**6 in magnitude: each score's
      exponent is one f32 FMA against the row max, whose f32 unit past about
      10**7 outgrows P's 2**8 (then the values are not finite).

    Raises:
      ValueError: head_dim other than 64 or 128, sequence lengths not a
        multiple of 128, mismatched shapes, causal with ``q_seq != kv_seq``, or a
        non-finite or zero scale.
      TypeError: a recipe other than None, non-floating inputs, or a scale that is traced
        or not a number.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> q = k = v = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
      >>> fp8jax.dot_product_attention(q, k, v, causal=True).shape
      (1, 128, 2, 64)
    """
    _validate(q, k, v, causal, recipe, implementation)
    if not isinstance(hadamard, bool):
        raise TypeError(f"dot_product_attention: hadamard must be a bool, got {hadamard!r}.")
    if not isinstance(causal, bool | np.bool_):  # "False", a str, would mask
        raise TypeError(f"dot_product_attention: causal must be a bool, got {causal!r}.")
    forward_config = _build("forward_config", forward_config, kernel.DEFAULT_CONFIG)
    backward_config = _build("backward_config", backward_config, backward_kernels.DEFAULT_CONFIG)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _static_scale(scale)
    if scale < 0:
        # The kernels fold the scale into exp2's argument after the row max of the
        # raw scores, which is the scaled scores' max only for a positive factor:
        # (-q)·k at |scale| is the same logits (negation is exact).
        q, scale = -q, -scale
    if hadamard:
        q, k = _rotated(q, k)
    config = _Config(causal=bool(causal), scale=scale, xla_only=implementation == "xla",
                     dtypes=(q.dtype, k.dtype, v.dtype), forward=forward_config,
                     backward=backward_config)  # fmt: skip
    return _attention(q, k, v, config).astype(q.dtype)


def _build(name: str, config, default):
    """A kernel build argument: ``default`` for None, else an instance of ``default``'s class."""
    if config is None:
        return default
    cls = type(default)
    if not isinstance(config, cls):
        raise TypeError(
            f"dot_product_attention: {name} must be None or a "
            f"{cls.__module__}.{cls.__qualname__}, got {config!r}."
        )
    return config


def _static_scale(scale) -> float:
    """``scale`` as a Python float: it is part of the kernels' static configuration."""
    if isinstance(scale, jax.core.Tracer):
        raise TypeError(
            "dot_product_attention: scale must be None or a Python number (static: the "
            f"kernels are built for it), got a traced array of shape {scale.shape}; pass it "
            "outside jit's arguments (functools.partial, or static_argnames)."
        )
    try:
        if isinstance(scale, str | bytes | bool | np.bool_):
            raise TypeError  # float("0.1") and float(True) would be taken
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(
            f"dot_product_attention: scale must be None or a Python number, got {scale!r}."
        ) from None
    if not math.isfinite(value) or value == 0:
        raise ValueError(
            "dot_product_attention: scale must be None or a finite, nonzero number (the "
            f"kernels mask scores before scaling them, and -inf * 0 is NaN), got {value}."
        )
    return value


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


def hadamard_rotation(d: int, seed: int = 0) -> tuple[np.ndarray, float, float]:
    """``(signed, q_factor, k_factor)``: Q -> Q @ signed * q_factor, K -> K @ signed * k_factor.

    ``signed`` is Sylvester's ±1 Hadamard matrix of order ``d`` (a power of
    two) with its rows' signs drawn once from ``seed``: ``signed @ signedᵀ =
    d I``. The factors are powers of two whose product is ``1 / d``, so the
    logits ``(Q R)(K R')ᵀ = Q Kᵀ`` and every entry and factor is exact in BF16.
    """
    hadamard = np.ones((1, 1))
    while hadamard.shape[0] < d:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    if hadamard.shape[0] != d:
        raise ValueError(f"hadamard_rotation: d must be a power of two, got {d}.")
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), d)
    log2 = int(math.log2(d))
    return signs[:, None] * hadamard, 2.0 ** -((log2 + 1) // 2), 2.0 ** -(log2 // 2)


def _rotated(q, k):
    """Q and K through :func:`hadamard_rotation`, f32 sums, in their own dtypes."""
    signed, q_factor, k_factor = hadamard_rotation(q.shape[-1])

    def rotate(x, factor):
        y = jnp.einsum("bthd,de->bthe", x, jnp.asarray(signed, x.dtype),
                       preferred_element_type=jnp.float32)  # fmt: skip
        return (y * factor).astype(x.dtype)

    return rotate(q, q_factor), rotate(k, k_factor)


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
        out, lse2 = kernel.forward(*operands, causal=config.causal, config=config.forward)
    return out, lse2, quantized


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, config: _Config):
    return _forward(q, k, v, config)[0]


def _attention_fwd(q, k, v, config: _Config):
    out, lse2, quantized = _forward(q, k, v, config)
    return out, (quantized, out, lse2)


def _dequantized(x8, scale):
    """(B, T, H, D) E4M3 with (B, H, T // 128) scales -> BF16 values (exact products in f32)."""
    rows = jnp.transpose(_expand(scale, kernel.BLOCK), (0, 2, 1))[..., None]
    return (x8.astype(jnp.float32) * rows).astype(jnp.bfloat16)


def backward_operands(quantized, out, lse2, g, scale: float):
    """The backward kernels' operands from the forward's residuals and the output gradient.

    ``quantized``: :func:`kernel_operands`' ``(x8, scale)`` pairs of Q, K and V;
    ``out``, ``lse2``: the forward kernel's results; ``g``: the output's gradient.
    """
    ((q8, qs), (k8, ks), (v8, vs)) = quantized
    delta = jnp.sum(g.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return (
        q8, k8,
        _expand(qs * (scale * kernel.LOG2E), kernel.BLOCK),
        _expand(ks, kernel.BLOCK),
        _dequantized(q8, qs), _dequantized(k8, ks), _dequantized(v8, vs),
        g.astype(jnp.bfloat16), lse2, jnp.transpose(delta, (0, 2, 1)),
    )  # fmt: skip


def _attention_bwd(config: _Config, residuals, g):
    quantized, out, lse2 = residuals
    operands = backward_operands(quantized, out, lse2, g, config.scale)
    if config.xla_only:
        grads = backward_kernels.xla_backward(*operands, causal=config.causal, scale=config.scale)
    else:
        grads = backward_kernels.backward(*operands, causal=config.causal, scale=config.scale,
                                          config=config.backward)  # fmt: skip
    return tuple(x.astype(dtype) for x, dtype in zip(grads, config.dtypes, strict=True))


# Q, K and V travel to the backward as E4M3 bits: a checkpoint policy that saves
# them would round E4M3 at IEEE bounds (docs/design.md#activation-checkpointing).
_attention.defvjp(*saved_as_bits(_attention_fwd, _attention_bwd))
