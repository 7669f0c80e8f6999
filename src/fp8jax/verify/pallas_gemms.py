"""fp8jax's own Pallas GEMM kernels, as the GEMM report recognizes them.

A Pallas Triton kernel compiles to a ``__gpu$xla.gpu.triton`` custom call
whose backend config names the kernel (``name = "..."``); a Pallas Mosaic
GPU kernel to a ``mosaic_gpu_v2`` custom call whose ``op_name`` ends in
``<name>/mpmd_map``. Such a call is a GEMM of the report only when its name
is one of :data:`KERNELS`, each listed with the operands that hold its two
GEMM inputs; it is FP8 when both are f8 (backend ``pallas-fp8``, else
``pallas``), as for cuBLASLt's and Triton's GEMMs. Other Pallas kernels
(casts, norms) stay out of the report.

A Mosaic GPU kernel is FP8 only if its code says so too: Mosaic GPU lowers
``wgmma`` to inline PTX, which the custom call's serialized module carries,
and an FP8 ``wgmma`` names its operand types there
(``wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3``). A kernel that
reads f8 operands but issues no FP8 ``wgmma`` (it widened them to 16 bits
first) is reported as ``pallas``, upcast from FP8. A Pallas Triton call
carries Triton IR, whose MMA instruction Triton picks later: its code is in
the PTX XLA writes with ``--xla_dump_to`` (:func:`read_ptx`), one ``.entry``
per kernel; given it, the report requires FP8 ``wgmma``s there too, and
without it the operands' types are the evidence (:func:`fp8_mma` returns None).
"""

from __future__ import annotations

import pathlib
import re

TRITON_TARGET = "__gpu$xla.gpu.triton"
MOSAIC_GPU_TARGET = "mosaic_gpu_v2"
# Kernel name -> the operand indices of its two GEMM inputs.
KERNELS = {
    "fp8jax_block_scaled_gemm": (0, 1),  # fp8jax.kernels.block_gemm (Mosaic GPU)
    # fp8jax.kernels.grouped_gemm: the group tables come first, the operands last.
    "fp8jax_grouped_gemm": (-2, -1),
    "fp8jax_grouped_gemm_wgrad": (-2, -1),
    # fp8jax.kernels.attention: Q and K (QKᵀ; the kernel's PV runs on the same FP8 tensor cores).
    "fp8jax_attention_fwd": (0, 1),
    # fp8jax.kernels.attention_backward: the gradient products take BF16 Q and V
    # (the scores' recompute is FP8), so the report lists them as not FP8.
    "fp8jax_attention_dkv": (4, 6),
    "fp8jax_attention_dq": (4, 6),
}

_NAME = re.compile(r'\bname = "([^"]*)"')


def kernel_name(target: str, attrs: str, op_name: str) -> str | None:
    """The :data:`KERNELS` name of a Pallas custom call, or None for any other call."""
    if target not in (TRITON_TARGET, MOSAIC_GPU_TARGET):
        return None
    # A Triton call's backend config names the kernel; JAX's op_name ends in
    # ".../<name>/pallas_call" (Triton) or ".../<name>/mpmd_map" (Mosaic GPU).
    match = _NAME.search(attrs.split("backend_config=", 1)[-1]) if target == TRITON_TARGET else None
    parts = op_name.split("/")
    names = [match.group(1)] if match else []
    if len(parts) >= 2 and parts[-1] in ("pallas_call", "mpmd_map"):
        names.append(parts[-2])
    return next((name for name in names if name in KERNELS), None)


# E4M3 or E5M2 on both sides, f32 accumulation: the FP8 forms of Hopper's wgmma.
_FP8_WGMMA = re.compile(
    r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e[45]m[23]\.e[45]m[23]\b"
)


# Any wgmma form (d, a, b types) and Ampere's mma.sync, in PTX or inline PTX.
_WGMMA_FORM = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.(\w+)\.(\w+)\.(\w+)")
_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\b")
_ENTRY = re.compile(r"\.entry\s+(\w+?)(?:__\d+)?\s*\(")  # XLA numbers repeats: name__1
_FP8_TYPES = {"e4m3", "e5m2"}


def read_ptx(folder) -> dict[str, str]:
    """The PTX files XLA wrote to ``--xla_dump_to=folder``, by file name.

    Example::

        dump = tempfile.mkdtemp()
        hlo = compile_for(fn, *args, target="h200", xla_flags=f"--xla_dump_to={dump}")
        report = gemm_report(hlo, ptx=read_ptx(dump))
    """
    return {p.name: p.read_text() for p in sorted(pathlib.Path(folder).glob("*.ptx"))}


def ptx_mma_forms(ptx) -> dict[str, frozenset[tuple[str, ...]]]:
    """Each PTX kernel's MMA forms: ``{name: {(d, a, b), ...}}`` for its ``wgmma``s, with
    ``("mma.sync",)`` for an Ampere-style MMA. ``ptx``: PTX texts, or a dict of them."""
    texts = ptx.values() if isinstance(ptx, dict) else ptx
    forms: dict[str, set] = {}
    for text in texts:
        starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(text)]
        for i, (start, name) in enumerate(starts):
            body = text[start : starts[i + 1][0] if i + 1 < len(starts) else len(text)]
            found = forms.setdefault(name, set())
            found.update(m.groups() for m in _WGMMA_FORM.finditer(body))
            if _MMA_SYNC.search(body):
                found.add(("mma.sync",))
    return {name: frozenset(f) for name, f in forms.items()}


def fp8_mma(target: str, attrs: str, kernel: str = "", ptx_forms=None) -> bool | None:
    """Whether a Pallas GEMM kernel's code multiplies on FP8 tensor cores, or None if unknown.

    A Mosaic GPU kernel: its inline PTX (``attrs``, the custom call's attributes
    as the HLO text prints them, serialized module included) has an FP8
    ``wgmma``. A Triton kernel: its PTX entries named ``kernel`` (``ptx_forms``,
    from :func:`ptx_mma_forms`) have MMAs, all FP8 ``wgmma``s; None without them.
    """
    if target == MOSAIC_GPU_TARGET:
        return _FP8_WGMMA.search(attrs) is not None
    if ptx_forms is None or kernel not in ptx_forms:
        return None
    forms = ptx_forms[kernel]
    return bool(forms) and all(len(f) == 3 and set(f[1:]) <= _FP8_TYPES for f in forms)


def backend(lhs_is_fp8: bool, rhs_is_fp8: bool, code_is_fp8: bool | None = None) -> str:
    """The report's backend of a Pallas GEMM: ``pallas-fp8`` on two f8 operands,
    unless its code (:func:`fp8_mma`) shows no FP8 MMA."""
    return "pallas-fp8" if lhs_is_fp8 and rhs_is_fp8 and code_is_fp8 is not False else "pallas"
