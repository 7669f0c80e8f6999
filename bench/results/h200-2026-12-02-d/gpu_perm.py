import sys
sys.path.insert(0, "tests/ops")
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
import fp8jax
from fp8jax.ops import ragged_dot as rd
import test_ragged_dot as T

t, top_k, k, f, n = 45, 3, 96, 80, 64
order, sizes, inverse = T._routing(t, top_k)
keys = jax.random.split(jax.random.key(11), 4)
x = jax.random.normal(keys[0], (t, k))
w1 = jax.random.normal(keys[1], (4, k, f)) * k**-0.5
w2 = jax.random.normal(keys[2], (4, f, n)) * f**-0.5
g = jax.random.normal(keys[3], (t * top_k, n))
def mk(run):
    @jax.jit
    def fb(x, w1, w2):
        y, vjp = jax.vjp(run, x, w1, w2)
        return (y, *vjp(g))
    return fb
def f32_run(x, w1, w2):
    xs = jnp.take(x, order // top_k, axis=0)
    h = jax.lax.ragged_dot(xs, w1, sizes, precision="highest")
    return jnp.take(jax.lax.ragged_dot(h, w2, sizes, precision="highest"), inverse, axis=0)
ref = mk(f32_run)(x, w1, w2)
perm = mk(T._two_experts_gemms(True, order, sizes, inverse, top_k))(x, w1, w2)
cop = mk(T._two_experts_gemms(False, order, sizes, inverse, top_k))(x, w1, w2)
for name, r, p, c in zip(("y", "dx", "dw1", "dw2"), ref, perm, cop):
    r, p, c = (np.asarray(a, np.float64) for a in (r, p, c))
    nr = np.linalg.norm(r)
    print(f"{name}: perm vs ref {np.linalg.norm(p-r)/nr:.4f}  copies vs ref {np.linalg.norm(c-r)/nr:.4f}  perm vs copies {np.linalg.norm(p-c)/nr:.4f}", flush=True)
# also with the XLA path (kernels off)
import fp8jax.kernels as fk
with fk.use_pallas(False):
    permx = mk(T._two_experts_gemms(True, order, sizes, inverse, top_k))(x, w1, w2)
    copx = mk(T._two_experts_gemms(False, order, sizes, inverse, top_k))(x, w1, w2)
for name, r, p, c in zip(("y", "dx", "dw1", "dw2"), ref, permx, copx):
    r, p, c = (np.asarray(a, np.float64) for a in (r, p, c))
    nr = np.linalg.norm(r)
    print(f"XLA {name}: perm vs ref {np.linalg.norm(p-r)/nr:.4f}  copies vs ref {np.linalg.norm(c-r)/nr:.4f}  perm vs copies {np.linalg.norm(p-c)/nr:.4f}", flush=True)
