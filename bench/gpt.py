"""The GPT train step of ``fp8jax train``: tokens/s, FP8 vs BF16 (issues 8 and 9).

Times the very step the CLI runs (model, AdamW, FP8 state handling), built
by :class:`fp8jax.training.loop.TrainProgram` for a named preset. By default
the state is not donated and the same state is fed again and again;
``--donate`` donates it and chains the steps, as the train loop does. With ``--mesh`` the
step runs over several GPUs (``fsdp=2``: parameters and AdamW moments split,
FP8 kernels gathered). ``--trace`` breaks the step's kernels down by class,
which gives the all-gather time per GPU: what FP8 weights save under FSDP.

    PYTHONPATH=src python bench/gpt.py --config medium [--mesh fsdp=2] [--trace DIR] [--out F]
"""

from __future__ import annotations

import argparse
import os

import jax
from harness import (
    add_compile_cache_argument,
    add_heat_argument,
    dump,
    measure,
    print_table,
    start,
)

from fp8jax import data
from fp8jax.training import mesh as mesh_lib
from fp8jax.training.config import TrainOptions, resolve
from fp8jax.training.loop import TrainProgram

VARIANTS = {
    "bf16": {"precision": "bf16"},
    "fp8jax_current": {"precision": "fp8", "recipe": "current"},
    "fp8jax_delayed": {"precision": "fp8", "recipe": "delayed"},
}


def step_and_args(
    preset: str, variant: str, mesh_text: str | None, attention: str, donate: bool,
    unroll_layers: bool = True,
):  # fmt: skip
    options = TrainOptions(out="unused", config=preset, mesh=mesh_text, **VARIANTS[variant])
    config = resolve(options)
    axes = mesh_lib.parse_mesh(mesh_text)
    mesh = mesh_lib.build_mesh(axes, batch_size=config.batch_size, hidden=config.model.hidden)
    with jax.numpy_dtype_promotion("standard"):  # as fp8jax train: optax mixes int32 and f32
        program = TrainProgram(config, mesh, attention, unroll_layers)
    corpus = data.load_corpus(None)
    batch = program.put(
        data.train_batch(corpus.train, 0, batch_size=config.batch_size,
                         seq_len=config.seq_len, seed=0)
    )  # fmt: skip
    out_shardings = None
    if mesh is not None:
        state_shardings = jax.tree.map(lambda a: a.sharding, program.initial_state)
        out_shardings = (state_shardings, mesh_lib.replicated(mesh))
    step = jax.jit(
        program.raw_step, out_shardings=out_shardings, donate_argnums=0 if donate else ()
    )
    tokens = config.batch_size * config.seq_len
    devices = 1 if mesh is None else mesh.size
    return program, step, (program.initial_state, batch), tokens, devices


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="medium")
    parser.add_argument("--mesh", default=None, help="e.g. fsdp=2; default one GPU")
    parser.add_argument("--attention", default="cudnn")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--donate", action="store_true",
        help="donate the state and feed each step's new state to the next, as fp8jax train does",
    )  # fmt: skip
    parser.add_argument(
        "--rolled-layers", action="store_true",
        help="keep the scan over layers rolled (Gpt.unroll_layers=False), to compare",
    )  # fmt: skip
    parser.add_argument("--trace", default=None, help="profile each variant here")
    parser.add_argument("--out", default=None)
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    env = start(args)
    print(env)
    title = f"GPT {args.config} train step" + (f", mesh {args.mesh}" if args.mesh else "")
    title += ", layers rolled" if args.rolled_layers else ""
    print(f"\n{title}", flush=True)
    rows = []
    for name in args.variants:
        program, step, step_args, tokens, devices = step_and_args(
            args.config, name, args.mesh, args.attention, args.donate, not args.rolled_layers
        )
        trace = os.path.join(args.trace, name) if args.trace else None
        with jax.numpy_dtype_promotion("standard"), program.sharding_context():
            row = measure(name, step, *step_args, iters=args.iters, trace_dir=trace,
                          devices=devices, carry=args.donate)  # fmt: skip
        row["tokens_per_s"] = tokens / (row["median_ms"] / 1e3)
        if "breakdown" in row:
            ms = row["breakdown"]["ms"]
            row["all_gather_ms_per_gpu"] = ms.get("all-gather", 0.0)
        print(f"    {row['tokens_per_s']:,.0f} tokens/s", flush=True)
        rows.append(row)
        del program, step, step_args
    print_table(title, rows, "bf16")
    for r in rows:
        if "all_gather_ms_per_gpu" in r:
            print(f"  {r['name']}: all-gather {r['all_gather_ms_per_gpu']:.3f} ms/step per GPU")
    if args.out:
        dump(args.out, {"environment": env, "title": title, "mesh": args.mesh, "rows": rows})


if __name__ == "__main__":
    main()
