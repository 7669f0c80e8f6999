import sys, functools, json, os, traceback
sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp
from jax import lax
from harness import measure, start
import argparse
import fp8jax
from fp8jax.fine_quantize import expand_blocks, quantize_blocks, quantize_tiles
from fp8jax.kernels import block_gemm
import probe_kernel as bgemm
BF16, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn
p = argparse.ArgumentParser(); p.add_argument("--heat", type=float, default=0.5); p.add_argument("--size", type=int, default=8192)
p.add_argument("--compile-cache", default=None)
args = p.parse_args(); start(args)
sms = jax.devices()[0].core_count
print("sms", sms, flush=True)
m = n = k = args.size
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (1, m, k), jnp.float32)
w = jax.random.normal(kw, (1, n, k), jnp.float32) * 0.02
qa, sa = quantize_tiles(x, fp8jax.E4M3, 128)
qb, sbb = quantize_blocks(w, fp8jax.E4M3, 128)
sb = expand_blocks(sbb, 128)
ref = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32))(qa, qb, sa, sb)[0]
sa_t, sb_t = jnp.swapaxes(sa[0], 0, 1), jnp.swapaxes(sb[0], 0, 1)
flops = 2 * m * n * k
rows = {}
def run(name, fn, *a):
    try:
        r = measure(name, fn if hasattr(fn, "lower") else jax.jit(fn), *a, iters=20)
        r.pop("report", None)
        rows[name] = {"ms": r["median_ms"], "tflops": flops / r["median_ms"] / 1e9, "pipelined_ms": r.get("pipelined_mean_ms"), "compile_s": r.get("compile_s")}
        print(name, rows[name], flush=True)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:2000], flush=True)
dims = (((1,), (1,)), ((), ()))
run("bf16", lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=BF16), x[0].astype(BF16), w[0].astype(BF16))
run("fp8_cublaslt", jax.jit(lambda a, b, s: lax.dot_general(a, b, dims, preferred_element_type=BF16) * s, compiler_options=fp8jax.compiler_options()), qa[0], qb[0], jnp.float32(0.5).astype(BF16))
run("triton_b_blocks", functools.partial(block_gemm.pallas_block_matmul, out_dtype=BF16, b_blocks=True), qa, qb, sa, sbb)
configs = [dict(stages=4, group=8), dict(stages=4, group=8, b_scalar=True), dict(stages=3, group=8, overlap=True), dict(stages=3, group=8, overlap=True, b_scalar=True), dict(stages=2, group=8, overlap=True, b_scalar=True), dict(stages=3, group=16, overlap=True, b_scalar=True)]
for cfg in configs:
    name = "mgpu_" + "_".join(f"{k}{v}" for k, v in cfg.items())
    fn = functools.partial(bgemm.matmul, sms=sms, **cfg)
    try:
        y = jax.jit(fn)(qa[0], qb[0], sa_t, sb_t).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
        print(name, "max rel diff vs xla", err, flush=True)
        rows[name + "_err"] = err
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:3000], flush=True); traceback.print_exc(); continue
    run(name, fn, qa[0], qb[0], sa_t, sb_t)
json.dump(rows, open(os.environ.get("OUT", ".") + "/mgpu.json", "w"), indent=1)
