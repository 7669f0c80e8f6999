"""The BF16 Mosaic GPU baseline's grouped GEMM (bench/moe.py mgpu_ragged_dot) against f32 lax.ragged_dot."""
import sys
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import moe

gemm = moe.mgpu_ragged_dot()
m, k, n = 2048, 512, 384
sizes = jnp.array([700, 0, 900, 448], jnp.int32)
keys = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
w = (jax.random.normal(keys[1], (4, k, n)) * k**-0.5).astype(jnp.bfloat16)
g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
def fb(f):
    def run(x, w):
        y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return (y, *vjp(g.astype(y.dtype)))
    return jax.jit(run)
got = fb(gemm)(x, w)
ref = fb(lambda a, b, s: lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), s,
                                         precision="highest"))(x, w)
for name, a, b in zip(("y", "dx", "dw"), got, ref):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    print(f"{name}: normwise error vs f32 {np.linalg.norm(a - b) / np.linalg.norm(b):.2e}", flush=True)
