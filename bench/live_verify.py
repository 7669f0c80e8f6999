"""Live-GPU side of the verifier (issue 3): run on the H200.

1. Reads the card's properties and compares them with the shipped H200
   target config.
2. Compiles fp8jax dense forward+backward, a QDQ dot and a BF16 dot live and
   deviceless (H200 target), with Triton GEMMs on and off, and prints both
   reports side by side.
3. Writes small live HLO samples for the parser tests to ``--out``.

    PYTHONPATH=src python bench/live_verify.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re

import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.verify import compile_for, gemm_report

TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"


def device_facts() -> None:
    target = pathlib.Path(fp8jax.verify.__file__).parent / "targets" / "h200.txtpb"
    shipped = dict(re.findall(r"(\w+): ([\d.]+)", target.read_text()))
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
    except Exception as e:
        print("cupy unavailable:", e)
        return
    measured = {
        "core_count": props["multiProcessorCount"],
        "l2_cache_size": props["l2CacheSize"],
        "device_memory_size": props["totalGlobalMem"],
        "shared_memory_per_block": props["sharedMemPerBlock"],
        "shared_memory_per_block_optin": props["sharedMemPerBlockOptin"],
        "shared_memory_per_core": props["sharedMemPerMultiprocessor"],
        "threads_per_core_limit": props["maxThreadsPerMultiProcessor"],
        "registers_per_core_limit": props["regsPerMultiprocessor"],
        "registers_per_block_limit": props["regsPerBlock"],
        "threads_per_block_limit": props["maxThreadsPerBlock"],
        "clock_rate_ghz": props["clockRate"] / 1e6,
        "memory_bandwidth": 2 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8,
    }
    print(f"device: {props['name']}, compute capability {props['major']}.{props['minor']}")
    print(f"{'field':<32} {'shipped':>16} {'measured':>16}")
    for field, value in measured.items():
        mark = "" if str(shipped.get(field)) == str(value) else "  <- differs"
        print(f"{field:<32} {shipped.get(field, '-'):>16} {value!s:>16}{mark}")


def programs():
    x = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)

    def fp8_dense(x, w):
        return jax.grad(lambda x, w: fp8jax.dense(x, w).astype(jnp.float32).sum(), argnums=(0, 1))(
            x, w
        )

    def qdq(x, w):
        deq = lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)  # noqa: E731
        return deq(x) @ deq(w)

    def bf16(x, w):
        return x @ w

    return {
        "fp8jax_dense_fwd_bwd": (fp8_dense, (x, w)),
        "qdq_dot": (qdq, (x, w)),
        "bf16_dot": (bf16, (x, w)),
    }


def summary(report) -> str:
    rows = [f"{g.backend}({g.lhs_dtype}x{g.rhs_dtype})" for g in report.gemms]
    return ", ".join(rows)


def compare(out: pathlib.Path | None) -> None:
    for flags in (None, TRITON_OFF):
        print(f"\n=== XLA flags: {flags or 'default'}")
        for name, (fn, args) in programs().items():
            live = gemm_report(compile_for(fn, *args, target="live", xla_flags=flags))
            deviceless = gemm_report(compile_for(fn, *args, target="h200", xla_flags=flags))
            print(f"{name}:\n  live       {summary(live)}\n  deviceless {summary(deviceless)}")
            if name == "fp8jax_dense_fwd_bwd":
                print(live)
    if out is not None:
        x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
        fn = programs()["fp8jax_dense_fwd_bwd"][0]
        for flags, tag in ((None, "default"), (TRITON_OFF, "triton_off")):
            text = compile_for(fn, x, w, target="live", xla_flags=flags)
            (out / f"live_h200_dense_fwd_bwd_{tag}.hlo.txt").write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices())
    device_facts()
    compare(pathlib.Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
