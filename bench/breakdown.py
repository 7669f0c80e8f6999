"""Where a compiled step's GPU time goes, by kernel class, from a profiler trace.

The trace (``jax.profiler``'s XSpace, read with ``jax.profiler.ProfileData``,
so nothing beyond JAX is needed) names each kernel after the HLO fusion that
launched it, or after the library kernel (cuBLASLt, cuDNN, NCCL). The
compiled HLO text then says what each fusion reads and writes, which is how a
quantize kernel is told apart: it writes FP8 from a high-precision array.

Classes: ``gemm`` (cuBLAS/cuBLASLt or Triton GEMM fusions), ``attention``
(cuDNN, and fp8jax's own FP8 attention kernels by their names), ``quantize``
(fusions writing FP8 from high precision), ``fp8-relayout`` (FP8 in, FP8
out: the transposes cuBLASLt's FP8 GEMMs need for operands whose
contracting axis is not the minor one), ``all-gather`` /
``reduce-scatter`` / ``all-reduce`` / ``collective`` (NCCL), ``optimizer``
(the fusions under the train step's ``fp8jax.optimizer`` named scope: the
gradient norm and the update) and ``other`` (norms, activations, amax
passes, residual adds, copies).
"""

from __future__ import annotations

import collections
import glob
import os
import re

from jax.profiler import ProfileData

from fp8jax.kernels import attention, attention_backward

