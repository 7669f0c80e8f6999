"""GPU check of fp8jax.ragged_dot's kernel vs an f32 lax.ragged_dot reference."""

import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp8jax

print(jax.__version__, jax.devices(), flush=True)


def check(m, k, n, sizes, dtype=jnp.float32, dead=None):
    g = len(sizes)
    x = jax.random.normal(jax.random.key(0), (m, k), dtype)
    w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.float32) * k**-0.5
    if dead is not None:
        w = w.at[dead].multiply(1e-4)
    w = w.astype(dtype)
    gs = jnp.array(sizes, jnp.int32)
    gy = jax.random.normal(jax.random.key(2), (m, n), dtype)

    def vg(f):
        def step(x, w):
            y, vjp = jax.vjp(lambda x, w: f(x, w, gs), x, w)
            return (y, *vjp(gy.astype(y.dtype)))

        return step

    ref = jax.jit(
        vg(
            lambda x, w, s: lax.ragged_dot(
                x.astype(jnp.float32), w.astype(jnp.float32), s, precision=lax.Precision.HIGHEST
            ).astype(x.dtype)
        )
    )(x, w)
    jf = jax.jit(vg(fp8jax.ragged_dot))
    hlo = jf.lower(x, w).compile().as_text()
    calls = sorted(
        set(
            l.split('custom_call_target="')[1].split('"')[0]
            for l in hlo.splitlines()
            if 'custom_call_target="' in l
        )
    )
    print(
        " custom calls:",
        calls,
        "| triton grouped kernel names:",
        hlo.count("fp8jax_grouped_gemm"),
        flush=True,
    )
    got = jf(x, w)
    with fp8jax.kernels.use_pallas(False):
        xla = jax.jit(vg(fp8jax.ragged_dot))(x, w)
    for name, r, a, b in zip(("y", "dx", "dw"), ref, got, xla, strict=True):
        r = np.asarray(r, np.float64)
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        s = np.abs(r).max()
        kernel, path, apart = (np.abs(u - v).max() / s for u, v in ((a, r), (b, r), (a, b)))
        print(
            f"  {name}: kernel rel err {kernel:.4f}  xla-path rel err {path:.4f}  "
            f"kernel-vs-xla {apart:.2e}",
            flush=True,
        )
    if dead is not None:
        r = np.asarray(ref[0], np.float64)
        a = np.asarray(got[0], np.float64)
        lo = sum(sizes[:dead])
        hi = lo + sizes[dead]
        s = np.abs(r[lo:hi]).max()
        print(
            f"  dead expert rows: rel err {np.abs(a[lo:hi] - r[lo:hi]).max() / s:.4f}", flush=True
        )


for case in [
    dict(m=1000, k=256, n=384, sizes=[300, 0, 123, 500, 77]),
    dict(m=517, k=200, n=130, sizes=[100, 1, 0, 316], dtype=jnp.bfloat16),
    dict(m=4096, k=1024, n=2048, sizes=[1024] * 4, dtype=jnp.bfloat16, dead=2),
]:
    print(case, flush=True)
    try:
        check(**case)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
