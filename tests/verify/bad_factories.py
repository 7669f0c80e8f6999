"""Factories that ``fp8jax verify`` must refuse in one line (issue 56, item 9)."""

import jax.numpy as jnp

NOT_CALLABLE = 3


def _fn(x):
    return x @ x


_ARGS = (jnp.zeros((16, 16), jnp.bfloat16),)


def no_mesh_argument():
    return _fn, _ARGS


def only_the_function(mesh):
    return _fn


def three_things(mesh):
    return _fn, _ARGS, None


def raises(mesh):
    raise RuntimeError("the model config is missing")


def shapes_that_do_not_fit(mesh):
    return (lambda x: x @ jnp.zeros((8, 8), jnp.bfloat16)), _ARGS


def sleeps(mesh):
    """Keeps the compiler child busy until the test interrupts the command."""
    import time

    time.sleep(600)
    return _fn, _ARGS


def exits(mesh):
    """Ends the compiler child as a crash would, mid-request."""
    import os

    os._exit(3)
