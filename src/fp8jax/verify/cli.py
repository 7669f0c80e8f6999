"""``fp8jax verify MODULE:FUNCTION``: compile for a GPU target and check the GEMMs.

FUNCTION takes the ``Mesh`` built from ``--mesh`` over the target's devices
(None without ``--mesh``) and returns ``(fn, args)``; args may be
``jax.ShapeDtypeStruct``s carrying ``NamedSharding``s on that mesh. The exit
status is 0 only if every GEMM is FP8 or matched by ``--allow``; 1 if not;
2 if the program could not be compiled or the arguments were wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from fp8jax.verify import assertions, compilation, meshes, toolchain
from fp8jax.verify.report import gemm_report

_DESCRIPTION = __doc__.split("\n\n", 1)[1].replace("``", "")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``verify`` on an ``add_subparsers()`` object; returns its parser."""
    parser = subparsers.add_parser(
        "verify",
        help="Compile for an H100/H200 (no GPU needed) and check that every GEMM is FP8.",
        description=_DESCRIPTION,
    )
    parser.add_argument("entry", metavar="MODULE:FUNCTION", help="factory: mesh -> (fn, args)")
    parser.add_argument(
        "--target",
        default="h100",
        help=f"{', '.join(compilation.TARGETS)}, or a GpuTargetConfigProto .txtpb path "
        "(default: h100)",
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="GPUs in total (default: mesh size)"
    )
    parser.add_argument("--hosts", type=int, default=1, help="hosts the GPUs span (default: 1)")
    parser.add_argument("--mesh", default=None, help="mesh axes, e.g. dp=2,fsdp=4")
    parser.add_argument(
        "--xla-flags",
        default=None,
        help="XLA_FLAGS for the compile, e.g. --xla-flags=--xla_gpu_enable_triton_gemm=false",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PATTERN",
        help="regex (source line, op_name or stack) of a GEMM allowed to stay high precision; "
        "repeatable",
    )
    parser.add_argument("--expect", type=int, default=None, help="exact number of FP8 GEMMs")
    parser.add_argument("--at-least", type=int, default=None, help="minimum number of FP8 GEMMs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs ``fp8jax verify``; returns the exit status."""
    # Like `python -m`, resolve MODULE from the working directory first.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        _check_arguments(args)
        axes = meshes.resolve_mesh(args.mesh) if args.mesh else None
        devices = args.devices if args.devices is not None else (axes.size if axes else 1)
        if axes is not None and axes.size != devices:
            raise ValueError(
                f"--mesh {axes} has {axes.size} devices but --devices is {devices}; "
                "the mesh must span every device."
            )
        patterns = assertions.allow_patterns(args.allow)
        hlo = compilation.compile_for(
            args.entry,
            target=args.target,
            devices=devices,
            hosts=args.hosts,
            mesh=axes,
            xla_flags=args.xla_flags,
        )
        report = gemm_report(hlo)
        problems = assertions.check(
            report, expect=args.expect, at_least=args.at_least, allow=patterns
        )
    except (ValueError, TypeError, ImportError, RuntimeError) as e:
        if args.json:
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}, indent=2))
        print(f"fp8jax verify: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        result = {
            "ok": not problems,
            "problems": problems,
            "target": args.target,
            "devices": devices,
            "mesh": str(axes) if axes else None,
            "report": report.to_dict(),
        }
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.entry} on {devices} x {_target_name(args.target)}")
        print(report)
        allowed = len(report.non_fp8_gemms)
        verdict = f"OK: {len(report.fp8_gemms)} FP8 GEMMs" + (
            f", {allowed} high-precision GEMMs allowed." if allowed else ", no other GEMMs."
        )
        print("\n".join(["", "FAIL:", *problems]) if problems else "\n" + verdict)
    return 1 if problems else 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuses bad numbers and an entry whose module cannot be found, before compiling.

    The compile runs in a child process, which would report a missing module
    as an import traceback.
    """
    for option, value in (("--expect", args.expect), ("--at-least", args.at_least)):
        if value is not None and value < 0:
            raise ValueError(f"{option} must be an int >= 0, got {value}.")
    if args.expect is not None and args.at_least is not None:
        raise ValueError("pass --expect or --at-least, not both.")
    module, colon, function = args.entry.partition(":")
    if not colon or not module or not function:
        raise ValueError(
            f"MODULE:FUNCTION must name a module and a function, like mypkg.model:make_step; "
            f"got {args.entry!r}."
        )
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        found = False
    if not found:
        raise ValueError(
            f"module {module!r} of {args.entry!r} was not found in the working directory or on "
            "sys.path; run from the folder that holds it, or install its package."
        )


def _target_name(target: str) -> str:
    return target.upper() if target in toolchain.TARGET_NAMES else target


def main(argv: list[str] | None = None) -> int:
    """``python -m fp8jax.verify.cli ...``, the same as ``fp8jax verify ...``."""
    parser = argparse.ArgumentParser(prog="fp8jax")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
