"""``fp8jax compare``: a loss-curve PNG and a table with gaps relative to the first run."""

import json

import pytest

from fp8jax import cli
from fp8jax.compare import CompareError, compare, load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path, precision, recipe, losses, tokens_per_s=1000.0):
    """A run directory as fp8jax train writes it: val loss every other metrics line."""
    path.mkdir(parents=True)
    lines = []
    for i, loss in enumerate(losses, start=1):
        record = {"step": 10 * i, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": 0.1}
        if i % 2 == 0:
            record["val_loss"] = loss + 0.05
        lines.append(json.dumps(record))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    config = {"precision": precision, "recipe": recipe}
    (path / "config.json").write_text(json.dumps(config))
    summary = {"tokens_per_s": tokens_per_s, "status": "completed"}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_compare_writes_a_png_and_a_table_relative_to_the_first_run(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "bf16", None, [5.0, 3.0, 2.5, 2.0], 1000.0)
    fp8 = write_run(tmp_path / "fp8", "fp8", "current", [5.0, 3.0, 2.5, 2.02], 1500.0)
    png = tmp_path / "plots" / "loss.png"
    assert cli.main(["compare", str(bf16), str(fp8), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == [
        "run", "steps", "train", "loss", "val", "loss", "tokens/s", "train", "gap", "val", "gap",
    ]  # fmt: skip
    assert out[2].split() == [
        "bf16",
        "(bf16)",
        "40",
        "2.0000",
        "2.0500",
        "1,000",
        "+0.00%",
        "+0.00%",
    ]
    # 2.02 vs 2.00 is +1.00%; 2.07 vs 2.05 is +0.98%.
    assert out[3].split() == [
        "fp8", "(fp8", "current)", "40", "2.0200", "2.0700", "1,500", "+1.00%", "+0.98%",
    ]  # fmt: skip
    assert out[-1] == f"plot: {png}"


def test_default_plot_goes_beside_the_first_run(tmp_path):
    run = write_run(tmp_path / "runs" / "a", "fp8", "delayed", [4.0, 3.0])
    table, png = compare([str(run)])
    assert png == tmp_path / "runs" / "compare.png" and png.is_file()
    assert "a (fp8 delayed)" in table


def test_a_run_without_metrics_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["compare", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(CompareError, match="no metrics lines yet"):
        load_run(tmp_path / "empty")


def test_a_torn_last_metrics_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "a", "bf16", None, [4.0, 3.0])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 30, "lo')  # a crash mid-write
    assert [m["step"] for m in load_run(run).metrics] == [10, 20]
