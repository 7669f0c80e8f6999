"""The errors ``fp8jax train`` stops with; each message says what to do next."""

from __future__ import annotations


class TrainError(Exception):
    """Base class: the CLI prints the message, without a traceback, and exits non-zero."""

    exit_code = 2


class ConfigError(TrainError, ValueError):
    """A bad option: unknown preset, precision, recipe or mesh, or a bad number."""


class RunDirError(TrainError):
    """The run directory cannot be used: it holds another run, or nothing to resume."""


class CheckpointError(TrainError):
    """A checkpoint is unreadable, or belongs to a different configuration."""


class DivergedError(TrainError):
    """The loss became NaN or Inf; the last good checkpoint is kept."""

    exit_code = 1


class OutOfMemoryError(TrainError):
    """The step (or the model's state) does not fit in device memory."""

    exit_code = 1
