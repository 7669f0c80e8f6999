"""The ``fp8jax train`` step per preset: tokens/s and MFU, FP8 vs BF16 (issues 8, 9 and 33).

Times the very step the CLI runs: :class:`fp8jax.training.program.TrainProgram`'s
``step``, jitted as ``fp8jax train`` jits it (``fp8jax.compiler_options()``,
the state donated; each step's new state feeds the next, as in the loop).
All variants run in one process against the BF16 row. Each row has the
first-compile time (no compilation cache unless ``--compile-cache``), the
median step time, tokens/s, MFU (model FLOPs per token, fp8jax.training.mfu,
against the device's dense BF16 peak; none where that peak is unknown) and
the peak memory of the compiled step (``compiled.memory_analysis()``). With
``--mesh`` the step runs over several GPUs; ``--trace`` breaks the step's
kernels down by class (all-gather time per GPU under FSDP, among others).

    PYTHONPATH=src:bench python bench/gpt.py --config llama-1b [--mesh fsdp=2] [--out F]

The MoE presets (mixtral, deepseek) take current scaling only, and their MFU
counts active parameters (fp8jax.training.mfu):

    PYTHONPATH=src:bench python bench/gpt.py --config mixtral --variants bf16 fp8jax_current
"""

from __future__ import annotations

import argparse
import contextlib
import os
import traceback

import floor
import jax
import jax.numpy as jnp
from harness import (
    add_compile_cache_argument,
    add_heat_argument,
    dump,
    measure,
    print_table,
    start,
)

import fp8jax
from fp8jax import data
from fp8jax.kernels import attention as attention_kernel
from fp8jax.kernels import attention_backward
from fp8jax.training import mesh as mesh_lib
from fp8jax.training import mfu
from fp8jax.training.config import TrainOptions, resolve
from fp8jax.training.program import TrainProgram

VARIANTS = {
    "bf16": {"precision": "bf16"},
    "fp8jax_current": {"precision": "fp8", "recipe": "current"},
    "fp8jax_delayed": {"precision": "fp8", "recipe": "delayed"},
    # Opt-in (--variants): fp8jax.dot_product_attention as the attention core.
    "fp8jax_current_fp8_attention": {"precision": "fp8", "recipe": "current", "attention": "fp8"},
    "fp8jax_current_fp8_attention_hadamard": {
        "precision": "fp8",
        "recipe": "current",
        "attention": "fp8-hadamard",
    },
}
DEFAULT_VARIANTS = [name for name, v in VARIANTS.items() if "attention" not in v]


def step_and_args(preset: str, variant: str, *, mesh_text: str | None = None,
                  attention: str = "auto", unroll_layers: bool = True, **overrides):  # fmt: skip
    """``(program, the jitted train step, its arguments, tokens per step, devices)``.

    ``overrides`` are :class:`TrainOptions` fields (``batch_size``, ``remat``,
    ``accumulation_steps``...), as ``fp8jax train`` takes them.
    """
    options = TrainOptions(
        out="unused", config=preset, mesh=mesh_text, **VARIANTS[variant], **overrides
    )
    config = resolve(options)
    attention = VARIANTS[variant].get("attention", attention)
    axes = mesh_lib.parse_mesh(mesh_text)
    mesh = mesh_lib.build_mesh(
        axes, batch_size=config.batch_size, hidden=config.model.hidden, experts=config.model.experts
    )
    with jax.numpy_dtype_promotion("standard"):  # as fp8jax train: optax mixes int32 and f32
        program = TrainProgram(config, mesh, attention, unroll_layers)
    corpus = data.load_corpus(None)
    batch = program.put(
        data.train_batch(corpus.train, 0, batch_size=config.batch_size,
                         seq_len=config.seq_len, seed=0)
    )  # fmt: skip
    tokens = config.batch_size * config.seq_len
    devices = 1 if mesh is None else mesh.size
    return program, program.step, (program.initial_state, batch), tokens, devices


