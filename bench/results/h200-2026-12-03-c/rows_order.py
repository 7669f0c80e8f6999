import functools, jax, jax.numpy as jnp
from harness import measure, start
import argparse
import fp8jax
from fp8jax.fine_quantize import expand_blocks, quantize_blocks, quantize_tiles
from fp8jax.kernels import block_gemm
import block_gemm_old  # git show b47d821:src/fp8jax/kernels/block_gemm.py > block_gemm_old.py
p = argparse.ArgumentParser(); p.add_argument("--heat", type=float, default=0.5); p.add_argument("--compile-cache", default=None)
args = p.parse_args(); start(args)
m = n = k = 8192
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (1, m, k), jnp.float32); w = jax.random.normal(kw, (1, n, k), jnp.float32) * 0.02
qa, sa = quantize_tiles(x, fp8jax.E4M3, 128); qb, sbb = quantize_blocks(w, fp8jax.E4M3, 128); sb = expand_blocks(sbb, 128)
ref = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32))(qa, qb, sa, sb)
for rnd in range(2):
    for name, mod in (("old", block_gemm_old), ("new", block_gemm)):
        for form, s in (("rows", sb), ("blocks", sbb)):
            fn = jax.jit(functools.partial(mod.mosaic_block_matmul, out_dtype=jnp.bfloat16, b_blocks=form == "blocks"))
            y = fn(qa, qb, sa, s).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
            r = measure(f"{name}_{form}_{rnd}", fn, qa, qb, sa, s, iters=20)
            print(f"RESULT {name} {form} round {rnd}: {r['median_ms']:.3f} ms ({r['pipelined_ms']:.3f} pipelined) err {err:.2e}", flush=True)
