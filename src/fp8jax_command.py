"""The ``fp8jax`` console script: takes over Ctrl-C before JAX is imported.

It lives outside the ``fp8jax`` package because importing anything inside it
first runs ``fp8jax/__init__.py``, which imports JAX (a second or more). A
Ctrl-C during that import raised a KeyboardInterrupt somewhere inside JAX's
import: a traceback, an ImportError, an abort (SIGABRT), or an interrupt that a
garbage-collection callback swallowed, after which the run went on. So this
module loads :mod:`fp8jax.training.interrupts` (standard library only) by its
path, installs its Ctrl-C policy, and only then imports the command.
``python -m fp8jax_command`` runs the same. ``python -m fp8jax.cli`` works too,
without this guard during its imports.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_INTERRUPTS = "fp8jax.training.interrupts"


def _load_interrupts():
    """Imports ``fp8jax/training/interrupts.py`` without importing its packages.

    It is registered under its own name, so the package's later import of it
    finds this module (and its installed policy) in ``sys.modules``.
    """
    if _INTERRUPTS in sys.modules:
        return sys.modules[_INTERRUPTS]
    path = pathlib.Path(__file__).with_name("fp8jax") / "training" / "interrupts.py"
    spec = importlib.util.spec_from_file_location(_INTERRUPTS, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_INTERRUPTS] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    """Entry point of the ``fp8jax`` console script; see the module docstring."""
    _load_interrupts().install("", "interrupted.")
    from fp8jax import cli

    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
