"""FP8 relayouts: the kernels that only move FP8 data into another layout.

cuBLASLt's FP8 GEMM reads only operands whose contracting axis is minor in
memory, so every FP8 operand contracted on another axis (a kernel in the
forward GEMM, the activations in wgrad) is copied into a transposed layout
first. A compiled program shows these as fusions (or copies, transposes) that
read FP8 and write FP8.

XLA emits most of them with its tiled transpose emitter (``kind=kInput``).
One that is a ``kLoop`` fusion around a ``transpose`` is emitted element by
element instead. Measured on an H200 (jaxlib 0.11.2), those ran at about
0.3 TB/s, against about 2.4 TB/s for the tiled ones; fp8jax's and Flax's
FP8 GEMMs both got them there
(docs/design.md#the-forward-kernel-transposed-in-the-program). The local deviceless
compiles (jaxlib 0.10.2) write both layouts in one fusion instead, so only a
live compile shows them.

Example:
  >>> from fp8jax import verify
  >>> hlo = '''
  ... HloModule m
  ... %t (p: f8e4m3fn[64,32]) -> f8e4m3fn[32,64] {
  ...   %p = f8e4m3fn[64,32]{0,1} parameter(0)
  ...   ROOT %r = f8e4m3fn[32,64]{0,1} transpose(%p), dimensions={1,0}
  ... }
  ... ENTRY %main (a: f8e4m3fn[64,32]) -> f8e4m3fn[32,64] {
  ...   %a = f8e4m3fn[64,32]{0,1} parameter(0)
  ...   ROOT %w = f8e4m3fn[32,64]{0,1} fusion(%a), kind=kLoop, calls=%t
  ... }
  ... '''
  >>> [(r.name, r.kind, r.untiled_transpose) for r in verify.fp8_relayouts(hlo)]
  [('w', 'kLoop', True)]
"""

from __future__ import annotations

import dataclasses

from fp8jax.verify import _hlo
from fp8jax.verify.report import _gemm_fusion_backend, _location, _walk

_MOVES = ("fusion", "copy", "transpose")


@dataclasses.dataclass(frozen=True)
class RelayoutRow:
    """One kernel that reads only FP8 arrays and writes FP8 arrays.

    Attributes:
      name: the HLO instruction.
      kind: the fusion kind (``kLoop``, ``kInput``) or the opcode.
      dtype, shape: its (first) result.
      bytes: bytes written, every result together.
      untiled_transpose: a ``kLoop`` fusion whose root is a transpose, or a
        bare transpose: a physical transpose that XLA's tiled transpose
        emitter does not handle.
      source, op_name: as in :class:`fp8jax.verify.GemmRow`.
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    untiled_transpose: bool
    source: str = ""
    op_name: str = ""


def fp8_relayouts(hlo_text: str) -> tuple[RelayoutRow, ...]:
    """Every FP8-to-FP8 relayout kernel of an optimized HLO module, in program order.

    Args:
      hlo_text: optimized HLO text, as for :func:`fp8jax.verify.gemm_report`.

    Raises:
      TypeError: if ``hlo_text`` is not a str.
      ValueError: if it holds no HLO computation.
    """
    module = _hlo.parse_module(hlo_text)
    rows = []
    for comp, inst, callers in _walk(module, module.entry, (), set()):
        # Instructions inside a fusion body are parts of a kernel, not kernels.
        if callers or inst.opcode not in _MOVES:
            continue
        if inst.opcode == "fusion" and _gemm_fusion_backend(module, inst):
            continue
        if not _only_fp8(inst.types) or not _reads_only_fp8(comp, inst):
            continue
        rows.append(_row(module, comp, inst))
    return tuple(rows)


def _only_fp8(types) -> bool:
    """Whether there is an array among ``types`` and every array is FP8 (scalars aside)."""
    arrays = [t for t in types if t.shape]
    return bool(arrays) and all(t.is_fp8 for t in arrays)


def _reads_only_fp8(comp: _hlo.Computation, inst: _hlo.Instruction) -> bool:
    # Scalar operands are scales and constants; a fusion that reads none but them writes a
    # broadcast, not a relayout.
    return _only_fp8([t for op in inst.operands if op in comp.instructions
                      for t in comp.instructions[op].types])  # fmt: skip


def _row(module: _hlo.Module, comp: _hlo.Computation, inst: _hlo.Instruction) -> RelayoutRow:
    if inst.opcode == "fusion":
        body = module.computations.get(inst.called[0]) if inst.called else None
        kind = inst.fusion_kind or "fusion"
        untiled = kind == "kLoop" and body is not None and body.root.opcode == "transpose"
    else:
        kind, untiled = inst.opcode, inst.opcode == "transpose"
    source, op_name, _ = _location(module, inst, comp)
    first = next(t for t in inst.types if t.shape)
    written = sum(t.nbytes for t in inst.types)
    return RelayoutRow(inst.name, kind, first.dtype, first.shape, written, untiled, source, op_name)
