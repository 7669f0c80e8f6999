"""The ``fp8jax`` command's errors: one ``error:`` line, exit 2, and nothing left on disk.

Also the platform the command picks on a machine without a GPU, ``--version``,
and the modes of the files a run writes.
"""

import importlib.metadata
import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest

from fp8jax import cli
from fp8jax.training import run_dir

FAST = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]
ONE_STEP = ["--steps", "1", "--log-every", "1", "--eval-every", "1", "--precision", "bf16"]


def command(*argv: str, env: dict | None = None, timeout: int = 300):
    """Runs ``python -m fp8jax.cli ARGV`` as the user would; returns (status, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "fp8jax.cli", *argv],
        env=env if env is not None else os.environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


def a_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fp8jax {importlib.metadata.version('fp8jax')}"


def test_trains_help_names_every_preset(capsys, monkeypatch):
    from fp8jax.training.config import PRESETS

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps lines after a name's hyphen
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    words = set(capsys.readouterr().out.replace(",", " ").replace(";", " ").split())
    assert set(PRESETS) - words == set()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "--seed must be an int in [0, 2**32), got -1."),
        (["--seed", str(2**32)], "--seed must be an int in [0, 2**32)"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf."),
        (["--lr", "nan"], "--lr must be a number > 0, got nan."),
        (["--lr", "0"], "--lr must be a number > 0"),
        # 0 or inf in the f32 schedule: a run that never moved, or NaN parameters.
        (["--lr", "1e-300"], "--lr must be within float32's normal range [1.18e-38, 3.4e+38]"),
        (["--lr", "1e300"], "as the optimizer computes in f32; got 1e+300."),
        (["--attention", "cudnn"], "--attention cudnn runs cuDNN's attention kernel"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be an int >= 1, got 0."),
        (["--eval-batches", "-2"], "--eval-batches must be an int >= 1, got -2."),
        (["--checkpoint-every", "0"], "--checkpoint-every must be an int >= 1"),
        (["--mesh", "dp=0"], "--mesh axis dp must have size >= 1"),
        (["--inject-nan-at", "0"], "--inject-nan-at must be an int >= 1, got 0."),
    ],
)
def test_bad_values_are_refused_before_the_run_directory_exists(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert cli.main(["train", *FAST, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8jax train: error: ") and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--steps", "abc"], "invalid int value: 'abc'"), (["--lr", "fast"], "invalid float")],
)
def test_non_numbers_are_refused_by_the_parser(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", *argv, "--out", str(out)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


DATA_MESSAGE = (
    "--data must be a text file or folder, got ''; leave --data out to train on the Python "
    "standard library's source."
)


@pytest.mark.parametrize(
    ("option", "message"),
    [("--out", "--out must be a directory path, got ''."), ("--data", DATA_MESSAGE)],
)
def test_an_empty_out_or_data_is_refused_not_taken_as_the_working_directory(
    tmp_path, capsys, monkeypatch, option, message
):
    # pathlib reads '' as '.': the run was written into, or trained on, the working directory.
    monkeypatch.chdir(tmp_path)
    argv = ["--out", str(tmp_path / "run"), option, ""]  # the last --out wins
    assert cli.main(["train", *FAST, *ONE_STEP, *argv]) == 2
    assert capsys.readouterr().err == f"fp8jax train: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    path = a_file(tmp_path)
    assert cli.main(["train", *FAST, "--out", str(path)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert path.read_text() == "not a directory\n"


def test_an_out_below_a_file_is_refused(tmp_path, capsys):
    path = a_file(tmp_path)
    assert cli.main(["train", *FAST, "--out", str(path / "run")]) == 2
    assert f"cannot be created: {str(path)!r} is a file" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_an_out_in_a_read_only_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "read_only"
    folder.mkdir(mode=0o555)
    assert cli.main(["train", *FAST, "--out", str(folder / "run")]) == 2
    assert "cannot be created in" in capsys.readouterr().err
    assert list(folder.iterdir()) == []


def test_an_out_without_write_access_is_refused(tmp_path, capsys, monkeypatch):
    # As root (CI containers) no folder is read-only, so the permission check is exercised
    # through os.access, which is what it asks.
    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)
    out = tmp_path / "run"
    assert cli.main(["train", *FAST, "--out", str(out)]) == 2
    assert "no write permission or a read-only file system" in capsys.readouterr().err
    assert not out.exists()


def test_a_compile_cache_that_is_a_file_is_refused_before_the_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--compile-cache", str(a_file(tmp_path)), "--out", str(out)]
    assert cli.main(["train", *FAST, *argv]) == 2
    assert "--compile-cache: " in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_profile_that_cannot_be_a_directory_is_refused_before_the_run_directory(
    tmp_path, capsys, where
):
    # jax.profiler failed only when it stopped, after the traced steps, with a traceback.
    profile = a_file(tmp_path) if where == "a file" else a_file(tmp_path) / "trace"
    out = tmp_path / "run"
    assert cli.main(["train", *FAST, "--profile", str(profile), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fp8jax train: error: --profile {str(profile)!r} "), err
    assert "not a directory" in err
    assert not out.exists()


def test_resume_without_out_continues_the_default_run_directory(tmp_path, capsys, monkeypatch):
    # "Continue with the same command plus --resume" holds for a command without --out.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--precision", "bf16", "--resume"]) == 2
    assert "--resume: runs/tiny-bf16 holds no run" in capsys.readouterr().err


@pytest.mark.skipif(
    any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")),
    reason="a machine with an NVIDIA GPU: JAX rightly starts CUDA",
)
def test_a_cpu_machine_with_the_cuda_plugin_starts_jax_without_a_traceback(tmp_path):
    """Without JAX_PLATFORMS, the command pins a GPU-less machine to the CPU.

    --attention cudnn makes the command start JAX's backends and then refuse,
    so the whole start-up runs in seconds. Before the fix, the CUDA plugin of
    fp8jax[verify] logged a 20-line 'Unable to load cuDNN' traceback here.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = tmp_path / "run"
    status, stdout, stderr = command("train", "--attention", "cudnn", "--out", str(out), env=env)
    assert status == 2
    assert stderr.splitlines() == [
        "fp8jax train: error: --attention cudnn runs cuDNN's attention kernel, which needs an "
        "NVIDIA GPU; JAX's backend here is 'cpu'. Use --attention xla, or auto (cuDNN on a GPU, "
        "XLA elsewhere)."
    ]
    assert stdout == "" and not out.exists()


