"""The ``fp8jax`` command: one subcommand per job.

As the command (``main()`` without arguments: the console script, ``python -m
fp8jax.cli``) it owns its process, and so it decides two things a library must
not: the JAX platform when the user left ``JAX_PLATFORMS`` unset and no NVIDIA
GPU is visible (:func:`choose_platform`), and what Ctrl-C does
(:mod:`fp8jax.training.interrupts`). ``main(argv)`` with a list, as tests call
it, leaves both alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
from collections.abc import Mapping

import fp8jax

# The device files whose absence makes JAX skip its CUDA backend
# (jax._src.hardware_utils.has_visible_nvidia_gpu, the same list).
_NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def choose_platform(
    environ: Mapping[str, str] | None = None,
    *,
    gpu_visible: bool | None = None,
    cuda_plugin: bool | None = None,
) -> str | None:
    """The platform the command pins JAX to before its backends start, or None.

    JAX imports every installed plugin when it starts its backends, and the
    CUDA plugin (``fp8jax[verify]`` installs it for deviceless compiles)
    checks its CUDA libraries even on a machine without a GPU, logging a
    20-line traceback before JAX falls back to the CPU; ``JAX_PLATFORMS=cpu``
    skips that check. So ``"cpu"`` is returned only when all of these hold,
    and JAX's choice is otherwise left alone: the user did not set
    ``JAX_PLATFORMS``, a CUDA plugin is installed, and none of the device
    files is present whose absence makes JAX skip CUDA anyway. A GPU machine
    therefore still uses its GPU, and a broken CUDA install on it still says
    so.

    Args:
      environ: the environment (default ``os.environ``).
      gpu_visible, cuda_plugin: for tests; None looks at the machine.
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME"):
        return None
    if cuda_plugin is None:
        cuda_plugin = any(_module_exists(name) for name in _CUDA_PLUGINS)
    if gpu_visible is None:
        gpu_visible = any(os.path.exists(path) for path in _NVIDIA_DEVICE_FILES)
    return "cpu" if cuda_plugin and not gpu_visible else None


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _demo(args: argparse.Namespace) -> int:
    from fp8jax import demo

    return demo.main()


def _error(command: str, message: str, code: int) -> int:
    print(f"fp8jax {command}: error: {message}", file=sys.stderr)
    return code


def _given_options(args: argparse.Namespace) -> dict:
    """The TrainOptions fields given on the command line (every train default is None)."""
    from fp8jax.training import TrainOptions

    fields = TrainOptions.__dataclass_fields__
    return {k: v for k, v in vars(args).items() if k in fields and v is not None}


