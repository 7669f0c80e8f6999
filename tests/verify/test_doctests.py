"""The docstring examples of fp8jax.verify's modules run as written.

tests/test_repository.py runs the other modules' examples; these three are
here because two of them compile for an H100 (or check the toolchain that
does) and need the ``deviceless`` marker.
"""

import doctest
import importlib

import pytest

MODULES = [
    "fp8jax.verify.report",  # compiles for the CPU
    pytest.param("fp8jax.verify.assertions", marks=pytest.mark.deviceless),
    pytest.param("fp8jax.verify.toolchain", marks=pytest.mark.deviceless),
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no runnable example"
    assert result.failed == 0