def step_gradients(program: TrainProgram):
    """``measure``'s ``gradients`` for the train step: each parameter's max |gradient|.

    The step donates its state and returns only the loss, so the gradients
    are taken by a program of their own: the step's loss on the state
    (calibrated FP8 state included) and batch it is timed on, under the same
    compiler options. Reduced to one scalar a parameter on the device, so
    that no second copy of the gradients is held beside the train state.
    With ``--accumulation-steps`` they are the first micro-batch's, the
    step's first backward (its shape, and its activations' memory).
    """
    micro = program.config.batch_size // program.config.accumulation_steps

    def max_abs(state, batch):
        grads = jax.grad(program.loss)(program._variables(state), batch[:micro])["params"]
        return jax.tree.map(lambda g: jnp.max(jnp.abs(g)), grads)

    jitted = jax.jit(max_abs, compiler_options=fp8jax.compiler_options())

    def gradients(step, args):
        return jitted(*args)

    return gradients


def forward_build(name: str | None):
    """bench/attention.py's FP8 attention builds named in ``name`` (None: the library's
    defaults): comma-separated, at most one of FORWARD_BUILDS and one of BACKWARD_BUILDS,
    as a ``(ForwardConfig or None, BackwardConfig or None)`` pair."""
    if name is None:
        return None
    from attention import BACKWARD_BUILDS, FORWARD_BUILDS

    forward = backward = None
    for part in name.split(","):
        if part in FORWARD_BUILDS and forward is None:
            forward = FORWARD_BUILDS[part]
        elif part in BACKWARD_BUILDS and backward is None:
            backward = BACKWARD_BUILDS[part]
        else:
            raise SystemExit(
                "--attention-build takes at most one forward build of "
                f"{sorted(FORWARD_BUILDS)} and one backward build of {sorted(BACKWARD_BUILDS)}, "
                f"comma-separated; got {name!r}"
            )
    return forward, backward


@contextlib.contextmanager
def attention_built_as(builds):
    """FP8 attention's kernels built as ``builds`` (:func:`forward_build`'s pair; None: as
    the library builds them) while a step is traced: the A/B of builds that beat the
    defaults in bench/attention.py."""
    forward, backward = builds or (None, None)
    saved = attention_kernel.DEFAULT_CONFIG, attention_backward.DEFAULT_CONFIG
    # fp8jax.dot_product_attention reads both defaults when it is traced.
    if forward is not None:
        attention_kernel.DEFAULT_CONFIG = forward
    if backward is not None:
        attention_backward.DEFAULT_CONFIG = backward
    try:
        yield
    finally:
        attention_kernel.DEFAULT_CONFIG, attention_backward.DEFAULT_CONFIG = saved


def row_rates(row: dict, program: TrainProgram, tokens: int, devices: int) -> None:
    """Adds tokens/s, model FLOPs per token and MFU (or why there is none) to ``row``."""
    c = program.config
    row["tokens_per_s"] = tokens / (row["median_ms"] / 1e3)
    row["tokens_per_s_pipelined"] = tokens / (row["pipelined_ms"] / 1e3)
    row["step_ms"] = row["median_ms"]
    row["model_flops_per_token"] = mfu.flops_per_token(c.model, c.seq_len)
    used = jax.devices()[:devices] if program.mesh is None else list(program.mesh.devices.flat)
    peak, kind = mfu.peak_flops(used)
    row["mfu"] = mfu.mfu(row["tokens_per_s"], row["model_flops_per_token"], peak)
    row["mfu_text"] = mfu.describe(peak, kind, devices, row["mfu"])
    row["batch"] = [c.batch_size, c.seq_len]
    row["remat"], row["accumulation_steps"] = c.remat, c.accumulation_steps


