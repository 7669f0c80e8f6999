"""The ``fp8jax`` command: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from fp8jax import demo

    return demo.main()


def _error(command: str, message: str, code: int) -> int:
    print(f"fp8jax {command}: error: {message}", file=sys.stderr)
    return code


def _train(args: argparse.Namespace) -> int:
    from fp8jax.data import DataError
    from fp8jax.training import TrainError, TrainOptions, train

    if args.out is None:
        args.out = f"runs/{args.config}-{args.precision}" + (
            f"-{args.recipe}" if args.recipe else ""
        )
    fields = TrainOptions.__dataclass_fields__
    options = TrainOptions(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        result = train(options, progress=False if args.no_progress else None)
    except (TrainError, DataError) as e:
        return _error("train", str(e), getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        return _error("train", "interrupted before the first step; nothing was saved.", 130)
    return 130 if result.status == "interrupted" else 0


def _compare(args: argparse.Namespace) -> int:
    from fp8jax.compare import CompareError, compare

    try:
        text, png = compare(args.runs, args.out, args.title)
    except CompareError as e:
        return _error("compare", str(e), 2)
    print(text)
    print(f"plot: {png}")
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="Train a small GPT in FP8 or BF16 (CPU for tiny, GPU for small/medium).",
        description=(
            "Train a byte-level GPT built from fp8jax's Flax modules on the Python standard "
            "library's source (or --data), with metrics, validation, checkpoints and --resume. "
            "Options left out take the preset's value."
        ),
    )
    p.add_argument("--config", default="tiny", help="preset: tiny (CPU), small, medium (GPU)")
    p.add_argument("--precision", default="fp8", help="fp8 (block GEMMs in FP8) or bf16")
    p.add_argument("--recipe", default=None, help="FP8 scaling: current (default) or delayed")
    p.add_argument("--steps", type=int, help="total steps of the run")
    p.add_argument("--out", help="run directory (default runs/CONFIG-PRECISION[-RECIPE])")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--data", help="text file or folder (default: the Python stdlib's source)")
    p.add_argument("--mesh", help="devices, e.g. fsdp=8 or dp=2,fsdp=4 (default: one device)")
    p.add_argument("--batch-size", type=int, help="sequences per step, over all devices")
    p.add_argument("--seq-len", type=int, help="bytes per sequence")
    p.add_argument("--lr", type=float, dest="learning_rate", help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialization and batch order")
    p.add_argument("--log-every", type=int, help="steps per metrics line")
    p.add_argument("--eval-every", type=int, help="steps per validation loss")
    p.add_argument("--eval-batches", type=int, help="validation batches per evaluation")
    p.add_argument("--checkpoint-every", type=int, help="steps per checkpoint")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept")
    p.add_argument(
        "--attention",
        default="auto",
        help="attention core: xla, cudnn, or auto (cuDNN on a GPU, XLA elsewhere)",
    )
    p.add_argument(
        "--rolled-layers",
        action="store_true",
        help="keep the layer scan a loop: faster compile, less FSDP memory, slower steps",
    )
    p.add_argument(
        "--compile-cache",
        default="auto",
        help="JAX's persistent compilation cache: auto (a cache under ~/.cache/fp8jax on a GPU, "
        "none on a CPU), none, or a directory; spares later runs XLA's minutes of FP8 GEMM "
        "autotuning",
    )
    p.add_argument(
        "--verify-target",
        help="also compile the train step for h100 or h200 (deviceless; needs fp8jax[verify]) "
        "or for this machine's GPU (live) and count its FP8 GEMMs",
    )
    p.add_argument("--no-progress", action="store_true", help="print lines instead of a bar")
    # Testing aid, documented in docs/train.md: NaN parameters before step N.
    p.add_argument("--inject-nan-at", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=_train)


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="Loss curves of fp8jax train runs in one PNG, and a table of final losses.",
        description=(
            "Plot the train and validation losses of runs (their --out directories) and print "
            "their final losses, tokens/s and relative gaps to the first run."
        ),
    )
    p.add_argument("runs", nargs="+", help="run directories; the first is the reference")
    p.add_argument("--out", help="PNG path (default: compare.png beside the first run)")
    p.add_argument("--title", help="plot title")
    p.set_defaults(func=_compare)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fp8jax", description="FP8 training for JAX and Flax on NVIDIA Hopper GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="FP8 vs f32 results for one dense layer (CPU is fine).")
    demo.set_defaults(func=_demo)
    _add_train(sub)
    _add_compare(sub)
    from fp8jax.verify import cli as verify_cli

    verify_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8jax`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
