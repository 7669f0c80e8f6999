"""The GEMM report: which backend runs each matmul, in which dtypes, from which line.

A GEMM is FP8 when both operands the GEMM kernel reads are FP8: a cuBLASLt
``__cublas$lt$matmul$f8`` call, a Triton GEMM fusion whose ``dot`` reads f8
values, or one of fp8jax's Pallas GEMM kernels (:mod:`fp8jax.verify.pallas_gemms`:
the block-scaled GEMM, the grouped expert GEMMs of ``fp8jax.ragged_dot``)
reading two f8 operands (backend ``pallas-fp8``), or cuDNN's block-scaled GEMM
``__cudnn$blockScaledDot`` on f8 operands (``cudnn-fp8``: MXFP8 on Blackwell). A GEMM whose
operands were converted from f8 to a wider type on the way in (the
quantize-dequantize pattern) is flagged ``upcast_from_fp8``: the data was FP8
once, but the multiply runs in BF16 or F32. So is a Triton fusion around a
block-scaled ``scaled-dot`` (``jax.lax.scaled_dot``; backend ``triton-scaled``),
which is never FP8 here: on Hopper its kernel converts the f8 operands and runs
a BF16 MMA, and its HLO is the same for Blackwell, whose MXFP8 MMA it would use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from fp8jax.verify import _hlo, _upcast, pallas_gemms

GEMM_BACKENDS = (
    "cublaslt-fp8", "triton-fp8", "pallas-fp8", "cudnn-fp8", "cublaslt", "cublas", "triton",
    "triton-scaled", "pallas", "cudnn", "dot",
)  # fmt: skip
# The ops that are a GEMM where they stand, unfused or inside a GEMM fusion. A
# ``scaled-dot`` (jax.lax.scaled_dot: operands, then their block scales) is one:
# deviceless for an H100 (jax 0.10.2), Triton's PTX for it converted the E4M3
# operands to 16 bits and ran BF16 wgmma, since Hopper has no block-scaled MMA.
_GEMM_OPS = ("dot", "scaled-dot")
COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)
_CUBLAS_TARGETS = {
    "__cublas$lt$matmul$f8": "cublaslt-fp8",
    "__cublas$lt$matmul": "cublaslt",
    "__cublas$gemm": "cublas",
}
# cuDNN's block-scaled GEMM (jax.nn.scaled_matmul on Blackwell: MXFP8), whose
# operands are (lhs, rhs, lhs_scales, rhs_scales): FP8 when lhs and rhs are f8.
_CUDNN_BLOCK_SCALED = "__cudnn$blockScaledDot"
# fp8jax's Pallas (Triton) kernels that are GEMMs, by their pallas_call name:
# each reads its two GEMM operands as its last two operands and multiplies
# them in the dtype it reads them in (fp8jax.kernels.grouped_gemm). A Pallas call
# is a ``__gpu$xla.gpu.triton`` custom call whose op name ends in its name.
# Frames in these packages are plumbing; the source column shows the first
# frame outside them, which is the line of user code that asked for the GEMM.
_LIBRARY_FILE = re.compile(
    r"(^|/)(site-packages|dist-packages|src)/(jax|jaxlib|flax|optax|fp8jax|qwix)/"
)
_EXPORT_PREFIX = re.compile(r"^jit\(call\)/call_exported/")


@dataclasses.dataclass(frozen=True)
class GemmRow:
    """One GEMM (or cuDNN attention call) of a compiled program.

    Attributes:
      name: the HLO instruction (custom call, fusion or dot).
      backend: one of ``GEMM_BACKENDS``.
      kind: ``"gemm"``, or ``"attention"`` for a cuDNN fused attention call.
      target: the custom-call target, the fusion's backend kind, or ``"dot"``.
      lhs_dtype, lhs_shape, rhs_dtype, rhs_shape: the operands the kernel reads.
      out_dtype, out_shape: its result.
      upcast_from_fp8: an operand was converted from f8 to a wider type on its
        way into this GEMM, so FP8 data is multiplied in high precision (or,
        for a Mosaic GPU kernel, widened inside it: no FP8 MMA in its code).
      fp8_mma: for fp8jax's Pallas GEMM kernels, whether the kernel's code
        multiplies on FP8 ``wgmma`` (:func:`fp8jax.verify.pallas_gemms.fp8_mma`:
        Mosaic GPU's from the HLO, Triton's from the PTX given to
        ``gemm_report``); None where no code was read (cuBLASLt's and XLA's
        GEMMs, Triton kernels without PTX).
      source: ``file:line`` of the innermost frame outside jax, flax and fp8jax.
      op_name: the JAX op name from the HLO metadata.
      stack: every frame, innermost first, as ``file:line in function``.
    """

    name: str
    backend: str
    kind: str
    target: str
    lhs_dtype: str
    lhs_shape: tuple[int, ...]
    rhs_dtype: str
    rhs_shape: tuple[int, ...]
    out_dtype: str
    out_shape: tuple[int, ...]
    upcast_from_fp8: bool = False
    source: str = ""
    op_name: str = ""
    stack: tuple[str, ...] = ()
    fp8_mma: bool | None = None

    @property
    def is_fp8(self) -> bool:
        """Whether the GEMM kernel reads two FP8 operands and, where its code is in the
        HLO, multiplies them on FP8 tensor cores (a block-scaled one never counts)."""
        fp8 = self.lhs_dtype.startswith("f8") and self.rhs_dtype.startswith("f8")
        scaled = self.backend == "triton-scaled" or self.target == "scaled-dot"
        return fp8 and not scaled and self.fp8_mma is not False


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective; an async ``-start``/``-done`` pair is one row.

    ``dtype`` and ``shape`` describe the result (the gathered tensor for an
    all-gather, the local shard for a reduce-scatter); ``bytes`` is the larger
    of input and result, i.e. the full tensor for gathers and scatters.
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    is_async: bool
    source: str = ""
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    """GEMMs, cuDNN attention calls and collectives of one compiled module."""

    gemms: tuple[GemmRow, ...]
    collectives: tuple[CollectiveRow, ...]
    attention: tuple[GemmRow, ...] = ()
    module: str = ""
    num_partitions: int = 1

    @property
    def fp8_gemms(self) -> tuple[GemmRow, ...]:
        return tuple(row for row in self.gemms if row.is_fp8)

    @property
    def non_fp8_gemms(self) -> tuple[GemmRow, ...]:
        return tuple(row for row in self.gemms if not row.is_fp8)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; rows carry ``is_fp8`` too."""
        gemm = lambda row: {**dataclasses.asdict(row), "is_fp8": row.is_fp8}  # noqa: E731
        return {
            "module": self.module,
            "num_partitions": self.num_partitions,
            "fp8_gemms": len(self.fp8_gemms),
            "non_fp8_gemms": len(self.non_fp8_gemms),
            "gemms": [gemm(row) for row in self.gemms],
            "attention": [gemm(row) for row in self.attention],
            "collectives": [dataclasses.asdict(row) for row in self.collectives],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return "\n".join(_format(self))


def gemm_report(hlo_text: str, ptx=None) -> Report:
    """Lists every GEMM and collective of an optimized HLO module.

    Args:
      hlo_text: optimized HLO text, from ``compile_for`` or
        ``jax.jit(f).lower(...).compile().as_text()``.
      ptx: optional, the PTX XLA wrote for the same compile (texts, or the
        dict :func:`fp8jax.verify.read_ptx` returns): fp8jax's Triton GEMM
        kernels then count as FP8 only if their code's MMAs are FP8 ``wgmma``s
        (Mosaic GPU kernels are checked from the HLO alone).

    Returns:
      A ``Report``; ``str(report)`` prints aligned tables.

    Raises:
      TypeError: if ``hlo_text`` is not a str.
      ValueError: if it holds no HLO computation.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.verify import gemm_report
      >>> x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
      >>> hlo = jax.jit(jnp.dot).lower(x, x.update(shape=(32, 8))).compile().as_text()
      >>> [(g.backend, g.lhs_dtype, g.is_fp8) for g in gemm_report(hlo).gemms]
      [('dot', 'f32', False)]
    """
    module = _hlo.parse_module(hlo_text)
    ptx_forms = None if ptx is None else pallas_gemms.ptx_mma_forms(ptx)
    gemms, attention, collectives = [], [], []
    for comp, inst, callers in _walk(module, module.entry, (), set()):
        if inst.opcode == "custom-call":
            row = _custom_call_row(module, comp, inst, ptx_forms)
            if row is not None:
                (attention if row.kind == "attention" else gemms).append(row)
        elif inst.opcode == "fusion" and _gemm_fusion_backend(module, inst):
            gemms.append(_fusion_row(module, comp, inst, callers))
        elif inst.opcode in _GEMM_OPS:
            gemms.append(_dot_row(module, comp, inst, inst, "dot", inst.opcode, callers))
        row = _collective_row(module, comp, inst)
        if row is not None:
            collectives.append(row)
    return Report(
        tuple(gemms), tuple(collectives), tuple(attention), module.name, module.num_partitions
    )


def _walk(module: _hlo.Module, comp: _hlo.Computation, callers: tuple, seen: set[str]):
    """Yields (computation, instruction, callers) in program order, entering called code.

    ``callers`` is the chain of (computation, fusion) that led into a fusion
    body, so parameters can be traced back to the values feeding the fusion.
    GEMM fusion bodies are not entered (the fusion is the GEMM), nor are async
    wrappers (the -start instruction already stands for the collective).
    """
    seen.add(comp.name)
    for inst in comp.instructions.values():
        yield comp, inst, callers
        if inst.opcode == "async-start" or (
            inst.opcode == "fusion" and _gemm_fusion_backend(module, inst)
        ):
            continue
        inner = (*callers, (comp, inst)) if inst.opcode == "fusion" else ()
        for name in inst.called:
            if name in module.computations and name not in seen:
                yield from _walk(module, module.computations[name], inner, seen)


def _gemm_fusion_backend(module: _hlo.Module, fusion: _hlo.Instruction) -> str | None:
    """'triton', 'triton-scaled' or 'cudnn' for a custom fusion that computes a dot, else None."""
    kind = fusion.backend_kind or ""
    found = _find_dot(module, fusion) if fusion.fusion_kind == "kCustom" else None
    if found is None:
        return None
    if kind.startswith("__triton"):
        return "triton-scaled" if found[1].opcode == "scaled-dot" else "triton"
    return "cudnn" if "cudnn" in kind else None


def _find_dot(module: _hlo.Module, inst: _hlo.Instruction):
    """The first dot (or scaled-dot) in the computations ``inst`` calls, with its computation."""
    for name in inst.called:
        comp = module.computations.get(name)
        for inner in comp.instructions.values() if comp else ():
            if inner.opcode in _GEMM_OPS:
                return comp, inner
            found = _find_dot(module, inner)
            if found:
                return found
    return None


def _fusion_row(module, comp, fusion, callers) -> GemmRow:
    body, dot = _find_dot(module, fusion)
    backend = _gemm_fusion_backend(module, fusion)
    # The dot's operands may be parameters of the fusion body; an upcast
    # feeding them can sit inside the body or outside, in the caller.
    chain = (*callers, *_callers_to(module, comp, fusion, body))
    row = _dot_row(module, body, dot, fusion, backend, fusion.backend_kind or "", chain)
    if backend == "triton" and row.is_fp8:
        row = dataclasses.replace(row, backend="triton-fp8")
    return row


def _callers_to(module, comp, fusion, body) -> tuple:
    """The (computation, fusion) chain from ``comp`` down to the body holding the dot."""
    chain = ((comp, fusion),)
    current = module.computations[fusion.called[0]]
    while current.name != body.name:
        inner = next(i for i in current.instructions.values() if _reaches(module, i, body.name))
        chain += ((current, inner),)
        current = module.computations[inner.called[0]]
    return chain


def _reaches(module: _hlo.Module, inst: _hlo.Instruction, target: str) -> bool:
    for name in inst.called:
        if name == target:
            return True
        comp = module.computations.get(name)
        if comp and any(_reaches(module, i, target) for i in comp.instructions.values()):
            return True
    return False


def _dot_row(module, comp, dot, gemm, backend, target, callers) -> GemmRow:
    """The row of ``gemm`` (a fusion, or ``dot`` itself) from the dot it computes."""
    lhs, rhs = (_upcast.type_of(comp, op) for op in dot.operands[:2])
    located = gemm if "op_name" in gemm.metadata else dot
    row = _row(module, located, backend, "gemm", target, lhs, rhs, dot.types[0])
    row = dataclasses.replace(row, name=gemm.name)
    if not row.is_fp8:
        # A scaled-dot widens its f8 operands itself, inside the kernel.
        upcast = (dot.opcode == "scaled-dot" and (lhs.is_fp8 or rhs.is_fp8)) or any(
            _upcast.dequantized(module, comp, op, callers) for op in dot.operands[:2]
        )
        row = dataclasses.replace(row, upcast_from_fp8=upcast)
    return row


def _custom_call_row(module, comp, inst, ptx_forms=None) -> GemmRow | None:
    target = inst.custom_call_target or ""
    kernel = pallas_gemms.kernel_name(target, inst.attrs, inst.metadata.get("op_name", ""))
    pallas = None if kernel is None else pallas_gemms.KERNELS[kernel]
    if target in _CUBLAS_TARGETS:
        backend, kind = _CUBLAS_TARGETS[target], "gemm"
    elif target == _CUDNN_BLOCK_SCALED:
        backend, kind = "cudnn", "gemm"  # cudnn-fp8 once the operands are known
    elif "cudnn" in target and ("fmha" in target or "attention" in target):
        backend, kind = "cudnn", "attention"
    elif pallas is not None:
        backend, kind = "pallas", "gemm"  # pallas-fp8 once the operands are known
    else:
        return None  # not a GEMM: its operands may be anything (a CPU callback has one)
    operands = [inst.operands[i] for i in pallas or (0, 1)]
    lhs, rhs = (_upcast.type_of(comp, op) for op in operands)
    code_is_fp8 = None
    if pallas is not None:
        code_is_fp8 = pallas_gemms.fp8_mma(target, inst.attrs, kernel, ptx_forms)
        backend, target = pallas_gemms.backend(lhs.is_fp8, rhs.is_fp8, code_is_fp8), kernel
    elif target == _CUDNN_BLOCK_SCALED and lhs.is_fp8 and rhs.is_fp8:
        backend = "cudnn-fp8"
    row = _row(module, inst, backend, kind, target, lhs, rhs, inst.types[0])
    row = dataclasses.replace(row, fp8_mma=code_is_fp8)
    if kind == "gemm" and not row.is_fp8:
        widened = code_is_fp8 is False and lhs.is_fp8 and rhs.is_fp8  # inside the kernel
        upcast = widened or any(_upcast.dequantized(module, comp, op, ()) for op in operands)
        row = dataclasses.replace(row, upcast_from_fp8=upcast)
    return row


def _row(module, inst, backend, kind, target, lhs, rhs, out) -> GemmRow:
    source, op_name, stack = _location(module, inst)
    return GemmRow(
        name=inst.name,
        backend=backend,
        kind=kind,
        target=target,
        lhs_dtype=lhs.dtype,
        lhs_shape=lhs.shape,
        rhs_dtype=rhs.dtype,
        rhs_shape=rhs.shape,
        out_dtype=out.dtype,
        out_shape=out.shape,
        source=source,
        op_name=op_name,
        stack=stack,
    )


def _collective_row(module, comp, inst) -> CollectiveRow | None:
    kind, is_async = inst.opcode, False
    if kind.endswith("-start"):
        kind, is_async = kind.removesuffix("-start"), True
    if inst.opcode == "async-start":
        wrapped = module.computations.get(inst.called[0]) if inst.called else None
        kind = wrapped.root.opcode if wrapped else ""
    if kind not in COLLECTIVES:
        return None
    outputs = inst.types
    if is_async:
        done = next((u for u in comp.users.get(inst.name, ()) if u.opcode.endswith("-done")), None)
        outputs = done.types if done else inst.types[len(inst.types) // 2 :]
    inputs = [t for op in inst.operands for t in comp.instructions[op].types[:1]]
    size = max(sum(t.nbytes for t in outputs), sum(t.nbytes for t in inputs))
    dtype = "/".join(dict.fromkeys(t.dtype for t in outputs))
    source, op_name, _ = _location(module, inst, comp)
    return CollectiveRow(
        inst.name, kind, dtype, outputs[0].shape if outputs else (), size, is_async, source, op_name
    )


def _location(module: _hlo.Module, inst: _hlo.Instruction, comp=None):
    """(source, op_name, stack) of ``inst``; collectives XLA created borrow their input's."""
    metadata = inst.metadata
    if "op_name" not in metadata and comp is not None:
        # Passes such as all-reduce -> reduce-scatter drop the metadata; the
        # value being communicated still points at the user's line.
        producers = (comp.instructions.get(op) for op in inst.operands)
        metadata = next((p.metadata for p in producers if p and "op_name" in p.metadata), {})
    frames = ()
    if "stack_frame_id" in metadata:
        frames = module.stack(int(metadata["stack_frame_id"]))
    user = [frame for frame in frames if not _LIBRARY_FILE.search(frame.file)]
    if frames:
        source = str((user or frames)[0])
    elif "source_file" in metadata:
        source = f"{metadata['source_file']}:{metadata.get('source_line', 0)}"
    else:
        source = ""
    # compile_for's child wraps the exported function in jit(call); drop that
    # prefix so names read as in a direct compile.
    op_name = _EXPORT_PREFIX.sub("", metadata.get("op_name", ""))
    return source, op_name, tuple(f"{frame} in {frame.function}" for frame in frames)


def short_path(source: str) -> str:
    """``source`` relative to the working directory when it lies below it."""
    path, _, line = source.rpartition(":")
    if path.startswith(os.getcwd() + os.sep):
        return f"{os.path.relpath(path)}:{line}"
    return source


def _format(report: Report) -> Iterator[str]:
    n_fp8 = len(report.fp8_gemms)
    yield f"GEMMs: {len(report.gemms)} ({n_fp8} FP8, {len(report.gemms) - n_fp8} not FP8)"
    status = lambda g: "yes" if g.is_fp8 else ("UPCAST" if g.upcast_from_fp8 else "no")  # noqa: E731
    rows = [
        (
            str(i),
            g.backend,
            tensor_text(g.lhs_dtype, g.lhs_shape),
            tensor_text(g.rhs_dtype, g.rhs_shape),
            tensor_text(g.out_dtype, g.out_shape),
            status(g),
            short_path(g.source),
            g.op_name,
        )
        for i, g in enumerate(report.gemms, 1)
    ]
    yield from _table(("#", "backend", "lhs", "rhs", "out", "fp8", "source", "op_name"), rows)
    if report.attention:
        yield f"cuDNN attention: {len(report.attention)}"
        rows = [
            (str(i), a.target, tensor_text(a.lhs_dtype, a.lhs_shape), short_path(a.source))
            for i, a in enumerate(report.attention, 1)
        ]
        yield from _table(("#", "target", "q", "source"), rows)
    yield f"Collectives: {len(report.collectives)}"
    rows = [
        (
            str(i),
            c.kind + (" (async)" if c.is_async else ""),
            tensor_text(c.dtype, c.shape),
            f"{c.bytes:,}",
            short_path(c.source),
        )
        for i, c in enumerate(report.collectives, 1)
    ]
    yield from _table(("#", "kind", "result", "bytes", "source"), rows)


def tensor_text(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> Iterator[str]:
    if not rows:
        return
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers))]
    for row in (headers, *rows):
        yield "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