def test_choose_platform_leaves_gpus_and_the_users_choice_alone():
    assert cli.choose_platform({}, gpu_visible=False, cuda_plugin=True) == "cpu"
    assert cli.choose_platform({}, gpu_visible=True, cuda_plugin=True) is None
    assert cli.choose_platform({}, gpu_visible=False, cuda_plugin=False) is None
    environ = {"JAX_PLATFORMS": "cuda"}
    assert cli.choose_platform(environ, gpu_visible=False, cuda_plugin=True) is None


def test_json_files_get_the_umasks_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        path = tmp_path / "config.json"
        run_dir.write_json_atomic(path, {"a": 1})
        path.chmod(0o600)
        run_dir.write_json_atomic(path, {"a": 2})  # replaced, not rewritten in place
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary left


def test_every_file_of_a_run_gets_the_same_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        out = tmp_path / "run"
        assert cli.main(["train", *FAST, *ONE_STEP, "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert modes == {"config.json": 0o644, "metrics.jsonl": 0o644, "summary.json": 0o644}


def test_compare_out_with_an_unsupported_suffix_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    out = tmp_path / "x.txt"
    assert cli.main(["compare", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8jax compare: error: --out") and ".png" in err
    assert not out.exists()


@pytest.mark.parametrize("where", ["a directory", "below a file"])
def test_compare_out_that_cannot_be_written_is_refused(tmp_path, capsys, where):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    out = tmp_path / "plot.png"
    if where == "a directory":
        out.mkdir()
    else:
        out = a_file(tmp_path) / "plot.png"
    assert cli.main(["compare", str(run), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("fp8jax compare: error: --out")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no.such.module:make_step"], "module 'no.such.module' of 'no.such.module:make_step' "),
        (["make_step"], "MODULE:FUNCTION must name a module and a function"),
        (["os:getcwd", "--expect", "-1"], "--expect must be an int >= 0, got -1."),
        (["os:getcwd", "--at-least", "-1"], "--at-least must be an int >= 0, got -1."),
        (["os:getcwd", "--devices", "0"], "devices must be a positive int, got 0."),
        (["os:getcwd", "--hosts", "-1"], "hosts must be a positive int, got -1."),
    ],
)
def test_verify_refuses_bad_arguments_in_one_line_before_compiling(capsys, argv, message):
    assert cli.main(["verify", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8jax verify: error: ") and message in err, err
    assert len(err.splitlines()) == 1, err


def test_compare_skips_metrics_lines_and_files_that_are_not_records(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = ["5", "[1, 2]", '{"step": "x", "loss": 1.0}', '{"step": 3, "loss": 2.5}']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "config.json").write_text("[1]")
    (run / "summary.json").write_text('"done"')
    assert cli.main(["compare", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert "2.5000" in capsys.readouterr().out


@pytest.mark.parametrize("switch", ["resume", "rolled_layers"])
def test_a_train_options_switch_that_is_not_a_bool_is_refused(tmp_path, switch):
    # resume="no" is true: it resumed, or refused for want of a run to resume.
    from fp8jax.training import ConfigError, TrainOptions, train

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"^{switch} must be a bool, got 'no'.$"):
        train(TrainOptions(out=str(out), steps=1, **{switch: "no"}), progress=False)
    assert not out.exists()
