"""Any dot_general under RowwiseScaling, BlockScaling or MXFP8Scaling: one custom_vjp for all three.

:func:`dot_general` brings every product to a batch of ``a (B, M, K) .
b (B, N, K)^T``: batch axes first, the free axes merged into rows, the
contracted axes merged into the minor axis, which is where cuBLASLt's FP8
GEMM and the block kernel read K. Each operand is brought there in high
precision, where XLA fuses the transpose into the pass that quantizes it;
JAX differentiates the reshapes and transposes around the custom_vjp.
Under BlockScaling and MXFP8Scaling, M, N and K are padded with zeros to
multiples of 128 (zeros add nothing to a sum, and their scale is 1; the
block kernel's tiles and cuDNN's MX scale layout need whole 128s).

:func:`fine_dot` is the one custom_vjp. Its forward quantizes ``a`` (role
``"x"``) and ``b`` (``"kernel"``) with
:func:`fp8jax.ops.quantizing.quantize_operand` at the granularity the
recipe declares for each role, and multiplies them with the recipe's
scaled GEMM (:data:`_SCHEMES`); its backward quantizes the output gradient
(``"grad"``) along N for the input gradient ``g . b`` and along M (tokens)
for the weight gradient ``g^T . a``, against the copies of ``a`` (along M)
and ``b`` (along N) the forward saved in FP8:

* RowwiseScaling: a scale per row of each operand factors out of the sum
  over K, so the GEMM takes the FP8 data as they are (a real FP8
  tensor-core GEMM; docs/design.md#why-fp8-operands-go-straight-into-dot_general)
  and the outer product of the two ``scale_inv`` vectors multiplies its
  output, an epilogue XLA fuses into the consumer. Each operand's copy
  along the other axis (per column) comes from the same cast pass.
* BlockScaling: activations and gradients per 1x128 tile along K, the
  weight per 128x128 block, whose scale serves the weight and its
  transpose alike; :func:`~fp8jax.kernels.block_gemm.block_scaled_matmul`
  applies the scales every 128 of K.
* MXFP8Scaling: every operand in OCP MX blocks of 32 along K, power-of-two
  scales (E8M0 on the GPU), quantized again along the other axis for the
  backward. On NVIDIA GPUs the GEMM is ``jax.nn.scaled_matmul``, which XLA
  compiles to cuDNN's block-scaled FP8 GEMM for Blackwell; for Hopper XLA
  would dequantize both operands to BF16, so :func:`check_devices` refuses
  a GPU below compute capability 10. Elsewhere (the CPU) XLA computes the
  same sums, one FP8 dot per 32-wide slice of K; nothing is dequantized
  before a GEMM (docs/design.md#mxfp8-for-blackwell).

The fused ops (``layernorm_dense``, ``layernorm_mlp``) take these recipes
as a norm followed by these GEMMs (:func:`layernorm_dense`): not fused into
one custom_vjp as the per-tensor recipes' ops are
(docs/design.md#fine-grained-scaling).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.activations import gated
from fp8jax.kernels.block_gemm import BLOCK, block_scaled_matmul, xla_block_matmul
from fp8jax.ops import _partitioning, dimensions, quantizing
from fp8jax.ops.gemm import gemm_dtype
from fp8jax.ops.norm import NormConfig, norm
from fp8jax.ops.residuals import saved_as_bits
from fp8jax.quantize import Fp8Array
from fp8jax.recipes import PER_TENSOR, BlockScaling, MXFP8Scaling, RowwiseScaling

# The compute capability whose GPUs multiply MX blocks in FP8 (Blackwell).
BLACKWELL = 10


def check_devices(devices=None, advice: str = "Use fp8jax.BlockScaling() on Hopper.") -> None:
    """Raises ValueError for a GPU among ``devices`` (this process's) older than Blackwell.

    MXFP8Scaling's GEMMs need one. ``advice``: the message's last sentence,
    what to use instead.
    """
    for device in jax.local_devices() if devices is None else devices:
        capability = getattr(device, "compute_capability", None)
        if device.platform != "gpu" or capability is None:
            continue
        if int(str(capability).split(".")[0]) < BLACKWELL:
            raise ValueError(
                f"MXFP8Scaling needs a GPU of compute capability {BLACKWELL}.0 or later "
                f"(Blackwell) for its block-scaled FP8 GEMMs; {device.device_kind} has "
                f"{capability}, where XLA would dequantize the operands and multiply in BF16. "
                + advice
            )


@dataclasses.dataclass(frozen=True)
class FineDotConfig:
    """Everything static about one fine-grained GEMM: :func:`fine_dot`'s only static argument."""

    recipe: RowwiseScaling | BlockScaling | MXFP8Scaling
    out_dtype: np.dtype
    a_dtype: np.dtype
    b_dtype: np.dtype
    # What each operand's cotangent must match: shard_map axes, Explicit sharding.
    inputs: tuple[_partitioning.InputType, ...] = ()


def is_fine(recipe) -> bool:
    """Whether ``recipe`` scales finer than per tensor (its GEMMs run here)."""
    return recipe.granularity("x") != PER_TENSOR


def dot_general(lhs, rhs, dims, recipe, out_dtype) -> jax.Array:
    """FP8 ``lax.dot_general(lhs, rhs, dims)`` under a fine-grained ``recipe``, in ``out_dtype``.

    ``dims`` are normalized (:func:`fp8jax.ops.dimensions.normalize`); the
    result is laid out as ``lax.dot_general`` lays it out.

    Over Explicit mesh axes the merges, transposes and GEMMs below have no
    sharding their types can state (the weight gradient contracts sharded
    tokens; a block view splits a sharded axis), so they run with the axes
    Auto, partitioned by XLA as under ``jit``, and the result takes the
    sharding the per-tensor recipes give it
    (:func:`fp8jax.ops._partitioning.dot_out_sharding`).
    """
    out_sharding = _partitioning.dot_out_sharding(lhs, rhs, dims)
    product = functools.partial(_dot_general, dims=dims, recipe=recipe, out_dtype=out_dtype)
    if out_sharding is None:
        return product(lhs, rhs)
    return jax.sharding.auto_axes(product, out_sharding=out_sharding)(lhs, rhs)


def _dot_general(lhs, rhs, *, dims, recipe, out_dtype) -> jax.Array:
    (lc, rc), (lb, rb) = dims
    lf = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
    rf = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
    batch = [lhs.shape[i] for i in lb]
    free_l, free_r = [lhs.shape[i] for i in lf], [rhs.shape[i] for i in rf]
    out_shape = (*batch, *free_l, *free_r)
    b_, m, n = math.prod(batch), math.prod(free_l), math.prod(free_r)
    k = math.prod(lhs.shape[i] for i in lc)
    if 0 in (b_, m, n, k):  # an empty operand: no GEMM, a zero (or empty) product
        return jnp.zeros(out_shape, out_dtype)
    a = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(b_, m, k)
    b = jnp.transpose(rhs, (*rb, *rf, *rc)).reshape(b_, n, k)
    return _product(a, b, recipe, jnp.dtype(out_dtype)).reshape(out_shape)


def _product(a, b, recipe, out_dtype) -> jax.Array:
    scheme = _scheme(recipe)
    if not scheme.padded:
        config = FineDotConfig(recipe, out_dtype, jnp.dtype(a.dtype), jnp.dtype(b.dtype),
                               _partitioning.input_types(a, b))  # fmt: skip
        return fine_dot(a, b, config)
    _, m, k = a.shape
    n = b.shape[1]
    pad = lambda size: -size % BLOCK  # noqa: E731
    a = jnp.pad(a, ((0, 0), (0, pad(m)), (0, pad(k))))
    b = jnp.pad(b, ((0, 0), (0, pad(n)), (0, pad(k))))
    config = FineDotConfig(recipe, out_dtype, jnp.dtype(a.dtype), jnp.dtype(b.dtype),
                           _partitioning.input_types(a, b))  # fmt: skip
    return fine_dot(a, b, config)[:, :m, :n]


def dot(lhs, rhs, bias, dims, recipe, out_dtype, split=None):
    """:func:`dot_general`, plus a bias over the output's trailing axes, cut by ``split``.

    ``bias`` (checked by the caller) spans the rhs's free axes; its gradient
    is JAX's sum of the output gradient. ``split``: a
    :class:`~fp8jax.ops.split.Split` of the output, or None.
    """
    y = dot_general(lhs, rhs, dims, recipe, out_dtype)
    if bias is not None:
        y = y + _partitioning.broadcastable(bias.astype(y.dtype), y.ndim)
    return y if split is None else split.apply(y)


# The fused ops, composed. The norm (fp8jax.ops.norm.norm) and the activation
# compute in f32 and hand on x.dtype, and their backwards keep only x.dtype
# tensors: the norm's input and row statistics, the activation's input.
# Written as plain f32 autodiff, the TE-config layer's MLP kept its f32
# pre-activation for the backward and wrote its gradient in f32, and the f32
# normalized input made the input-gradient GEMM write f32
# (docs/design.md#the-fine-grained-fused-ops).


def layernorm_dense(x, gamma, beta, kernel, bias, norm_config: NormConfig, recipe, *, split=None,
                    return_normalized=False, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_dense` (checked arguments) as a norm, then a fine-grained dense."""
    normed = norm(x, gamma, beta, norm_config)
    dims = dimensions.contract_last(x.ndim)
    y = dot(normed, kernel, bias, dims, recipe, x.dtype, split)
    if return_normalized:
        return y, normed
    return (y, x) if return_residual else y


def layernorm_mlp(x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, norm_config: NormConfig,
                  recipe, activations, *, return_residual=False):  # fmt: skip
    """:func:`fp8jax.layernorm_mlp` (checked arguments): norm, dense, activation, dense."""
    normed = norm(x, gamma, beta, norm_config)
    dims = dimensions.contract_last(x.ndim)
    pre = dot(normed, kernel_1, bias_1, dims, recipe, x.dtype)
    # Recomputed in the backward from pre, so that only pre is kept.
    h = jax.checkpoint(gated, static_argnums=(1, 2, 3))(pre, tuple(activations), -2, pre.dtype)
    y = dot(h, kernel_2, bias_2, dims, recipe, x.dtype)
    return (y, x) if return_residual else y


# The scaled GEMMs: ``a (B, M, K) . b (B, N, K)^T`` of two Fp8Arrays, each
# rescaled by the scales its granularity gives, in ``out_dtype``.


def _epilogue_gemm(a: Fp8Array, b: Fp8Array, out_dtype, precision) -> jax.Array:
    """Per-row scales (B, *, 1): the FP8 GEMM, then the outer product of the scales.

    A batch of one runs as a plain matrix product.
    """
    acc = gemm_dtype(out_dtype)
    if a.data.shape[0] == 1:
        y = lax.dot_general(a.data[0], b.data[0], (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=acc)[None]  # fmt: skip
    else:
        y = lax.dot_general(a.data, b.data, (((2,), (2,)), ((0,), (0,))), precision=precision,
                            preferred_element_type=acc)  # fmt: skip
    outer = a.scale_inv * jnp.swapaxes(b.scale_inv, 1, 2)
    return (y.astype(jnp.float32) * outer).astype(out_dtype)


def _block_gemm(a: Fp8Array, b: Fp8Array, out_dtype, precision) -> jax.Array:
    """``a`` per 1x128 tile along K; ``b`` per tile, or per 128x128 block (its scales say which).

    The kernel promotes each 128-long slice of K to f32: ``precision`` has no say.
    """
    del precision
    b_blocks = b.scale_inv.shape[1] * BLOCK == b.data.shape[1]  # (B, N / 128, K / 128)
    return block_scaled_matmul(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype,
                               b_blocks=b_blocks)  # fmt: skip


def _mx_gemm(a: Fp8Array, b: Fp8Array, out_dtype, precision) -> jax.Array:
    """Both in MX blocks of 32 along K: cuDNN's block-scaled GEMM on NVIDIA GPUs, XLA elsewhere.

    The block-scaled GEMMs accumulate in f32: ``precision`` has no say.
    """
    del precision
    # Refused here, before XLA would compile a Hopper GPU's GEMM in BF16.
    check_devices()
    block = MXFP8Scaling.BLOCK

    def gpu(qa, qb, sa, sb):
        e8m0 = jnp.float8_e8m0fnu  # exact: the scales are powers of two in its range
        return jax.nn.scaled_matmul(qa, qb, sa.astype(e8m0), sb.astype(e8m0),
                                    preferred_element_type=out_dtype)  # fmt: skip

    def xla(qa, qb, sa, sb):
        return xla_block_matmul(qa, qb, sa, sb, out_dtype=out_dtype, block=block)

    return lax.platform_dependent(a.data, b.data, a.scale_inv, b.scale_inv, cuda=gpu, default=xla)


@dataclasses.dataclass(frozen=True)
class _Scheme:
    """How one fine-grained recipe's GEMMs run; the quantizers follow its granularity per role."""

    gemm: Callable[[Fp8Array, Fp8Array, np.dtype, lax.Precision | None], jax.Array]
    # M, N and K padded to multiples of 128 (the block kernel's tiles, cuDNN's MX scale layout).
    padded: bool
    # The cast pass that writes an operand also writes its copy along the
    # other axis (the Pallas cast kernels where they run); otherwise that copy
    # is quantized again, after the forward GEMM.
    one_pass: bool
    # The operands, and the output gradient, reach HBM in their own dtype
    # before their two casts: XLA kept the producer's f32 value for both
    # casts otherwise (docs/design.md#the-fine-grained-fused-ops).
    barrier: bool


# Keyed by the weight's granularity (recipe.granularity("kernel").kind).
_SCHEMES = {
    "row": _Scheme(_epilogue_gemm, padded=False, one_pass=True, barrier=True),  # RowwiseScaling
    "block": _Scheme(_block_gemm, padded=True, one_pass=True, barrier=False),  # BlockScaling
    "tile": _Scheme(_mx_gemm, padded=True, one_pass=False, barrier=False),  # MXFP8Scaling
}


def _scheme(recipe) -> _Scheme:
    kind = recipe.granularity("kernel").kind
    if kind not in _SCHEMES:
        raise TypeError(
            f"recipe must be RowwiseScaling, BlockScaling or MXFP8Scaling here, got {recipe!r}."
        )
    return _SCHEMES[kind]


def _quantize(x, fmt, recipe, role: str, both_ways: bool):
    """``x`` (B, R, K) at ``role``'s granularity; ``both_ways``: with its copy along R."""
    return quantizing.quantize_operand(x, fmt, None, recipe, role=role, transpose=both_ways,
                                       rows_are_tokens=role != "kernel")  # fmt: skip


def _precision(recipe, gemm: str) -> lax.Precision | None:
    """The recipe's accumulation for ``gemm`` ("forward", "dgrad", "wgrad"), where it has one."""
    return getattr(recipe, f"{gemm}_precision", None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fine_dot(a, b, config: FineDotConfig):
    """``a (B, M, K) . b (B, N, K)^T`` -> (B, M, N), fine-grained scales, FP8 both ways."""
    return _fine_dot_fwd(a, b, config)[0]


def _fine_dot_fwd(a, b, config: FineDotConfig):
    recipe, fmt = config.recipe, config.recipe.formats.forward
    scheme = _scheme(recipe)
    if scheme.barrier:
        a, b = lax.optimization_barrier((a, b))
    # A weight block's scales serve its transpose (the dgrad's): no second copy.
    weight_blocks = recipe.granularity("kernel").kind == "block"
    qa = _quantize(a, fmt, recipe, "x", scheme.one_pass)
    qb = _quantize(b, fmt, recipe, "kernel", scheme.one_pass and not weight_blocks)
    y = scheme.gemm(qa.fp8, qb.fp8, config.out_dtype, _precision(recipe, "forward"))
    # Saved for the backward: a along M (the wgrad contracts it), b along N (the dgrad).
    if scheme.one_pass:
        a_t, b_t = qa.transposed, qb.fp8 if weight_blocks else qb.transposed
    else:
        a_t = _quantize(jnp.swapaxes(a, 1, 2), fmt, recipe, "x", False).fp8
        b_t = _quantize(jnp.swapaxes(b, 1, 2), fmt, recipe, "kernel", False).fp8
    return y, (a_t, b_t)


def _fine_dot_bwd(config: FineDotConfig, residuals, g):
    a_t, b_t = residuals
    recipe, fmt = config.recipe, config.recipe.formats.backward
    scheme = _scheme(recipe)
    if scheme.barrier:
        g = lax.optimization_barrier(g)
    # g along N for the dgrad, and along M (tokens) for the wgrad.
    qg = _quantize(g, fmt, recipe, "grad", scheme.one_pass)
    if scheme.one_pass:
        g_t = qg.transposed
    else:
        g_t = _quantize(jnp.swapaxes(g, 1, 2), fmt, recipe, "grad", False).fp8
    if recipe.granularity("kernel").kind == "block":  # (B, K, N), scales (B, K/128, N/128)
        b_t = Fp8Array(jnp.swapaxes(b_t.data, 1, 2), jnp.swapaxes(b_t.scale_inv, 1, 2), b_t.format)
    d_a = scheme.gemm(qg.fp8, b_t, config.a_dtype, _precision(recipe, "dgrad"))
    d_b = scheme.gemm(g_t, a_t, config.b_dtype, _precision(recipe, "wgrad"))
    return _partitioning.match_cotangents((d_a, d_b), None, config.inputs)[:2]


fine_dot.defvjp(*saved_as_bits(_fine_dot_fwd, _fine_dot_bwd))
