"""bench/moe.py's BF16 baselines compute the MoE block they stand in for."""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import moe  # noqa: E402

from fp8jax.flax.linen import MoEBlock  # noqa: E402


# Each block's parameters and output (the reference the baselines must give) are made once
# for the module, each by one jitted program: eagerly, every op of the block compiled on its
# own; the baselines are jitted alike (the three tests that compare them: 2.7 s -> 1.8 s).
@functools.cache
def _block_and_params(shared):
    """``(params, x, want)``: the library's BF16 block's parameters and its output on ``x``."""
    block = MoEBlock(num_experts=4, top_k=2, ffn=32, shared_experts=shared, fp8=False)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    params = jax.jit(block.init)(jax.random.key(1), x)
    want, _ = jax.jit(functools.partial(block.apply, mutable=["intermediates"]))(params, x)
    return params, x, want


def _jitted(baseline, **options):
    return jax.jit(functools.partial(baseline, **options))


def test_with_room_for_every_slot_it_equals_the_library_block():
    # Capacity for all slots (factor = experts): nothing dropped, the same sums.
    for shared in (0, 1):
        params, x, want = _block_and_params(shared)
        got = _jitted(moe.capacity_moe, top_k=2, capacity_factor=4.0)(params, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_slots_past_the_capacity_are_dropped():
    params, x, want = _block_and_params(0)
    got = _jitted(moe.capacity_moe, top_k=2, capacity_factor=0.25)(params, x)
    # A quarter of a balanced share: most slots dropped, so most rows differ,
    # and a token whose two slots are both dropped gives zero.
    differs = np.abs(np.asarray(got - want)).max(axis=1) > 1e-4
    assert differs.mean() > 0.5
    assert (np.abs(np.asarray(got)).max(axis=1) == 0).any()
    assert jnp.isfinite(got).all()


def test_the_grouped_block_on_lax_ragged_dot_equals_the_library_block():
    # The Mosaic GPU baseline is this block with its GEMMs on JAX's Mosaic GPU
    # kernels (GPU only; checked against lax.ragged_dot there). Its router,
    # permutations, SwiGLU and shared experts are checked here, with
    # lax.ragged_dot as the GEMM: the library's BF16 block's values.
    for shared in (0, 1):
        params, x, want = _block_and_params(shared)
        got = _jitted(moe.grouped_moe, top_k=2, gemm=lax.ragged_dot)(params, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_h200_presets_train_the_layers_benchmarked_here():
    # fp8jax train --config mixtral / deepseek: the block shapes whose FP8 speed-up
    # bench/moe.py measures, at as many tokens a step (docs/train.md#moe-presets).
    from fp8jax.training.config import PRESETS

    for name, shape in moe.SHAPES.items():
        preset = PRESETS[name]
        model = preset.model
        got = (model.hidden, model.expert_ffn or model.ffn, model.experts, model.top_k,
               model.shared_experts)  # fmt: skip
        assert got == (shape.hidden, shape.ffn, shape.experts, shape.top_k, shape.shared), name
        assert preset.batch_size * preset.seq_len >= shape.tokens, name


def test_block_rows_check_their_gradients_and_give_both_ratios(monkeypatch):
    # The block part at a toy shape on the CPU: every block that runs here
    # passes the non-zero gradient check before it is timed (parameters and
    # input, router and shared experts included), and each FP8 row is set
    # against the fastest BF16 block, synchronized and pipelined.
    import harness

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    monkeypatch.setitem(moe.ITERS, "n", 2)
    shape = moe.Shape(tokens=64, hidden=32, ffn=64, experts=4, top_k=2, shared=1)
    with jax.numpy_dtype_promotion("standard"):
        rows = {r["name"]: r for r in moe.block_rows(shape)}
    ran = {name for name, r in rows.items() if "median_ms" in r}
    assert {"fp8jax", "bf16_capacity", "bf16_ragged_dot"} <= ran, rows
    for name in ran:
        # router, wi, wo, shared_wi, shared_wo and the input
        assert rows[name]["gradient_leaves_checked"] == 6, name
    assert rows["fp8jax"]["vs_fastest_bf16"] > 0 and rows["fp8jax"]["vs_fastest_bf16_pipelined"] > 0


def test_a_row_whose_gradients_are_zeros_is_reported_not_timed(monkeypatch):
    import harness

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    x = jnp.ones((8, 8), jnp.float32)
    lost = moe._row("lost", lambda x: (jnp.zeros_like(x), x), (x,), 1.0, iters=1, backward=True)
    assert "gradients are all zeros" in lost["error"] and "median_ms" not in lost
