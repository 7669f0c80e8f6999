"""Tile sweep of the row/column maxima kernel and the both-ways cast kernel, H200."""
import sys, functools, itertools
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
import fp8jax
from fp8jax.kernels import row_cast as rc
from harness import time_ms

def gbps(nbytes, ms): return nbytes / ms / 1e6
for shape in [(16384, 16384), (16384, 4096), (4096, 16384)]:
    x = jax.random.normal(jax.random.key(0), shape).astype(jnp.bfloat16)
    n = x.size * 2
    xla = jax.jit(lambda x: (jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0)))
    t = time_ms(xla, x)["median_ms"]; print(f"{shape} xla two reductions {t:.3f} ms {gbps(n,t):.0f} GB/s", flush=True)
    for (r, c, w) in [(64,128,4),(128,128,4),(128,128,8),(64,256,4),(128,256,8),(256,128,8),(256,256,8),(32,256,4)]:
        rc.MAXIMA_ROWS, rc.MAXIMA_COLS, rc.MAXIMA_WARPS = r, c, w
        f = jax.jit(lambda x: rc._pallas_maxima(x))
        try:
            t = time_ms(f, x)["median_ms"]; print(f"{shape} maxima {r}x{c} w{w} {t:.3f} ms {gbps(n,t):.0f} GB/s", flush=True)
        except Exception as e:
            print(f"{shape} maxima {r}x{c} w{w} failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    rs = jnp.ones((shape[0], 1)); cs = jnp.ones((1, shape[1]))
    for (r, c, w) in [(64,128,4),(128,128,4),(128,128,8),(64,64,4),(128,64,4)]:
        rc.TILE_ROWS, rc.TILE_COLS, rc.WARPS = r, c, w
        f = jax.jit(lambda x, a, b: rc._pallas_cast(x, a, b, fp8jax.E4M3))
        try:
            t = time_ms(f, x, rs, cs)["median_ms"]; print(f"{shape} cast {r}x{c} w{w} {t:.3f} ms {gbps(2*n,t):.0f} GB/s", flush=True)
        except Exception as e:
            print(f"{shape} cast {r}x{c} w{w} failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    rc.TILE_ROWS, rc.TILE_COLS, rc.WARPS = 64, 128, 4
