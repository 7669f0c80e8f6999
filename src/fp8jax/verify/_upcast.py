"""Was a value dequantized from FP8? Dataflow through an HLO module, backwards.

A GEMM that reads BF16 is not FP8, but it matters why: an f8 tensor widened
on its way in (quantize -> dequantize, or an f8 kernel converted after its
all-gather) is the bug this verifier exists to catch. The search walks from a
GEMM operand towards its producers, through ops that only move or rescale
values, across fusion boundaries, and stops at anything that computes.
"""

from __future__ import annotations

import re

from fp8jax.verify import _hlo

# Ops that move or rescale values without computing new ones. A dequantize is
# convert(f8 -> wide) followed by a multiply by the scale, and the partitioner
# may put copies, transposes or collectives between it and the GEMM. Adds are
# left out on purpose: through a residual stream everything would "come from"
# some FP8 tensor.
_PASS_THROUGH = {
    "bitcast",
    "broadcast",
    "concatenate",
    "convert",
    "copy",
    "copy-start",
    "copy-done",
    "divide",
    "dynamic-slice",
    "multiply",
    "pad",
    "reshape",
    "slice",
    "transpose",
    "all-gather",
    "all-gather-start",
    "all-gather-done",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
    "collective-permute-done",
    "async-start",
    "async-done",
}


def type_of(comp: _hlo.Computation, name: str) -> _hlo.TensorType:
    """The (first) array type of value ``name``; ``?[]`` if it is not in ``comp``."""
    inst = comp.instructions.get(name)
    return inst.types[0] if inst and inst.types else _hlo.TensorType("?", ())


def dequantized(module, comp, name, callers, index=None, seen=None) -> bool:
    """Whether value ``name`` was converted from f8 to a wider type upstream."""
    seen = set() if seen is None else seen
    if (comp.name, name, index) in seen or name not in comp.instructions:
        return False
    seen.add((comp.name, name, index))
    inst = comp.instructions[name]
    recurse = lambda c, n, cs=callers, i=None: dequantized(module, c, n, cs, i, seen)  # noqa: E731
    if inst.opcode == "convert":
        source = type_of(comp, inst.operands[0])
        if source.is_fp8 and not inst.types[0].is_fp8:
            return True
    if inst.opcode == "parameter":
        if not callers:
            return False
        (caller, fusion), rest = callers[-1], callers[:-1]
        position = int(inst.args_text.strip())
        return position < len(fusion.operands) and recurse(caller, fusion.operands[position], rest)
    if inst.opcode == "get-tuple-element":
        position = int(re.search(r"index=(\d+)", inst.attrs).group(1))
        return recurse(comp, inst.operands[0], callers, position)
    if inst.opcode == "tuple":
        operands = inst.operands if index is None else inst.operands[index : index + 1]
        return any(recurse(comp, op) for op in operands)
    if inst.opcode == "fusion" and inst.called:
        body = module.computations[inst.called[0]]
        return recurse(body, body.root.name, (*callers, (comp, inst)), index)
    if inst.opcode in _PASS_THROUGH:
        return any(recurse(comp, op) for op in inst.operands)
    return False
