"""The block-scaled GEMM's kernel builds against BF16 and cuBLASLt's per-tensor FP8 (issue 61).

In one process, for every GEMM that ``BlockScaling`` runs in a dense layer at
8192^3 and at the ``llama-3b`` (hidden 3072, ffn 8192, 32768 tokens) and
Llama-3-8B (hidden 4096, ffn 14336, 16384 tokens) MLP projections, as
``(M, N, K)`` with K contracted:

- the forward ``x . W`` and the input gradient ``g . W^T``: 1x128 tiles of
  the activation (or gradient) against the weight's 128x128 block scales;
- the weight gradient ``g^T . x``: it contracts the tokens, with per-row
  scales on both operands (tiles along the tokens).

Each GEMM is timed as XLA's BF16 GEMM, cuBLASLt's per-tensor FP8 GEMM
(operands quantized already) and every :class:`KernelConfig` of
:data:`VARIANTS` (a build that the shape table makes identical to another is
timed once). Times are synchronized medians after ``--heat`` seconds of back
to back calls (bench/harness.py); ratios against BF16 and cuBLASLt follow
each GEMM, and each kernel's error against XLA's sums
(:func:`~fp8jax.kernels.block_gemm.xla_block_matmul`) on its first 256
rows. Rows left when ``--budget`` seconds have passed are skipped and listed.

    PYTHONPATH=src:bench python bench/block_variants.py --out block_variants.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from harness import add_compile_cache_argument, add_heat_argument, dump, measure, start
from jax import lax

import fp8jax
from fp8jax.kernels import block_gemm
from fp8jax.kernels.block_gemm import KernelConfig
from fp8jax.ops.fine_quantize import quantize_blocks, quantize_tiles

BF16 = jnp.bfloat16
NT = (((1,), (1,)), ((), ()))  # a (M, K) . b (N, K)^T
# Kernel builds, by name. "late" is the kernel before issue 61 (scales read
# after the MMA, 128 columns); "table" is the library's default.
VARIANTS = {
    "late": KernelConfig(scales_first=False, tile_n=128),
    "first": KernelConfig(scales_first=True, tile_n=128),
    "table": block_gemm.DEFAULT_CONFIG,
    "late_table": KernelConfig(scales_first=False),  # the table may take 192 columns here
    "first_pingpong": KernelConfig(scales_first=True, tile_n=128, pingpong=True),
}
# (name, M, N, K, weight's block scales): each distinct GEMM once, in order of
# priority. A projection's input gradient is the other projection's forward.
GEMMS = [
    ("8192^3 fwd/dgrad", 8192, 8192, 8192, True),
    ("8192^3 wgrad", 8192, 8192, 8192, False),
    ("llama-3b up fwd / down dgrad", 32768, 8192, 3072, True),
    ("llama-3b down fwd / up dgrad", 32768, 3072, 8192, True),
    ("llama-3b up wgrad", 8192, 3072, 32768, False),
    ("llama-3b down wgrad", 3072, 8192, 32768, False),
    ("llama3-8b up fwd", 16384, 14336, 4096, True),
    ("llama3-8b up dgrad", 16384, 4096, 14336, True),
    ("llama3-8b up wgrad", 14336, 4096, 16384, False),
]
CHECK_ROWS = 256  # rows compared against XLA's sums (its products are (K/128) x rows x N)


def operands(m, n, k, b_blocks, key=0):
    """BF16 ``a`` (M, K) and ``b`` (N, K), and their FP8 data and scales for the kernel."""
    ka, kb = jax.random.split(jax.random.key(key))
    a = jax.random.normal(ka, (1, m, k), jnp.float32)
    b = jax.random.normal(kb, (1, n, k), jnp.float32) * 0.02
    qa = quantize_tiles(a, fp8jax.E4M3, block_gemm.BLOCK)
    quantize_b = quantize_blocks if b_blocks else quantize_tiles
    qb = quantize_b(b, fp8jax.E4M3, block_gemm.BLOCK)
    return (a[0].astype(BF16), b[0].astype(BF16)), (qa.data, qb.data, qa.scale_inv, qb.scale_inv)


def xla_reference(fp8_ops, b_blocks) -> jax.Array:
    """XLA's sums (f32) of the same FP8 products and scales, for the first rows."""
    qa, qb, sa, sb = fp8_ops
    rows = slice(0, CHECK_ROWS)
    xla = functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32, b_blocks=b_blocks)
    return jax.jit(xla)(qa[:, rows], qb, sa[:, rows], sb)


def kernel_error(y, ref) -> dict:
    """The kernel's bf16 output's first rows against XLA's f32 sums."""
    got = y[:, :CHECK_ROWS].astype(jnp.float32)
    peak = float(jnp.max(jnp.abs(ref)))
    return {
        # bf16's own rounding, 2**-9 of a value, is most of it.
        "max_rel_err_vs_xla": float(jnp.max(jnp.abs(got - ref))) / peak,
        # Outputs that are not XLA's sums rounded to bf16: where the f32 sums
        # differ in their last bits (fused multiply-adds) across a rounding edge.
        "frac_differing_from_xla_bf16": float(
            jnp.mean(got != ref.astype(BF16).astype(jnp.float32))
        ),
    }


