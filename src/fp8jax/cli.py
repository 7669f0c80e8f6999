"""The ``fp8jax`` command: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from fp8jax import demo

    return demo.main()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fp8jax", description="FP8 training for JAX and Flax on NVIDIA Hopper GPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="FP8 vs f32 results for one dense layer (CPU is fine).")
    demo.set_defaults(func=_demo)
    from fp8jax.verify import cli as verify_cli

    verify_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8jax`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
