import sys, functools, json, os
import jax, jax.numpy as jnp
from jax import lax
from harness import measure, start
import argparse
import fp8jax
from fp8jax.fine_quantize import expand_blocks, quantize_blocks, quantize_tiles
from fp8jax.kernels import block_gemm
BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn
p = argparse.ArgumentParser(); p.add_argument("--heat", type=float, default=0.5); p.add_argument("--size", type=int, default=8192)
p.add_argument("--compile-cache", default=None)
args = p.parse_args(); start(args)
m = n = k = args.size
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (1, m, k), jnp.float32)
w = jax.random.normal(kw, (1, n, k), jnp.float32) * 0.02
qa, sa = quantize_tiles(x, fp8jax.E4M3, 128)
qb, sbb = quantize_blocks(w, fp8jax.E4M3, 128)
sb = expand_blocks(sbb, 128)
ref = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32))(qa, qb, sa, sb)
flops = 2 * m * n * k
rows = {}
def run(name, fn, *a):
    try:
        r = measure(name, fn if hasattr(fn, "lower") else jax.jit(fn), *a, iters=20)
        rows[name] = {"ms": r["median_ms"], "tflops": flops / r["median_ms"] / 1e9}
        print(name, rows[name], flush=True)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:1500], flush=True)
dims = (((1,), (1,)), ((), ()))
run("bf16", lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=BF16), x[0].astype(BF16), w[0].astype(BF16))
run("fp8_cublaslt", jax.jit(lambda a, b, s: lax.dot_general(a, b, dims, preferred_element_type=BF16) * s, compiler_options=fp8jax.compiler_options()), qa[0], qb[0], jnp.float32(0.5).astype(BF16))
for tn, st, g in [(128, 4, 8), (256, 3, 8), (256, 2, 8), (256, 3, 16), (256, 3, 4)]:
    for form in ("blocks", "rows"):
        if form == "rows" and g != 8: continue
        fn = functools.partial(block_gemm.mosaic_block_matmul, out_dtype=BF16, tile_n=tn, stages=st, group=g, b_blocks=form == "blocks")
        ops = (qa, qb, sa, sbb if form == "blocks" else sb)
        name = f"mosaic_{form}_n{tn}_s{st}_g{g}"
        try:
            y = jax.jit(fn)(*ops).astype(jnp.float32)
            print(name, "max rel diff", float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))), flush=True)
        except Exception as e:
            print(name, "FAILED", type(e).__name__, str(e)[:1500], flush=True); continue
        run(name, fn, *ops)
