"""fp8jax.dot_general with a batch axis that is not leading in the kernel: values and gradients.

The bounds come from tests/numerics.py's gemm_error_bound: each operand off by
its format's rounding (E4M3 for x and the kernel, E5M2 for the cotangent) at
its current scale, plus f32 accumulation; elementwise, against float64
einsums. A batch axis paired with the wrong kernel slice is off by O(1).
"""

import jax
import numpy as np

import fp8jax
from numerics import assert_within, current_scale, gemm_error_bound

DIMS = (((2,), (0,)), ((0,), (1,)))  # x: (b, s, k), w: (k, b, n) -> (b, s, n)


def test_batched_dot_general_and_its_gradients_match_the_reference():
    kx, kw, kg = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (3, 16, 32))
    w = jax.random.normal(kw, (32, 3, 8))
    g = jax.random.normal(kg, (3, 16, 8))
    y, vjp = jax.vjp(lambda x, w: fp8jax.dot_general(x, w, DIMS), x, w)
    dx, dw = vjp(g)
    xs, ws, gs = (np.asarray(a, np.float64) for a in (x, w, g))
    sx, sw, sg = current_scale(xs, "e4m3"), current_scale(ws, "e4m3"), current_scale(gs, "e5m2")
    f32 = np.float32

    want = np.einsum("bsk,kbn->bsn", xs, ws)
    bound = gemm_error_bound(xs, ws, "e4m3", "e4m3", sx, sw, "bsk,kbn->bsn", f32)
    assert_within(y, want, bound, "y")
    want = np.einsum("bsn,kbn->bsk", gs, ws)
    bound = gemm_error_bound(gs, ws, "e5m2", "e4m3", sg, sw, "bsn,kbn->bsk", f32)
    assert_within(dx, want, bound, "dx")
    want = np.einsum("bsk,bsn->kbn", xs, gs)
    bound = gemm_error_bound(xs, gs, "e4m3", "e5m2", sx, sg, "bsk,bsn->kbn", f32)
    assert_within(dw, want, bound, "dw")
