"""A GEMM output returned in pieces along one of its feature axes: a fused QKV's q, k and v.

Sliced outside the op, the pieces cost the backward a pass: autodiff pads
each piece's gradient to the whole output and sums them, so the whole
gradient is written in bf16 before its FP8 cast reads it again
(docs/design.md#the-fused-qkv-split-inside-the-op). Split inside the op, the
backward receives the pieces as they are,
and the cast reads them directly (:class:`~fp8jax.kernels.cast_transpose.Interleaved`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.kernels.cast_transpose import Interleaved
from fp8jax.ops import gemm


@dataclasses.dataclass(frozen=True)
class Split:
    """Piece sizes along axis ``axis`` (non-negative) of the op's output."""

    sizes: tuple[int, ...]
    axis: int

    def apply(self, y: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jnp.split(y, np.cumsum(self.sizes)[:-1].tolist(), axis=self.axis))


def make_split(
    sizes: Sequence[int] | None, axis: int, out_shape: tuple[int, ...], n_features: int
) -> Split | None:
    """Checks ``sizes`` and ``axis`` against an output of ``out_shape`` whose last
    ``n_features`` axes are features; None for no split."""
    if sizes is None:
        return None
    sizes = tuple(sizes)
    ndim = len(out_shape)
    if not -n_features <= axis < 0:
        raise ValueError(
            f"split_axis must name one of the output's {n_features} feature axes, counted from "
            f"the end (-{n_features} to -1), got {axis}."
        )
    axis += ndim
    if (
        not sizes
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
        or sum(sizes) != out_shape[axis]
    ):
        raise ValueError(
            f"split must be positive integers summing to the output's axis {axis - ndim} "
            f"({out_shape[axis]}), got {sizes}."
        )
    return Split(sizes, axis)


def split_output_with_bias(
    y: jax.Array, bias: jax.Array | None, n_out_axes: int, split: Split | None
) -> jax.Array | tuple[jax.Array, ...]:
    """An op's GEMM output ``y`` plus ``bias`` (over its last ``n_out_axes``), cut by ``split``.

    Cut, the pieces are copied out of ``y`` anyway, and the bias is added in
    that copy: behind the optimization barrier XLA cannot fold it into the
    GEMM. Folded, a bias over several output axes (a fused QKV's heads, 3,
    head_dim) became the GEMM's whole (tokens, features) addend matrix,
    written by a fusion of its own first: 0.24 ms of the TE-config layer's
    step on the H200 (docs/design.md#the-fused-qkv-split-inside-the-op).
    """
    if split is not None and bias is not None:
        y = lax.optimization_barrier(y)
    y = gemm.add_bias(y, bias, n_out_axes)
    return y if split is None else split.apply(y)


def split_output(
    y: jax.Array, sizes: Sequence[int] | None, axis: int, n_features: int
) -> jax.Array | tuple[jax.Array, ...]:
    """``y`` cut as the ops cut it (:func:`make_split`), for outputs no op computed."""
    split = make_split(sizes, axis, y.shape, n_features)
    return y if split is None else split.apply(y)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pieces"], meta_fields=["axis"])
@dataclasses.dataclass(frozen=True)
class SplitGradient:
    """The gradient of a split output, as its pieces along ``axis``."""

    pieces: tuple[jax.Array, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.pieces[0].shape
        joined = sum(p.shape[self.axis] for p in self.pieces)
        return (*first[: self.axis], joined, *first[self.axis + 1 :])

    @property
    def ndim(self) -> int:
        return self.pieces[0].ndim

    @property
    def dtype(self):
        return self.pieces[0].dtype

    def joined(self) -> jax.Array:
        return jnp.concatenate(self.pieces, axis=self.axis)

    def interleaved(self, rows_ndim: int) -> Interleaved:
        """As a (rows, columns) matrix of the leading ``rows_ndim`` axes by the rest."""
        rows = math.prod(self.shape[:rows_ndim])
        periods = math.prod(self.shape[rows_ndim : self.axis])
        return Interleaved(tuple(p.reshape(rows, -1) for p in self.pieces), periods)
