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

import contextlib
import json
import logging
import os
import pathlib
import secrets
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from fp8jax.flax import checkpoint
from fp8jax.training.errors import CheckpointError, RunDirError


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, then renames it over ``path``.

    The file is created with mode 0o666 less the umask, like every other file
    of the run (``tempfile.mkstemp`` would make it 0o600).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: pathlib.Path, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` atomically (a temporary file, then a rename)."""
    _write_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _differences(saved: dict, wanted: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key, "<missing>"), wanted.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: checkpoint has {a!r}, this run has {b!r}")
    return diffs


def _leaves_by_path(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): (
            tuple(leaf.shape),
            str(np.dtype(leaf.dtype)),
        )
        for path, leaf in leaves
    }


_CAUSE_CHARS = 300


@contextlib.contextmanager
def _orbax_leftovers_dropped() -> Iterator[None]:
    """Keeps the reads orbax left in flight on a corrupt checkpoint from printing tracebacks.

    Orbax reads a checkpoint's arrays through TensorStore futures on an asyncio
    loop. When one read fails, the others still finish later, on TensorStore's
    threads, and call back into the loop orbax has closed by then: Python
    reports each as an unraisable ``RuntimeError: Event loop is closed`` (or
    the read's own error), a traceback printed after the one-line message that
    already said the checkpoint is unreadable. Only those are dropped; every
    other unraisable exception goes to the hook that was there before.

    The filter is on from the read's start: the other reads report while the
    failed one unwinds, before any ``except`` of ours runs, and later; one
    installed only on the failure let the first ones through when the CPUs were
    busy. It stays after a failed read, and a read that succeeds leaves the
    hook as it found it.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_orbax_leftovers", False):
        yield
        return

    def hook(unraisable) -> None:
        if not _is_orbax_leftover(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    hook.drops_orbax_leftovers = True
    sys.unraisablehook = hook
    yield  # a failed read raises here, and the filter stays for its leftovers
    if sys.unraisablehook is hook:
        sys.unraisablehook = previous


def _is_orbax_leftover(error: BaseException | None, tb) -> bool:
    frames = traceback.extract_tb(tb) if tb is not None else []
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return any(f.name == "_check_closed" and "asyncio" in f.filename for f in frames)
    # orbax's own wording for a failed TensorStore read (serialization.py).
    return str(error).startswith("Encountered error while reading array index")


def _cause(error: BaseException) -> str:
    """The root cause of a failed checkpoint read, in one line of at most 300 characters.

    Orbax wraps TensorStore's error in one that embeds the whole TensorStore
    spec (over a kilobyte); the innermost exception names the file and the
    problem.
    """
    seen = {id(error)}
    while True:
        inner = error.__cause__
        if inner is None and not error.__suppress_context__:
            inner = error.__context__  # raised while handling it: often the real failure
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        error = inner
    text = str(error).strip()
    line = text.splitlines()[0].split(" See full TensorStore details")[0] if text else ""
    line = line if len(line) <= _CAUSE_CHARS else line[: _CAUSE_CHARS - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Silences the loggers that repeat a failed read's error (the CLI prints it once)."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio", "orbax")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class RunDir:
    """The files of one run; see the module docstring for the layout."""

    def __init__(self, path: str | os.PathLike, *, writer: bool = True):
        """``writer=False``: every check and checkpoint, but no config, metrics or summary.

        In a multi-process run every process saves and restores checkpoints
        (orbax coordinates them) and only process 0 writes the other files.
        """
        self.path = pathlib.Path(path)
        self.writer = writer
        self.config_path = self.path / "config.json"
        self.metrics_path = self.path / "metrics.jsonl"
        self.summary_path = self.path / "summary.json"
        self.checkpoints = self.path / "checkpoints"
        self.saved_config: dict = {}  # what check_resume read

    def check_usable(self) -> None:
        """Checks, before anything is written, that the run directory can be written.

        Raises:
          RunDirError: if the path is a file, or it cannot be created or written.
        """
        where = f"--out {str(self.path)!r}"
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"{where} is a file, not a directory; pass a directory path.")
        existing = self.path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise RunDirError(
                f"{where} cannot be created: {str(existing)!r} is a file, not a directory."
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "written to" if existing == self.path else f"created in {str(existing)!r}"
            raise RunDirError(
                f"{where} cannot be {what} (no write permission or a read-only file "
                "system); choose another --out."
            )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        if not self.checkpoints.is_dir():
            return None
        with _quiet_orbax():  # orbax logs an unreadable step's metadata, then skips the step
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
        if not self.writer:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.config_path, config)
        except OSError as e:
            raise RunDirError(
                f"--out {str(self.path)!r} cannot be written ({e.strerror or e}); choose "
                "another --out."
            ) from None
        self.metrics_path.unlink(missing_ok=True)
        self.summary_path.unlink(missing_ok=True)

    def check_resume(self, config: dict, may_change: tuple[str, ...],
                     missing: dict | None = None) -> int:  # fmt: skip
        """Checks that the run can be resumed with ``config``; returns its newest step.

        ``missing``: the value a field had in runs whose config.json predates it.

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
        missing = missing or {}
        diffs = _differences({k: saved.get(k, missing.get(k, "<missing>")) for k in fixed}, fixed)
        if diffs:
            raise CheckpointError(
                f"--resume: the run in {self.path} was made with a different configuration:\n  "
                + "\n  ".join(diffs)
                + "\nLeave these options out to resume with the run's saved values (only "
                "--steps and the log/eval/checkpoint intervals may change), or choose another "
                "--out. Nothing was changed."
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
        hint = "It was left as is; delete that step's folder to resume from an older one."
        try:
            with (
                _quiet_orbax(),
                _orbax_leftovers_dropped(),
                ocp.CheckpointManager(
                    self.checkpoints.absolute(), item_handlers=ocp.StandardCheckpointHandler()
                ) as manager,
            ):
                stored = _leaves_by_path(manager.item_metadata(step).tree)
        except Exception as e:
            raise CheckpointError(
                f"--resume: checkpoint {where} is unreadable: {_cause(e)}\n{hint}"
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
            with _quiet_orbax(), _orbax_leftovers_dropped():
                return checkpoint.restore(self.checkpoints, like, step)
        except Exception as e:
            raise CheckpointError(
                f"--resume: checkpoint {where} is unreadable: {_cause(e)}\n{hint}"
            ) from None

    def resumed(self, config: dict, step: int) -> None:
        """Records a resumed session's config and drops the metrics logged after ``step``."""
        if not self.writer:
            return
        write_json_atomic(self.config_path, config)
        self.truncate_metrics(step)

    def append_metrics(self, record: dict) -> None:
        if not self.writer:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """Drops metrics lines after ``step`` (logged after the checkpoint a resume starts from)."""
        if not self.metrics_path.exists():
            return
        lines = read_metrics(self.metrics_path)
        kept = "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines if r["step"] <= step)
        _write_atomic(self.metrics_path, kept)

    def write_summary(self, summary: dict) -> None:
        if not self.writer:
            return
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
