"""How many of the train step's GEMMs are FP8, from the verifier.

Always: :func:`fp8jax.verify.jaxpr_dots` on the traced train step, which is
cheap and needs no GPU toolchain. The scanned layer body is one jaxpr, so its
GEMMs count once, not once per layer. Optionally: a deviceless compile for an
H100/H200 (``fp8jax[verify]``), whose optimized HLO shows what each GEMM
really runs as. That one never fails the run: a missing toolchain or a failed
compile is reported as skipped, with the reason.
"""

from __future__ import annotations

import time

import jax

from fp8jax import xla_options
from fp8jax.verify.jaxpr_dots import jaxpr_dots


def jaxpr_counts(step_fn, *args) -> dict:
    """``{"fp8": n, "total": m, "scope": ...}`` for the dot_generals ``step_fn`` traces to."""
    dots = jaxpr_dots(step_fn, *args)
    return {
        "fp8": sum(d.is_fp8 for d in dots),
        "total": len(dots),
        "scope": "jaxpr dot_generals; the scanned layer body counts once",
    }


def _abstract(tree):
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
        tree,
    )


def deviceless_counts(step_fn, state, batch, *, target: str, mesh) -> dict:
    """Compiles the step for ``target`` and counts the HLO's FP8 GEMMs.

    ``target`` is ``"h100"``/``"h200"`` (deviceless) or ``"live"`` (this GPU).

    Returns ``{"target", "fp8", "total", "attention", "seconds"}``, or
    ``{"target", "skipped": reason}`` when the toolchain is missing or the compile fails.
    """
    try:
        from fp8jax import verify
    except ImportError as e:  # pragma: no cover - verify ships with fp8jax
        return {"target": target, "skipped": str(e)}
    start = time.perf_counter()
    devices = 1 if mesh is None else mesh.size
    try:
        hlo = verify.compile_for(
            step_fn,
            _abstract(state),
            _abstract(batch),
            target=target,
            devices=devices,
            mesh=mesh,
            # The options the step itself compiles with, so the report shows its GEMMs.
            xla_flags=xla_options.as_xla_flags(),
        )
    except ImportError as e:
        return {"target": target, "skipped": f"fp8jax[verify] is not installed: {e}"}
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return {"target": target, "skipped": f"compile failed: {type(e).__name__}: {first}"}
    report = verify.gemm_report(hlo)
    return {
        "target": target,
        "fp8": len(report.fp8_gemms),
        "total": len(report.gemms),
        "attention": len(report.attention),
        "seconds": round(time.perf_counter() - start, 1),
    }
