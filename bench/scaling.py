"""Fine-grained scaling on the GPU (issue 35): the block kernel's numerics and speed, rowwise dense.

1. The block-scaled GEMM kernel against XLA's expression of the same sums
   (:func:`fp8jax.kernels.block_gemm.xla_block_matmul`) and an f32 reference.
2. The block-scaled GEMM alone at ``--gemm`` (TFLOP/s) for a few kernel
   configurations, against the BF16 GEMM and the per-tensor FP8 GEMM
   (cuBLASLt, operands pre-quantized).
3. ``fp8jax.dense`` forward + backward (random output gradient) at
   ``--dense`` under RowwiseScaling, BlockScaling, CurrentScaling and BF16.

    PYTHONPATH=src python bench/scaling.py --heat 0.5 --out results.json
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
from harness import (
    add_compile_cache_argument,
    add_heat_argument,
    dump,
    grad_part,
    measure,
    output_cotangent,
    start,
)
from jax import lax

import fp8jax
from fp8jax.kernels import block_gemm
from fp8jax.ops.fine_quantize import quantize_blocks, quantize_tiles

BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn
# Kernel configurations timed, by name; the first is the library's default.
CONFIGS = {
    "default": {},
    "group4": {"config": block_gemm.KernelConfig(group=4)},
    "group16": {"config": block_gemm.KernelConfig(group=16)},
    "stages3": {"config": block_gemm.KernelConfig(stages=3)},
}


def operands(m, k, n, key=0):
    kx, kw = jax.random.split(jax.random.key(key))
    x = jax.random.normal(kx, (1, m, k), jnp.float32)
    w = jax.random.normal(kw, (1, n, k), jnp.float32) * 0.02
    a, b = quantize_tiles(x, fp8jax.E4M3, 128), quantize_blocks(w, fp8jax.E4M3, 128)
    return x, w, (a.data, b.data, a.scale_inv, block_gemm.expand_blocks(b.scale_inv, 128))


def check(m=1024, k=2048, n=768) -> dict:
    x, w, ops = operands(m, k, n, key=1)
    out = {}
    xla = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32))(*ops)
    exact = jnp.einsum("bmk,bnk->bmn", x, w, precision=lax.Precision.HIGHEST)
    for config, kwargs in list(CONFIGS.items())[:1]:
        fn = functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.float32, **kwargs)
        y = jax.jit(fn)(*ops)
        out[config] = {
            "max_rel_diff_vs_xla": float(jnp.max(jnp.abs(y - xla)) / jnp.max(jnp.abs(xla))),
            "rel_error_vs_f32": float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)),
        }
    out["xla_rel_error_vs_f32"] = float(jnp.linalg.norm(xla - exact) / jnp.linalg.norm(exact))
    print("check", out, flush=True)
    return out


def gemm_rows(m, k, n, iters, trace=None) -> list[dict]:
    """The GEMM rows; with ``trace`` (a folder), each row also has ``device_ms``.

    ``device_ms`` is the kernels' own time per call from a profile of three
    calls: at about a millisecond a call, the synchronized median also holds
    the host's dispatch and wait, several tenths of a millisecond on the H200
    (docs/design.md#the-block-scaled-gemm-kernel).
    """
    x, w, ops = operands(m, k, n)
    flops = 2 * m * k * n
    rows = []
    dims = (((1,), (1,)), ((), ()))
    a8, b8 = x[0].astype(E4M3), w[0].astype(E4M3)
    variants = {
        "bf16": (jax.jit(lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=BF16)),
                 (x[0].astype(BF16), w[0].astype(BF16))),
        "fp8_per_tensor_cublaslt": (
            jax.jit(lambda a, b, s: lax.dot_general(a, b, dims, preferred_element_type=BF16) * s,
                    compiler_options=fp8jax.compiler_options()),
            (a8, b8, jnp.float32(0.5).astype(BF16))),
    }  # fmt: skip
    # The weight's block scales (b_blocks, the library's forward and dgrad): one
    # scalar a tile and step; per-row scales (its wgrad's form): a row and a column.
    b_blocks = quantize_blocks(w, fp8jax.E4M3, 128).scale_inv
    for config, kwargs in CONFIGS.items():
        for form, scales in (("blocks", b_blocks), ("rows", ops[3])):
            fn = functools.partial(block_gemm.mosaic_block_matmul, out_dtype=BF16,
                                   b_blocks=form == "blocks", **kwargs)  # fmt: skip
            variants[f"block_mosaic_{form}_{config}"] = (jax.jit(fn), (*ops[:3], scales))
    for name, (fn, args) in variants.items():
        where = os.path.join(trace, name) if trace else None
        try:
            row = measure(name, fn, *args, iters=iters, trace_dir=where)
        except Exception as e:  # a kernel configuration that does not compile
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        row.pop("report", None)
        if where:
            row["device_ms"] = row.pop("breakdown")["kernel_ms"]
            print(f"    {name}: {row['device_ms']:.3f} ms of kernels a call", flush=True)
        rows.append(row | {"tflops": flops / row["median_ms"] / 1e9})
    return rows


def dense_rows(m, k, n, iters) -> list[dict]:
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(BF16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(BF16)
    g = output_cotangent((m, n))
    recipes = {
        "bf16": None,
        "fp8_current": fp8jax.CurrentScaling(),
        "fp8_rowwise": fp8jax.RowwiseScaling(),
        "fp8_block": fp8jax.BlockScaling(),
    }
    rows = []
    for name, recipe in recipes.items():

        def step(x, w, g, recipe=recipe):
            dense = (lambda x, w: x @ w) if recipe is None else functools.partial(
                fp8jax.dense, recipe=recipe)  # fmt: skip
            y, vjp = jax.vjp(dense, x, w)
            return y, vjp(g)

        # The BF16 baseline as a user jits it, fp8jax's rows with fp8jax's options (layer.py's).
        options = None if recipe is None else fp8jax.compiler_options()
        fn = jax.jit(step, compiler_options=options)
        try:
            row = measure(name, fn, x, w, g, iters=iters, gradients=grad_part(1))  # (y, grads)
        except Exception as e:
            print(f"  {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        row.pop("report", None)
        rows.append(row | {"tflops": 3 * 2 * m * k * n / row["median_ms"] / 1e9})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemm", default="8192x8192x8192")
    parser.add_argument("--dense", default="16384x4096x16384", help="'' skips the dense rows")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", type=int, default=len(CONFIGS),
                        help="kernel configurations timed (the first N of CONFIGS)")  # fmt: skip
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None, help="profile the GEMM rows here (device_ms)")
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    env = start(args)
    print(env, flush=True)
    results = {"environment": env, "check": check()}
    for config in list(CONFIGS)[args.configs :]:
        del CONFIGS[config]
    gm, gk, gn = (int(v) for v in args.gemm.split("x"))
    results["gemm"] = {args.gemm: gemm_rows(gm, gk, gn, args.iters, args.trace)}
    if args.out:
        dump(args.out, results)
    if not args.dense:
        return
    dm, dk, dn = (int(v) for v in args.dense.split("x"))
    results["dense_fwd_bwd"] = {args.dense: dense_rows(dm, dk, dn, args.iters)}
    if args.out:
        dump(args.out, results)


if __name__ == "__main__":
    main()
