"""The MoE presets' convergence: three seeds of BF16 and FP8 each, by docs/train.md's protocol.

For each preset (default ``mixtral-small`` and ``deepseek-small``), trains
seeds 0, 1, 2 in BF16 and in FP8 (current scaling, the one recipe the experts
take) with ``fp8jax.training.train``, as ``fp8jax train`` does, then:

* ``fp8jax compare`` on the six runs: FP8 passes when its mean final
  validation loss lies within the BF16 seeds' range and within 0.5% of the
  BF16 mean (docs/train.md, "Convergence: small on an H200, three seeds");
* the load balance (``summary.json``'s ``moe.load_balance``: each MoE
  layer's largest expert share over the mean, averaged over layers, at the
  last log step): FP8's mean over its seeds within 10% of BF16's.

Runs go to ``OUT/PRESET/{bf16,fp8}-seedS``; a run whose ``summary.json`` says
``completed`` is kept, so a stopped script continues where it was. Each
preset's verdicts go to ``OUT/PRESET/moe_convergence.json`` beside the
comparison's plot and JSON, and the script exits 1 if any check fails.

    PYTHONPATH=src python bench/moe_convergence.py --out runs/moe-convergence
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

from fp8jax import compare
from fp8jax.training import TrainOptions, train

PRECISIONS = ("bf16", "fp8")
BALANCE_TOLERANCE = 0.10  # FP8's mean load balance within 10% of BF16's (issue 62)
OVERRIDES = ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every", "batch_size")


def run_dir(out: pathlib.Path, preset: str, precision: str, seed: int) -> pathlib.Path:
    return out / preset / f"{precision}-seed{seed}"


def completed(path: pathlib.Path) -> bool:
    summary = path / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("status") == "completed"


def train_all(args, preset: str) -> list[pathlib.Path]:
    """Every seed of every precision of ``preset``, trained unless already completed."""
    overrides = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    paths = []
    for seed in args.seeds:
        for precision in PRECISIONS:
            path = run_dir(args.out, preset, precision, seed)
            paths.append(path)
            if completed(path):
                print(f"{path}: completed before, kept", flush=True)
                continue
            print(f"\n== {preset} {precision} seed {seed} -> {path}", flush=True)
            options = TrainOptions(out=str(path), config=preset, precision=precision, seed=seed,
                                   data=args.data, **overrides)  # fmt: skip
            result = train(options, progress=False, say=lambda m: print(m, flush=True))
            if result.status != "completed":
                raise SystemExit(f"{path}: the run ended {result.status!r}; see its summary.json.")
    return paths


def balance_check(paths: list[pathlib.Path]) -> dict:
    """The mean final load balance per precision and whether FP8's is within 10% of BF16's."""
    balance = {p: [] for p in PRECISIONS}
    for path in paths:
        summary = json.loads((path / "summary.json").read_text())
        config = json.loads((path / "config.json").read_text())
        balance[config["precision"]].append(summary["moe"]["load_balance"])
    means = {p: statistics.fmean(v) for p, v in balance.items()}
    gap = (means["fp8"] - means["bf16"]) / means["bf16"]
    return {"per_seed": balance, "mean": means, "gap": gap, "tolerance": BALANCE_TOLERANCE,
            "within": abs(gap) <= BALANCE_TOLERANCE}  # fmt: skip


def check(args, preset: str, paths: list[pathlib.Path]) -> bool:
    """Prints and writes ``preset``'s verdicts; True when both checks pass."""
    folder = args.out / preset
    text, plot, numbers = compare.compare(
        [str(p) for p in paths], out=folder / "compare.png",
        title=f"{preset}, {len(args.seeds)} seeds, BF16 vs FP8",
    )  # fmt: skip
    groups = {g["label"]: g for g in json.loads(numbers.read_text())["groups"]}
    fp8 = next(g for label, g in groups.items() if label.startswith("fp8"))
    loss_ok = bool(fp8["mean_within_reference_range"] and fp8["mean_within_tolerance"])
    balance = balance_check(paths)
    print(f"\n{preset}\n{text}")
    print(f"validation loss: FP8 mean within BF16's seed range and within 0.5% of its mean: "
          f"{'PASS' if loss_ok else 'FAIL'}")  # fmt: skip
    print(f"load balance (max expert share / mean): BF16 {balance['mean']['bf16']:.3f}, "
          f"FP8 {balance['mean']['fp8']:.3f}, gap {balance['gap']:+.1%} (within "
          f"{BALANCE_TOLERANCE:.0%}: {'PASS' if balance['within'] else 'FAIL'})")  # fmt: skip
    record = {"preset": preset, "seeds": args.seeds, "runs": [str(p) for p in paths],
              "validation_loss": {"pass": loss_ok, "compare": str(numbers), "plot": str(plot)},
              "load_balance": balance, "pass": loss_ok and balance["within"]}  # fmt: skip
    (folder / "moe_convergence.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"json: {folder / 'moe_convergence.json'}", flush=True)
    return record["pass"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", nargs="+", default=["mixtral-small", "deepseek-small"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/moe-convergence"))
    parser.add_argument("--data", default=None, help="default: the standard library's source")
    for name in OVERRIDES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help="default: the preset's")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    passed = [check(args, preset, train_all(args, preset)) for preset in args.config]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
