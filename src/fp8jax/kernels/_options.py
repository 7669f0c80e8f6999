"""fp8jax's options that change what a traced program contains, as JAX's own options do.

Each is part of ``jit``'s cache key (JAX's ``include_in_jit_key``): changing
one after a function was traced makes the next call trace it again, where
an ``os.environ`` read at trace time would be ignored by the cached trace.
JAX makes such options only through its private ``jax._src.config``
(``bool_state``, ``State``, jax 0.10 and 0.11); this module is the one
place that touches it. Where that API is missing, :class:`_Fallback` keeps
the semantics by clearing JAX's caches whenever a value changes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax

_TRUE, _FALSE = ("1", "true", "yes", "on", "t", "y"), ("0", "false", "no", "off", "f", "n")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() not in _TRUE + _FALSE:
        raise ValueError(
            f"the environment variable {name} must be 0 or 1 (or true/false), got {value!r}; "
            f"unset it for the default ({int(default)})."
        )
    return value.lower() in _TRUE


class _Fallback:
    """An option without JAX's config: every change clears JAX's caches (so it retraces)."""

    def __init__(self, default: Any):
        self._global = default
        self._local: list[Any] = []

    @property
    def value(self) -> Any:
        return self._local[-1] if self._local else self._global

    def set_global(self, value: Any) -> None:
        if value != self.value:
            jax.clear_caches()
        self._global = value

    @contextlib.contextmanager
    def __call__(self, value: Any) -> Iterator[None]:
        before = self.value
        self._local.append(value)
        if value != before:
            jax.clear_caches()
        try:
            yield
        finally:
            self._local.pop()
            if self.value != value:
                jax.clear_caches()


def _jax_state(name: str, default: Any, help: str, *, boolean: bool):
    """A JAX config option in the jit key, or None where this JAX has no such API."""
    try:
        from jax._src import config as jax_config
    except ImportError:
        return None
    kwargs = {"include_in_jit_key": True, "include_in_trace_context": True}
    try:
        if boolean:
            # bool_state reads the environment variable NAME.upper() itself;
            # _env_flag has checked it already, with fp8jax's message.
            return jax_config.bool_state(name, default, help, **kwargs)
        return jax_config.State(name, default, help, **kwargs)
    except (AttributeError, TypeError):  # the private API moved
        return None


def bool_option(name: str, help: str, default: bool):
    """A bool option named ``name`` (``jax.config.update(name, ...)`` sets it too).

    Its default comes from the environment variable ``name.upper()``.
    """
    value = _env_flag(name.upper(), default)
    state = _jax_state(name, value, help, boolean=True)
    return _Fallback(value) if state is None else state


def option(name: str, help: str, default: Any):
    """An option of hashable values, set as a context manager: ``with opt(value):``."""
    state = _jax_state(name, default, help, boolean=False)
    return _Fallback(default) if state is None else state


def set_global(state, value: Any) -> None:
    """Sets ``state`` outside any context manager (``jax.config.update``'s role)."""
    if isinstance(state, _Fallback):
        state.set_global(value)
    elif state.name in jax.config.values:
        jax.config.update(state.name, value)
    else:
        # jax.config.update knows the options declared through bool_state only;
        # it sets those through the same method.
        state._set(value)
