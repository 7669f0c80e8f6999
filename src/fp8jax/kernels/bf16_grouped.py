"""BF16 grouped GEMMs for the BF16 MoE baseline: JAX's Mosaic GPU kernels, or ``lax.ragged_dot``.

XLA's GPU backend lowers ``lax.ragged_dot`` to one dense GEMM over all
groups (:mod:`fp8jax.kernels.grouped_gemm`), ``g`` times the useful FLOPs,
so a BF16 MoE baseline on it would make FP8's speedup look larger than it is
(docs/design.md#grouped-expert-gemms). On NVIDIA GPUs :func:`ragged_dot`
runs JAX's own Mosaic GPU kernels instead: ``ragged_dot_mgpu`` for the
forward and the input gradient (the weights read transposed) and
``transposed_ragged_dot_mgpu`` for the weights' gradient, under one
custom_vjp. Each product has an XLA twin (``lax.ragged_dot`` or
``lax.ragged_dot_general``) that runs elsewhere.

Where the kernels run (:func:`placement`):

* the process has a GPU backend: ``transposed_ragged_dot_mgpu`` reads the
  SM count of ``jax.devices()[0]`` when traced (jax 0.10.2), which a CPU
  device lacks, so a CPU host (the tests, deviceless compiles) takes
  ``lax.ragged_dot``;
* :func:`fp8jax.kernels.dispatch.decide` says so with whole arrays (no
  mesh axis of size > 1 but manual ones: the MoE blocks route each device's
  tokens inside ``shard_map``), and the switch on;
* the shape rule :func:`fits`: both operands BF16 or F16, the contraction and
  output widths multiples of 128 (the kernels' tiles, in both the
  forward's and the transposed gradients' roles).

On a GPU a call the kernels cannot take warns once per reason and shape, then
takes ``lax.ragged_dot``. Rows past the last group are zero, as
``lax.ragged_dot`` leaves them (the forward kernel does not write them).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels import dispatch

# The kernels' tiling, the one bench/moe.py's block part measured; the
# contraction and output widths must be multiples of ALIGN in every role.
TILES = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4,
         "grid_block_n": 1}  # fmt: skip
ALIGN = 128
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fits(k: int, n: int, dtype) -> bool:
    """Whether the kernels take ``[m, k] . [g, k, n]`` in ``dtype`` (any ``m``, any groups)."""
    return jnp.dtype(dtype) in DTYPES and k % ALIGN == 0 and n % ALIGN == 0 and k > 0 and n > 0


def _gpu_host() -> bool:
    return jax.default_backend() == "gpu"


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(
        f"fp8jax.kernels.bf16_grouped.ragged_dot: {reason}; these grouped GEMMs take "
        "lax.ragged_dot, which XLA's GPU backend expands to one dense GEMM over all groups.",
        RuntimeWarning,
        stacklevel=4,
    )


def placement(k: int, n: int, dtype) -> dispatch.Placement:
    """Where ``[m, k] . [g, k, n]`` in ``dtype`` runs here: the Mosaic GPU kernels or XLA.

    Warns once per reason on a GPU where the kernels are on but cannot take the call.
    """
    if not _gpu_host() or not dispatch.enabled():
        return dispatch.XLA
    shape_ok = fits(k, n, dtype)
    # rows_are_tokens=False: the kernels run on whole arrays only (inside shard_map).
    decided = dispatch.decide(lambda _: shape_ok, rows_are_tokens=False)
    if not decided.kernel:
        if not shape_ok:
            _warn_once(
                f"the Mosaic GPU kernels need BF16 or F16 operands and k, n multiples of "
                f"{ALIGN}, got k={k}, n={n}, dtype {jnp.dtype(dtype).name}"
            )
        else:
            _warn_once(
                "the Mosaic GPU kernels run on whole arrays only (inside shard_map); here the "
                f"mesh is {dict(jax.sharding.get_abstract_mesh().shape)}"
            )
    return decided


def _rows_in_groups(y, group_sizes):
    """``y`` with the rows past the last group zeroed, as ``lax.ragged_dot`` leaves them."""
    rows = lax.broadcasted_iota(jnp.int32, (y.shape[0], 1), 0)
    return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))


def _on_cuda(kernel_fn, xla_fn, *operands):
    """``kernel_fn`` on CUDA, ``xla_fn`` elsewhere; ``xla_fn`` alone on a host without a GPU,
    where the wgrad kernel cannot be traced (module docstring)."""
    if not _gpu_host():
        return xla_fn(*operands)
    return lax.platform_dependent(*operands, cuda=kernel_fn, default=xla_fn)


def _forward_kernel(x, w, group_sizes):
    """``x [m, k] . w [g, k, n]`` on ``ragged_dot_mgpu``, rows past the groups zeroed."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    y = ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, **TILES)
    # plgpu.kernel's results do not say which shard_map axes they vary along, and the
    # two branches of lax.platform_dependent must have one type.
    y = dispatch.varying_like(y, (x, w, group_sizes))
    return _rows_in_groups(y, group_sizes)