def elementwise_against_floor(row: dict, program: TrainProgram) -> dict:
    """The row's element-wise kernel time beside its floor from the shapes (bench/floor.py)."""
    c = program.config
    spent = sum(v for k, v in row["breakdown"]["ms"].items() if k not in ("gemm", "attention"))
    # BF16 has no amax to fuse or not; FP8 gets both of bench/floor.py's floors.
    ways = {"": False}
    if c.precision == "fp8":
        ways = {"amax fused": False, "amax in its own pass": True}
    floors = {
        way: floor.step_floor(c.model, c.batch_size, c.seq_len, precision=c.precision,
                              two_pass_amax=two_pass)["total_ms"]
        for way, two_pass in ways.items()
    }  # fmt: skip
    against = ", ".join(f"{v:.1f}" + (f" ({way})" if way else "") for way, v in floors.items())
    text = (f"not GEMM or attention: {spent:.1f} ms/step; "
            f"floor at {floor.DEFAULT_TB_S} TB/s: {against}")  # fmt: skip
    return {"elementwise_ms": spent, "floor_ms": floors, "text": text}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="medium")
    parser.add_argument("--mesh", default=None, help="e.g. fsdp=2; default one GPU")
    parser.add_argument(
        "--attention", default="auto", help="auto (cuDNN on a GPU), xla, cudnn, fp8, fp8-hadamard"
    )
    parser.add_argument(
        "--attention-build", default=None,
        help="FP8 attention rows with the kernels built as these bench/attention.py builds "
        "(one of FORWARD_BUILDS, one of BACKWARD_BUILDS, comma-separated), not the library's "
        "defaults; recorded in the output",
    )  # fmt: skip
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    parser.add_argument("--remat", default=None, help="none, dots, full (default: the preset's)")
    parser.add_argument("--accumulation-steps", type=int, default=None)
    parser.add_argument(
        "--rolled-layers", action="store_true",
        help="keep the scan over layers rolled (Gpt.unroll_layers=False), to compare",
    )  # fmt: skip
    parser.add_argument(
        "--donate", action="store_true",
        help="accepted for older commands: the step is always donated and chained now",
    )  # fmt: skip
    parser.add_argument("--trace", default=None, help="profile each variant here")
    parser.add_argument("--out", default=None, help="JSON, rewritten after every row")
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    build = forward_build(args.attention_build)
    env = start(args)
    print(env)
    overrides = {
        k: v
        for k, v in {
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "remat": args.remat,
            "accumulation_steps": args.accumulation_steps,
        }.items()
        if v is not None
    }
    title = f"GPT {args.config} train step (fp8jax train's jitted step)"
    title += f", mesh {args.mesh}" if args.mesh else ""
    title += ", layers rolled" if args.rolled_layers else ""
    title += f", FP8 attention built as {args.attention_build}" if args.attention_build else ""
    print(f"\n{title}", flush=True)
    rows, failed = [], []
    for name in args.variants:
        try:
            program, step, step_args, tokens, devices = step_and_args(
                args.config, name, mesh_text=args.mesh, attention=args.attention,
                unroll_layers=not args.rolled_layers, **overrides,
            )  # fmt: skip
            trace = os.path.join(args.trace, name) if args.trace else None
            with (jax.numpy_dtype_promotion("standard"), program.sharding_context(),
                  attention_built_as(build)):  # fmt: skip
                row = measure(name, step, *step_args, iters=args.iters, trace_dir=trace,
                              devices=devices, carry=True,
                              gradients=step_gradients(program))  # fmt: skip
        except Exception as e:  # an OOM in one row keeps the rows measured before it
            traceback.print_exc()
            failed.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            print(f"  {name}: FAILED ({type(e).__name__})", flush=True)
        else:
            row_rates(row, program, tokens, devices)
            if "breakdown" in row:
                row["all_gather_ms_per_gpu"] = row["breakdown"]["ms"].get("all-gather", 0.0)
                row["floor"] = elementwise_against_floor(row, program)
                print(f"    {row['floor']['text']}", flush=True)
            print(f"    {row['tokens_per_s']:,.0f} tokens/s, {row['mfu_text']}", flush=True)
            rows.append(row)
            del program, step, step_args
        if args.out:
            payload = {"environment": env, "title": title, "mesh": args.mesh,
                       "attention_build": args.attention_build,
                       "overrides": overrides, "rows": rows, "failed": failed}  # fmt: skip
            dump(args.out, payload)
    if any(r["name"] == "bf16" for r in rows):
        print_table(title, rows, "bf16")
    for r in rows:
        mfu_text = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"  {r['name']}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu_text}, "
              f"peak {r['peak_memory_gib'] or 0:.2f} GiB")  # fmt: skip
        if "all_gather_ms_per_gpu" in r:
            print(f"  {r['name']}: all-gather {r['all_gather_ms_per_gpu']:.3f} ms/step per GPU")
    return rows


if __name__ == "__main__":
    main()
