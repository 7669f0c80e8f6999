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
from harness import (
    DELAYED,
    add_compile_cache_argument,
    add_heat_argument,
    add_loss_argument,
    bf16_matrices,
    dump,
    grad_part,
    measure,
    output_cotangent,
    output_loss,
    print_table,
    standard_variants,
    start,
)

import fp8jax
from fp8jax import activations as activations_

BF16, F32 = jnp.bfloat16, jnp.float32


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
        return nn.Dense(x.shape[-1], dtype=BF16, **kw)(
            activations_.gated(pre, self.activations, dtype=BF16)
        )


def flax_variant(x, ffn, activations, dot_general_cls):
    model = FlaxMlp(ffn, activations, dot_general_cls)
    variables = bf16_matrices(jax.jit(model.init)(jax.random.key(0), x))

    def loss(variables, x, r):
        return output_loss(model.apply(variables, x), r)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step, (variables, x, output_cotangent(x.shape))


def fp8jax_variant(x, ffn, activations, recipe, bias=True):
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
    if not bias:  # unused, they would have zero gradients
        del params["b1"], params["b2"]
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(params, x, state, r):
        y = fp8jax.layernorm_mlp(
            x,
            params["gamma"],
            params["beta"],
            params["k1"],
            params["k2"],
            params.get("b1"),
            params.get("b2"),
            activations=activations,
            recipe=recipe,
            state=state,
        )
        return output_loss(y, r)

    step = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=fp8jax.compiler_options()
    )
    return step, (params, x, state, output_cotangent(x.shape))


FAST = {"dgrad_precision": jax.lax.Precision.DEFAULT, "wgrad_precision": jax.lax.Precision.DEFAULT}


def gemms_only(x, ffn, activations, precision):
    """The block's six GEMMs on FP8 operands and nothing else: the floor of any FP8 MLP."""
    tokens, hidden = x.shape
    width = ffn * len(activations)
    keys = jax.random.split(jax.random.key(3), 6)

    def rand(key, shape, dtype):
        return jax.random.normal(key, shape).astype(dtype)

    E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    operands = (
        rand(keys[0], (tokens, hidden), E4),  # normalized input
        rand(keys[1], (hidden, width), E4),  # kernel 1
        rand(keys[2], (tokens, ffn), E4),  # activation
        rand(keys[3], (ffn, hidden), E4),  # kernel 2
        rand(keys[4], (tokens, hidden), E5),  # output gradient
        rand(keys[5], (tokens, width), E5),  # pre-activation gradient
    )
    fwd = jax.lax.Precision.DEFAULT

    def dot(a, b, contract, p):
        return jax.lax.dot_general(a, b, (contract, ((), ())), precision=p,
                                   preferred_element_type=BF16)  # fmt: skip

    def six(xq, k1q, hq, k2q, g2q, g1q):
        return (
            dot(xq, k1q, ((1,), (0,)), fwd),
            dot(hq, k2q, ((1,), (0,)), fwd),
            dot(g2q, k2q, ((1,), (1,)), precision),  # dgrad 2
            dot(hq, g2q, ((0,), (0,)), precision),  # wgrad 2
            dot(g1q, k1q, ((1,), (1,)), precision),  # dgrad 1
            dot(xq, g1q, ((0,), (0,)), precision),  # wgrad 1
        )

    return jax.jit(six), operands


def _swapped_backward_dots(swap_dgrad: bool):
    """gemm.backward_dots with the gradient as the GEMM's first operand (JAX's order).

    An experiment: cuBLASLt picks its kernel by operand roles and output
    layout, so the same product in the other order may run faster.
    """
    from fp8jax.ops import dimensions
    from fp8jax.ops.gemm import scaled_dot

    def swapped(a, b, dims, out_dtype, precision, permutation, like):
        (ac, bc), (ab, bb) = dims
        y = scaled_dot(b, a, ((bc, ac), (bb, ab)), out_dtype, precision)
        nb = len(ab)
        a_free = [i for i in range(a.data.ndim) if i not in ac and i not in ab]
        b_free = [i for i in range(b.data.ndim) if i not in bc and i not in bb]
        # y's axes: batch, b free, a free; the unswapped result: batch, a free, b free.
        back = (*range(nb), *(nb + len(b_free) + i for i in range(len(a_free))),
                *(nb + i for i in range(len(b_free))))  # fmt: skip
        y = jnp.transpose(y, back)
        return y if permutation is None else jnp.transpose(y, permutation)

    def backward_dots(dims, lhs_ndim, lhs, rhs_q, g, lhs_dtype, rhs_dtype, recipe):
        # The layouts as themselves: the cast kernel's transposed copies go unused here.
        lhs_q, g_q = lhs.fp8, g.fp8
        if lhs.transposed:
            raise ValueError("the swapped variants need lhs as itself, not transposed")
        dg = dimensions.dgrad(dims, lhs_q.data.ndim, rhs_q.data.ndim)
        wg = dimensions.wgrad(dims, lhs_q.data.ndim, rhs_q.data.ndim)
        if swap_dgrad:
            d_lhs = swapped(g_q, rhs_q, dg.dimension_numbers, lhs_dtype, recipe.dgrad_precision,
                            dg.permutation, lhs_q.data)  # fmt: skip
        else:
            d_lhs = scaled_dot(g_q, rhs_q, dg.dimension_numbers, lhs_dtype,
                               recipe.dgrad_precision, dg.permutation)  # fmt: skip
        d_rhs = swapped(lhs_q, g_q, wg.dimension_numbers, rhs_dtype, recipe.wgrad_precision,
                        wg.permutation, rhs_q.data)  # fmt: skip
        return d_lhs, d_rhs

    return backward_dots


