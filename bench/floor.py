"""The floor of a train step's element-wise work, counted from the model's shapes.

Everything in a step that is not a GEMM or attention (norms, RoPE, the gated
activation, residual adds, FP8 casts, amax reductions, FP8 transposes, the
optimizer) is memory-bound. Its floor is the bytes that must cross HBM if every
such operation were folded into a pass that has to read or write the data
anyway, divided by a stated bandwidth. This module lists those passes for one
pre-norm Llama block (RMSNorm, GQA attention with RoPE, SwiGLU MLP) and the
optimizer, so that the number a benchmark prints beside its breakdown is
computed, not counted by hand. It is an estimate of what a perfectly fused step
could reach, never a measurement.

Two floors are given for FP8 under current scaling, whose amax must be known
before the cast it scales:

- ``fused``: every amax comes out of the pass that produces the tensor (as
  delayed scaling, or a producer that reduces as it writes, allows);
- ``two_pass``: each tensor whose producer cannot reduce (a GEMM's output, the
  cuDNN attention output, the gated activation and its gradient) is read once
  more for its amax, the design issue 59 allows ("a two-pass design with the
  amax of the first pass feeding the second is fine").

What is left out, because it is small at every preset: the embedding, the
final norm, the LM head's softmax and loss (vocabulary 256), and the GEMMs'
own output writes (they belong to the GEMM's time).

    PYTHONPATH=src:bench python bench/floor.py --config llama-3b
"""

from __future__ import annotations

import argparse
import dataclasses

BF16, FP8, F32 = 2, 1, 4
# What fp8jax's own memory-bound kernels reach on the H200 at the power cap; HBM3e's
# peak is 4.8 TB/s (docs/design.md#the-layers-ceiling).
DEFAULT_TB_S = 3.3


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass over HBM: its name, its phase and the bytes it reads and writes."""

    name: str
    phase: str  # "forward", "backward" or "optimizer"
    read: float
    write: float

    @property
    def bytes(self) -> float:
        return self.read + self.write


def layer_passes(
    tokens: int, hidden: int, heads: int, kv_heads: int, ffn: int, *,
    precision: str = "fp8", two_pass_amax: bool = True,
) -> list[Pass]:  # fmt: skip
    """The element-wise passes of one Llama block's forward and backward, in bytes."""
    t, h, f = tokens, hidden, ffn
    q = hidden
    kv = hidden // heads * kv_heads
    fp8 = precision == "fp8"
    # An FP8 operand of a GEMM whose other use contracts the other axis is written in
    # both layouts (the wgrad's transposed copy); BF16 GEMMs read one layout.
    cast_out = 2 * FP8 if fp8 else 0
    amax = two_pass_amax and fp8
    out: list[Pass] = []

    def add(name, phase, read, write):
        out.append(Pass(name, phase, read, write))

    for norm in ("attention norm", "mlp norm"):
        # Residual add of the GEMM output that ends the previous sub-block, RMSNorm, cast:
        # reads the residual and the GEMM output, writes the new residual and x_n.
        add(f"{norm}: residual add + RMSNorm (+ cast)", "forward",
            2 * t * h * BF16, t * h * BF16 + t * h * (cast_out if fp8 else BF16))  # fmt: skip
    add("RoPE on q, k", "forward", t * (q + kv) * BF16, t * (q + kv) * BF16)
    if fp8:
        if amax:
            add("attention output: amax", "forward", t * q * BF16, 0)
        add("attention output: cast", "forward", t * q * BF16, t * q * cast_out)
    if amax:
        add("SwiGLU: amax", "forward", 2 * t * f * BF16, 0)
    add("SwiGLU", "forward", 2 * t * f * BF16, t * f * (cast_out if fp8 else BF16))

    # Backward, from the residual stream's gradient g (BF16) down.
    if fp8:
        if amax:
            add("g (down projection): amax", "backward", t * h * BF16, 0)
        add("g (down projection): cast", "backward", t * h * BF16, t * h * cast_out)
    if amax:
        add("SwiGLU gradient: amax", "backward", 3 * t * f * BF16, 0)
    add("SwiGLU gradient", "backward", 3 * t * f * BF16,
        2 * t * f * (cast_out if fp8 else BF16))  # fmt: skip
    for norm in ("mlp norm", "attention norm"):
        # dx_n, the norm's input (recomputed statistics) and the residual gradient in,
        # the new residual gradient out.
        add(f"{norm}: RMSNorm backward + residual", "backward", 3 * t * h * BF16, t * h * BF16)
        if norm == "mlp norm" and fp8:
            if amax:
                add("g (output projection): amax", "backward", t * h * BF16, 0)
            add("g (output projection): cast", "backward", t * h * BF16, t * h * cast_out)
    add("RoPE backward on dq, dk", "backward", t * (q + kv) * BF16, t * (q + kv) * BF16)
    if fp8:
        if amax:
            add("dqkv: amax", "backward", t * (q + 2 * kv) * BF16, 0)
        add("dqkv: cast", "backward", t * (q + 2 * kv) * BF16, t * (q + 2 * kv) * cast_out)
    return out


