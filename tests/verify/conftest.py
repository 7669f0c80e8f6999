"""Deviceless compiles need fp8jax[verify]; where it is missing, say so.

A developer without the extra gets the deviceless tests skipped with the
reason. In CI (``CI`` set) they fail instead: the README's test command
installs the extra, so a missing toolchain there is a broken install that a
skip would hide.
"""

import os
import pathlib

import pytest

from fp8jax.verify import toolchain

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    try:
        toolchain.check_deviceless()
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        skip = pytest.mark.skip(reason=f"no deviceless GPU compiles here: {e}")
        for item in items:
            if "deviceless" in item.keywords and HERE in item.path.parents:
                item.add_marker(skip)
