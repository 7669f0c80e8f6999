"""``fp8jax train`` as one process per GPU against one process driving every GPU, on one host.

For each precision (BF16 first, then FP8) it runs the same training twice,
through the command itself: one process with ``--mesh fsdp=N`` over all N
GPUs, then N processes of one GPU each (``CUDA_VISIBLE_DEVICES``) joined with
``--coordinator-address 127.0.0.1:PORT``. It prints, as each run ends, its
tokens/s and final losses, then FP8 over BF16 tokens/s per launch mode and
how far the N-process losses are from the one-process ones. Every run's
output is written to ``OUT/NAME.log`` while it runs.

    PYTHONPATH=src python bench/multiprocess_train.py --config small --steps 200 --out /tmp/mp
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(args, precision: str, out: pathlib.Path) -> list[str]:
    return [
        sys.executable, "-m", "fp8jax_command", "train", "--config", args.config,
        "--precision", precision, "--steps", str(args.steps), "--mesh", f"fsdp={args.gpus}",
        "--out", str(out), "--no-progress", "--eval-every", str(args.steps),
        "--log-every", str(args.log_every), "--checkpoint-every", str(args.steps),
    ]  # fmt: skip


def _run(name: str, commands: list[tuple[list[str], dict]], root: pathlib.Path) -> float:
    """Runs the processes of one training to their end; their output goes to ROOT/NAME[.I].log."""
    start = time.perf_counter()
    procs = []
    for i, (command, env) in enumerate(commands):
        log = open(root / (f"{name}.{i}.log" if len(commands) > 1 else f"{name}.log"), "w")  # noqa: SIM115
        procs.append(
            (subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        )
    codes = []
    for proc, log in procs:
        codes.append(proc.wait())
        log.close()
    if any(codes):
        raise SystemExit(f"{name}: exit codes {codes}; see {root}/{name}*.log")
    return time.perf_counter() - start


def _result(out: pathlib.Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "tokens_per_s": summary.get("tokens_per_s"),
        "val_loss": summary.get("final_val_loss"),
        "losses": [m["loss"] for m in metrics],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--out", required=True, help="a new directory for the runs and logs")
    parser.add_argument(
        "--cpu", action="store_true",
        help="smoke test on a CPU: --gpus host devices for one process, one for each of N (Gloo)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    root = pathlib.Path(args.out)
    root.mkdir(parents=True, exist_ok=False)
    results = {}

    def environ(devices: int, gpu: int | None = None) -> dict:
        if not args.cpu:
            return os.environ | ({} if gpu is None else {"CUDA_VISIBLE_DEVICES": str(gpu)})
        flags = f"--xla_force_host_platform_device_count={devices}"
        return os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
                             "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}  # fmt: skip

    for precision in ("bf16", "fp8"):
        name = f"one-process-{precision}"
        seconds = _run(name, [(_command(args, precision, root / name), environ(args.gpus))], root)
        results[name] = _result(root / name) | {"wall_s": round(seconds, 1)}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "losses"}),
              flush=True)  # fmt: skip
        name = f"{args.gpus}-processes-{precision}"
        address = f"127.0.0.1:{_free_port()}"
        commands = []
        for i in range(args.gpus):
            env = environ(1, gpu=i)
            extra = ["--coordinator-address", address, "--num-processes", str(args.gpus),
                     "--process-id", str(i)]  # fmt: skip
            commands.append((_command(args, precision, root / name) + extra, env))
        seconds = _run(name, commands, root)
        results[name] = _result(root / name) | {"wall_s": round(seconds, 1)}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "losses"}),
              flush=True)  # fmt: skip
    for mode in ("one-process", f"{args.gpus}-processes"):
        fp8, bf16 = results[f"{mode}-fp8"], results[f"{mode}-bf16"]
        print(f"{mode}: FP8 {fp8['tokens_per_s'] / bf16['tokens_per_s']:.3f}x BF16 tokens/s")
    for precision in ("bf16", "fp8"):
        one = results[f"one-process-{precision}"]["losses"]
        many = results[f"{args.gpus}-processes-{precision}"]["losses"]
        gap = max(abs(a - b) / abs(a) for a, b in zip(one, many, strict=True))
        print(
            f"{precision}: largest relative gap between the two launches' logged losses {gap:.2e}"
        )
    (root / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
