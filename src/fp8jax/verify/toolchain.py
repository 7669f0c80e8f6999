"""What a deviceless compile needs installed, and the shipped GPU target configs.

A CPU-only machine compiles for a GPU through the CUDA PJRT plugin, which must
match jaxlib to the patch version, with ``ptxas`` (nvidia-cuda-nvcc) and
libdevice (nvidia-nvvm) next to it. Each check names the package that fixes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import os
import pathlib
import re
import shutil

TARGET_NAMES = ("h100", "h200", "b200")
PLUGIN = "jax-cuda13-plugin"
PJRT = "jax-cuda13-pjrt"  # the plugin's PJRT half, which registers jax_plugins.xla_cuda13
# XLA divides by some of these; a config without them crashes the compiler.
_REQUIRED_FIELDS = ("gpu_device_info", "core_count", "threads_per_warp", "cuda_compute_capability")


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_deviceless() -> None:
    """Raises ImportError, naming the fix, unless a deviceless compile can run.

    Example:
      >>> from fp8jax.verify import toolchain
      >>> toolchain.check_deviceless()  # silent when fp8jax[verify] is installed
    """
    jaxlib, plugin, pjrt = (distribution_version(n) for n in ("jaxlib", PLUGIN, PJRT))
    if plugin is None or pjrt is None:
        missing = " and ".join(n for n, v in ((PLUGIN, plugin), (PJRT, pjrt)) if v is None)
        raise ImportError(
            f"Deviceless GPU compiles need the CUDA plugin, but {missing} is not installed. "
            f"Install it with: pip install 'fp8jax[verify]'  (or pip install {PLUGIN}=={jaxlib})"
        )
    if plugin != jaxlib or pjrt != jaxlib:
        raise ImportError(
            f"{PLUGIN} {plugin} (with {PJRT} {pjrt}) does not match jaxlib {jaxlib}; the "
            f"plugin must be the exact jaxlib version. Fix: pip install {PLUGIN}=={jaxlib}"
        )
    roots = cuda_roots()
    if not any((root / "bin" / "ptxas").is_file() for root in roots):
        raise ImportError(
            "ptxas was not found, and XLA needs it to compile GPU kernels. Install "
            "nvidia-cuda-nvcc (pip install nvidia-cuda-nvcc, part of 'fp8jax[verify]'), or "
            f"set CUDA_ROOT to a CUDA toolkit. Searched: {[str(r) for r in roots]}"
        )
    if not any((root / "nvvm" / "libdevice" / "libdevice.10.bc").is_file() for root in roots):
        raise ImportError(
            "libdevice (nvvm/libdevice/libdevice.10.bc) was not found, and XLA needs it for "
            "math such as gelu. Install nvidia-nvvm (pip install nvidia-nvvm, part of "
            f"'fp8jax[verify]'), or set CUDA_ROOT. Searched: {[str(r) for r in roots]}"
        )


def cuda_roots() -> list[pathlib.Path]:
    """Where XLA looks for ``bin/ptxas`` and ``nvvm/``: CUDA_ROOT, then the pip wheels."""
    roots = []
    if os.environ.get("CUDA_ROOT"):
        roots.append(pathlib.Path(os.environ["CUDA_ROOT"]))
    for package in ("nvidia.cu13", "nvidia.cuda_nvcc"):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            roots.extend(pathlib.Path(p) for p in spec.submodule_search_locations)
    ptxas = shutil.which("ptxas")
    if ptxas:
        roots.append(pathlib.Path(ptxas).resolve().parent.parent)
    return roots


def target_config(name: str) -> str:
    """The ``GpuTargetConfigProto`` text shipped for ``name`` ("h100", "h200" or "b200")."""
    if name not in TARGET_NAMES:
        raise ValueError(f"target must be one of {TARGET_NAMES}, got {name!r}.")
    files = importlib.resources.files("fp8jax.verify") / "targets" / f"{name}.txtpb"
    return files.read_text()


def validate_target_config(text: str, origin: str) -> str:
    """Returns ``text`` if it has the fields XLA divides by; raises ValueError otherwise."""
    missing = [f for f in _REQUIRED_FIELDS if not re.search(rf"\b{f}\b", text)]
    if missing:
        raise ValueError(
            f"target config {origin} lacks {', '.join(missing)}; XLA crashes (SIGFPE) on a "
            "GpuTargetConfigProto without them. Start from fp8jax/verify/targets/h100.txtpb."
        )
    return text