def gemm_rows(name, m, n, k, b_blocks, iters, deadline) -> list[dict]:
    """The rows of one GEMM; those past ``deadline`` (time.perf_counter) are skipped."""
    (a16, b16), fp8_ops = operands(m, n, k, b_blocks)
    flops = 2 * m * n * k
    a8, b8 = fp8_ops[0][0], fp8_ops[1][0]
    runs = {
        "bf16": (jax.jit(lambda a, b: lax.dot_general(a, b, NT, preferred_element_type=BF16)),
                 (a16, b16)),
        "fp8_per_tensor_cublaslt": (
            jax.jit(lambda a, b, s: lax.dot_general(a, b, NT, preferred_element_type=BF16) * s,
                    compiler_options=fp8jax.compiler_options()),
            (a8, b8, jnp.float32(0.5).astype(BF16))),
    }  # fmt: skip
    built = {}
    for variant, config in VARIANTS.items():
        tile_n = config.tile_n or block_gemm.tile_n_for(
            m, n, b_blocks, block_gemm.sm_count(), scales_first=config.scales_first
        )
        same = dataclasses.replace(config, tile_n=tile_n)
        if same in built:  # the table chose what another variant fixes
            print(f"  {variant}: the same build as {built[same]} (tile_n {tile_n})", flush=True)
            continue
        built[same] = variant
        fn = functools.partial(block_gemm.mosaic_block_matmul, out_dtype=BF16, b_blocks=b_blocks,
                               config=config)  # fmt: skip
        runs[f"block_{variant}_n{tile_n}"] = (jax.jit(fn), fp8_ops)
    rows, ref = [], None
    for run, (fn, args) in runs.items():
        if time.perf_counter() > deadline:
            print(f"  {run}: skipped (--budget spent)", flush=True)
            rows.append({"gemm": name, "name": run, "skipped": True})
            continue
        try:
            row = measure(run, fn, *args, iters=iters)
        except Exception as e:  # a build that does not compile or run: the others go on
            message = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {run}: failed: {message}", flush=True)
            rows.append({"gemm": name, "name": run, "error": message})
            continue
        row.pop("report", None)
        row |= {"gemm": name, "tflops": flops / row["median_ms"] / 1e9}
        if run.startswith("block_"):
            if ref is None:
                ref = xla_reference(fp8_ops, b_blocks)
            row |= kernel_error(fn(*args), ref)
            err, differ = row["max_rel_err_vs_xla"], row["frac_differing_from_xla_bf16"]
            print(f"    vs XLA's f32 sums: max error {err:.2e} of the peak (bf16 output); "
                  f"{differ:.2%} of outputs differ from them rounded to bf16",
                  flush=True)  # fmt: skip
        rows.append(row)
    summarize(name, rows)
    return rows


def summarize(name, rows) -> None:
    timed = {r["name"]: r for r in rows if "median_ms" in r}
    bf16, fp8 = timed.get("bf16"), timed.get("fp8_per_tensor_cublaslt")
    print(f"== {name}", flush=True)
    for run, row in timed.items():
        ratios = []
        if bf16:
            ratios.append(f"{bf16['median_ms'] / row['median_ms']:.3f}x BF16")
        if fp8:
            ratios.append(f"{fp8['median_ms'] / row['median_ms']:.3f}x cuBLASLt FP8")
        print(f"   {run:32s} {row['median_ms']:8.3f} ms {row['tflops']:7.0f} TFLOP/s  "
              + ", ".join(ratios), flush=True)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds after which the remaining rows are skipped")  # fmt: skip
    parser.add_argument("--gemms", type=int, default=len(GEMMS), help="the first N of GEMMS")
    parser.add_argument("--out", default=None)
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    parser.set_defaults(heat=1.0)
    args = parser.parse_args()
    began = time.perf_counter()
    env = start(args)
    print(env, flush=True)
    results = {
        "environment": env,
        "variants": {k: repr(v) for k, v in VARIANTS.items()},
        "rows": [],
    }
    for name, m, n, k, b_blocks in GEMMS[: args.gemms]:
        scales = "128x128 blocks" if b_blocks else "1x128 tiles along K"
        print(f"{name}: M {m}, N {n}, K {k}; b's scales per {scales}", flush=True)
        results["rows"] += gemm_rows(name, m, n, k, b_blocks, args.iters, began + args.budget)
        if args.out:
            dump(args.out, results)
    skipped = [f"{r['gemm']}: {r['name']}" for r in results["rows"] if r.get("skipped")]
    print(f"done in {time.perf_counter() - began:.0f} s; skipped: {skipped or 'none'}", flush=True)


if __name__ == "__main__":
    main()
