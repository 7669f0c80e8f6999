"""MoEBlock's capacity_factor across devices: the single-device rule, and a bounded buffer.

A capacity keeps each expert's first ``ceil(capacity_factor * tokens *
top_k / experts)`` slots in token order (tests/ops/test_moe.py checks that
rule against a reference). Under expert parallelism each device learns its
place in every expert's order from the other devices' counts, so the kept
slots, hence the values and gradients, are one device's; the receive buffer
then holds ``experts / ep * capacity`` rows, ``capacity_factor`` times the
balanced share, where the dropless one holds the worst case.
"""

import re

import jax
import numpy as np
import pytest
from test_expert_parallel import BACKWARD, EP, FORWARD, _assert_within, _block

import fp8jax.sharding as fs
from fp8jax.flax import _expert_parallel

E, K, H, TOKENS = 16, 2, 64, 96  # test_expert_parallel's skewed inputs
CAPACITY_FACTOR = 1.25


@pytest.fixture(scope="module")
def skewed():
    from test_expert_parallel import _skewed_inputs

    return _skewed_inputs()


@pytest.mark.parametrize(
    "sizes,config",
    [({"ep": 8}, EP), ({"fsdp": 8}, fs.ShardingConfig())],
    ids=["ep8", "fsdp8_local"],
)
def test_capacity_gives_the_single_device_values_and_drops(skewed, sizes, config):
    x, params = skewed
    block = _block(capacity_factor=CAPACITY_FACTOR)

    def run():
        def loss(params, x):
            y, state = block.apply({"params": params}, x, mutable=["intermediates", "moe_stats"])
            weights = np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape)
            return (y * weights).sum(), (y, state["moe_stats"]["dropped"][0])

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (_, (want_y, want_dropped)), want_grads = run()
    with fs.use_mesh(fs.make_mesh(**sizes, config=config), config):
        (_, (y, dropped)), grads = run()
    # The two hot experts overflow (most slots go there): the same share dropped on both.
    assert 0 < float(want_dropped) < 1
    np.testing.assert_allclose(float(dropped), float(want_dropped), rtol=1e-6)
    _assert_within(y, want_y, FORWARD, "y")
    _assert_within(grads[1], want_grads[1], BACKWARD, "dx")
    for name in ("router", "wi", "wo"):
        _assert_within(grads[0][name], want_grads[0][name], BACKWARD, f"d{name}")
    # Dropping changed the values: without a capacity they differ.
    dropless = jax.jit(_block().apply)({"params": params}, x)
    assert np.abs(np.asarray(dropless) - np.asarray(want_y)).max() > 0.1 * np.abs(want_y).max()


def _received_rows(capacity_factor, x, params) -> set[int]:
    """The rows of every ragged_all_to_all's output in the ep=8 block's jaxpr."""
    block = _block(capacity_factor=capacity_factor)
    with fs.use_mesh(fs.make_mesh(ep=8, config=EP), EP):
        jaxpr = str(jax.make_jaxpr(lambda p, x: block.apply({"params": p}, x))(params, x))
    return {int(r) for r in re.findall(rf"f32\[(\d+),{H}\] = ragged_all_to_all", jaxpr)}


def test_the_receive_buffer_is_the_capacity_factor_times_the_balanced_share(skewed):
    x, params = skewed
    balanced = TOKENS * K // 8  # the rows each device receives when routing is even
    own = TOKENS // 8 * K  # each device's own slots, which come back to it
    bounded = _received_rows(CAPACITY_FACTOR, x, params)
    dropless = _received_rows(None, x, params)
    # There and back: the receive buffer, then each device's own slots. The
    # buffer is exactly E / ep experts' capacity, ceil(1.25 * 96 * 2 / 16) = 15
    # rows each: 30 = 1.25 x 24, neither smaller (rows dropped that one device
    # keeps) nor the dropless worst case.
    assert bounded == {CAPACITY_FACTOR * balanced, own}, bounded
    assert max(dropless) == _expert_parallel.receive_rows(TOKENS // 8, 8, E // 8, K, None)
    assert dropless == {8 * balanced, own}, dropless  # the worst case: every slot to one device