def _resumed_options(out: str, given: dict) -> dict:
    """``--resume``: the run's saved options, overridden by those given on the command line.

    An unreadable or missing config.json is left for ``train`` to report.
    """
    from fp8jax.data import default_corpus_path
    from fp8jax.training.config import saved_options

    try:
        saved = json.loads((pathlib.Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        return given
    if not isinstance(saved, dict):
        return given
    options = saved_options(saved, str(default_corpus_path())) | given
    if options.get("precision") == "bf16" and "recipe" not in given:
        # A saved FP8 recipe does not apply to a --precision bf16 given now; the refusal
        # then names the precision that differs, not a --recipe the user did not pass.
        options["recipe"] = None
    return options


def _train(args: argparse.Namespace) -> int:
    from fp8jax.data import DataError
    from fp8jax.training import TrainError, TrainOptions, train

    given = _given_options(args)
    if "out" not in given:  # the default, also for --resume: "the same command plus --resume"
        config, precision = given.get("config", "tiny"), given.get("precision", "fp8")
        recipe = given.get("recipe")
        given["out"] = f"runs/{config}-{precision}" + (f"-{recipe}" if recipe else "")
    options = _resumed_options(given["out"], given) if args.resume else given
    try:
        result = train(TrainOptions(**options), progress=False if args.no_progress else None)
    except (TrainError, DataError) as e:
        return _error("train", str(e), getattr(e, "exit_code", 2))
    except KeyboardInterrupt:  # only when called from Python: the command raises none
        return _error("train", "interrupted before the first step; no checkpoint was saved.", 130)
    return 130 if result.status == "interrupted" else 0


def _compare(args: argparse.Namespace) -> int:
    from fp8jax.compare import DEFAULT_TOLERANCE, CompareError, compare

    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    try:
        text, png, numbers = compare(
            args.runs, args.out, args.title, tolerance=tolerance, per_run=args.per_run
        )
    except CompareError as e:
        return _error("compare", str(e), 2)
    print(text)
    print(f"json: {numbers}")
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
    p.add_argument(
        "--config",
        help=(
            "preset: tiny (CPU, the default), small, medium, llama-1b, llama-3b (GPU); MoE: "
            "mixtral-tiny, deepseek-tiny (CPU), mixtral-small, deepseek-small, mixtral, "
            "deepseek (GPU)"
        ),
    )
    p.add_argument("--precision", help="fp8 (block GEMMs in FP8, the default) or bf16")
    p.add_argument(
        "--recipe",
        default=None,
        help="FP8 scaling: current (default), delayed, row, block, mxfp8 (Blackwell)",
    )
    p.add_argument("--steps", type=int, help="total steps of the run")
    p.add_argument("--out", help="run directory (default runs/CONFIG-PRECISION[-RECIPE])")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out; options left out take the run's saved values",
    )
    p.add_argument("--data", help="text file or folder (default: the Python stdlib's source)")
    p.add_argument("--mesh", help="devices, e.g. fsdp=8 or dp=2,fsdp=4 (default: one device)")
    p.add_argument("--batch-size", type=int, help="sequences per step, over all devices")
    p.add_argument("--seq-len", type=int, help="bytes per sequence")
    p.add_argument("--lr", type=float, dest="learning_rate", help="peak learning rate")
    p.add_argument("--seed", type=int, help="initialization and batch order (default 0)")
    p.add_argument("--log-every", type=int, help="steps per metrics line")
    p.add_argument("--eval-every", type=int, help="steps per validation loss")
    p.add_argument("--eval-batches", type=int, help="validation batches per evaluation")
    p.add_argument("--checkpoint-every", type=int, help="steps per checkpoint")
    p.add_argument("--keep-checkpoints", type=int, help="newest checkpoints kept (default 3)")
    p.add_argument(
        "--attention",
        help="attention core: xla, cudnn, fp8 (fp8jax.dot_product_attention), fp8-hadamard (the "
        "same, Q and K Hadamard-rotated before quantizing), or auto (cuDNN on a GPU, XLA "
        "elsewhere)",
    )
    p.add_argument(
        "--rolled-layers",
        action="store_true",
        default=None,
        help="keep the layer scan a loop: faster compile, less FSDP memory, slower steps",
    )
    p.add_argument(
        "--remat",
        help="activation checkpointing per block: none (the default), dots (keep GEMM outputs "
        "and FP8 casts, recompute the rest) or full (keep each block's input)",
    )
    p.add_argument(
        "--accumulation-steps",
        type=int,
        help="micro-batches per step: gradients averaged, FP8 scale states merged by max",
    )
    p.add_argument(
        "--moe-aux-weight",
        type=float,
        help="MoE presets: the load-balancing loss's weight in the training loss (default 0.01)",
    )
    p.add_argument("--profile", help="write a jax.profiler trace of a few steps to this directory")
    p.add_argument(
        "--compile-cache",
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
    # Several processes (docs/scaling.md); SLURM and Open MPI launches need none of these.
    p.add_argument(
        "--coordinator-address",
        help="host:port of process 0, for a multi-process run outside SLURM/Open MPI "
        "(default: JAX_COORDINATOR_ADDRESS)",
    )
    p.add_argument("--num-processes", type=int, help="processes in the run (with --process-id)")
    p.add_argument("--process-id", type=int, help="this process's number, 0 to N-1")
    # Testing aid, documented in docs/train.md: NaN parameters before step N.
    p.add_argument("--inject-nan-at", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=_train)


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="Loss curves of fp8jax train runs in one PNG, and a table of final losses.",
        description=(
            "Plot the train and validation losses of runs (their --out directories) and print "
            "their final losses, tokens/s and relative gaps to the first run. Runs whose "
            "config.json differs only in the seed form one group: the table then gives each "
            "group's mean, min and max final validation loss over its seeds and whether its "
            "mean is within the first group's seed range and within --tolerance of its mean. "
            "The table is also written as JSON beside the plot."
        ),
    )
    p.add_argument(
        "runs", nargs="+", metavar="RUN", help="run directories; the first's group is the reference"
    )
    p.add_argument("--out", help="PNG path (default: compare.png beside the first run)")
    p.add_argument("--title", help="plot title")
    p.add_argument(
        "--tolerance",
        type=float,
        metavar="FRACTION",
        help="how close a group's mean final validation loss must be to the reference mean, "
        "as a fraction (default 0.005: 0.5%%)",
    )
    p.add_argument(
        "--per-run",
        action="store_true",
        help="compare every run on its own, not grouped by configuration (e.g. one config and "
        "seed before and after a code change)",
    )
    p.set_defaults(func=_compare)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fp8jax", description="FP8 training for JAX and Flax on NVIDIA Hopper GPUs."
    )
    parser.add_argument("--version", action="version", version=f"fp8jax {fp8jax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="FP8 vs f32 results for one dense layer (CPU is fine).")
    demo.set_defaults(func=_demo)
    _add_train(sub)
    _add_compare(sub)
    from fp8jax.verify import cli as verify_cli

    verify_cli.add_parser(sub)
    return parser


_INTERRUPTED = {
    "train": "interrupted before the first step; no checkpoint was saved.",
    "verify": "interrupted; nothing was checked.",
    "compare": "interrupted; no plot was written.",
    "demo": "interrupted.",
}


def _stop_compiles() -> None:
    """Ends the deviceless compiler children (verify, --verify-target) when Ctrl-C exits."""
    compilation = sys.modules.get("fp8jax.verify.compilation")  # never imported just for this
    if compilation is not None:
        compilation.stop_children_before_exit()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8jax`` console script.

    Args:
      argv: the arguments; None reads ``sys.argv`` and makes this the process's
        command, which picks the platform (:func:`choose_platform`) and takes
        over Ctrl-C (:mod:`fp8jax.training.interrupts`).
    """
    command = argv is None
    if command:  # first, so that a Ctrl-C while the parser imports is handled too
        from fp8jax.training import interrupts

        interrupts.install("", "interrupted.")
    args = build_parser().parse_args(argv)
    if command:
        interrupts.install(args.command, _INTERRUPTED.get(args.command, "interrupted."))
        interrupts.at_exit(_stop_compiles)
        platform = choose_platform()
        if platform is not None:
            import jax

            jax.config.update("jax_platforms", platform)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
