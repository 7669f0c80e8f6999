"""bench/moe_convergence.py end to end on the CPU: a toy preset, two seeds of 2 small steps each.

The numbers mean nothing at 2 steps, and two seeds (the script's default is
three) keep the test short; it checks the protocol's wiring: four runs,
``fp8jax compare``'s verdict on them, and the load-balance check recomputed
here from the runs' own summaries.
"""

import json
import pathlib
import statistics
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import moe_convergence  # noqa: E402

pytestmark = pytest.mark.usefixtures("shared_compile_cache")

# mixtral-tiny (8 experts), not deepseek-tiny (64): the script does the same for any MoE
# preset (train, compare, the load balance of summary.json), and on a CPU each of
# deepseek-tiny's steps takes seconds (64 experts' grouped GEMMs): 16.7 s against 11.8.
# Two sequences a batch, not the preset's 8: the wiring does not depend on the batch.
FAST = ["--steps", "2", "--log-every", "2", "--eval-every", "2", "--eval-batches", "1",
        "--checkpoint-every", "2", "--batch-size", "2"]  # fmt: skip


def test_the_seeds_of_each_precision_are_compared_on_loss_and_load_balance(tmp_path, capsys):
    argv = ["--config", "mixtral-tiny", "--seeds", "0", "1", "--out", str(tmp_path), "--data",
            str(ROOT / "src" / "fp8jax"), *FAST]  # fmt: skip
    status = moe_convergence.main(argv)
    record = json.loads((tmp_path / "mixtral-tiny" / "moe_convergence.json").read_text())
    runs = sorted(p.name for p in (tmp_path / "mixtral-tiny").iterdir() if p.is_dir())
    assert runs == [f"{p}-seed{s}" for p in ("bf16", "fp8") for s in (0, 1)]
    balance = {"bf16": [], "fp8": []}
    for run in runs:
        summary = json.loads((tmp_path / "mixtral-tiny" / run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["step"] == 2, summary
        balance[run.split("-")[0]].append(summary["moe"]["load_balance"])
    means = {p: statistics.fmean(v) for p, v in balance.items()}
    gap = (means["fp8"] - means["bf16"]) / means["bf16"]
    assert record["load_balance"]["gap"] == pytest.approx(gap)
    assert record["load_balance"]["within"] == (abs(gap) <= 0.10)
    compared = json.loads(pathlib.Path(record["validation_loss"]["compare"]).read_text())
    assert [g["label"] for g in compared["groups"]] == ["bf16", "fp8 current"]
    assert all(len(g["runs"]) == 2 for g in compared["groups"])
    fp8 = compared["groups"][1]
    loss_ok = fp8["mean_within_reference_range"] and fp8["mean_within_tolerance"]
    assert record["validation_loss"]["pass"] == loss_ok
    assert status == (0 if loss_ok and record["load_balance"]["within"] else 1)
    out = capsys.readouterr().out
    assert "load balance (max expert share / mean): BF16" in out and "fp8 current" in out

    # A second call keeps the completed runs and trains nothing.
    assert moe_convergence.main(argv) == status
    assert out.count("completed before, kept") == 0
    assert capsys.readouterr().out.count("completed before, kept") == 4
