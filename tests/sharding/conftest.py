"""Makes the helpers in tests/sharding importable (deviceless skips: tests/conftest.py)."""

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def reference():
    """The single-device train step every sharded run is compared with."""
    import sharded_layer

    return sharded_layer.reference()
