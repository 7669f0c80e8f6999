"""A persistent compilation cache, because XLA's first FP8 compile on Hopper is slow.

On an H200 the first compile of an FP8 block's forward and backward step took
minutes, nearly all of it XLA autotuning Triton GEMM configurations for the
FP8 dots, where a BF16 step compiles in seconds; a fresh process that found
XLA's autotune results on disk compiled the same block in under a second
(docs/design.md, "First compile time").

JAX's persistent compilation cache stores compiled executables and, through
``jax_persistent_cache_enable_xla_caches``, XLA's per-fusion autotune
results, which also serve a program that changed elsewhere but kept its
GEMMs. JAX writes an executable only when it took at least
``jax_persistent_cache_min_compile_time_secs`` (1 s by default) to compile:
the slow GPU compiles this cache is for, not a CPU run's small programs.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

# The one JAX option enable() sets; the cache's other options keep JAX's defaults.
_CONFIG_KEY = "jax_compilation_cache_dir"


def default_dir() -> str:
    """``$FP8JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp8jax/jax`` (``~/.cache`` by default)."""
    explicit = os.environ.get("FP8JAX_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fp8jax", "jax")


def resolve(setting: str | None, backend: str | None = None) -> str | None:
    """The cache directory that ``setting`` asks for, or None for no cache.

    ``"auto"`` (and None) means :func:`default_dir` when the backend is a GPU,
    where the cache pays, and no cache elsewhere; ``"none"`` means no cache;
    anything else is the directory itself.
    """
    if setting is None or setting == "auto":
        backend = backend or jax.default_backend()
        return default_dir() if backend == "gpu" else None
    if setting == "none":
        return None
    if not setting.strip():
        raise ValueError(
            "compile_cache must be 'auto', 'none' or a directory; got an empty string."
        )
    return setting


def check(directory: str) -> str:
    """Checks, without creating anything, that ``directory`` can be used; returns its path.

    Raises:
      ValueError: if it is a file, or it cannot be created or written.
    """
    path = os.path.abspath(os.path.expanduser(directory))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"compile_cache: cannot create the directory {path!r}: {existing!r} is a file; "
            "pass a directory, or 'none'."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"compile_cache: cannot create the directory {path!r}: no write permission in "
            f"{existing!r} (or a read-only file system); pass another directory, or 'none'."
        )
    return path


def enable(directory: str) -> str:
    """Turns JAX's persistent compilation cache on in ``directory`` (created if missing).

    Later compiles in this process read and write the cache in ``directory``,
    also when an earlier call gave another one: JAX opens its cache once, at
    the first compile that finds a directory, so this closes the open one.
    Returns the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile_cache: cannot create the directory {path!r}: {e}") from e
    jax.config.update(_CONFIG_KEY, path)
    # Without the reset, a process that compiled with another directory goes
    # on writing there, silently.
    _jax_cache.reset_cache()
    return path
