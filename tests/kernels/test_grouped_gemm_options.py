"""fp8jax.kernels.grouped_gemm's options: the tiling and interpret mode are in the jit key."""

import jax
import jax.numpy as jnp
import pytest

from fp8jax.kernels import grouped_gemm as gg

SMALL = gg.Tiles(m=32, n=64, k=32, wgrad_k=32, wgrad_n=64)


def test_a_changed_tiling_retraces():
    # A function traced under one tiling must not keep it under another: as
    # a module global read at trace time, the tiling was not in jit's key.
    rows_per_tile = jax.jit(lambda x: x + gg.current_tiles().m)
    assert int(rows_per_tile(jnp.int32(0))) == gg.DEFAULT_TILES.m
    with gg.use_tiles(SMALL):
        assert int(rows_per_tile(jnp.int32(0))) == SMALL.m
    assert int(rows_per_tile(jnp.int32(0))) == gg.DEFAULT_TILES.m


def test_interpret_mode_retraces():
    interpreting = jax.jit(lambda x: x + int(gg.interpreting()))
    assert int(interpreting(jnp.int32(0))) == 0
    with gg.interpret_kernels():
        assert int(interpreting(jnp.int32(0))) == 1
    assert int(interpreting(jnp.int32(0))) == 0


def test_set_tiles_sets_the_process_default():
    try:
        gg.set_tiles(SMALL)
        assert gg.current_tiles() == SMALL
    finally:
        gg.set_tiles(gg.DEFAULT_TILES)
    assert gg.current_tiles() == gg.DEFAULT_TILES


@pytest.mark.parametrize("bad", [None, (128, 256, 128), {"m": 32}])
def test_a_tiling_must_be_tiles(bad):
    with pytest.raises(TypeError, match="tiles must be a fp8jax.kernels.grouped_gemm.Tiles"):
        gg.use_tiles(bad)


def test_interpret_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="flag must be a bool, got 1"):
        gg.interpret_kernels(1)
