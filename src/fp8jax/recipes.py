"""Scaling recipes: how each FP8 tensor's scale is chosen.

A recipe is a frozen, hashable dataclass, passed explicitly to every op (there
is no global recipe). Five are available. Two scale each tensor as a whole:

* :class:`CurrentScaling` derives the scale from the tensor being quantized.
  It needs no state, so it is a drop-in that leaves train steps unchanged.
* :class:`DelayedScaling` derives the scale from a history of past amaxes
  (TransformerEngine's rule). It needs per-tensor state; see
  :mod:`fp8jax.scaling`.

Three fine-grained recipes scale parts of a tensor apart, so that one outlier
token or channel does not push the rest into the FP8 subnormals
(docs/design.md#fine-grained-scaling): :class:`RowwiseScaling` (per row),
:class:`BlockScaling` (DeepSeek-V3's 1x128 tiles and 128x128 weight blocks)
and :class:`MXFP8Scaling` (OCP MX blocks of 32, for Blackwell). They derive
their scales from the tensor at hand, as current scaling does, and keep no
state.

Every recipe answers one question the same way: :meth:`granularity` of a
role (``"x"``, ``"kernel"`` or ``"grad"``), the :class:`Granularity` that
says what one scale of that operand covers, and so the shape of its
``scale_inv`` in the GEMM's (rows, K) view.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from jax import lax

from fp8jax.formats import ALL_E4M3, HYBRID, FormatPair

_AMAX_ALGOS = ("max", "most_recent")

GRANULARITIES = ("tensor", "row", "tile", "block")
# A GEMM operand's roles: the input, the weight, the output gradient.
ROLES = ("x", "kernel", "grad")


@dataclasses.dataclass(frozen=True)
class Granularity:
    """What one scale covers, and so the shape of ``scale_inv`` for a (rows, K) GEMM operand.

    K is the axis the operand's GEMM contracts (the minor one):

    * ``"tensor"``: one scale, ``scale_inv`` of shape ();
    * ``"row"``: one per row, (rows, 1);
    * ``"tile"``: one per 1 x ``block`` tile along K, (rows, K / block);
    * ``"block"``: one per ``block`` x ``block`` block, (rows / block, K / block),
      which serves the operand and its transpose alike.

    ``power_of_two``: every scale is a power of two (MX blocks, stored as
    E8M0 on the GPU; BlockScaling's ``power_of_two_scales``).

    Example:
      >>> from fp8jax.recipes import Granularity
      >>> Granularity("tile", 128).scale_shape(64, 512)
      (64, 4)
    """

    kind: str = "tensor"
    block: int | None = None
    power_of_two: bool = False

    def __post_init__(self):
        if self.kind not in GRANULARITIES:
            raise ValueError(f"Granularity.kind must be one of {GRANULARITIES}, got {self.kind!r}.")
        if (self.kind in ("tile", "block")) != (self.block is not None):
            raise ValueError(
                "Granularity.block is the extent one scale covers: an int > 0 for kind='tile' "
                f"or 'block' and None otherwise, got kind={self.kind!r}, block={self.block!r}."
            )
        if self.block is not None and (not isinstance(self.block, int) or self.block <= 0):
            raise ValueError(f"Granularity.block must be an int > 0, got {self.block!r}.")

    def scale_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        """The shape of ``scale_inv`` for a (rows, columns) operand whose GEMM contracts columns."""
        if self.kind == "tensor":
            return ()
        if self.kind == "row":
            return (rows, 1)
        tiles = -(-columns // self.block)
        return (rows, tiles) if self.kind == "tile" else (-(-rows // self.block), tiles)


PER_TENSOR = Granularity()


def check_role(role: str) -> str:
    """Returns ``role`` if it is one of :data:`ROLES`; raises ValueError otherwise."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}.")
    return role


# A margin scales by 2**-margin. The FP8 formats span at most 2**31 between
# their smallest normal and largest value (E5M2), so a margin beyond 32 only
# pushes every value into the subnormals and zero; and 2**margin must stay a
# finite f32 for the scale to be finite and nonzero.
_MAX_MARGIN = 32


