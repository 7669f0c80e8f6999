"""MLP block forward+backward on one GPU: fp8jax vs BF16 vs Flax's FP8 ops.

Case (issue 4 / 8): LayerNorm -> dense -> activation -> dense, hidden 4096,
ffn 16384, 16384 tokens, bf16 activations and kernels, gradients with
respect to the input and every parameter.

    PYTHONPATH=src python bench/mlp.py [--activations gelu gelu,linear silu,linear] [--out F]
"""

from __future__ import annotations

import argparse
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from harness import compiled_facts, dump, environment, print_table, time_ms

import fp8jax
from fp8jax.ops.fused import ACTIVATIONS

BF16, F32 = jnp.bfloat16, jnp.float32


def gated(pre, activations):
    h = ACTIVATIONS[activations[0]](pre[..., 0, :].astype(F32))
    for i, name in enumerate(activations[1:], start=1):
        h = h * ACTIVATIONS[name](pre[..., i, :].astype(F32))
    return h.astype(BF16)


class FlaxMlp(nn.Module):
    """The same block in plain Flax Linen; dot_general_cls picks the matmul."""

    ffn: int
    activations: tuple
    dot_general_cls: type | None = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
        y = nn.LayerNorm(dtype=BF16)(x)
        pre = nn.DenseGeneral((len(self.activations), self.ffn), dtype=BF16, **kw)(y)
        return nn.Dense(x.shape[-1], dtype=BF16, **kw)(gated(pre, self.activations))


def to_bf16(tree):
    return jax.tree.map(lambda p: p.astype(BF16) if p.dtype == F32 and p.ndim > 1 else p, tree)


def flax_variant(x, ffn, activations, dot_general_cls):
    model = FlaxMlp(ffn, activations, dot_general_cls)
    variables = to_bf16(jax.jit(model.init)(jax.random.key(0), x))

    def loss(variables, x):
        return model.apply(variables, x).astype(F32).mean()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (variables, x)


def fp8jax_variant(x, ffn, activations, recipe):
    hidden = x.shape[-1]
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "gamma": jnp.ones((hidden,), F32),
        "beta": jnp.zeros((hidden,), F32),
        "k1": (jax.random.normal(k1, (hidden, len(activations), ffn), F32) * 0.02).astype(BF16),
        "b1": jnp.zeros((len(activations), ffn), BF16),
        "k2": (jax.random.normal(k2, (ffn, hidden), F32) * 0.02).astype(BF16),
        "b2": jnp.zeros((hidden,), BF16),
    }
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(params, x, state):
        y = fp8jax.layernorm_mlp(
            x,
            params["gamma"],
            params["beta"],
            params["k1"],
            params["k2"],
            params["b1"],
            params["b2"],
            activations=activations,
            recipe=recipe,
            state=state,
        )
        return y.astype(F32).mean()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (params, x, state)


FAST = {"dgrad_precision": jax.lax.Precision.DEFAULT, "wgrad_precision": jax.lax.Precision.DEFAULT}


def run_case(tokens, hidden, ffn, activations, iters, names=None, trace_dir=None):
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), F32).astype(BF16)
    variants = {
        "bf16": functools.partial(flax_variant, dot_general_cls=None),
        "flax_fp8_direct": functools.partial(
            flax_variant, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp
        ),
        "flax_fp8_qdq": functools.partial(flax_variant, dot_general_cls=fp8_ops.Fp8DotGeneralOp),
        "fp8jax_current": functools.partial(fp8jax_variant, recipe=fp8jax.CurrentScaling()),
        "fp8jax_delayed": functools.partial(
            fp8jax_variant, recipe=fp8jax.DelayedScaling(amax_history_len=1024)
        ),
        "fp8jax_current_fastacc": functools.partial(
            fp8jax_variant, recipe=fp8jax.CurrentScaling(**FAST)
        ),
        "fp8jax_delayed_fastacc": functools.partial(
            fp8jax_variant, recipe=fp8jax.DelayedScaling(**FAST)
        ),
    }
    rows = []
    for name, make in variants.items():
        if names and name not in names:
            continue
        fn, args = make(x, ffn, activations)
        facts = compiled_facts(fn, *args)
        timing = time_ms(fn, *args, iters=iters)
        gemm_flops = 2 * tokens * hidden * ffn * (len(activations) + 1) * 3
        rows.append(
            {"name": name, **timing, **facts, "tflops": gemm_flops / timing["median_ms"] / 1e9}
        )
        print(
            f"  {name}: {timing['median_ms']:.3f} ms, {facts['fp8_gemms']}/{facts['gemms']} "
            f"FP8 GEMMs {facts['backends']}",
            flush=True,
        )
        if trace_dir and name.startswith("fp8jax_current"):
            with jax.profiler.trace(os.path.join(trace_dir, f"trace_{name}")):
                for _ in range(3):
                    jax.block_until_ready(fn(*args))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--activations", nargs="+", default=["gelu", "gelu,linear", "silu,linear"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--variants", nargs="*", default=None, help="run only these")
    parser.add_argument("--trace", default=None, help="write fp8jax profiler traces here")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    env = environment()
    print(env)
    results = {"environment": env, "cases": {}}
    for spec in args.activations:
        activations = tuple(spec.split(","))
        print(
            f"\nlayernorm_mlp {activations}: tokens {args.tokens}, hidden {args.hidden}, "
            f"ffn {args.ffn}",
            flush=True,
        )
        rows = run_case(
            args.tokens, args.hidden, args.ffn, activations, args.iters, args.variants, args.trace
        )
        print_table(f"MLP {spec} fwd+bwd", rows, "bf16")
        results["cases"][spec] = rows
    if args.out:
        dump(args.out, results)


if __name__ == "__main__":
    main()
