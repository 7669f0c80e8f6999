"""Where does the FP8 MLP block's time go? Variants and a profiler trace (issue 4/8).

Compares, in one process: BF16, Flax's direct FP8 op, fp8jax with split
(HIGHEST) or fast (DEFAULT) accumulation in the gradient GEMMs, and the six
FP8 GEMMs alone on pre-quantized operands (the floor any FP8 MLP can reach).
Writes a profiler trace per variant named in --trace to $OUT.

    PYTHONPATH=src python bench/profile_mlp.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from harness import compiled_facts, dump, environment, print_table, time_ms
from jax import lax
from mlp import flax_variant, fp8jax_variant

import fp8jax

E4M3, E5M2, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16


def gemm_floor(x, ffn, activations, precision):
    """The six GEMMs of the block on FP8 operands, nothing else."""
    tokens, hidden = x.shape
    key = jax.random.key(3)
    xq = jax.random.normal(key, (tokens, hidden)).astype(E4M3)
    k1q = jax.random.normal(key, (hidden, ffn)).astype(E4M3)
    hq = jax.random.normal(key, (tokens, ffn)).astype(E4M3)
    k2q = jax.random.normal(key, (ffn, hidden)).astype(E4M3)
    g2q = jax.random.normal(key, (tokens, hidden)).astype(E5M2)
    g1q = jax.random.normal(key, (tokens, ffn)).astype(E5M2)

    def dot(a, b, dims, p):
        return lax.dot_general(a, b, (dims, ((), ())), precision=p, preferred_element_type=BF16)

    def six(xq, k1q, hq, k2q, g2q, g1q):
        return (
            dot(xq, k1q, ((1,), (0,)), lax.Precision.DEFAULT),
            dot(hq, k2q, ((1,), (0,)), lax.Precision.DEFAULT),
            dot(g2q, k2q, ((1,), (1,)), precision),  # dgrad 2
            dot(hq, g2q, ((0,), (0,)), precision),  # wgrad 2
            dot(g1q, k1q, ((1,), (1,)), precision),  # dgrad 1
            dot(xq, g1q, ((0,), (0,)), precision),  # wgrad 1
        )

    return jax.jit(six), (xq, k1q, hq, k2q, g2q, g1q)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--activations", default="gelu")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--trace", nargs="*", default=["fp8jax_current_fast", "flax_fp8_direct"])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    activations = tuple(args.activations.split(","))
    fast = dict(dgrad_precision=lax.Precision.DEFAULT, wgrad_precision=lax.Precision.DEFAULT)
    variants = {
        "bf16": functools.partial(flax_variant, dot_general_cls=None),
        "flax_fp8_direct": functools.partial(
            flax_variant, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp
        ),
        "fp8jax_current_split": functools.partial(fp8jax_variant, recipe=fp8jax.CurrentScaling()),
        "fp8jax_current_fast": functools.partial(
            fp8jax_variant, recipe=fp8jax.CurrentScaling(**fast)
        ),
        "fp8jax_delayed_fast": functools.partial(
            fp8jax_variant, recipe=fp8jax.DelayedScaling(**fast)
        ),
        "gemms_only_fast": functools.partial(gemm_floor, precision=lax.Precision.DEFAULT),
        "gemms_only_split": functools.partial(gemm_floor, precision=lax.Precision.HIGHEST),
    }
    print(environment())
    x = jax.random.normal(jax.random.key(1), (args.tokens, args.hidden)).astype(BF16)
    rows = []
    for name, make in variants.items():
        fn, fn_args = make(x, args.ffn, activations)
        facts = compiled_facts(fn, *fn_args)
        timing = time_ms(fn, *fn_args, iters=args.iters)
        rows.append({"name": name, **timing, **facts})
        print(f"  {name}: {timing['median_ms']:.3f} ms {facts['backends']}", flush=True)
        if name in args.trace and args.out:
            with jax.profiler.trace(os.path.join(args.out, f"trace_{name}")):
                for _ in range(3):
                    jax.block_until_ready(fn(*fn_args))
    print_table(f"MLP {args.activations} fwd+bwd, variants", rows, "bf16")
    if args.out:
        dump(os.path.join(args.out, "profile_mlp.json"), {"rows": rows})


if __name__ == "__main__":
    main()
