"""Fixtures of the op tests."""

import jax
import pytest


@pytest.fixture
def one_device():
    """A one-device mesh as context, for the live single-GPU tests.

    With several GPUs visible and no mesh, the ops cannot tell a one-device
    ``jit`` from a sharded one and keep XLA's cast (kernels.dispatch.is_local);
    on 2 H200s the kernel assertions of tests/ops/test_fused.py then failed (run 8A).
    """
    with jax.set_mesh(jax.make_mesh((1,), ("one",), devices=jax.devices()[:1])) as mesh:
        yield mesh
