"""How many sequences of a preset fit on one GPU: an estimate that needs no GPU.

The Llama presets' batch sizes came from this until the compiled step's measured
peak showed its activations about five times too high (docs/train.md#llama-presets).
It counts what the train step keeps from the forward for the backward
(``jax.ad_checkpoint``'s saved residuals of the loss, traced on abstract
values, nothing allocated) and adds the f32 training state:

* residuals per token per layer: the residual bytes of a 2-layer model minus
  those of a 1-layer model, at sequence lengths S and 2S, split into a part
  linear in S and one in S^2. The S^2 part is XLA attention's score matrix,
  which cuDNN's fused attention (the default on a GPU) never stores, so only
  the linear part is kept;
* state: 16 bytes per parameter (f32 parameters, gradients and AdamW's two
  moments).

It is an upper bound on activations: XLA fuses elementwise chains and may
keep fewer of their values than the jaxpr saves. The compiled step's own
``memory_analysis()`` (bench/gpt.py's ``peak_memory_gib``) is the measurement.

    PYTHONPATH=src python bench/train_memory.py --config llama-1b --budget-gib 98
"""

from __future__ import annotations

import argparse
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

# What jax.ad_checkpoint.print_saved_residuals prints, as a list; jax does not
# export it, so a jax upgrade may move it (a benchmark script, not the library).
from jax._src.ad_checkpoint import saved_residuals

import fp8jax
from fp8jax.models import Gpt, next_token_loss
from fp8jax.training.config import PRESETS, REMAT


def residual_bytes(model, precision: str, remat: str, seq_len: int) -> int:
    """Bytes the forward of one sequence saves for the backward (parameters excluded)."""
    gpt = Gpt(
        config=model, precision=precision, remat=remat, attention_implementation="xla",
        recipe=fp8jax.CurrentScaling() if precision == "fp8" else None,
    )  # fmt: skip
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    variables = jax.eval_shape(
        lambda k: nn.meta.unbox(gpt.init(k, jnp.zeros(tokens.shape, jnp.int32))),
        jax.random.key(0),
    )

    def loss(params, t):
        return next_token_loss(gpt.apply({"params": params}, t), t)

    with jax.numpy_dtype_promotion("standard"):
        saved = saved_residuals(loss, variables["params"], tokens)
    return sum(a.size * a.dtype.itemsize for a, why in saved if "from the argument" not in why)


def per_layer_bytes(model, precision: str, remat: str, seq_len: int) -> float:
    """Residual bytes per sequence per layer at ``seq_len``, without the S^2 attention part."""
    short = seq_len // 4

    def layer(s):
        one = residual_bytes(dataclasses.replace(model, layers=1), precision, remat, s)
        two = residual_bytes(dataclasses.replace(model, layers=2), precision, remat, s)
        return two - one

    d1, d2 = layer(short), layer(2 * short)
    quadratic = (d2 - 2 * d1) / (2 * short**2)  # d(s) = a s + c s^2
    linear = (d1 - quadratic * short**2) / short
    return linear * seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="llama-1b", choices=sorted(PRESETS))
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--remat", default="none", choices=REMAT)
    parser.add_argument(
        "--budget-gib", type=float, default=98.0,
        help="memory the step may use (default: JAX's 75%% of an H200's 131 GiB)",
    )  # fmt: skip
    args = parser.parse_args()
    preset = PRESETS[args.config]
    model, seq = preset.model, preset.seq_len
    state = 16 * model.num_params()
    per_sequence = per_layer_bytes(model, args.precision, args.remat, seq) * model.layers
    fits = int((args.budget_gib * 2**30 - state) // per_sequence)
    print(
        f"{args.config} {args.precision} remat {args.remat}: state {state / 2**30:.1f} GiB, "
        f"activations {per_sequence / 2**30:.2f} GiB per {seq}-byte sequence; "
        f"{fits} sequences fit in {args.budget_gib:.0f} GiB (upper bound on activations)"
    )


if __name__ == "__main__":
    main()
