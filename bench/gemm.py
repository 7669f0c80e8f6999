"""Single GEMMs: BF16 vs FP8 on pre-quantized operands vs fp8jax.dense (issue 8).

Reports TFLOP/s and the fraction of the H200's dense peaks (FP8 1979, BF16
989 TFLOP/s). "fp8_prequantized" is the GEMM alone; "fp8jax_dense_*" include
quantizing both operands every call, as training does.

    PYTHONPATH=src python bench/gemm.py [--shapes 8192x8192x8192 16384x4096x16384]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from harness import (
    add_compile_cache_argument,
    add_heat_argument,
    calibrate_flax_state,
    calibrate_state,
    dump,
    measure,
    start,
)
from jax import lax

import fp8jax

BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn
PEAK_TFLOPS = {"fp8": 1979.0, "bf16": 989.0}


def flax_gemm(op_cls, x, w, dims):
    """Flax's FP8 dot_general module alone, forward, with its scale state calibrated.

    Flax's scales start at 1; a training step's gradient of its FP8
    collection calibrates them, as for fp8jax's delayed row.
    """
    op = op_cls()
    variables = op.init(jax.random.key(0), x, w, dims)
    train = jax.jit(jax.value_and_grad(
        lambda v, x, w: op.apply(v, x, w, dims).astype(jnp.float32).sum(), argnums=(0, 1, 2)
    ))  # fmt: skip
    variables = calibrate_flax_state(train, [variables, x, w])
    return jax.jit(lambda v, x, w: op.apply(v, x, w, dims)), (variables, x, w)


def variants(m, k, n):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k)).astype(BF16)
    w = (jax.random.normal(kw, (k, n)) * 0.02).astype(BF16)
    dims = (((1,), (0,)), ((), ()))
    delayed = fp8jax.DelayedScaling(amax_history_len=16)

    def delayed_dense(x, w, s):
        return fp8jax.dense(x, w, recipe=delayed, state=s)

    # The forward alone returns no state: a training step's gradient calibrates
    # the scales, which would otherwise stay 1 (docs/design.md#the-benchmarks-loss-and-fp8-state).
    train = jax.jit(jax.value_and_grad(
        lambda x, w, s: delayed_dense(x, w, s).astype(jnp.float32).sum(), argnums=(0, 1, 2)
    ))  # fmt: skip
    state = calibrate_state(train, [x, w, fp8jax.init_state(delayed)], state_arg=2)
    return {
        "bf16": ("bf16", jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=BF16)), (x, w)),
        "fp8_prequantized": (
            "fp8",
            jax.jit(lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=BF16)),
            (x.astype(E4M3), w.astype(E4M3)),
        ),
        "flax_fp8_direct": ("fp8", *flax_gemm(fp8_ops.Fp8DirectDotGeneralOp, x, w, dims)),
        "flax_fp8_qdq": ("fp8", *flax_gemm(fp8_ops.Fp8DotGeneralOp, x, w, dims)),
        "fp8jax_dense_current": ("fp8", jax.jit(fp8jax.dense), (x, w)),
        "fp8jax_dense_delayed": (
            "fp8",
            jax.jit(delayed_dense),
            (x, w, state),
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["8192x8192x8192", "16384x4096x16384"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None)
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    env = start(args)
    print(env)
    results = {"environment": env, "shapes": {}}
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        flops = 2 * m * k * n
        rows = []
        print(f"\nGEMM {m}x{k}x{n}")
        print(f"{'variant':<24} {'vs bf16':>8} {'ms':>8} {'TFLOP/s':>8} {'of peak':>8}  backends")
        base = None
        for name, (kind, fn, fn_args) in variants(m, k, n).items():
            row = measure(name, fn, *fn_args, iters=args.iters)
            tflops = flops / row["median_ms"] / 1e9
            base = base or row["median_ms"]
            rows.append(row | {"tflops": tflops, "fraction_of_peak": tflops / PEAK_TFLOPS[kind]})
            print(
                f"{name:<24} {base / row['median_ms']:>7.3f}x {row['median_ms']:>8.3f} "
                f"{tflops:>8.0f} {tflops / PEAK_TFLOPS[kind]:>7.1%}  {row['backends']}"
            )
        results["shapes"][shape] = rows
    if args.out:
        dump(args.out, results)


if __name__ == "__main__":
    main()
