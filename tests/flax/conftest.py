"""Makes the helpers in tests/flax importable from the tests below it; shared fixtures."""

import pathlib
import sys

import jax
import pytest

HERE = str(pathlib.Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def standard_promotion():
    """JAX's standard dtype promotion, for the tests that need it because of code not ours.

    optax.adam's bias correction mixes its int32 step count with f32. And JAX
    lowers the backward of its bf16 attention core (a bf16 x f32 dot_general on
    CPU) through jnp code that strict promotion rejects; that happens when the
    jitted step is compiled, outside any scope fp8jax can set.
    """
    with jax.numpy_dtype_promotion("standard"):
        yield
