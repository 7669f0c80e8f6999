"""``fp8jax train``: a small GPT trained in FP8 or BF16, with metrics, checkpoints and resume.

:func:`train` runs a :class:`TrainOptions` and writes its run directory
(``config.json``, ``metrics.jsonl``, ``checkpoints/``, ``summary.json``);
:data:`PRESETS` holds the named configurations (``tiny``, ``small``, ``medium``,
``llama-1b``, ``llama-3b``).
"""

from fp8jax.training.config import PRESETS, Preset, RunConfig, TrainOptions, resolve
from fp8jax.training.errors import (
    CheckpointError,
    ConfigError,
    DivergedError,
    OutOfMemoryError,
    RunDirError,
    TrainError,
)
from fp8jax.training.loop import TrainResult, train
from fp8jax.training.run_dir import RunDir, read_metrics

__all__ = [
    "PRESETS",
    "CheckpointError",
    "ConfigError",
    "DivergedError",
    "OutOfMemoryError",
    "Preset",
    "RunConfig",
    "RunDir",
    "RunDirError",
    "TrainError",
    "TrainOptions",
    "TrainResult",
    "read_metrics",
    "resolve",
    "train",
]