def optimizer_passes(params: int, *, precision: str = "fp8") -> list[Pass]:
    """AdamW with global-norm clipping over f32 master weights, in one pass each."""
    out = [
        Pass("gradient norm", "optimizer", params * F32, 0),
        # f32 weights, both moments and the gradient in; weights and moments out.
        Pass("AdamW update", "optimizer", 4 * params * F32, 3 * params * F32),
    ]
    if precision == "fp8":
        # The next step's weight casts (both layouts), folded into the update's pass.
        out.append(Pass("weight FP8 copies", "optimizer", 0, 2 * params * FP8))
    return out


def step_floor(model, batch_size: int, seq_len: int, *, precision: str = "fp8",
               two_pass_amax: bool = True, tb_s: float = DEFAULT_TB_S) -> dict:  # fmt: skip
    """The floor of one train step's element-wise work: bytes and ms, by phase.

    ``model`` is a :class:`fp8jax.models.gpt.GptConfig`.
    """
    tokens = batch_size * seq_len
    per_layer = layer_passes(
        tokens, model.hidden, model.heads, model.kv_heads or model.heads, model.ffn,
        precision=precision, two_pass_amax=two_pass_amax,
    )  # fmt: skip
    passes = [dataclasses.replace(p, read=p.read * model.layers, write=p.write * model.layers)
              for p in per_layer]  # fmt: skip
    passes += optimizer_passes(model.num_params(), precision=precision)
    by_phase: dict[str, float] = {}
    for p in passes:
        by_phase[p.phase] = by_phase.get(p.phase, 0.0) + p.bytes
    ms = {k: v / (tb_s * 1e12) * 1e3 for k, v in by_phase.items()}
    return {
        "tb_s": tb_s,
        "precision": precision,
        "two_pass_amax": two_pass_amax,
        "gb": {k: v / 1e9 for k, v in by_phase.items()},
        "ms": ms,
        "total_ms": sum(ms.values()),
        "passes": [dataclasses.asdict(p) | {"bytes": p.bytes} for p in passes],
    }


def describe(floor: dict) -> str:
    """One line: the floor's total and its phases."""
    phases = ", ".join(f"{k} {v:.1f}" for k, v in floor["ms"].items())
    how = "amax in its own pass" if floor["two_pass_amax"] else "amax fused"
    return (f"element-wise floor {floor['total_ms']:.1f} ms at {floor['tb_s']} TB/s "
            f"({floor['precision']}, {how}): {phases}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from fp8jax.training.config import TrainOptions, resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama-3b")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--tb-s", type=float, default=DEFAULT_TB_S)
    args = parser.parse_args(argv)
    options = TrainOptions(out="unused", config=args.config)
    if args.batch_size:
        options = dataclasses.replace(options, batch_size=args.batch_size)
    config = resolve(options)
    print(f"{args.config}: batch {config.batch_size} x {config.seq_len}, "
          f"{config.model.num_params() / 1e9:.2f} B parameters")  # fmt: skip
    for precision, two_pass in (("bf16", False), ("fp8", False), ("fp8", True)):
        floor = step_floor(config.model, config.batch_size, config.seq_len,
                           precision=precision, two_pass_amax=two_pass, tb_s=args.tb_s)  # fmt: skip
        print("  " + describe(floor))


if __name__ == "__main__":
    main()
