"""bench/floor.py: the element-wise floor counted from a model's shapes."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import floor  # noqa: E402

from fp8jax.models.gpt import GptConfig  # noqa: E402


def _bytes(passes, phase=None):
    return sum(p.bytes for p in passes if phase is None or p.phase == phase)


def test_a_bf16_block_moves_the_bytes_counted_by_hand():
    # T tokens, hidden H = q width, one kv head of H/4, ffn F, BF16 (2 bytes):
    # forward: 2 norms (read x and y, write x and x_n: 8TH), RoPE (read+write q,k:
    # 2 * 2 * 1.25TH), SwiGLU (read gate, up: 4TF, write h: 2TF);
    # backward: SwiGLU gradient (read dh, gate, up: 6TF, write dgate, dup: 4TF), 2 norms
    # (read 3, write 1: 8TH), RoPE backward (5TH).
    t, h, f = 8, 64, 128
    passes = floor.layer_passes(t, h, heads=4, kv_heads=1, ffn=f, precision="bf16")
    assert _bytes(passes, "forward") == 2 * 8 * t * h + 5 * t * h + 6 * t * f
    assert _bytes(passes, "backward") == 10 * t * f + 2 * 8 * t * h + 5 * t * h


def test_fp8_adds_casts_in_both_layouts_and_the_two_pass_amax_reads():
    args = (8, 64)
    kw = {"heads": 4, "kv_heads": 1, "ffn": 128}
    bf16 = _bytes(floor.layer_passes(*args, **kw, precision="bf16"))
    fused = _bytes(floor.layer_passes(*args, **kw, precision="fp8", two_pass_amax=False))
    two = floor.layer_passes(*args, **kw, precision="fp8", two_pass_amax=True)
    amax_reads = sum(p.read for p in two if p.name.endswith("amax"))
    assert all(p.write == 0 for p in two if p.name.endswith("amax"))
    assert _bytes(two) == fused + amax_reads
    assert fused > bf16 and amax_reads > 0


def test_the_step_floor_scales_with_layers_and_tokens_and_divides_by_bandwidth():
    model = GptConfig(hidden=64, layers=3, heads=4, kv_heads=1, ffn=128)
    one = floor.step_floor(model, 2, 16, precision="fp8", tb_s=1.0)
    two = floor.step_floor(model, 4, 16, precision="fp8", tb_s=1.0)
    assert two["gb"]["forward"] == pytest.approx(2 * one["gb"]["forward"])
    assert two["gb"]["optimizer"] == one["gb"]["optimizer"]  # parameters, not tokens
    per_layer = _bytes(floor.layer_passes(32, 64, 4, 1, 128, precision="fp8"), "forward")
    assert one["gb"]["forward"] == pytest.approx(3 * per_layer / 1e9)
    half = floor.step_floor(model, 2, 16, precision="fp8", tb_s=2.0)
    assert half["total_ms"] == pytest.approx(one["total_ms"] / 2)
    # AdamW: weights, both moments and the gradient read, three written, in f32.
    assert floor.optimizer_passes(10, precision="bf16")[1].bytes == 7 * 10 * 4
