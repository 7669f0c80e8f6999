"""Recipes and formats: defaults and the errors for unknown settings."""

import dataclasses

import pytest
from jax import lax

import fp8jax


def test_defaults():
    r = fp8jax.DelayedScaling()
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (0, 1024, "max")
    assert r.formats == fp8jax.HYBRID
    assert r.forward_precision == lax.Precision.DEFAULT
    assert r.dgrad_precision == r.wgrad_precision == lax.Precision.HIGHEST
    assert fp8jax.CurrentScaling().formats.backward == fp8jax.E5M2
    assert (fp8jax.E4M3.max, fp8jax.E5M2.max) == (448.0, 57344.0)


def test_recipes_are_frozen_and_hashable():
    r = fp8jax.CurrentScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 2
    assert hash(r) == hash(fp8jax.CurrentScaling())


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: fp8jax.DelayedScaling(amax_compute_algo="mean"),
            ValueError,
            r"amax_compute_algo must be one of \('max', 'most_recent'\), got 'mean'",
        ),
        (
            lambda: fp8jax.DelayedScaling(amax_history_len=0),
            ValueError,
            "amax_history_len must be an int >= 1, got 0",
        ),
        (
            lambda: fp8jax.DelayedScaling(amax_history_len=2.5),
            ValueError,
            "amax_history_len must be an int >= 1, got 2.5",
        ),
        (
            lambda: fp8jax.CurrentScaling(margin=-1),
            ValueError,
            "CurrentScaling.margin must be a real number >= 0, got -1",
        ),
        (
            lambda: fp8jax.CurrentScaling(formats="hybrid"),
            TypeError,
            "formats must be a FormatPair such as fp8jax.HYBRID, got 'hybrid'",
        ),
        (
            lambda: fp8jax.CurrentScaling(dgrad_precision="highest"),
            TypeError,
            "dgrad_precision must be a jax.lax.Precision, got 'highest'",
        ),
        (
            lambda: fp8jax.FormatPair(fp8jax.E5M2, fp8jax.E5M2),
            ValueError,
            "E5M2 x E5M2 GEMM, which cuBLASLt rejects",
        ),
        (lambda: fp8jax.CurrentScaling(1), TypeError, "positional"),
    ],
)
def test_bad_settings_are_named(make, error, message):
    with pytest.raises(error, match=message):
        make()
