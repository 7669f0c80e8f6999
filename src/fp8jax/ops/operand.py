"""One quantized GEMM operand: its FP8 copies, what their scales cover, its amax, its column sums.

cuBLASLt's FP8 GEMMs read both operands with the contracting axis minor,
so one operand may be read in two layouts by its two GEMMs (a kernel: the
forward GEMM transposed, the dgrad GEMM as itself; an activation or a
gradient: one GEMM as itself, the wgrad GEMM transposed). Where the cast
kernel runs, the quantize pass writes both copies at once
(docs/design.md#cast-and-transpose-in-one-kernel); elsewhere only the copy
as itself exists and XLA transposes inside the GEMM. A
:class:`QuantizedOperand` holds what one quantize pass made, and a GEMM
asks it for the layout it reads (:meth:`QuantizedOperand.for_wgrad`).

Every quantize path returns one: :func:`fp8jax.ops.quantizing.quantize_operand`
for a value under every recipe (the fine-grained ones through
:mod:`fp8jax.ops.fine_quantize`), and :func:`from_kernel` for the FP8
output of a fused kernel (the norm's, the activation's). The shape of
``scale_inv`` says what one scale covers (:class:`fp8jax.recipes.Granularity`):
() per tensor, (R, 1) per row, (R, K / 128) per 1x128 tile (MX: 1x32,
powers of two that E8M0 holds), (R / 128, K / 128) per block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp8jax.formats import Fp8Format
from fp8jax.quantize import Fp8Array
from fp8jax.recipes import PER_TENSOR, Granularity


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fp8"],
    meta_fields=["transposed"],
)
@dataclasses.dataclass(frozen=True)
class Fp8Layout:
    """One FP8 copy of an operand as a GEMM reads it: as itself, or transposed to (columns, rows).

    The static ``transposed`` says which; a saved residual keeps it through
    the custom_vjp. Build one with :meth:`QuantizedOperand.as_itself` or
    :meth:`QuantizedOperand.for_wgrad`, or :func:`transposed_copy`.
    """

    fp8: Fp8Array
    transposed: bool = False


def transposed_copy(fp8: Fp8Array) -> Fp8Layout:
    """``fp8``, which a kernel wrote as (columns, rows), as the layout a wgrad GEMM reads."""
    return Fp8Layout(fp8, transposed=True)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["fp8", "amax", "transposed", "column_sums"],
    meta_fields=["granularity"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedOperand:
    """What one quantize pass made of a GEMM operand.

    Attributes:
      fp8: the operand in FP8, in its own shape, with its ``scale_inv``.
      amax: the operand's amax for a scaling state's update (f32). Under
        delayed scaling it may come as per-tile maxima, whose maximum it is
        (:func:`fp8jax.scaling.update_group` reduces them). None for the
        fine-grained recipes, which keep no state.
      transposed: the (columns, rows) FP8 copy, where the cast kernel wrote
        one; ask :attr:`has_transposed` rather than comparing with None.
      column_sums: f32 sums over the rows, in the columns' shape, where
        asked for (a bias's gradient).
      granularity: what one scale covers (static); ``fp8.scale_inv`` has the
        shape it gives (:meth:`fp8jax.recipes.Granularity.scale_shape`, with
        any batch axes in front).
    """

    fp8: Fp8Array
    amax: jax.Array | None
    transposed: Fp8Array | None = None
    column_sums: jax.Array | None = None
    granularity: Granularity = PER_TENSOR

    @property
    def has_transposed(self) -> bool:
        """Whether the quantize pass also wrote the transposed (columns, rows) copy."""
        return self.transposed is not None

    @property
    def format(self) -> Fp8Format:
        return self.fp8.format

    @property
    def shape(self) -> tuple[int, ...]:
        return self.fp8.shape

    @property
    def data(self) -> jax.Array:
        """The FP8 values in the operand's own layout."""
        return self.fp8.data

    @property
    def scale_inv(self) -> jax.Array:
        """``value ~= data * scale_inv``, in the shape :attr:`granularity` gives."""
        return self.fp8.scale_inv

    def as_itself(self) -> Fp8Layout:
        """The copy in the operand's own layout."""
        return Fp8Layout(self.fp8)

    def for_wgrad(self) -> Fp8Layout:
        """The copy a wgrad GEMM over token rows reads: the transposed one where it was made."""
        if self.has_transposed:
            return transposed_copy(self.transposed)
        return self.as_itself()


def inverse(scale: jax.Array) -> jax.Array:
    """``scale_inv`` of a per-tensor ``scale``, as ``quantize_with_scale`` computes it."""
    return 1.0 / scale.astype(jnp.float32)


def from_kernel(
    data: jax.Array, scale_inv: jax.Array, fmt: Fp8Format, amax: jax.Array, *,
    transposed: jax.Array | None = None, column_sums: jax.Array | None = None,
) -> QuantizedOperand:  # fmt: skip
    """The :class:`QuantizedOperand` of a kernel's FP8 output, cast at ``1 / scale_inv``.

    ``scale_inv``: per tensor, from :func:`inverse`.
    """
    return QuantizedOperand(
        Fp8Array(data, scale_inv, fmt),
        amax,
        None if transposed is None else Fp8Array(transposed, scale_inv, fmt),
        column_sums,
    )
