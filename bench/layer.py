"""One transformer layer forward+backward: fp8jax vs BF16 vs Flax's FP8 ops.

Three presets (``--preset``), bf16 activations and kernels, gradients with
respect to the input and every parameter, causal cuDNN attention:

- ``te``: TransformerEngine's published configuration: hidden 4096, ffn 16384
  (gelu), LayerNorm, biases, 32 heads, seq 2048, batch 8.
- ``llama3-8b``: one Llama-3-8B layer: hidden 4096, ffn 14336 (SwiGLU),
  RMSNorm, no biases, 32 query and 8 key/value heads of 128, seq 4096,
  batch 2 (no RoPE: it is the same elementwise work in every variant).
- ``qwen2.5-14b``: one Qwen2.5-14B layer, a model family the library was not
  tuned on (issue 59's check that other shapes gain as much): hidden 5120, ffn
  13824 (SwiGLU), RMSNorm, 40 query and 8 key/value heads of 128, seq 4096,
  batch 2; like ``llama3-8b`` without RoPE, and without Qwen's QKV bias.

The BF16 and Flax FP8 variants run :class:`FlaxLayer`, the layer as a Flax
user writes it, with the variant's ``dot_general_cls`` and default jit
options; fp8jax runs its own TransformerLayer with the same shapes, jitted
with :func:`fp8jax.compiler_options`. The loss is harness's ``--loss``
(by default a random output gradient).

    PYTHONPATH=src python bench/layer.py [--preset NAME] [--variants ...] [--out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
    grad_part,
    measure,
    output_cotangent,
    output_loss,
    print_table,
    standard_variants,
    start,
)

import fp8jax
from fp8jax.flax import linen as fnn

BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
    """One layer's configuration and its input's shape."""

    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated: bool  # SwiGLU and RMSNorm without biases (Llama) or gelu and LayerNorm with biases


PRESETS = {
    "te": Shape(batch=8, seq=2048, hidden=4096, heads=32, kv_heads=32, ffn=16384, gated=False),
    "llama3-8b": Shape(batch=2, seq=4096, hidden=4096, heads=32, kv_heads=8, ffn=14336, gated=True),
    "qwen2.5-14b": Shape(
        batch=2, seq=4096, hidden=5120, heads=40, kv_heads=8, ffn=13824, gated=True
    ),
}


class FlaxLayer(nn.Module):
    """A pre-norm transformer layer in plain Flax; ``dot_general_cls`` picks the matmul."""

    shape: Shape
    attention: str
    dot_general_cls: type | None = None

    @nn.compact
    def __call__(self, x):
        s = self.shape
        kw = {"dtype": BF16, "use_bias": not s.gated}
        if self.dot_general_cls is not None:
            kw["dot_general_cls"] = self.dot_general_cls
        norm = nn.RMSNorm if s.gated else nn.LayerNorm
        head_dim = s.hidden // s.heads
        y = norm(dtype=BF16)(x)
        q = nn.DenseGeneral((s.heads, head_dim), name="q", **kw)(y)
        k = nn.DenseGeneral((s.kv_heads, head_dim), name="k", **kw)(y)
        v = nn.DenseGeneral((s.kv_heads, head_dim), name="v", **kw)(y)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        x = x + nn.DenseGeneral(s.hidden, axis=(-2, -1), name="out", **kw)(a)
        y = norm(dtype=BF16)(x)
        if s.gated:
            h = nn.silu(nn.Dense(s.ffn, name="gate", **kw)(y)) * nn.Dense(s.ffn, name="up", **kw)(y)
        else:
            h = nn.gelu(nn.Dense(s.ffn, name="up", **kw)(y))
        return x + nn.Dense(s.hidden, name="down", **kw)(h)


def flax_variant(x, shape, attention, dot_general_cls):
    model = FlaxLayer(shape, attention, dot_general_cls)
    variables = bf16_matrices(jax.jit(model.init)(jax.random.key(0), x))

    def loss(variables, x, r):
        return output_loss(model.apply(variables, x), r)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step, (variables, x, output_cotangent(x.shape))


def fp8jax_variant(x, shape, attention, recipe):
    s = shape
    layer = fnn.TransformerLayer(
        num_heads=s.heads, num_kv_heads=s.kv_heads, intermediate_dim=s.ffn,
        # FlaxLayer's nn.gelu is the tanh approximation.
        activations=("silu", "linear") if s.gated else ("gelu_tanh",),
        norm_type="rmsnorm" if s.gated else "layernorm", use_bias=not s.gated,
        causal=True, attention_implementation=attention, dtype=BF16, recipe=recipe,
    )  # fmt: skip
    variables = bf16_matrices(jax.jit(layer.init)(jax.random.key(0), x))
    params = variables["params"]
    state = variables.get("fp8_state")

    def loss(params, x, state, r):
        collections = (
            {"params": params} if state is None else {"params": params, "fp8_state": state}
        )
        return output_loss(layer.apply(collections, x), r)

    step = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=fp8jax.compiler_options()
    )
    return step, (params, x, state, output_cotangent(x.shape))


VARIANTS = standard_variants(flax_variant, fp8jax_variant) | {
    # The fine-grained recipes (not in the default --variants): one scale per row,
    # and DeepSeek-V3's 1x128 / 128x128 blocks.
    "fp8jax_row": functools.partial(fp8jax_variant, recipe=fp8jax.RowwiseScaling()),
    "fp8jax_block": functools.partial(fp8jax_variant, recipe=fp8jax.BlockScaling()),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in ("fp8jax_row", "fp8jax_block")]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="te", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=None, help="override the preset's batch")
    parser.add_argument("--attention", default="cudnn", help="cudnn on the GPU, xla elsewhere")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--trace", default=None, help="profile each variant here")
    add_loss_argument(parser)
    parser.add_argument("--out", default=None)
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    shape = PRESETS[args.preset]
    if args.batch is not None:
        shape = dataclasses.replace(shape, batch=args.batch)
    env = start(args)
    env["preset"] = dataclasses.asdict(shape) | {"name": args.preset}
    print(env)
    x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq, shape.hidden)).astype(BF16)
    rows = []
    for name in args.variants:
        fn, fn_args = VARIANTS[name](x, shape, args.attention)
        trace = os.path.join(args.trace, name) if args.trace else None
        state_arg = 2 if name.startswith("fp8jax") else None  # (params, x, state, r)
        rows.append(
            measure(
                name,
                fn,
                *fn_args,
                iters=args.iters,
                trace_dir=trace,
                state_arg=state_arg,
                flax_fp8_state=name.startswith("flax_fp8"),
                gradients=grad_part(1),  # (loss, grads)
            )
        )
    print_table(f"TransformerLayer fwd+bwd, preset {args.preset}", rows, "bf16")
    if args.out:
        dump(args.out, {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
