"""``fp8jax train``'s options each have their effect: --lr, --seed, --keep-checkpoints,
--checkpoint-every, --compile-cache, and the progress bar.

Three short runs of the tiny preset through ``cli.main``, shared by the tests.
"""

import contextlib
import io
import json
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp8jax import cli
from fp8jax.training import read_metrics

FAST = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--log-every", "1"]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, so tqdm draws its bar."""

    def isatty(self):
        return True


def _train(out: pathlib.Path, *argv: str, terminal: bool = False) -> str:
    """Runs ``fp8jax train``; returns what it wrote to stderr."""
    err = _Terminal() if terminal else io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["train", *FAST, "--out", str(out), *argv])
    assert status == 0, err.getvalue()
    return err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_compile_cache):
    # shared_compile_cache: every program is written, and the cache is off after the module.
    root = tmp_path_factory.mktemp("options")
    cache = str(root / "cache")
    # Seed 0 at --lr 1e-3 and 2e-3. warmup_steps is 1 on runs this short, so
    # step 1 runs at learning rate 0: its checkpoint holds the initial
    # parameters, and step 2 runs at the peak rate on the same gradients.
    a_err = _train(
        root / "a", "--steps", "2", "--lr", "1e-3", "--checkpoint-every", "1",
        "--keep-checkpoints", "5", "--compile-cache", cache, "--no-progress",
    )  # fmt: skip
    a_cached = os.listdir(cache)  # what run a wrote
    # b and c read a's initial-state and eval programs from the cache instead of
    # compiling them again (their steps differ: the learning rate schedule).
    _train(
        root / "b", "--steps", "2", "--lr", "2e-3", "--checkpoint-every", "1",
        "--keep-checkpoints", "1", "--compile-cache", cache, "--no-progress",
    )  # fmt: skip
    c_err = _train(
        root / "c", "--steps", "3", "--seed", "1", "--checkpoint-every", "2",
        "--compile-cache", cache, terminal=True,
    )  # fmt: skip
    return root, a_err, c_err, a_cached


def _checkpoint_steps(run: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def _params(run: pathlib.Path, step: int) -> dict:
    tree = ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / "default")
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(tree["params"])
    }


def test_lr_scales_the_first_update(runs):
    root = runs[0]
    initial = _params(root / "a", 1)
    after_a, after_b = _params(root / "a", 2), _params(root / "b", 2)
    # AdamW's update is the learning rate times a function of the gradients
    # (weight decay included), the same in both runs here, so doubling --lr
    # doubles every parameter's change. Each parameter was rounded to f32
    # once per run: 2**-24 of its magnitude, three times (the change is
    # under 0.01 at these rates).
    moved = 0
    for name, p0 in initial.items():
        da, db = after_a[name] - p0, after_b[name] - p0
        bound = 4 * 2.0**-24 * (np.abs(p0) + 0.01)
        assert np.all(np.abs(db - 2 * da) <= bound), name
        moved += int(np.count_nonzero(da))
    assert moved > 0.5 * sum(p.size for p in initial.values())
    lrs = [r["lr"] for r in read_metrics(root / "a" / "metrics.jsonl")]
    assert lrs == [0.0, pytest.approx(1e-3)]


def test_seed_sets_the_initial_parameters_and_so_the_first_loss(runs):
    root = runs[0]
    first = {r: read_metrics(root / r / "metrics.jsonl")[0]["loss"] for r in "abc"}
    assert first["a"] == first["b"]  # seed 0 twice: the same parameters and batch
    assert first["c"] != first["a"]
    a, c = _params(root / "a", 1), _params(root / "c", 2)
    assert not np.array_equal(a["['lm_head']['kernel']"], c["['lm_head']['kernel']"])
    assert json.loads((root / "c" / "config.json").read_text())["seed"] == 1


def test_checkpoint_every_and_keep_checkpoints(runs):
    root = runs[0]
    assert _checkpoint_steps(root / "a") == [1, 2]  # every step, all kept
    assert _checkpoint_steps(root / "b") == [2]  # every step, the newest kept
    assert _checkpoint_steps(root / "c") == [2, 3]  # every 2 steps, and the last


def test_compile_cache_directory_receives_the_compiled_programs(runs):
    _, a_err, _, a_cached = runs
    assert a_cached, "no compiled program was written to --compile-cache"
    assert "step/s" not in a_err and "3/3" not in a_err  # --no-progress: no bar


def test_progress_bar_on_a_terminal(runs):
    bar = runs[2].split("\r")[-1]
    assert bar.startswith("tiny fp8: 100%")
    assert "3/3" in bar and "loss=" in bar
