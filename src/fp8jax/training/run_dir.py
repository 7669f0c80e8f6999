"""A run directory: its config, metrics, summary and checkpoints, and the rules for reusing it.

``runs/NAME/``
  ``config.json``   the resolved run config and the data fingerprint (written first)
  ``metrics.jsonl`` one JSON object per log step
  ``checkpoints/``  orbax checkpoints, one folder per step (atomic: orbax writes a
                    temporary folder and renames it once complete)
  ``summary.json``  how the run ended, final losses, throughput, FP8 GEMM counts

A directory that already holds a run is never written to unless ``--resume``
is given, and ``--resume`` refuses a run whose configuration differs or whose
checkpoint is unreadable, before anything is written.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fp8jax.flax import checkpoint
from fp8jax.training.errors import CheckpointError, RunDirError


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """Writes JSON to a temporary file beside ``path``, then renames it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _differences(saved: dict, wanted: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key, "<missing>"), wanted.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: checkpoint has {a!r}, this run has {b!r}")
    return diffs


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaves_by_path(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(_key_name(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
        for path, leaf in leaves
    }


class RunDir:
    """The files of one run; see the module docstring for the layout."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.config_path = self.path / "config.json"
        self.metrics_path = self.path / "metrics.jsonl"
        self.summary_path = self.path / "summary.json"
        self.checkpoints = self.path / "checkpoints"
        self.saved_config: dict = {}  # what check_resume read

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        if not self.checkpoints.is_dir():
            return None
        return checkpoint.latest_step(self.checkpoints)

    def has_run(self) -> bool:
        """Whether the directory holds a run that trained: metrics or a checkpoint.

        A config.json alone (a run stopped before its first step) may be replaced.
        """
        has_metrics = self.metrics_path.exists() and self.metrics_path.stat().st_size > 0
        return has_metrics or self.latest_step() is not None

    def start(self, config: dict) -> None:
        """Claims the directory for a new run and writes ``config.json``.

        Raises:
          RunDirError: if it already holds a run.
        """
        if self.has_run():
            raise RunDirError(
                f"{self.path} already holds a run (metrics or checkpoints); pass --resume to "
                "continue it, or choose another --out. Nothing was changed."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.config_path, config)
        self.metrics_path.unlink(missing_ok=True)
        self.summary_path.unlink(missing_ok=True)

    def check_resume(self, config: dict, may_change: tuple[str, ...]) -> int:
        """Checks that the run can be resumed with ``config``; returns its newest step.

        Raises:
          RunDirError: if there is no run or no checkpoint to resume.
          CheckpointError: if the saved config is unreadable or differs from ``config``
            outside ``may_change``.
        """
        if not self.config_path.exists():
            raise RunDirError(
                f"--resume: {self.path} holds no run (no config.json); start one without --resume."
            )
        try:
            saved = json.loads(self.config_path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"--resume: {self.config_path} is unreadable ({e}); the run cannot be checked "
                "against this configuration. Nothing was changed."
            ) from None
        self.saved_config = saved
        fixed = {k: v for k, v in config.items() if k not in may_change}
        diffs = _differences({k: saved.get(k, "<missing>") for k in fixed}, fixed)
        if diffs:
            raise CheckpointError(
                f"--resume: the run in {self.path} was made with a different configuration:\n  "
                + "\n  ".join(diffs)
                + "\nPass the same options (only --steps and the log/eval/checkpoint intervals "
                "may change), or choose another --out. Nothing was changed."
            )
        step = self.latest_step()
        if step is None:
            raise RunDirError(
                f"--resume: {self.path} has no complete checkpoint to resume from; start a new "
                "run in another --out."
            )
        return step

    def save(self, step: int, state, *, keep: int) -> None:
        """Writes checkpoint ``step`` (orbax commits it atomically); keeps the newest ``keep``."""
        checkpoint.save(self.checkpoints, step, state, max_to_keep=keep)

    def restore(self, step: int, like):
        """Reads checkpoint ``step`` shaped (and sharded) like ``like``.

        Raises:
          CheckpointError: if its tree, shapes or dtypes differ from ``like``, or it is unreadable.
        """
        where = self.checkpoints / str(step)
        try:
            with ocp.CheckpointManager(
                self.checkpoints.absolute(), item_handlers=ocp.StandardCheckpointHandler()
            ) as manager:
                stored = _leaves_by_path(manager.item_metadata(step).tree)
        except Exception as e:
            raise CheckpointError(
                f"--resume: checkpoint {where} is unreadable ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); it was left as is. Delete that "
                "step's folder to resume from an older one."
            ) from None
        wanted = _leaves_by_path(like)
        if stored != wanted:
            diffs = [
                f"{p}: checkpoint {stored.get(p, 'missing')}, model {wanted.get(p, 'missing')}"
                for p in sorted(set(stored) | set(wanted))
                if stored.get(p) != wanted.get(p)
            ]
            raise CheckpointError(
                f"--resume: checkpoint {where} does not fit this model and optimizer "
                f"({len(diffs)} arrays differ, e.g. {diffs[0]}); it was left as is."
            )
        try:
            return checkpoint.restore(self.checkpoints, like, step)
        except Exception as e:
            raise CheckpointError(
                f"--resume: checkpoint {where} could not be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); it was left as is. Delete that "
                "step's folder to resume from an older one."
            ) from None

    def resumed(self, config: dict, step: int) -> None:
        """Records a resumed session's config and drops the metrics logged after ``step``."""
        write_json_atomic(self.config_path, config)
        self.truncate_metrics(step)

    def append_metrics(self, record: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """Drops metrics lines after ``step`` (logged after the checkpoint a resume starts from)."""
        if not self.metrics_path.exists():
            return
        lines = read_metrics(self.metrics_path)
        kept = "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines if r["step"] <= step)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".metrics.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(kept)
        os.replace(tmp, self.metrics_path)

    def write_summary(self, summary: dict) -> None:
        write_json_atomic(self.summary_path, summary)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl``; a torn last line (a crash mid-write) is skipped."""
    records = []
    for line in pathlib.Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
