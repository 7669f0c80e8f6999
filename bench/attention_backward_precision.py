"""Which of FP8 attention's backward GEMMs can take FP8 operands: errors against f64.

For the gradients of attention on fp8jax's quantized Q, K, V (the
straight-through gradients fp8jax.dot_product_attention returns), this
computes dQ, dK, dV with each family of backward GEMMs in turn given E4M3
operands (one power-of-two scale per 128 rows or columns and head, P at its
fixed 2**8 scale), the others in BF16, and prints the relative Frobenius
error of each gradient against an f64 reference:

* ``bf16``: every gradient GEMM in BF16 (what fp8jax runs);
* ``dv_fp8``: dV = Pᵀ dO with P and dO in E4M3;
* ``dp_fp8``: dP = dO Vᵀ with dO and V in E4M3;
* ``ds_fp8``: dQ = dS K and dK = dSᵀ Q with dS, K and Q in E4M3.

Runs on the CPU in a minute (no kernels: the arithmetic only):
  JAX_PLATFORMS=cpu PYTHONPATH=src python bench/attention_backward_precision.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops import attention as op

VARIANTS = ("bf16", "dv_fp8", "dp_fp8", "ds_fp8")


def e4m3(x, axis):
    """``x`` through E4M3, a power-of-two scale per 128 entries along ``axis`` (and the rest)."""
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks = x.reshape(*x.shape[:-1], -1, min(128, x.shape[-1]))
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, 2.0**-100) / 448.0)))
    out = ((blocks / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale).reshape(x.shape)
    return jnp.moveaxis(out, -1, axis)


def gradients(q, k, v, g, variant, scale):
    """(dq, dk, dv) of softmax(q kᵀ scale) v under ``variant``'s operand precision, f32 sums."""

    def bf16(x):  # the exact reference ("exact") rounds nothing
        return x if variant == "exact" else x.astype(jnp.bfloat16).astype(x.dtype)

    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    delta = jnp.einsum("bqhd,bqhd->bhq", g, out)[..., None]
    if variant == "dv_fp8":
        p_dv = (p * 256).astype(jnp.float8_e4m3fn).astype(jnp.float32) / 256
        dv = jnp.einsum("bhqk,bqhd->bkhd", p_dv, e4m3(g, 1))
    else:
        dv = jnp.einsum("bhqk,bqhd->bkhd", bf16(p), bf16(g))
    if variant == "dp_fp8":
        dp = jnp.einsum("bqhd,bkhd->bhqk", e4m3(g, 3), e4m3(v, 3))
    else:
        dp = jnp.einsum("bqhd,bkhd->bhqk", bf16(g), bf16(v))
    ds = p * (dp - delta) * scale
    if variant == "ds_fp8":
        dq = jnp.einsum("bhqk,bkhd->bqhd", e4m3(ds, 3), e4m3(k, 1))
        dk = jnp.einsum("bhqk,bqhd->bkhd", e4m3(ds, 2), e4m3(q, 1))
    else:
        dq = jnp.einsum("bhqk,bkhd->bqhd", bf16(ds), bf16(k))
        dk = jnp.einsum("bhqk,bqhd->bkhd", bf16(ds), bf16(q))
    return dq, dk, dv


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--peaky", type=float, default=2.0, help="q's scale: sharper softmax")
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (1, args.seq, args.heads, args.head_dim)
    q, k, v, g = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    q = q * args.peaky
    # The operands fp8jax's forward sees: each quantized per 128 rows and head.
    q, k, v = (op._dequantized(*op.quantize_blocks(x)).astype(jnp.float32) for x in (q, k, v))
    scale = args.head_dim**-0.5
    with jax.default_matmul_precision("highest"):
        jax.config.update("jax_enable_x64", True)
        want = gradients(*(x.astype(jnp.float64) for x in (q, k, v, g)), "exact", scale)
        jax.config.update("jax_enable_x64", False)
        for variant in VARIANTS:
            got = jax.jit(gradients, static_argnums=(4, 5))(q, k, v, g, variant, scale)
            errors = {
                name: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b))
                            / np.linalg.norm(np.asarray(b)))
                for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True)
            }  # fmt: skip
            print(f"{variant:<8} " + "  ".join(f"{n} {e:.2e}" for n, e in errors.items()))


if __name__ == "__main__":
    main()
