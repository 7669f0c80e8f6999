"""Shared GPU benchmark harness: timing, FP8 GEMM counts, memory, environment.

Timing is the median of ``iters`` individually synchronized calls after
``warmup`` calls, so one slow outlier (a clock ramp, a page fault) does not
move the result. Speed is only ever reported as a ratio against a baseline
measured in the same process.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time

import jax

from fp8jax.verify import gemm_report


def time_ms(fn, *args, warmup: int = 5, iters: int = 30) -> dict:
    """Median, 10th and 90th percentile wall time of ``fn(*args)`` in ms."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p10_ms": samples[len(samples) // 10],
        "p90_ms": samples[(9 * len(samples)) // 10],
        "iters": iters,
    }


def compiled_facts(jitted, *args) -> dict:
    """GEMM backends from the live compile, and the compiled peak memory."""
    compiled = jitted.lower(*args).compile()
    report = gemm_report(compiled.as_text())
    backends: dict[str, int] = {}
    for g in report.gemms:
        backends[g.backend] = backends.get(g.backend, 0) + 1
    memory = compiled.memory_analysis()
    peak = None
    if memory is not None:
        peak = (
            memory.temp_size_in_bytes
            + memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
        )
    return {
        "gemms": len(report.gemms),
        "fp8_gemms": len(report.fp8_gemms),
        "backends": backends,
        "attention": len(report.attention),
        "peak_memory_gib": None if peak is None else peak / 2**30,
        "report": report,
    }


def environment() -> dict:
    """Versions, device and date, for BENCHMARKS.md."""
    import flax
    import jaxlib

    return {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "device": str(jax.devices()[0].device_kind),
        "device_count": jax.device_count(),
    }


def print_table(title: str, rows: list[dict], baseline: str) -> None:
    """Ratios against ``baseline`` first; milliseconds as context."""
    base = next(r for r in rows if r["name"] == baseline)["median_ms"]
    print(f"\n{title}")
    print(
        f"{'variant':<28} {'vs ' + baseline:>10} {'median ms':>10} {'FP8 GEMMs':>10} "
        f"{'GEMMs':>6} {'peak GiB':>9}  backends"
    )
    for r in rows:
        print(
            f"{r['name']:<28} {base / r['median_ms']:>9.3f}x {r['median_ms']:>10.3f} "
            f"{r['fp8_gemms']:>10} {r['gemms']:>6} {r['peak_memory_gib'] or 0:>9.2f}  "
            f"{r['backends']}"
        )


def dump(path: str, payload: dict) -> None:
    """Writes ``payload`` (minus report objects) as JSON."""

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k != "report"}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    with open(path, "w") as f:
        json.dump(clean(payload), f, indent=2)
