"""The cost of the tile maximum in the forward activation kernel and the cast-transpose kernel."""
import functools, sys
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
import harness
from harness import time_ms
from fp8jax.kernels import activation_cast as ac, cast_transpose as ct
from fp8jax.formats import E4M3, E5M2
from fp8jax.quantize import quantize_with_scale
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pt
harness._heat["seconds"] = 0.0

def t(fn, *a):
    return time_ms(jax.jit(fn), *a, warmup=3, iters=20)["median_ms"]

def reduce(kind, h):
    a = jnp.abs(h)
    if kind == "none":
        return jnp.zeros((1, 1), jnp.float32)
    if kind == "lib":
        return jnp.max(jnp.max(a, axis=1, keepdims=True), axis=0, keepdims=True)
    if kind == "axis0first":
        return jnp.max(jnp.max(a, axis=0, keepdims=True), axis=1, keepdims=True)
    if kind == "rows":
        return jnp.max(a, axis=1, keepdims=True)
    if kind == "cols":
        return jnp.max(a, axis=0, keepdims=True)

def max_spec(kind, tr, tc):
    if kind == "rows":
        return pl.BlockSpec((tr, 1), lambda i, j: (i, j)), lambda g, rows, cols: (rows, g[1])
    if kind == "cols":
        return pl.BlockSpec((1, tc), lambda i, j: (i, j)), lambda g, rows, cols: (g[0], cols)
    return pl.BlockSpec((1, 1), lambda i, j: (i, j)), lambda g, rows, cols: g

def fwd(kind, pre, scale, rows, cols, tile, warps):
    tr, tc = tile
    grid = (rows // tr, cols // tc)
    def kern(pre_ref, scale_ref, q_ref, max_ref):
        h = ac._gated(("silu", "linear"), pre_ref[...].astype(jnp.float32), ac._GpuMath)[0]
        h = h.astype(jnp.bfloat16).astype(jnp.float32)
        q_ref[...] = quantize_with_scale(h, E4M3, scale_ref[0]).data
        max_ref[...] = reduce(kind, h)
    mspec, mshape = max_spec(kind, tr, tc)
    return pl.pallas_call(kern, grid=grid,
        in_specs=[pl.BlockSpec((tr, 2 * tc), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=[pl.BlockSpec((tr, tc), lambda i, j: (i, j)), mspec],
        out_shape=[jax.ShapeDtypeStruct((rows, cols), E4M3.dtype), jax.ShapeDtypeStruct(mshape(grid, rows, cols), jnp.float32)],
        compiler_params=pt.CompilerParams(num_warps=warps))(pre, scale.reshape(1))

def castt(kind, g, scale, tile, warps):
    rows, cols = g.shape
    tr, tc = tile
    grid = (rows // tr, cols // tc)
    def kern(g_ref, scale_ref, q_ref, qt_ref, max_ref):
        x = g_ref[...].astype(jnp.float32)
        q = quantize_with_scale(x, E5M2, scale_ref[0]).data
        q_ref[...] = q
        qt_ref[...] = q.T
        max_ref[...] = reduce(kind, x)
    mspec, mshape = max_spec(kind, tr, tc)
    return pl.pallas_call(kern, grid=grid,
        in_specs=[pl.BlockSpec((tr, tc), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=[pl.BlockSpec((tr, tc), lambda i, j: (i, j)), pl.BlockSpec((tc, tr), lambda i, j: (j, i)), mspec],
        out_shape=[jax.ShapeDtypeStruct((rows, cols), E5M2.dtype), jax.ShapeDtypeStruct((cols, rows), E5M2.dtype),
                   jax.ShapeDtypeStruct(mshape(grid, rows, cols), jnp.float32)],
        compiler_params=pt.CompilerParams(num_warps=warps))(g, scale.reshape(1))

scale = jnp.float32(2.0)
for name, rows, cols in [("llama1b", 16384, 8192), ("llama8b", 8192, 14336)]:
    pre = jax.random.normal(jax.random.key(0), (rows, 2 * cols), jnp.float32).astype(jnp.bfloat16)
    for kind in ("lib", "none", "axis0first", "rows", "cols"):
        for tile, warps in (((64, 64), 4), ((16, 256), 4), ((32, 128), 4)):
            try:
                ms = t(functools.partial(fwd, kind, rows=rows, cols=cols, tile=tile, warps=warps), pre, scale)
                print(f"fwd {name} max={kind} tile {tile} w{warps}: {ms:.3f} ms", flush=True)
            except Exception as e:
                print("fwd", name, kind, tile, "failed", repr(e)[:300], flush=True)
for name, rows, cols in [("gateup_grad_1b", 16384, 16384), ("te_qkv_grad", 16384, 12288)]:
    g = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(jnp.bfloat16)
    ms = t(lambda g, s: ct._pallas(g, s, E5M2, column_sums=False), g, scale)
    print(f"castT {name} library: {ms:.3f} ms", flush=True)
    for kind in ("lib", "none", "axis0first", "rows", "cols"):
        for tile, warps in ((ct._tile(g), ct.WARPS),):
            try:
                ms = t(functools.partial(castt, kind, tile=tile, warps=warps), g, scale)
                print(f"castT {name} max={kind} tile {tile} w{warps}: {ms:.3f} ms", flush=True)
            except Exception as e:
                print("castT", name, kind, "failed", repr(e)[:300], flush=True)
