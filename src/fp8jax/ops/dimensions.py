"""dot_general dimension numbers: validation, and the transposes for the backward.

The backward of ``y = dot_general(lhs, rhs)`` is two more dot_generals whose
dimension numbers are derived here, so that dgrad and wgrad can run on FP8
operands instead of going through JAX's own (high-precision) transpose rule.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

DimensionNumbers = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]


class TransposedDot(NamedTuple):
    """A dot_general to run, and the permutation that puts its result in place."""

    dimension_numbers: DimensionNumbers
    permutation: tuple[int, ...] | None  # None: the result is already in place


def contract_last(lhs_ndim: int) -> DimensionNumbers:
    """Dimension numbers contracting lhs's last axis against the kernel's first."""
    return (((lhs_ndim - 1,), (0,)), ((), ()))


def _is_int(a) -> bool:
    # NumPy integers too (axes computed with NumPy), as lax.dot_general takes them.
    return isinstance(a, numbers.Integral) and not isinstance(a, bool | np.bool_)


def _axes(value, ndim: int, what: str) -> tuple[int, ...]:
    if _is_int(value):
        value = (value,)
    if not isinstance(value, Sequence) or not all(_is_int(a) for a in value):
        raise TypeError(f"{what} must be a sequence of ints, got {value!r}.")
    axes = []
    for a in map(int, value):
        if not -ndim <= a < ndim:
            raise ValueError(f"{what} has axis {a}, out of range for an operand of rank {ndim}.")
        axes.append(a % ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{what} repeats an axis: {tuple(value)}.")
    return tuple(axes)


def normalize(dimension_numbers, lhs_shape, rhs_shape) -> DimensionNumbers:
    """Validates ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``; makes axes >= 0."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise TypeError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}."
        ) from None
    lc = _axes(lc, len(lhs_shape), "lhs contracting dims")
    rc = _axes(rc, len(rhs_shape), "rhs contracting dims")
    lb = _axes(lb, len(lhs_shape), "lhs batch dims")
    rb = _axes(rb, len(rhs_shape), "rhs batch dims")
    for kind, l_axes, r_axes in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(l_axes) != len(r_axes):
            raise ValueError(
                f"lhs and rhs need the same number of {kind} dims, got {l_axes} and {r_axes}."
            )
        for la, ra in zip(l_axes, r_axes, strict=True):
            if lhs_shape[la] != rhs_shape[ra]:
                raise ValueError(
                    f"{kind} dims must match in size: lhs axis {la} has {lhs_shape[la]} "
                    f"but rhs axis {ra} has {rhs_shape[ra]} "
                    f"(lhs shape {tuple(lhs_shape)}, rhs shape {tuple(rhs_shape)})."
                )
    if set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(f"an axis is both contracting and batch in {dimension_numbers!r}.")
    if not lc:
        raise ValueError("dimension_numbers contracts no axis; an FP8 GEMM needs at least one.")
    return (lc, rc), (lb, rb)


def _free(ndim: int, contracting, batch) -> list[int]:
    return [a for a in range(ndim) if a not in contracting and a not in batch]


def _placement(source_axes: list[int]) -> tuple[int, ...] | None:
    perm = tuple(source_axes.index(a) for a in range(len(source_axes)))
    return None if perm == tuple(range(len(perm))) else perm


def dgrad(dimension_numbers: DimensionNumbers, lhs_ndim: int, rhs_ndim: int) -> TransposedDot:
    """``d lhs = dot_general(g, rhs, ...)``, then the returned permutation."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb)
    nb = len(lb)
    g_rf = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
    dims = ((g_rf, tuple(rf)), (tuple(range(nb)), tuple(rb)))
    # Result axes: batch, lhs free (from g), then rhs's contracting axes in order.
    source = list(lb) + lf + [lc[rc.index(a)] for a in sorted(rc)]
    return TransposedDot(dims, _placement(source))


def wgrad(dimension_numbers: DimensionNumbers, lhs_ndim: int, rhs_ndim: int) -> TransposedDot:
    """``d rhs = dot_general(lhs, g, ...)``, then the returned permutation."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb)
    nb = len(lb)
    g_lf = tuple(range(nb, nb + len(lf)))
    dims = ((tuple(lf), g_lf), (tuple(lb), tuple(range(nb))))
    # Result axes: batch, lhs's contracting axes in order, then rhs free (from g).
    source = list(rb) + [rc[lc.index(a)] for a in sorted(lc)] + rf
    return TransposedDot(dims, _placement(source))
