"""One transformer layer forward+backward: fp8jax vs BF16 vs Flax's FP8 ops (issue 8).

TransformerEngine's published configuration: hidden 4096, ffn 16384 (gelu), 32 heads, seq 2048,
batch 8, causal cuDNN attention, bf16 activations and kernels, gradients with
respect to the input and every parameter. The BF16 and Flax FP8 variants run
:class:`FlaxLayer`, the layer as a Flax user writes it, with the variant's
``dot_general_cls``; fp8jax runs its own TransformerLayer with the same shapes.

    PYTHONPATH=src python bench/layer.py [--variants ...] [--out F]
"""

from __future__ import annotations

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from harness import (
    add_compile_cache_argument,
    add_heat_argument,
    add_loss_argument,
    bf16_matrices,
    dump,
    measure,
    output_loss,
    print_table,
    standard_variants,
    start,
)

from fp8jax.flax import linen as fnn

BF16, F32 = jnp.bfloat16, jnp.float32


class FlaxLayer(nn.Module):
    """A pre-norm transformer layer in plain Flax; ``dot_general_cls`` picks the matmul."""

    heads: int
    ffn: int
    attention: str
    dot_general_cls: type | None = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
        hidden = x.shape[-1]
        y = nn.LayerNorm(dtype=BF16)(x)
        qkv = nn.DenseGeneral((3, self.heads, hidden // self.heads), dtype=BF16, **kw)(y)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        x = x + nn.DenseGeneral(hidden, axis=(-2, -1), dtype=BF16, **kw)(a)
        y = nn.LayerNorm(dtype=BF16)(x)
        y = nn.gelu(nn.Dense(self.ffn, dtype=BF16, **kw)(y))
        return x + nn.Dense(hidden, dtype=BF16, **kw)(y)


def flax_variant(x, heads, ffn, attention, dot_general_cls):
    model = FlaxLayer(heads, ffn, attention, dot_general_cls)
    variables = bf16_matrices(jax.jit(model.init)(jax.random.key(0), x))

    def loss(variables, x):
        return output_loss(model.apply(variables, x))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (variables, x)


def fp8jax_variant(x, heads, ffn, attention, recipe):
    layer = fnn.TransformerLayer(
        # FlaxLayer's nn.gelu is the tanh approximation.
        num_heads=heads, intermediate_dim=ffn, activations=("gelu_tanh",), causal=True,
        attention_implementation=attention, dtype=BF16, recipe=recipe,
    )  # fmt: skip
    variables = bf16_matrices(jax.jit(layer.init)(jax.random.key(0), x))
    params = variables["params"]
    state = variables.get("fp8_state")

    def loss(params, x, state):
        collections = (
            {"params": params} if state is None else {"params": params, "fp8_state": state}
        )
        return output_loss(layer.apply(collections, x))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (params, x, state)


VARIANTS = standard_variants(flax_variant, fp8jax_variant)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=16384)
    parser.add_argument("--attention", default="cudnn", help="cudnn on the GPU, xla elsewhere")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--trace", default=None, help="profile the FP8 variants here")
    add_loss_argument(parser)
    parser.add_argument("--out", default=None)
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    env = start(args)
    print(env)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.hidden)).astype(BF16)
    rows = []
    for name in args.variants:
        fn, fn_args = VARIANTS[name](x, args.heads, args.ffn, args.attention)
        trace = os.path.join(args.trace, name) if args.trace and name != "bf16" else None
        rows.append(measure(name, fn, *fn_args, iters=args.iters, trace_dir=trace))
    print_table("TransformerLayer fwd+bwd", rows, "bf16")
    if args.out:
        dump(args.out, {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
