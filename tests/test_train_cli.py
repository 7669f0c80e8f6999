"""``fp8jax train`` from the command line: clear errors that change nothing, and Ctrl-C.

The runs of one configuration share their compiled programs through the module's
persistent compilation cache (``shared_compile_cache``, tests/conftest.py): the
resumed runs and the refused resumes build the programs ``run_dir`` and
``bf16_run`` compiled, and compiling is most of a short run's time on a CPU.
"""

import asyncio
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import pytest

from fp8jax import cli
from fp8jax.training import read_metrics

pytestmark = pytest.mark.usefixtures("shared_compile_cache")

FAST = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]


def fp8jax_train(*argv: str) -> int:
    return cli.main(["train", *FAST, *argv])


def snapshot(root: pathlib.Path) -> dict[str, str]:
    """Every file under ``root`` with the hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 2-step run, made through the CLI."""
    out = tmp_path_factory.mktemp("cli") / "run"
    status = fp8jax_train(
        "--steps", "2", "--log-every", "1", "--eval-every", "2", "--out", str(out)
    )
    assert status == 0
    return out


@pytest.fixture
def copy_of_run(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "/no/such/path"], "does not exist"),
        (
            ["--config", "huge"],
            "--config must be one of ['deepseek', 'deepseek-small', 'deepseek-tiny', ",
        ),
        (["--precision", "fp16"], "--precision must be one of"),
        (["--precision", "bf16", "--recipe", "delayed"], "--recipe delayed applies to FP8"),
        (["--recipe", "rowwise"], "--recipe must be one of"),
        (["--steps", "0"], "--steps must be an int >= 1"),
        (["--log-every", "3", "--eval-every", "5"], "must be a multiple of --log-every"),
        (["--mesh", "fsdp8"], "--mesh must look like"),
        (["--mesh", "fsdp=\u00b2"], "--mesh must look like"),  # isdigit, but no int
        (["--mesh", "tp=2"], "--mesh axes are ('dp', 'fsdp', 'ep')"),
        (["--mesh", "fsdp=16"], "needs 16 devices, but JAX sees 8"),
        (["--mesh", "dp=3"], "--batch-size 8 must be divisible by the mesh size 3"),
        (["--verify-target", "a100"], "--verify-target must be one of"),
        (["--attention", "flash"], "--attention must be one of"),
        (
            ["--attention", "fp8"],
            "--attention fp8 needs a head_dim in (64, 128) (the FP8 kernels' tiles); the preset "
            "'tiny' has 32.",
        ),
        (
            ["--config", "small", "--attention", "fp8-hadamard"],
            "--attention fp8-hadamard needs a --seq-len that is a multiple of 128",
        ),
        (["--remat", "some"], "--remat must be one of ('none', 'dots', 'full'), got 'some'"),
        (["--accumulation-steps", "0"], "--accumulation-steps must be an int >= 1, got 0"),
        (
            ["--accumulation-steps", "3"],
            "--accumulation-steps must divide --batch-size (8) into equal micro-batches, got 3",
        ),
        (["--profile", ""], "--profile must be a directory path, got ''"),
    ],
)
def test_bad_options_fail_before_anything_is_written(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert fp8jax_train("--out", str(out), *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8jax train: error: ") and message in err
    assert not out.exists()


def test_mxfp8_on_a_hopper_gpu_fails_before_anything_is_written(tmp_path, capsys, monkeypatch):
    # This machine's devices are CPUs, which the check passes; an H200's is this one.
    h200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="H200")
    monkeypatch.setattr(jax, "local_devices", lambda: [h200])
    out = tmp_path / "run"
    assert fp8jax_train("--out", str(out), "--recipe", "mxfp8") == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8jax train: error: --recipe mxfp8: MXFP8Scaling needs a GPU")
    assert "H200 has 9.0" in err and "Use --recipe block on Hopper." in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("kind", "message"),
    [("empty file", "the file is empty"), ("empty folder", "the folder has no non-empty text")],
)
def test_empty_data_is_refused(tmp_path, capsys, kind, message):
    data = tmp_path / "data"
    if kind == "empty file":
        data.write_text("")
    else:
        data.mkdir()
    assert fp8jax_train("--data", str(data), "--out", str(tmp_path / "run")) == 2
    assert message in capsys.readouterr().err


def test_the_summary_says_the_layers_ran_unrolled_by_default(run_dir):
    assert json.loads((run_dir / "summary.json").read_text())["layers"] == "unrolled"


