"""``fp8jax compare``: a loss-curve PNG and a table with gaps relative to the first run."""

import json

import pytest

from fp8jax import cli
from fp8jax.compare import Band, CompareError, compare, group_runs, judge, load_run
from fp8jax.training.config import TrainOptions, resolve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path, precision, recipe, losses, tokens_per_s=1000.0, seed=0, **options):
    """A run directory as fp8jax train writes it: val loss every other metrics line.

    Its config.json is the one ``fp8jax train`` would write for these options,
    read from a corpus at a path of its own (the same bytes for every run).
    """
    path.mkdir(parents=True)
    lines = []
    for i, loss in enumerate(losses, start=1):
        record = {"step": 10 * i, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": 0.1}
        if i % 2 == 0:
            record["val_loss"] = loss + 0.05
        lines.append(json.dumps(record))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    resolved = resolve(
        TrainOptions(out=str(path), precision=precision, recipe=recipe, seed=seed, **options)
    )
    data = {"source": str(path / "corpus"), "fingerprint": "ab" * 32}
    (path / "config.json").write_text(json.dumps(resolved.to_dict() | {"data": data}))
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
    table, png, numbers = compare([str(run)])
    assert png == tmp_path / "runs" / "compare.png" and png.is_file()
    assert numbers == tmp_path / "runs" / "compare.json" and numbers.is_file()
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


def seeds(root, name, precision, recipe, finals, **options):
    """One run per final train loss, seeds 0, 1, ...; each final validation loss is final + 0.05."""
    return [
        write_run(root / f"{name}-seed{seed}", precision, recipe, [5.0, 3.0, 2.5, final],
                  tokens_per_s=1000.0 + 100 * seed, seed=seed, **options)
        for seed, final in enumerate(finals)
    ]  # fmt: skip


def test_runs_are_grouped_by_their_config_less_the_seed(tmp_path):
    bf16 = seeds(tmp_path, "bf16", "bf16", None, [2.0, 2.0, 2.0])
    current = seeds(tmp_path, "current", "fp8", "current", [2.0, 2.0])
    delayed = seeds(tmp_path, "delayed", "fp8", "delayed", [2.0, 2.0])
    order = [bf16[0], current[0], bf16[1], delayed[0], current[1], bf16[2], delayed[1]]
    groups = group_runs([load_run(p) for p in order])
    assert [g.label for g in groups] == ["bf16", "fp8 current", "fp8 delayed"]
    assert [[r.path for r in g.runs] for g in groups] == [bf16, current, delayed]
    assert [g.seeds for g in groups] == [[0, 1, 2], [0, 1], [0, 1]]


def test_a_group_label_names_every_setting_that_differs_between_groups(tmp_path):
    base = seeds(tmp_path, "base", "fp8", "current", [2.0, 2.0])
    faster = seeds(tmp_path, "lr", "fp8", "current", [2.0, 2.0], learning_rate=0.01)
    # When checkpoints are written, and where the corpus was read from, change no loss.
    saved_more = write_run(tmp_path / "ckpt", "fp8", "current", [5.0, 3.0, 2.5, 2.0], seed=2,
                           checkpoint_every=7)  # fmt: skip
    groups = group_runs([load_run(p) for p in [*base, *faster, saved_more]])
    assert [g.label for g in groups] == [
        "fp8 current learning_rate=0.003",
        "fp8 current learning_rate=0.01",
    ]
    assert [len(g.runs) for g in groups] == [3, 2]


def test_a_run_without_config_json_is_a_group_of_its_own(tmp_path):
    bf16 = seeds(tmp_path, "bf16", "bf16", None, [2.0, 2.0])
    bare = write_run(tmp_path / "bare", "bf16", None, [5.0, 3.0, 2.5, 2.0], seed=2)
    (bare / "config.json").unlink()
    groups = group_runs([load_run(p) for p in [*bf16, bare]])
    assert [(g.label, len(g.runs), g.seeds) for g in groups] == [
        ("bf16", 2, [0, 1]),
        ("bare", 1, [None]),
    ]


def test_band_is_the_mean_min_and_max_at_the_steps_every_run_logged():
    curves = [([10, 20, 30], [4.0, 3.0, 2.0]), ([10, 20], [5.0, 2.0]), ([20, 10], [4.0, 6.0])]
    band = Band.of(curves)
    assert band.steps == [10, 20]
    assert band.mean == [5.0, 3.0] and band.low == [4.0, 2.0] and band.high == [6.0, 4.0]


GROUPS_TABLE_HEADER = [
    "group", "runs", "seeds", "val", "mean", "val", "min", "val", "max", "train", "mean",
    "tokens/s", "val", "gap", "in", "ref", "range", "within", "0.5%",
]  # fmt: skip


def test_group_table_gives_seed_means_spreads_gaps_and_verdicts(tmp_path, capsys):
    # Final validation losses: bf16 2.05, 2.07, 2.09 (mean 2.07); fp8 current 2.06, 2.08,
    # 2.10 (mean 2.08, +0.48%); fp8 delayed 2.15, 2.17, 2.19 (mean 2.17, +4.83%).
    bf16 = seeds(tmp_path, "bf16", "bf16", None, [2.00, 2.02, 2.04])
    current = seeds(tmp_path, "current", "fp8", "current", [2.01, 2.03, 2.05])
    delayed = seeds(tmp_path, "delayed", "fp8", "delayed", [2.10, 2.12, 2.14])
    png = tmp_path / "out" / "groups.png"
    argv = ["compare", *map(str, bf16 + current + delayed), "--out", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == GROUPS_TABLE_HEADER
    assert out[2].split() == [
        "bf16", "3", "0,1,2", "2.0700", "2.0500", "2.0900", "2.0200", "1,100", "+0.00%", "ref",
        "ref",
    ]  # fmt: skip
    assert out[3].split() == [
        "fp8", "current", "3", "0,1,2", "2.0800", "2.0600", "2.1000", "2.0300", "1,100",
        "+0.48%", "yes", "yes",
    ]  # fmt: skip
    assert out[4].split() == [
        "fp8", "delayed", "3", "0,1,2", "2.1700", "2.1500", "2.1900", "2.1200", "1,100",
        "+4.83%", "no", "no",
    ]  # fmt: skip
    assert out[5:] == [f"json: {png.with_suffix('.json')}", f"plot: {png}"]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_the_json_beside_the_plot_holds_the_table_and_each_run(tmp_path):
    bf16 = seeds(tmp_path, "bf16", "bf16", None, [2.00, 2.02, 2.04])
    current = seeds(tmp_path, "current", "fp8", "current", [2.01, 2.03, 2.05])
    _, png, numbers = compare([str(p) for p in bf16 + current], tmp_path / "c.svg")
    assert numbers == tmp_path / "c.json" and png == tmp_path / "c.svg"
    saved = json.loads(numbers.read_text())
    assert saved["reference"] == "bf16" and saved["tolerance"] == 0.005
    reference, fp8 = saved["groups"]
    assert [r["path"] for r in fp8["runs"]] == [str(p) for p in current]
    assert [r["seed"] for r in fp8["runs"]] == [0, 1, 2]
    assert [r["final_val_loss"] for r in fp8["runs"]] == pytest.approx([2.06, 2.08, 2.10])
    assert fp8["settings"]["precision"] == "fp8" and fp8["settings"]["recipe"] == "current"
    assert "seed" not in fp8["settings"]
    assert (fp8["val_loss_mean"], fp8["val_loss_min"], fp8["val_loss_max"]) == pytest.approx(
        (2.08, 2.06, 2.10)
    )
    assert fp8["val_gap"] == pytest.approx(0.01 / 2.07)
    assert fp8["train_gap"] == pytest.approx(0.01 / 2.02)
    assert fp8["mean_within_reference_range"] is True and fp8["mean_within_tolerance"] is True
    assert reference["mean_within_reference_range"] is None
    assert reference["val_gap"] == 0.0


@pytest.mark.parametrize(
    ("reference_finals", "finals", "in_range", "within_tolerance"),
    [
        ([2.00, 2.02, 2.04], [2.01, 2.03, 2.05], True, True),  # mean 2.08 vs 2.07: +0.48%
        ([2.00, 2.02, 2.04], [2.02, 2.035, 2.05], True, False),  # 2.085 vs 2.07: +0.72%
        ([2.020, 2.021, 2.022], [2.025, 2.03, 2.035], False, True),  # 2.08 vs 2.071: +0.43%
        ([2.00, 2.02, 2.04], [1.90, 1.91, 1.92], False, False),  # 1.96 vs 2.07: -5.3%
    ],
)
def test_the_two_verdicts(tmp_path, reference_finals, finals, in_range, within_tolerance):
    bf16 = seeds(tmp_path, "bf16", "bf16", None, reference_finals)
    fp8 = seeds(tmp_path, "fp8", "fp8", "current", finals)
    reference, group = group_runs([load_run(p) for p in bf16 + fp8])
    verdict = judge(group, reference, 0.005)
    assert (verdict.within_range, verdict.within_tolerance) == (in_range, within_tolerance)
    assert judge(reference, reference, 0.005).within_range is None


def test_tolerance_sets_the_second_verdict_and_its_column(tmp_path, capsys):
    bf16 = seeds(tmp_path, "bf16", "bf16", None, [2.00, 2.02, 2.04])
    fp8 = seeds(tmp_path, "fp8", "fp8", "current", [2.02, 2.035, 2.05])  # +0.72%
    runs = [str(p) for p in bf16 + fp8]
    assert cli.main(["compare", *runs, "--tolerance", "0.01"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-2:] == ["within", "1%"]
    assert out[3].split()[-3:] == ["+0.72%", "yes", "yes"]


@pytest.mark.parametrize("tolerance", ["0.5", "-0.001", "nan"])
def test_a_tolerance_that_is_not_a_small_fraction_is_refused(tmp_path, capsys, tolerance):
    run = write_run(tmp_path / "a", "bf16", None, [4.0, 3.0])
    assert cli.main(["compare", str(run), "--tolerance", tolerance]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8jax compare: error: --tolerance is a fraction") and tolerance in err
    assert not (tmp_path / "compare.png").exists()


def test_runs_of_a_group_that_end_at_different_steps_are_refused(tmp_path, capsys):
    finished = write_run(tmp_path / "s0", "bf16", None, [5.0, 3.0, 2.5, 2.0], seed=0)
    stopped = write_run(tmp_path / "s1", "bf16", None, [5.0, 3.0], seed=1)
    assert cli.main(["compare", str(finished), str(stopped)]) == 2
    err = capsys.readouterr().err
    assert "the runs of group 'bf16' end at different steps" in err
    assert f"{finished}: step 40, validation at 40; {stopped}: step 20, validation at 20" in err
    assert not (tmp_path / "compare.png").exists()


def test_two_runs_of_one_config_and_seed_are_compared_only_per_run(tmp_path, capsys):
    before = write_run(tmp_path / "before", "fp8", "current", [5.0, 3.0, 2.5, 2.0])
    after = write_run(tmp_path / "after", "fp8", "current", [5.0, 3.0, 2.5, 2.1])
    assert cli.main(["compare", str(before), str(after)]) == 2
    err = capsys.readouterr().err
    assert "have the same configuration and seed 0" in err and "--per-run" in err
    assert cli.main(["compare", str(before), str(after), "--per-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[0] == "run"
    assert out[3].split()[:2] == ["after", "(fp8"] and out[3].split()[-1] == "+4.88%"


def test_a_directory_given_twice_is_refused(tmp_path, capsys):
    run = write_run(tmp_path / "a", "bf16", None, [4.0, 3.0])
    assert cli.main(["compare", str(run), str(tmp_path / "." / "a"), "--per-run"]) == 2
    assert "is given twice" in capsys.readouterr().err


def test_labels_name_accumulation_and_remat_and_different_ends_are_warned(tmp_path, capsys):
    # Issue 56, item 13: "fp8 (fp8 current)" twice, and 2 steps against 20 without a word.
    one = write_run(tmp_path / "one", "fp8", "current", [5.0, 3.0])
    two = write_run(tmp_path / "two", "fp8", "current", [5.0, 3.0, 2.5, 2.0],
                    accumulation_steps=2, remat="full")  # fmt: skip
    assert cli.main(["compare", str(one), str(two)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:4] == ["one", "(fp8", "current", "accumulation_steps=1"]
    assert "remat=none)" in out[2]
    assert out[3].split()[:4] == ["two", "(fp8", "current", "accumulation_steps=2"]
    assert "remat=full)" in out[3]
    assert out[4] == (
        "warning: the runs end at different steps (one: 20, two: 40), so their final losses "
        "come from different points of training; compare runs of the same --steps."
    )
