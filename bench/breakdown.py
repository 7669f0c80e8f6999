"""Where a compiled step's GPU time goes, by kernel class, from a profiler trace.

The trace (``jax.profiler``'s XSpace, read with ``jax.profiler.ProfileData``,
so nothing beyond JAX is needed) names each kernel after the HLO fusion that
launched it, or after the library kernel (cuBLASLt, cuDNN, NCCL). The
compiled HLO text then says what each fusion writes, which is how a
quantize kernel is told apart: it is a fusion whose result holds an FP8 array.

Classes: ``gemm`` (cuBLAS/cuBLASLt or Triton GEMM fusions), ``attention``
(cuDNN), ``quantize`` (fusions writing FP8), ``all-gather`` /
``reduce-scatter`` / ``all-reduce`` / ``collective`` (NCCL) and ``other``
(norms, activations, amax and optimizer fusions, copies).
"""

from __future__ import annotations

import collections
import glob
import os
import re

from jax.profiler import ProfileData

_GEMM_LIBRARY = re.compile(r"gemm|xmma|cutlass|cublas|sm90_|sm80_|gmma", re.IGNORECASE)
_ATTENTION_LIBRARY = re.compile(r"cudnn|fmha|flash|sdpa", re.IGNORECASE)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s(\w[\w\-]*)\(", re.MULTILINE)


def _kernel_name(name: str) -> str:
    # Kernels are named after their fusion with '.' and '-' turned into '_'.
    return re.sub(r"[.\-]", "_", name)


def fusion_classes(hlo_text: str) -> dict[str, str]:
    """Kernel name -> class, for every fusion and custom call in ``hlo_text``."""
    classes = {}
    for match in _INSTRUCTION.finditer(hlo_text):
        name, shape, opcode = match.groups()
        line_end = hlo_text.find("\n", match.end())
        line = hlo_text[match.start() : line_end if line_end >= 0 else None]
        if "__triton_gemm" in line or "__cublas" in line:
            kind = "gemm"
        elif "cudnn" in line and opcode == "custom-call":
            kind = "attention"
        elif opcode == "fusion" and "f8e" in shape:
            kind = "quantize"
        else:
            continue
        classes[_kernel_name(name)] = kind
    return classes


def classify(kernel: str, fusions: dict[str, str]) -> str:
    lowered = kernel.lower()
    if "nccl" in lowered:
        for key, kind in (
            ("allgather", "all-gather"),
            ("reducescatter", "reduce-scatter"),
            ("allreduce", "all-reduce"),
        ):
            if key in lowered:
                return kind
        return "collective"
    if kernel in fusions:
        return fusions[kernel]
    if _ATTENTION_LIBRARY.search(kernel):
        return "attention"
    if _GEMM_LIBRARY.search(kernel) and "fusion" not in lowered:
        return "gemm"
    return "other"


def kernel_times_us(trace_dir: str) -> dict[str, float]:
    """Total microseconds per kernel name over every GPU in the newest trace."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                totals[event.name] += event.duration_ns / 1e3
    return dict(totals)


def breakdown(trace_dir: str, hlo_text: str, steps: int, devices: int = 1) -> dict:
    """Per-step, per-GPU kernel time by class (ms), and the quantize share.

    Shares are of the summed kernel time, which equals the step time when the
    GPU never idles; ``kernel_ms`` is that sum, to compare with the wall time.
    """
    fusions = fusion_classes(hlo_text)
    per_class: dict[str, float] = collections.defaultdict(float)
    top: dict[str, float] = {}
    for name, us in kernel_times_us(trace_dir).items():
        per_class[classify(name, fusions)] += us
        top[name] = us
    scale = 1.0 / (1e3 * steps * devices)
    total = sum(per_class.values()) * scale
    return {
        "kernel_ms": total,
        "ms": {k: v * scale for k, v in sorted(per_class.items())},
        "share": {k: v * scale / total for k, v in sorted(per_class.items())} if total else {},
        "top_kernels_ms": {
            k: v * scale for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]
        },
    }
