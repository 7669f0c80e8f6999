"""A/B in one process: the block-scaled GEMM at 8192^3 with a TMA pipeline per output tile
(`continued=False`, the kernel before) or one across each CTA's tiles (`continued=True`),
against XLA's BF16 GEMM and cuBLASLt's per-tensor FP8 GEMM; two rounds."""
import functools, jax, jax.numpy as jnp
from harness import measure, start
import fp8jax
from fp8jax.fine_quantize import expand_blocks, quantize_blocks, quantize_tiles
from fp8jax.kernels import block_gemm


class A: heat = 0.5; compile_cache = None
print(start(A), flush=True)
m = n = k = 8192
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (1, m, k), jnp.float32)
w = jax.random.normal(kw, (1, n, k), jnp.float32) * 0.02
qa, sa = quantize_tiles(x, fp8jax.E4M3, 128)
qb, sbb = quantize_blocks(w, fp8jax.E4M3, 128)
sb = expand_blocks(sbb, 128)
ref = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32))(qa, qb, sa, sb)
xb, wb = x[0].astype(jnp.bfloat16), w[0].astype(jnp.bfloat16)
bf16 = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16))
one = jnp.float32(1)
per_tensor = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                      preferred_element_type=jnp.bfloat16))
qx, qw = qa[0], qb[0]
for rnd in range(2):
    r = measure(f"bf16_{rnd}", bf16, xb, wb, iters=20)
    print(f"RESULT bf16 round {rnd}: {r['median_ms']:.3f} ms ({r['pipelined_ms']:.3f} pipelined)", flush=True)
    r = measure(f"fp8_tensor_{rnd}", per_tensor, qx, qw, iters=20)
    print(f"RESULT per-tensor fp8 round {rnd}: {r['median_ms']:.3f} ms ({r['pipelined_ms']:.3f} pipelined)", flush=True)
    for continued in (False, True):
        for form, s in (("rows", sb), ("blocks", sbb)):
            fn = jax.jit(functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.bfloat16,
                                           b_blocks=form == "blocks", continued=continued))
            y = fn(qa, qb, sa, s).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
            name = f"{'continued' if continued else 'per_tile'}_{form}_{rnd}"
            r = measure(name, fn, qa, qb, sa, s, iters=20)
            tflops = 2 * m * n * k / r["median_ms"] / 1e9
            print(f"RESULT {name}: {r['median_ms']:.3f} ms ({r['pipelined_ms']:.3f} pipelined) "
                  f"{tflops:.0f} TFLOP/s err {err:.2e}", flush=True)
