"""Ctrl-C for the ``fp8jax`` command: one line and exit 130, at every phase of a run.

Python runs a signal handler only between bytecodes of the main thread, so a
Ctrl-C that arrives while XLA compiles (seconds on a CPU, minutes of FP8 GEMM
autotuning on a GPU) waits for the compile to return, and the
KeyboardInterrupt it then raises unwinds through JAX, orbax and the
interpreter's shutdown, which crashed (a segmentation fault) or was swallowed
by code that catches everything. So the command raises no KeyboardInterrupt at
all: :func:`install` sets a Python handler that does nothing and has the
interpreter write each signal's number to a pipe (``signal.set_wakeup_fd``,
done in C the moment the signal arrives), and a thread that reads the pipe
decides:

* inside the training loop (:func:`training_loop`), the first Ctrl-C asks the
  loop to stop after the current step and save a checkpoint, as it promises;
* anywhere else, and on a second Ctrl-C, it prints one line and ends the
  process with ``os._exit(130)``: no Python unwinding and no ``atexit``
  handlers, which is safe because every file a run writes is written whole or
  not at all (temporary names and renames, orbax's committed checkpoints).

Only the command installs this: :func:`fp8jax.training.train` called from
Python keeps Python's Ctrl-C (a KeyboardInterrupt the loop turns into a saved
checkpoint), and library imports change no signal handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_STATUS = 130  # 128 + SIGINT, what shells report for a Ctrl-C


class CtrlC:
    """The process's Ctrl-C policy; see the module docstring.

    Attributes:
      command: the subcommand, for the message (``fp8jax COMMAND: ...``).
      note: what the message says when Ctrl-C ends the process now (or a function
        that returns it, called then).
    """

    def __init__(self, command: str, note: str | Callable[[], str] = "interrupted."):
        self.command = command
        self.note = note
        self._stop: threading.Event | None = None
        self._say: Callable[[str], None] = print
        self._lock = threading.Lock()

    def _install(self) -> None:
        # Ctrl-C is held back until the pipe, the handler and the watcher are all
        # in place: one that came between the pipe and the handler raised a
        # KeyboardInterrupt through the command's start. Held back, it arrives
        # once the mask is restored and takes the pipe like any other.
        mask = getattr(signal, "pthread_sigmask", None)  # POSIX only
        previous = mask(signal.SIG_BLOCK, {signal.SIGINT}) if mask else None
        try:
            read, write = os.pipe()
            os.set_blocking(write, False)
            signal.signal(signal.SIGINT, _ignore)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read,), daemon=True, name="ctrl-c").start()
        finally:
            if mask:
                mask(signal.SIG_SETMASK, previous)

    def _watch(self, fd: int) -> None:
        while True:
            try:
                signals = os.read(fd, 64)
            except OSError:
                return
            if not signals:
                return
            for number in signals:
                if number == signal.SIGINT:
                    self._on_ctrl_c()

    def _on_ctrl_c(self) -> None:
        with self._lock:
            stop = self._stop
            if stop is not None and not stop.is_set():
                stop.set()
                self._say(
                    "Ctrl-C: stopping after this step and saving a checkpoint "
                    "(Ctrl-C again to abort)."
                )
                return
            note = self.note() if callable(self.note) else self.note
            exit_now(" ".join(filter(None, ("fp8jax", self.command))) + f": {note}")

    @contextlib.contextmanager
    def training_loop(
        self,
        say: Callable[[str], None],
        abort_note: str | Callable[[], str],
        finish_note: str | Callable[[], str],
    ) -> Iterator[Callable[[], bool]]:
        """Inside: the first Ctrl-C requests a stop; a second exits with ``abort_note``.

        Yields a function that says whether a stop was requested. After the
        loop (the summary, the last lines) a Ctrl-C exits with ``finish_note``.
        """
        with self._lock:
            self._stop, self._say, self.note = threading.Event(), say, abort_note
        try:
            yield self._stop.is_set
        finally:
            with self._lock:
                self._stop, self.note = None, finish_note


_active: CtrlC | None = None


def _ignore(signum, frame) -> None:
    # The watcher thread acts on the signal; the main thread carries on.
    return None


def install(command: str, note: str = "interrupted.") -> CtrlC:
    """Takes over Ctrl-C for this process (the ``fp8jax`` command only).

    Must be called from the main thread.
    """
    global _active
    if _active is None:
        _active = CtrlC(command, note)
        _active._install()
    else:
        _active.command, _active.note = command, note
    return _active


def active() -> CtrlC | None:
    """The installed policy, or None where Python's own Ctrl-C applies."""
    return _active


_cleanups: list[Callable[[], None]] = []


def at_exit(cleanup: Callable[[], None]) -> None:
    """Has :func:`exit_now` call ``cleanup`` before it ends the process.

    ``os._exit`` runs no ``finally`` and no ``atexit``: what the process started
    outside itself (a compiler child and its temporary folder) needs this.
    """
    if cleanup not in _cleanups:
        _cleanups.append(cleanup)


def exit_now(message: str) -> None:
    """Runs the :func:`at_exit` cleanups, prints ``message`` to stderr, and exits with 130."""
    for cleanup in _cleanups:
        with contextlib.suppress(Exception):
            cleanup()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())
    os._exit(EXIT_STATUS)