def _dgrad_kernel(g, w, group_sizes):
    """``g [m, n] . w[i]^T`` per group on ``ragged_dot_mgpu`` (the weights read transposed)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    dx = ragged_dot_mgpu.ragged_dot(g, w, group_sizes=group_sizes, transpose_rhs=True, **TILES)
    dx = dispatch.varying_like(dx, (g, w, group_sizes))
    return _rows_in_groups(dx, group_sizes)


def _wgrad_kernel(x, g, group_sizes):
    """``x[rows of i]^T . g[rows of i]`` per group on ``transposed_ragged_dot_mgpu``."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(x, g, group_sizes=group_sizes, **TILES)
    return dispatch.varying_like(dw, (x, g, group_sizes))


def _forward_xla(x, w, group_sizes):
    return lax.ragged_dot(x, w, group_sizes)


def _dgrad_xla(g, w, group_sizes):
    return lax.ragged_dot(g, jnp.swapaxes(w, 1, 2), group_sizes)


def _wgrad_xla(x, g, group_sizes):
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return lax.ragged_dot_general(x, g, group_sizes, numbers)


@jax.custom_vjp
def _grouped(x, w, group_sizes):
    return _on_cuda(_forward_kernel, _forward_xla, x, w, group_sizes)


def _grouped_fwd(x, w, group_sizes):
    return _grouped(x, w, group_sizes), (x, w, group_sizes)


def _grouped_bwd(residuals, g):
    x, w, group_sizes = residuals
    g = g.astype(x.dtype)
    dx = _on_cuda(_dgrad_kernel, _dgrad_xla, g, w, group_sizes)
    dw = _on_cuda(_wgrad_kernel, _wgrad_xla, x, g, group_sizes)
    return dx, dw.astype(w.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` in ``lhs.dtype``, on Mosaic GPU kernels on GPUs.

    Args:
      lhs: ``[m, k]``, rows sorted by group.
      rhs: ``[g, k, n]`` in ``lhs.dtype``.
      group_sizes: ``[g]`` integers, the rows of each group (summing to at most ``m``).

    Returns:
      ``[m, n]`` in ``lhs.dtype``: each group's rows times its matrix, zeros past the groups.

    Raises:
      ValueError: the shapes or dtypes do not match.

    Example:
      >>> import jax.numpy as jnp
      >>> from fp8jax.kernels import bf16_grouped
      >>> x = jnp.ones((4, 128), jnp.bfloat16)
      >>> w = jnp.ones((2, 128, 128), jnp.bfloat16)
      >>> bf16_grouped.ragged_dot(x, w, jnp.array([3, 1], jnp.int32)).shape
      (4, 128)
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            "bf16_grouped.ragged_dot: expected lhs [m, k] and rhs [g, k, n] with the same k, "
            f"got lhs {lhs.shape} and rhs {rhs.shape}."
        )
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"bf16_grouped.ragged_dot: group_sizes must have shape ({rhs.shape[0]},) (one per "
            f"group of rhs), got {group_sizes.shape}."
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(
            f"bf16_grouped.ragged_dot: lhs and rhs must have one dtype, got {lhs.dtype} and "
            f"{rhs.dtype}; cast rhs to lhs.dtype."
        )
    if lhs.shape[0] == 0:  # nothing to multiply; the kernels' grids need a row
        return lax.ragged_dot(lhs, rhs, group_sizes)
    if not placement(lhs.shape[1], rhs.shape[2], lhs.dtype).kernel:
        return lax.ragged_dot(lhs, rhs, group_sizes)
    return _kernel_path(lhs, rhs, group_sizes)


def _kernel_path(lhs, rhs, group_sizes):
    """:func:`_grouped`, ``rhs`` first typed to vary as the rows do inside shard_map.

    The wgrad is a per-device partial sum; typed varying, a replicated ``rhs``'s
    cotangent is summed over the devices by JAX (the transpose of ``pcast``),
    as ``lax.ragged_dot``'s is.
    """
    return _grouped(lhs, dispatch.varying_like(rhs, (lhs, group_sizes)), group_sizes)
