"""bench/harness.py's timing loops, on the CPU: what they call, never how fast."""

import pathlib
import sys

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import harness


def test_both_timing_loops_thread_the_state_through_every_call():
    def step(state, increment):
        return state + increment, state

    args = [jnp.zeros(()), jnp.ones(())]
    timing = harness._timed(step, args, warmup=2, iters=5, carry=True)
    # 2 warm-up calls, 5 synchronized ones and 5 pipelined ones, each fed the
    # state the call before it returned.
    assert float(args[0]) == 12
    assert timing["iters"] == 5
    assert timing["pipelined_ms"] > 0
    assert timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"]
