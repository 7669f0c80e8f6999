"""A TransformerLayer train step sharded over each mesh layout matches the single-device run.

Two DelayedScaling steps (f32 compute, SGD) from the same init, on 8 CPU
devices and on one. What may differ, and by how much:

* **Scales must be identical.** The amax of a sharded tensor is a max over
  its shards, which XLA reduces across devices; a max is exact in any order.
  The kernels' and inputs' amaxes of step 1 are therefore bitwise the
  single-device ones, and every device holds the same state.
* **f32 sums are reordered.** Sharded GEMMs and reductions add partial sums
  in another order: about 2**-24 * sqrt(K) relative, K <= 256 here, so
  ~1e-7 (measured: 1e-7 on loss, updates and state).
* **FP8 rounding flips.** With identical scales an element rounds to another
  FP8 value only if that reordering noise moves it across a rounding
  midpoint: probability ~1e-5 per element, one FP8 step (<= 2**-3 relative)
  when it happens. A few flips move a normwise error by ~1e-4.

So updates and state must agree to ``sharded_layer.TOL = 1e-3`` (normwise): that allows
reordering and a few flips, while a scale taken from one shard's amax
instead of the whole tensor's changes every rounding (normwise error ~
2**-4 / sqrt(3) = 3.6e-2) and fails by a factor of 30.

**On a GPU** (``sharded_layer.GPU``, used by test_live_gpus.py) the FP8
GEMMs most likely add noise the CPU has not: Hopper's FP8 tensor cores keep about 14
mantissa bits while they accumulate (DeepSeek-V3 technical report, section
3.3.2), in an order set by the GEMM's shape, which sharding changes. This
step rounds to FP8 so often that noise of that size moves its results far
more than reordering does: on 2 H200s, every layout missed the CPU's loss
tolerance, by up to 1.1e-3. The GPU tolerances are derived from a proxy run
on the CPU (the test below): inputs perturbed by 2**-14 relative move the
loss by up to 1e-3 and a parameter's update by up to 6.2e-2 (normwise), while
a dp replica that skips the gradient all-reduce moves them by 2.6e-2 and
1.05. The tolerances (5e-3 and 0.3) sit about 4x to 5x from both; the FP8
state is compared only through the kernels' step-1 amax, which is exact.
"""

import jax
import numpy as np
import pytest
import sharded_layer as sl
from jax.sharding import AxisType

import fp8jax.sharding as fs

# FSDP alone, and FSDP with TP and Megatron SP; test_explicit_axes.py covers the ops.
EXPLICIT = ("fsdp8", "fsdp2_tp4_sp")


def _assert_same_on_every_device(fp8_state):
    for leaf in jax.tree.leaves(fp8_state):
        assert leaf.sharding.is_fully_replicated
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


@pytest.mark.parametrize("layout", sorted(sl.LAYOUTS))
def test_sharded_step_matches_single_device(layout, reference):
    sizes, config = sl.LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config)
    state, losses = sl.run(sl.model(), sl.STEPS, mesh, config)
    _assert_same_on_every_device(state.fp8_state)
    # The params keep the shardings their logical names give them.
    kernel = state.params["attention"]["qkv"]["kernel"]
    assert kernel.sharding.spec == fs.logical_spec(("embed", "heads", "qkv", "kv"), config=config)
    sl.check_against_reference(sl.to_host(state), losses, reference)


@pytest.mark.parametrize("layout", EXPLICIT)
def test_explicit_axes_match_single_device(layout, reference):
    # Explicit axes put shardings in the types; the ops give every GEMM its
    # output sharding (fp8jax.ops._partitioning), and the same step runs.
    sizes, config = sl.LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config, axis_types=AxisType.Explicit)
    state, losses = sl.run(sl.model(), sl.STEPS, mesh, config)
    _assert_same_on_every_device(state.fp8_state)
    sl.check_against_reference(sl.to_host(state), losses, reference)


def test_gpu_tolerances_admit_fp8_accumulator_noise_and_catch_a_skipped_all_reduce(reference):
    x, y = sl.batch()
    rng = np.random.default_rng(0)
    for _ in range(3):
        noisy = x * (1 + 2.0**-14 * rng.standard_normal(x.shape)).astype(np.float32)
        state, losses = sl.run(sl.model(), sl.STEPS, data=(noisy, y))
        sl.check_against_reference(sl.to_host(state), losses, reference, sl.GPU)
        # The CPU tolerances, on the other hand, are far below this noise.
        with pytest.raises(AssertionError):
            sl.check_against_reference(sl.to_host(state), losses, reference, sl.CPU)
    # What one replica of dp=2 computes if its gradients are not all-reduced.
    state, losses = sl.run(sl.model(), sl.STEPS, data=(x[:4], y[:4]))
    with pytest.raises(AssertionError):
        sl.check_against_reference(sl.to_host(state), losses, reference, sl.GPU)
