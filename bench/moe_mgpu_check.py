"""Checks the BF16 Mosaic GPU baseline of ``moe.py`` against f32 ``lax.ragged_dot``.

The baseline's grouped GEMM (``moe.mgpu_ragged_dot``, the library's
``fp8jax.kernels.bf16_grouped.ragged_dot``: JAX's ``ragged_dot_mgpu`` forward
and dgrad, ``transposed_ragged_dot_mgpu`` wgrad) is only a fair
baseline if it computes what it should. On an H100 or H200, from ``bench/``:

    python -u moe_mgpu_check.py

prints the normwise error of y, dx and dw against f32, uneven groups and an
empty one included.
"""

import jax
import jax.numpy as jnp
import moe
import numpy as np
from jax import lax


def forward_and_backward(f, sizes, g):
    """``f``'s output and its vjp on ``g``, jitted."""

    def run(x, w):
        y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return (y, *vjp(g.astype(y.dtype)))

    return jax.jit(run)


def f32_ragged_dot(a, b, sizes):
    return lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), sizes, precision="highest")


def main():
    m, k, n = 2048, 512, 384
    sizes = jnp.array([700, 0, 900, 448], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (4, k, n)) * k**-0.5).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    got = forward_and_backward(moe.mgpu_ragged_dot(), sizes, g)(x, w)
    ref = forward_and_backward(f32_ragged_dot, sizes, g)(x, w)
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"{name}: normwise error vs f32 {error:.2e}", flush=True)


if __name__ == "__main__":
    main()