def patched(make, attribute, replacement):
    """``make`` with ``fp8jax.ops.gemm.<attribute>`` replaced while it traces."""
    from fp8jax.ops import gemm as fused

    def traced_with_patch(*args, **kwargs):
        fn, fn_args = make(*args, **kwargs)
        original = getattr(fused, attribute)
        setattr(fused, attribute, replacement)
        try:
            fn = fn.trace(*fn_args).lower().compile()  # traced now, under the patch
        finally:
            setattr(fused, attribute, original)
        return fn, fn_args

    return traced_with_patch


def run_case(tokens, hidden, ffn, activations, iters, names=None, trace_dir=None):
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), F32).astype(BF16)
    variants = standard_variants(flax_variant, fp8jax_variant) | {
        "fp8jax_current_fastacc": functools.partial(
            fp8jax_variant, recipe=fp8jax.CurrentScaling(**FAST)
        ),
        "fp8jax_delayed_fastacc": functools.partial(
            fp8jax_variant, recipe=fp8jax.DelayedScaling(**FAST)
        ),
        "fp8jax_delayed_nobias": functools.partial(fp8jax_variant, recipe=DELAYED, bias=False),
        "gemms_only": functools.partial(gemms_only, precision=jax.lax.Precision.HIGHEST),
        "gemms_only_fastacc": functools.partial(gemms_only, precision=jax.lax.Precision.DEFAULT),
    }
    delayed = variants["fp8jax_delayed"]
    variants["fp8jax_delayed_swap_wgrad"] = patched(
        delayed, "backward_dots", _swapped_backward_dots(swap_dgrad=False)
    )
    variants["fp8jax_delayed_swap_both"] = patched(
        delayed, "backward_dots", _swapped_backward_dots(swap_dgrad=True)
    )
    rows = []
    gemm_flops = 2 * tokens * hidden * ffn * (len(activations) + 1) * 3
    for name, make in variants.items():
        if names and name not in names:
            continue
        fn, args = make(x, ffn, activations)
        traced = trace_dir if trace_dir and name != "bf16" else None
        state_arg = 2 if name.startswith("fp8jax") else None  # (params, x, state, r)
        row = measure(
            name,
            fn,
            *args,
            iters=iters,
            trace_dir=traced,
            state_arg=state_arg,
            flax_fp8_state=name.startswith("flax_fp8"),
            gradients=None if name.startswith("gemms_only") else grad_part(1),
        )
        rows.append(row | {"tflops": gemm_flops / row["median_ms"] / 1e9})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--activations", nargs="+", default=["gelu", "gelu,linear", "silu,linear"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--variants", nargs="*", default=None, help="run only these")
    parser.add_argument("--trace", default=None, help="profile FP8 variants here")
    add_loss_argument(parser)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    env = start(args)
    print(env)
    results = {"environment": env, "cases": {}}
    for spec in args.activations:
        activations = tuple(spec.split(","))
        print(
            f"\nlayernorm_mlp {activations}: tokens {args.tokens}, hidden {args.hidden}, "
            f"ffn {args.ffn}",
            flush=True,
        )
        trace = os.path.join(args.trace, spec.replace(",", "_")) if args.trace else None
        rows = run_case(
            args.tokens, args.hidden, args.ffn, activations, args.iters, args.variants, trace
        )
        print_table(f"MLP {spec} fwd+bwd", rows, "bf16")
        results["cases"][spec] = rows
    if args.out:
        dump(args.out, results)


if __name__ == "__main__":
    main()