@pytest.mark.deviceless
def test_rolled_layers_keep_one_layer_body_in_the_compiled_step_and_may_be_resumed(tmp_path):
    """--rolled-layers: the scan stays a loop, so the H100 compile holds one layer's 12 GEMMs.

    Unrolled (the default), it holds 12 per layer (tests/models/test_gpt.py).
    """
    out = tmp_path / "run"
    argv = ["--steps", "1", "--log-every", "1", "--eval-every", "1", "--verify-target", "h100"]
    assert fp8jax_train(*argv, "--rolled-layers", "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == "rolled"
    assert summary["fp8_gemms"]["deviceless"]["fp8"] == 12
    # The parameters are the same stacked arrays either way, so a run may switch on resume.
    # (To step 3: the programs of test_a_run_saved_before_remat_and_accumulation_existed_resumes's
    # resumed run, which then come from the compilation cache.)
    assert fp8jax_train("--steps", "3", "--log-every", "1", "--eval-every", "1", "--resume",
                        "--out", str(out)) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["layers"], summary["step"], summary["status"]) == ("unrolled", 3, "completed")


def test_an_existing_run_is_not_overwritten_without_resume(copy_of_run, capsys):
    before = snapshot(copy_of_run)
    assert fp8jax_train("--steps", "2", "--out", str(copy_of_run)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert snapshot(copy_of_run) == before


def test_resume_needs_a_run(tmp_path, capsys):
    assert fp8jax_train("--resume", "--out", str(tmp_path / "nothing")) == 2
    assert "holds no run" in capsys.readouterr().err


def test_resume_refuses_a_different_configuration(copy_of_run, capsys):
    before = snapshot(copy_of_run)
    argv = ["--resume", "--steps", "4", "--out", str(copy_of_run), "--precision", "bf16"]
    assert fp8jax_train(*argv) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err
    assert "precision: checkpoint has 'fp8', this run has 'bf16'" in err
    assert snapshot(copy_of_run) == before


def test_resume_refuses_a_checkpoint_that_does_not_fit_the_model(copy_of_run, capsys):
    # A config.json claiming delayed scaling over a checkpoint without FP8 state
    # (checkpoints copied between runs, say).
    config = json.loads((copy_of_run / "config.json").read_text())
    (copy_of_run / "config.json").write_text(json.dumps(config | {"recipe": "delayed"}))
    before = snapshot(copy_of_run)
    argv = ["--resume", "--steps", "4", "--recipe", "delayed", "--out", str(copy_of_run)]
    assert fp8jax_train(*argv) == 2
    err = capsys.readouterr().err
    assert "checkpoints/2 does not fit this model" in err and "fp8_state" in err
    assert snapshot(copy_of_run) == before


def test_resume_refuses_a_corrupt_checkpoint(copy_of_run, capsys):
    for f in (copy_of_run / "checkpoints" / "2").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    before = snapshot(copy_of_run)
    assert fp8jax_train("--resume", "--steps", "4", "--out", str(copy_of_run)) == 2
    err = capsys.readouterr().err
    assert "checkpoints/2 is unreadable" in err and "left as is" in err
    assert snapshot(copy_of_run) == before


def test_resume_of_a_finished_run_asks_for_more_steps(copy_of_run, capsys):
    assert fp8jax_train("--resume", "--steps", "2", "--out", str(copy_of_run)) == 2
    assert "already at step 2" in capsys.readouterr().err


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, shared_compile_cache):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fp8jax.cli", "train", *FAST, "--steps", "100000"]
    argv += ["--log-every", "1", "--eval-every", "1000", "--out", str(out)]
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["JAX_COMPILATION_CACHE_DIR"] = shared_compile_cache  # run_dir's initial state compile
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    assert "Ctrl-C: stopping after this step" in output and "Traceback" not in output
    summary = json.loads((out / "summary.json").read_text())
    step = summary["step"]
    assert summary["status"] == "interrupted" and step >= 1
    assert (out / "checkpoints" / str(step)).is_dir()
    assert read_metrics(out / "metrics.jsonl")[-1]["step"] == step


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A finished 2-step BF16 run with options that differ from the preset's."""
    out = tmp_path_factory.mktemp("cli") / "bf16"
    argv = ["--precision", "bf16", "--steps", "2", "--log-every", "1", "--eval-every", "2"]
    assert fp8jax_train(*argv, "--seed", "7", "--lr", "0.002", "--out", str(out)) == 0
    return out


@pytest.fixture
def copy_of_bf16_run(bf16_run, tmp_path):
    out = tmp_path / "bf16"
    shutil.copytree(bf16_run, out)
    return out