_GEMM_LIBRARY = re.compile(r"gemm|xmma|cutlass|cublas|sm90_|sm80_|gmma", re.IGNORECASE)
_ATTENTION_LIBRARY = re.compile(r"cudnn|fmha|flash|sdpa", re.IGNORECASE)
# fp8jax's Mosaic GPU attention kernels, by the kernel_name each is built with: a
# trace shows one under a name that starts with it (Mosaic GPU appends its own
# suffix, as in NAME_mosaic_gpu_kernel), so they are matched as prefixes, read
# from the library so that a rename follows.
FP8JAX_ATTENTION_KERNELS = (
    attention.KERNEL_NAME,
    attention_backward.DKV_KERNEL,
    attention_backward.DQ_KERNEL,
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s(\w[\w\-]*)\(", re.MULTILINE)
# "__triton_gemm", and "__triton_nested_gemm_fusion" in newer XLA.
_TRITON_GEMM = re.compile(r'"kind":"__triton\w*gemm')
_PALLAS_TRITON = "__gpu$xla.gpu.triton"
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
# fp8jax's train steps run the optimizer under this named scope (fp8jax.flax.train).
_OPTIMIZER_SCOPE = "/fp8jax.optimizer/"
# The classes a step's time is published in, in order; the NCCL classes join them
# under a mesh.
CLASSES = ("gemm", "attention", "quantize", "fp8-relayout", "optimizer", "other")


def _kernel_name(name: str) -> str:
    # Kernels are named after their fusion with '.' and '-' turned into '_'.
    return re.sub(r"[.\-]", "_", name)


def _is_fp8_array(shape: str) -> bool:
    return any(t.startswith("f8") and dims for t, dims in _ARRAY.findall(shape))


def _reads_high_precision(shape_of: dict[str, str], operands: str) -> bool:
    """Whether any operand is a non-scalar, non-FP8 floating array."""
    for name in _OPERAND.findall(operands):
        for dtype, dims in _ARRAY.findall(shape_of.get(name, "")):
            if dims and dtype[:2] in ("bf", "f1", "f3", "f6"):
                return True
    return False


def fusion_classes(hlo_text: str) -> dict[str, str]:
    """Kernel name -> class, for the GEMMs, attention calls and FP8-writing fusions."""
    matches = list(_INSTRUCTION.finditer(hlo_text))
    shape_of = {m.group(1): m.group(2) for m in matches}
    classes = {}
    for match in matches:
        name, shape, opcode = match.groups()
        line_end = hlo_text.find("\n", match.end())
        line = hlo_text[match.start() : line_end if line_end >= 0 else None]
        if _TRITON_GEMM.search(line) or "__cublas" in line:
            kind = "gemm"
        elif "cudnn" in line and opcode == "custom-call":
            kind = "attention"
        elif opcode in ("fusion", "copy", "transpose") and _is_fp8_array(shape):
            start = match.end() - match.start()
            operands = line[start : line.find(")", start)]
            quantizes = _reads_high_precision(shape_of, operands)
            kind = "quantize" if quantizes else "fp8-relayout"
        elif opcode == "custom-call" and _PALLAS_TRITON in line and _is_fp8_array(shape):
            # A Pallas kernel (fp8jax.kernels.cast_transpose) runs under the name
            # given to its pallas_call, the scope above "pallas_call" in op_name.
            start = match.end() - match.start()
            operands = line[start : line.find(")", start)]
            op_name = _OP_NAME.search(line)
            scopes = op_name.group(1).split("/") if op_name else []
            name = scopes[-2] if len(scopes) > 1 else name
            kind = "quantize" if _reads_high_precision(shape_of, operands) else "fp8-relayout"
        elif _OPTIMIZER_SCOPE in line:
            kind = "optimizer"
        else:
            continue
        classes[_kernel_name(name)] = kind
    return classes


def fusion_descriptions(hlo_text: str) -> dict[str, str]:
    """Kernel name -> "result shape | source op", to tell what an unnamed fusion computes."""
    described = {}
    for match in _INSTRUCTION.finditer(hlo_text):
        name, shape, _ = match.groups()
        line_end = hlo_text.find("\n", match.end())
        op_name = _OP_NAME.search(hlo_text, match.end(), line_end if line_end >= 0 else None)
        # The last two scopes (module and primitive) are what tells fusions apart.
        source = "/".join(op_name.group(1).split("/")[-2:]) if op_name else ""
        described[_kernel_name(name)] = f"{shape[:80]} | {source}"
    return described


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
    if kernel.startswith(FP8JAX_ATTENTION_KERNELS):
        return "attention"
    if kernel in fusions:
        return fusions[kernel]
    # A program with several calls of one Pallas kernel runs them as NAME,
    # NAME__1, NAME__2, ... (the Triton module's name made unique).
    unsuffixed = re.sub(r"__\d+$", "", kernel)
    if unsuffixed in fusions:
        return fusions[unsuffixed]
    if _ATTENTION_LIBRARY.search(kernel):
        return "attention"
    if _GEMM_LIBRARY.search(kernel) and "fusion" not in lowered:
        return "gemm"
    return "other"


def gpu_planes(trace_dir: str) -> list:
    """The GPU planes of the newest trace under ``trace_dir``."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    return [plane for plane in data.planes if plane.name.startswith("/device:GPU")]


def kernel_times_us(planes) -> dict[str, float]:
    """Total microseconds per kernel name over every GPU plane in ``planes``."""
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                totals[event.name] += event.duration_ns / 1e3
    return dict(totals)


def idle_gaps_us(intervals) -> list[float]:
    """The gaps, in us, between the union of ``(start_ns, end_ns)`` intervals."""
    gaps, reach = [], None
    for start, end in sorted(intervals):
        if reach is not None and start > reach:
            gaps.append((start - reach) / 1e3)
        reach = end if reach is None else max(reach, end)
    return gaps


# Upper bounds (us) of the idle-gap bins: launch gaps inside a step are a few
# us; the gaps between the profiled steps, which are synchronized one by one,
# include the host's dispatch of the next step.
GAP_BINS_US = (10.0, 100.0, 1000.0, float("inf"))


def gap_histogram_ms(planes, steps: int, devices: int = 1) -> dict[str, float]:
    """Idle GPU time between kernels per step and GPU, in ms, binned by gap length."""
    totals = dict.fromkeys(GAP_BINS_US, 0.0)
    for plane in planes:
        intervals = [(e.start_ns, e.end_ns) for line in plane.lines for e in line.events]
        for gap in idle_gaps_us(intervals):
            totals[next(b for b in GAP_BINS_US if gap < b)] += gap
    labels = ["<10us", "10-100us", "0.1-1ms", ">=1ms"]
    per_step = 1e3 * steps * devices
    return {label: totals[b] / per_step for label, b in zip(labels, GAP_BINS_US, strict=True)}


def breakdown(trace_dir: str, hlo_text: str, steps: int, devices: int = 1) -> dict:
    """Per-step, per-GPU kernel time by class (ms), and the quantize share.

    Shares are of the summed kernel time, which equals the step time when the
    GPU never idles; ``kernel_ms`` is that sum, to compare with the wall time.
    """
    fusions = fusion_classes(hlo_text)
    described = fusion_descriptions(hlo_text)
    per_class: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, tuple[str, float]] = {}
    planes = gpu_planes(trace_dir)
    for name, us in kernel_times_us(planes).items():
        kind = classify(name, fusions)
        per_class[kind] += us
        kernels[name] = (kind, us)
    scale = 1.0 / (1e3 * steps * devices)
    total = sum(per_class.values()) * scale
    by_time = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {
        "kernel_ms": total,
        "ms": {k: v * scale for k, v in sorted(per_class.items())},
        "share": {k: v * scale / total for k, v in sorted(per_class.items())} if total else {},
        "idle_ms": gap_histogram_ms(planes, steps, devices),
        # Every kernel, so two variants' "other" time can be compared kernel by kernel.
        "kernels_ms": {
            name: {"class": kind, "ms": us * scale, "what": described.get(name, "")}
            for name, (kind, us) in by_time
        },
    }


def main():
    import argparse
    import json

    parser = argparse.ArgumentParser(
        description="List one kernel class of benchmark rows, slowest first, per variant."
    )
    parser.add_argument("results", help="a bench JSON file written with --trace")
    parser.add_argument("--variants", nargs="*", default=None)
    parser.add_argument("--kind", default="other", help="kernel class (default: other)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.results) as f:
        results = json.load(f)
    # layer.py and gpt.py write {"rows": [...]}; mlp.py {"cases": {activations: [...]}}.
    cases = results.get("cases", {"": results.get("rows", [])})
    for case, rows in cases.items():
        if case:
            print(f"== {case}")
        _print_rows(rows, args)


def _print_rows(rows: list[dict], args) -> None:
    for row in rows:
        kernels = row.get("breakdown", {}).get("kernels_ms")
        if kernels is None or (args.variants and row["name"] not in args.variants):
            continue
        chosen = [(n, k) for n, k in kernels.items() if k["class"] == args.kind]
        total = sum(k["ms"] for _, k in chosen)
        print(f"{row['name']}: {args.kind} {total:.3f} ms in {len(chosen)} kernels")
        for name, k in chosen[: args.top]:
            print(f"  {k['ms']:7.3f}  {name[:40]:40s} {k['what']}")


if __name__ == "__main__":
    main()
