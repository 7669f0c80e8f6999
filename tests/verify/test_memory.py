"""fp8jax.verify.memory_many: a deviceless compile's buffer sizes, donation included."""

import jax
import jax.numpy as jnp
import pytest

from fp8jax import verify

pytestmark = pytest.mark.deviceless

MIB = 2**20


def test_memory_counts_arguments_outputs_and_donated_buffers():
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32)  # 2 MiB each
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)  # 1 MiB

    def step(state, w):
        return state * jnp.sum(w), jnp.sum(state)  # elementwise: the output fits in place

    [kept] = verify.memory_many([(step, (x, w))], target="h200")
    [donated] = verify.memory_many([(step, (x, w))], target="h200", donate_argnums=(0,))
    assert kept.argument == 3 * MIB and kept.alias == 0
    assert kept.output >= 2 * MIB and kept.peak >= 5 * MIB
    # The new state reuses the donated one's buffer: 2 MiB aliased, 2 MiB less at the peak.
    assert donated.alias == 2 * MIB and donated.peak == kept.peak - 2 * MIB


@pytest.mark.parametrize(
    ("donate", "error", "match"),
    [
        ([0], TypeError, r"donate_argnums must be a tuple of ints, got \[0\]"),
        ((2,), ValueError, r"donate_argnums=\(2,\) must index calls\[0\]'s 2 arguments"),
    ],
)
def test_bad_donate_argnums_are_refused_by_name(donate, error, match):
    x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    with pytest.raises(error, match=match):
        verify.memory_many([(jnp.add, (x, x))], target="h200", donate_argnums=donate)
