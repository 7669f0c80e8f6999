"""Makes the helpers in tests/sharding importable; deviceless compiles need fp8jax[verify].

As in tests/verify: without the extra the deviceless tests are skipped with
the reason, except in CI (``CI`` set), where a missing toolchain is a broken
install and fails.
"""

import os
import pathlib
import sys

import pytest

from fp8jax.verify import toolchain

HERE = pathlib.Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def reference():
    """The single-device train step every sharded run is compared with."""
    import sharded_layer

    return sharded_layer.reference()


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