def check_margin(cls_name: str, margin) -> None:
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real):
        raise TypeError(
            f"{cls_name}.margin must be a real number (int or float) >= 0, got {margin!r}."
        )
    if margin < 0:
        raise ValueError(f"{cls_name}.margin must be a real number >= 0, got {margin!r}.")
    if not math.isfinite(margin) or margin > _MAX_MARGIN:
        raise ValueError(
            f"{cls_name}.margin must be finite and at most {_MAX_MARGIN} (powers of two of "
            f"headroom), got {margin!r}. Typical margins are 0 to 2."
        )


def _check_reduction_axes(cls_name: str, axes) -> None:
    if not isinstance(axes, tuple) or not all(isinstance(a, str) and a for a in axes):
        raise TypeError(
            f"{cls_name}.amax_reduction_axes must be a tuple of mesh axis names such as "
            f"('dp', 'fsdp'), got {axes!r}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"{cls_name}.amax_reduction_axes names an axis twice: {axes!r}; name each once."
        )


def _check_common(cls_name: str, recipe) -> None:
    check_margin(cls_name, recipe.margin)
    _check_reduction_axes(cls_name, recipe.amax_reduction_axes)
    if not isinstance(recipe.formats, FormatPair):
        raise TypeError(
            f"{cls_name}.formats must be a FormatPair such as fp8jax.HYBRID, "
            f"got {recipe.formats!r}."
        )
    for field in ("forward_precision", "dgrad_precision", "wgrad_precision"):
        value = getattr(recipe, field)
        if not isinstance(value, lax.Precision):
            raise TypeError(
                f"{cls_name}.{field} must be a jax.lax.Precision, got {value!r}. "
                "DEFAULT enables cuBLASLt fast accumulation; HIGHEST splits it."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurrentScaling:
    """Scale each tensor by its own amax, computed just before quantizing.

    ``scale = fp8_max / amax / 2**margin``; an all-zero or non-finite tensor
    gets scale 1 so that one bad batch cannot poison the result's scale.

    Attributes:
      margin: extra headroom, in powers of two: a finite real number in
        [0, 32].
      formats: forward and gradient formats (default E4M3 / E5M2).
      forward_precision: accumulation of the forward GEMM. DEFAULT lets
        cuBLASLt use fast (FP8-rate) accumulation.
      dgrad_precision: accumulation of the input-gradient GEMM. HIGHEST asks
        for split accumulation, as TransformerEngine does for gradients.
      wgrad_precision: accumulation of the weight-gradient GEMM.
      amax_reduction_axes: mesh axes every amax is max-reduced over
        (``lax.pmax``), for ops called inside ``shard_map``: name the axes the
        tensors are sharded over (all of the shard_map's axes is always
        right) so that each device picks the scale of the whole tensor.
        Leave it ``()`` under ``jit``, where the amax of a sharded array is
        already global.

    Example:
      >>> import fp8jax
      >>> fp8jax.CurrentScaling(margin=1).margin
      1
    """

    margin: float = 0
    formats: FormatPair = HYBRID
    forward_precision: lax.Precision = lax.Precision.DEFAULT
    dgrad_precision: lax.Precision = lax.Precision.HIGHEST
    wgrad_precision: lax.Precision = lax.Precision.HIGHEST
    amax_reduction_axes: tuple[str, ...] = ()

    def __post_init__(self):
        _check_common("CurrentScaling", self)

    def granularity(self, role: str) -> Granularity:
        """What one scale of the operand ``role`` covers: the whole tensor."""
        check_role(role)
        return PER_TENSOR


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling:
    """Scale each tensor from the amaxes it had in previous steps.

    Each step quantizes with the scale stored in the state, records the
    tensor's amax in slot 0 of a rolling history, and computes the next scale
    as ``fp8_max / amax / 2**margin`` where ``amax`` is the history's maximum
    (``"max"``) or its newest entry (``"most_recent"``). If that amax is 0 the
    previous scale is kept; a non-finite amax is recorded as 0 (no
    information), so a single NaN step cannot freeze the scale for a whole
    history length.

    Attributes:
      margin: extra headroom, in powers of two: a finite real number in
        [0, 32].
      amax_history_len: number of steps remembered, an int >= 1.
      amax_compute_algo: ``"max"`` or ``"most_recent"``.
      formats: forward and gradient formats (default E4M3 / E5M2).
      forward_precision: accumulation of the forward GEMM.
      dgrad_precision: accumulation of the input-gradient GEMM.
      wgrad_precision: accumulation of the weight-gradient GEMM.
      amax_reduction_axes: as in :class:`CurrentScaling`. Inside
        ``shard_map`` DelayedScaling needs it: the state is one value for
        every device, so every device must see the same amaxes.

    Example:
      >>> import fp8jax
      >>> fp8jax.DelayedScaling(amax_history_len=16).amax_compute_algo
      'max'
    """

    margin: float = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    formats: FormatPair = HYBRID
    forward_precision: lax.Precision = lax.Precision.DEFAULT
    dgrad_precision: lax.Precision = lax.Precision.HIGHEST
    wgrad_precision: lax.Precision = lax.Precision.HIGHEST
    amax_reduction_axes: tuple[str, ...] = ()

    def granularity(self, role: str) -> Granularity:
        """What one scale of the operand ``role`` covers: the whole tensor."""
        check_role(role)
        return PER_TENSOR

    def __post_init__(self):
        _check_common("DelayedScaling", self)
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be an int >= 1, got {n!r}.")
        if not isinstance(self.amax_compute_algo, str) or self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be one of {_AMAX_ALGOS}, "
                f"got {self.amax_compute_algo!r}."
            )


