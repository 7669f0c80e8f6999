"""Throughput windows, the progress bar, and the Ctrl-C handler of a training run."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
from tqdm import tqdm

from fp8jax.training import interrupts


class Window:
    """Losses and timing between two metrics lines; eval and checkpoint time excluded."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.train_seconds = 0.0  # over the whole run, for the summary
        self.train_steps = 0
        self.timed_range: tuple[int, int] | None = None  # first and last step timed
        self._reset()

    def _reset(self) -> None:
        self.losses: list[float] = []
        self.timed_steps = 0
        self.start = time.perf_counter()
        self.excluded = 0.0

    def start_timing(self) -> None:
        """Starts the clock now (after the first step, whose time is mostly compile)."""
        self.start, self.excluded, self.timed_steps = time.perf_counter(), 0.0, 0

    def add(self, losses: list[float], timed_steps: int) -> None:
        self.losses += losses
        self.timed_steps += timed_steps

    def timed(self, steps: list[int]) -> None:
        """Records that ``steps`` count in the throughput."""
        if steps:
            first = steps[0] if self.timed_range is None else self.timed_range[0]
            self.timed_range = (first, steps[-1])

    @contextlib.contextmanager
    def excluding(self) -> Iterator[None]:
        """Time spent inside (validation, checkpoints) does not count as training."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t

    def close(self) -> dict:
        """The window's metrics; starts the next window."""
        seconds = time.perf_counter() - self.start - self.excluded
        record = {"loss": float(np.mean(self.losses))}
        if self.timed_steps:
            record["step_time_s"] = seconds / self.timed_steps
            record["tokens_per_s"] = self.timed_steps * self.tokens_per_step / seconds
            self.train_seconds += seconds
            self.train_steps += self.timed_steps
        self._reset()
        return record

    def tokens_per_s(self) -> float | None:
        """Over every timed step so far."""
        if not self.train_steps:
            return None
        return self.train_steps * self.tokens_per_step / self.train_seconds


def progress_bar(*, total: int, initial: int, desc: str, enabled: bool | None):
    """A tqdm bar over steps; ``enabled=None`` shows it only on a terminal."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="step",
        dynamic_ncols=True,
        disable=None if enabled is None else not enabled,
    )


def postfix(record: dict) -> dict:
    """The bar's postfix from a metrics record."""
    shown = {"loss": f"{record['loss']:.4f}"}
    if "tokens_per_s" in record:
        shown["tok/s"] = f"{record['tokens_per_s']:,.0f}"
        shown["step"] = f"{record['step_time_s'] * 1e3:.0f}ms"
    if "mfu" in record:
        shown["MFU"] = f"{record['mfu']:.1%}"
    if "val_loss" in record:
        shown["val"] = f"{record['val_loss']:.4f}"
    return shown


@contextlib.contextmanager
def stop_on_ctrl_c(
    say: Callable[[str], None],
    abort_note: str | Callable[[], str] = "aborted.",
    finish_note: str | Callable[[], str] = "interrupted.",
) -> Iterator[Callable[[], bool]]:
    """Turns the first Ctrl-C into a stop request the loop polls between steps.

    Yields a function that says whether a stop was requested. Under the
    ``fp8jax`` command (:mod:`fp8jax.training.interrupts`), a second Ctrl-C
    ends the process at once with ``abort_note``, even inside a compile, and
    one after the loop with ``finish_note``.
    Called from Python, a second Ctrl-C raises KeyboardInterrupt; outside the
    main thread (where Python cannot install signal handlers) Ctrl-C keeps
    its default behaviour, and the loop still catches KeyboardInterrupt.
    """
    command = interrupts.active()
    if command is not None:
        with command.training_loop(say, abort_note, finish_note) as stop_requested:
            yield stop_requested
        return
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested.is_set
        return

    def handler(signum, frame):
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        say("Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to abort).")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield requested.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
