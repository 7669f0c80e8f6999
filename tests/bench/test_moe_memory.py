"""The MoE presets' train step, compiled deviceless for an H200: FP8's peak within BF16's.

bench/moe_memory.py sizes the H200 presets' depth and batch from these compiles
at full size (a minute or more each). Here each preset runs one or two layers at
its own batch and sequence length: the same expert GEMMs, on the kernels the GPU
runs (the Mosaic GPU BF16 grouped GEMMs, the FP8 Pallas ones), so a change that
makes the FP8 step hold more than the BF16 one fails here first.
"""

import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import moe_memory  # noqa: E402

from fp8jax.training.config import PRESETS  # noqa: E402

# A short model at the preset's own batch and sequence: each MoE layer's weights and
# activations as in the preset. mixtral needs two layers: with one, the activations
# saved for the backward are too few for FP8's savings on them to outweigh its
# experts' FP8 weight copies (at 4 x 4096: 27.3 GB against BF16's 26.6). deepseek's
# dense first layer, a plain SwiGLU MLP, is left out: one layer fewer to compile. At a
# few tokens (2 x 512) the FP8 step does peak higher.
SHORT = {"mixtral": {"layers": 2}, "deepseek": {"layers": 1, "dense_layers": 0}}
H200_BYTES = 143_771 * 2**20  # what an H200 reports


@pytest.fixture(scope="module")
def peaks():
    """``{(preset, variant): Memory}`` of the short steps, in one compiler process."""
    from fp8jax import verify, xla_options

    keys = [(p, v) for p in ("mixtral", "deepseek") for v in ("bf16", "fp8jax_current")]
    calls = []
    with jax.numpy_dtype_promotion("standard"), moe_memory.as_on_h200():
        for preset, variant in keys:
            batch = PRESETS[preset].batch_size
            calls.append(moe_memory.train_step(preset, variant, batch, **SHORT[preset]))
        memories = verify.memory_many(
            calls, target="h200", xla_flags=xla_options.as_xla_flags(), donate_argnums=(0,)
        )
    return dict(zip(keys, memories, strict=True))


def test_the_bf16_step_traces_the_mosaic_gpu_grouped_gemms():
    # Without them (a CPU host's lax.ragged_dot) the deviceless BF16 step would
    # hold XLA's dense expansion over all experts, which the GPU never runs.
    with jax.numpy_dtype_promotion("standard"), moe_memory.as_on_h200():
        step, args = moe_memory.train_step("mixtral", "bf16", 1, seq_len=512, layers=1)
        jaxpr = str(jax.jit(step).trace(*args).jaxpr)
    assert "wgmma" in jaxpr


@pytest.mark.deviceless
@pytest.mark.parametrize("preset", ["mixtral", "deepseek"])
def test_the_fp8_step_peaks_at_most_at_the_bf16_steps_peak(preset, peaks):
    bf16, fp8 = peaks[preset, "bf16"], peaks[preset, "fp8jax_current"]
    assert 0 < fp8.peak <= bf16.peak < H200_BYTES, (fp8, bf16)
    # The donated state (f32 params and AdamW's two moments) is reused, not doubled.
    assert bf16.alias > 0 and bf16.argument >= bf16.alias