def resolve_recipe(recipe) -> Recipe:
    """Returns ``recipe``, or the default CurrentScaling for None; rejects others."""
    if recipe is None:
        return CurrentScaling()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            "recipe must be fp8jax.CurrentScaling(...), fp8jax.DelayedScaling(...), "
            "fp8jax.RowwiseScaling(...), fp8jax.BlockScaling(...), fp8jax.MXFP8Scaling() or "
            f"None, got {recipe!r}."
        )
    return recipe


def _check_fine(cls_name: str, recipe) -> None:
    check_margin(cls_name, recipe.margin)
    if not isinstance(recipe.formats, FormatPair):
        raise TypeError(
            f"{cls_name}.formats must be a FormatPair such as fp8jax.HYBRID or fp8jax.ALL_E4M3, "
            f"got {recipe.formats!r}."
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowwiseScaling:
    """One scale per row of each GEMM operand along its free (non-contracted) axes.

    Per token for activations and output gradients, per output channel for
    weights; each scale is ``fp8_max / row_amax / 2**margin`` (1 for an
    all-zero or non-finite row). Where a backward GEMM contracts an operand
    over the other axis, the operand is quantized again along that axis:
    the weight per input row for the input gradient, the activation and the
    output gradient per feature column for the weight gradient. The GEMMs
    take the FP8 operands as they are; the row and column scales multiply
    the product afterwards, an elementwise epilogue XLA fuses into the
    consumer (docs/design.md#fine-grained-scaling).

    Attributes:
      margin: extra headroom, in powers of two: a finite real number in [0, 32].
      formats: forward and gradient formats (default E4M3 / E5M2).
      forward_precision, dgrad_precision, wgrad_precision: accumulation of
        each GEMM, as in :class:`CurrentScaling`.
      amax_reduction_axes: inside ``shard_map``, the mesh axes that split
        token rows (data, FSDP or sequence parallelism). The column maxima
        (over tokens, for the weight gradient's operands) are max-reduced
        over them, so every scale is the whole tensor's; the per-token row
        maxima are not. Name no axis that splits features or a weight's
        rows (tensor parallelism): a column split over it is a different
        column on each device. Under ``jit`` leave it ``()``: a sharded
        array's maxima are already global there.

    Example:
      >>> import fp8jax
      >>> fp8jax.RowwiseScaling(margin=1).formats
      HYBRID
    """

    margin: float = 0
    formats: FormatPair = HYBRID
    forward_precision: lax.Precision = lax.Precision.DEFAULT
    dgrad_precision: lax.Precision = lax.Precision.HIGHEST
    wgrad_precision: lax.Precision = lax.Precision.HIGHEST
    amax_reduction_axes: tuple[str, ...] = ()

    def granularity(self, role: str) -> Granularity:
        """What one scale of the operand ``role`` covers: a row along the contracted axis."""
        check_role(role)
        return Granularity("row")

    def __post_init__(self):
        _check_fine("RowwiseScaling", self)
        _check_reduction_axes("RowwiseScaling", self.amax_reduction_axes)
        for field in ("forward_precision", "dgrad_precision", "wgrad_precision"):
            if not isinstance(getattr(self, field), lax.Precision):
                raise TypeError(
                    f"RowwiseScaling.{field} must be a jax.lax.Precision, "
                    f"got {getattr(self, field)!r}."
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockScaling:
    """DeepSeek-V3's recipe: 1x128 tiles for activations and gradients, 128x128 weight blocks.

    Every operand is scaled per tile of ``BLOCK`` (128) elements along the
    axis its GEMM contracts (per token and 128 features for activations and
    output gradients), weights per 128x128 block, which serves the forward
    and the input-gradient GEMM alike. The GEMM applies the scales inside its
    main loop: the product of each 128-long slice of K is taken in FP8,
    scaled and added to an f32 accumulator (docs/design.md#fine-grained-scaling).

    Attributes:
      margin: extra headroom, in powers of two: a finite real number in [0, 32].
      formats: forward and gradient formats; E4M3 for both by default
        (``fp8jax.ALL_E4M3``), as DeepSeek-V3 trains. ``fp8jax.HYBRID`` runs
        the gradient GEMMs with E5M2 x E4M3 operands, which the GPU kernel
        does not take: XLA's path computes them (:mod:`fp8jax.kernels.block_gemm`).
      power_of_two_scales: round each scale down to a power of two, so that
        scaling changes only exponents.

    Example:
      >>> import fp8jax
      >>> fp8jax.BlockScaling().formats
      FormatPair(forward=E4M3, backward=E4M3)
    """

    BLOCK = 128

    margin: float = 0
    formats: FormatPair = ALL_E4M3
    power_of_two_scales: bool = False

    def granularity(self, role: str) -> Granularity:
        """What one scale of the operand ``role`` covers: a weight block, else a 1 x 128 tile."""
        kind = "block" if check_role(role) == "kernel" else "tile"
        return Granularity(kind, self.BLOCK, self.power_of_two_scales)

    def __post_init__(self):
        _check_fine("BlockScaling", self)
        if not isinstance(self.power_of_two_scales, bool):
            raise TypeError(
                "BlockScaling.power_of_two_scales must be a bool, "
                f"got {self.power_of_two_scales!r}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8Scaling:
    """OCP MXFP8, for Blackwell: every operand in blocks of 32 along the axis its GEMM contracts.

    Each block of 32 consecutive elements along K (activations, weights and
    gradients alike; each operand is quantized again along the axis its
    backward GEMM contracts) shares one power-of-two scale, stored as E8M0:
    the smallest that brings the block's amax within the format's maximum,
    so that no element saturates. The GEMMs are ``jax.nn.scaled_matmul``,
    which XLA compiles to cuDNN's block-scaled FP8 GEMM on Blackwell
    (compute capability 10). On a Hopper GPU it would dequantize the
    operands to BF16 first, so the ops refuse one; elsewhere (the CPU) XLA
    computes the same sums as FP8 dots per 32-wide slice
    (docs/design.md#mxfp8-for-blackwell).

    Attributes:
      formats: forward and gradient formats; E4M3 for both by default
        (``fp8jax.ALL_E4M3``).

    Example:
      >>> import fp8jax
      >>> fp8jax.MXFP8Scaling().formats
      FormatPair(forward=E4M3, backward=E4M3)
    """

    BLOCK = 32

    formats: FormatPair = ALL_E4M3

    def granularity(self, role: str) -> Granularity:
        """What one scale of the operand ``role`` covers: a 1 x 32 block along K, a power of two."""
        check_role(role)
        return Granularity("tile", self.BLOCK, power_of_two=True)

    def __post_init__(self):
        if not isinstance(self.formats, FormatPair):
            raise TypeError(
                "MXFP8Scaling.formats must be a FormatPair such as fp8jax.ALL_E4M3 or "
                f"fp8jax.HYBRID, got {self.formats!r}."
            )


FINE_RECIPES = (RowwiseScaling, BlockScaling, MXFP8Scaling)
Recipe = CurrentScaling | DelayedScaling | RowwiseScaling | BlockScaling | MXFP8Scaling