def test_resume_takes_the_options_left_out_from_the_run(copy_of_bf16_run):
    # Only --out, --resume and a longer --steps: precision, seed, learning rate, batch
    # and sequence sizes come from config.json, not from the preset.
    argv = ["--resume", "--steps", "3", "--no-progress", "--out", str(copy_of_bf16_run)]
    assert cli.main(["train", *argv]) == 0
    config = json.loads((copy_of_bf16_run / "config.json").read_text())
    assert (config["precision"], config["seed"], config["learning_rate"]) == ("bf16", 7, 0.002)
    assert (config["batch_size"], config["seq_len"], config["steps"]) == (8, 32, 3)
    assert json.loads((copy_of_bf16_run / "summary.json").read_text())["step"] == 3


def test_resume_refuses_an_explicit_option_that_differs_from_the_run(copy_of_bf16_run, capsys):
    before = snapshot(copy_of_bf16_run)
    argv = ["--resume", "--steps", "3", "--seed", "8", "--out", str(copy_of_bf16_run)]
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "seed: checkpoint has 7, this run has 8" in err
    assert "Leave these options out to resume with the run's saved values" in err
    assert snapshot(copy_of_bf16_run) == before


@pytest.mark.parametrize("corrupt", ["every file", "the array data"])
def test_a_corrupt_checkpoints_error_is_short_and_keeps_the_hint(copy_of_bf16_run, capsys, corrupt):
    step_dir = copy_of_bf16_run / "checkpoints" / "2"
    files = [f for f in step_dir.rglob("*") if f.is_file()]
    if corrupt == "the array data":  # orbax's metadata intact, TensorStore's chunks not
        files = [f for f in files if f.parent.name == "d" and "ocdbt" in str(f.parent.parent)]
    assert files
    for f in files:
        f.write_bytes(b"garbage")
    before = snapshot(copy_of_bf16_run)
    argv = ["--resume", "--steps", "4", "--no-progress", "--out", str(copy_of_bf16_run)]
    assert cli.main(["train", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2 and len(captured.err) < 700, captured.err
    assert lines[0].startswith(
        f"fp8jax train: error: --resume: checkpoint {step_dir} is unreadable"
    )
    assert lines[1] == "It was left as is; delete that step's folder to resume from an older one."
    assert "TensorStore" not in captured.err and "absl" not in captured.out + captured.err
    assert snapshot(copy_of_bf16_run) == before


def test_resume_names_the_precision_given_not_the_saved_recipe(copy_of_bf16_run, capsys):
    # An FP8 run's config.json (its recipe included), resumed with --precision bf16.
    config = json.loads((copy_of_bf16_run / "config.json").read_text())
    (copy_of_bf16_run / "config.json").write_text(
        json.dumps(config | {"precision": "fp8", "recipe": "current"})
    )
    argv = ["--resume", "--steps", "3", "--precision", "bf16", "--out", str(copy_of_bf16_run)]
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "precision: checkpoint has 'fp8', this run has 'bf16'" in err
    assert "--recipe current applies to FP8" not in err


def test_a_run_saved_before_remat_and_accumulation_existed_resumes(copy_of_run):
    config_path = copy_of_run / "config.json"
    config = json.loads(config_path.read_text())
    assert (config.pop("remat"), config.pop("accumulation_steps")) == ("none", 1)
    config_path.write_text(json.dumps(config))
    hook = sys.unraisablehook
    assert fp8jax_train("--resume", "--steps", "3", "--out", str(copy_of_run)) == 0
    assert json.loads((copy_of_run / "summary.json").read_text())["step"] == 3
    assert sys.unraisablehook is hook  # a read that succeeds leaves no filter behind


def test_a_corrupt_checkpoint_leaves_no_asyncio_traceback_after_its_message(
    copy_of_run, capsys, monkeypatch
):
    # Issue 56, item 8: orbax's reads still in flight called back into its closed
    # event loop, and Python printed each as "RuntimeError: Event loop is closed".
    # Some report before the failed read returns: with the CPUs busy, a filter
    # installed only on the failure let them through (2 runs in 3).
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    (copy_of_run / "checkpoints" / "2" / "default" / "array_metadatas" / "process_0").write_text(
        "x"
    )
    assert fp8jax_train("--resume", "--steps", "4", "--out", str(copy_of_run)) == 2
    assert "checkpoints/2 is unreadable" in capsys.readouterr().err

    def unraisable(error):
        try:
            raise error
        except Exception as e:
            return types.SimpleNamespace(
                exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__, err_msg=None,
                object=None,
            )  # fmt: skip

    closed = asyncio.new_event_loop()
    closed.close()
    try:
        closed.call_soon_threadsafe(print)
    except RuntimeError as e:
        leftover = unraisable(e)
    sys.unraisablehook(leftover)
    sys.unraisablehook(unraisable(Exception("Encountered error while reading array index: 0")))
    assert seen == []  # dropped: the message above already said the checkpoint is unreadable
    other = unraisable(ValueError("anything else"))
    sys.unraisablehook(other)
    assert seen == [other]
