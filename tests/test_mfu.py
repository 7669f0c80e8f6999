"""fp8jax.training.mfu: the model FLOPs count against a hand count, and no MFU without a peak."""

import types

import pytest

from fp8jax.models import GptConfig
from fp8jax.training import mfu, progress, summary


def test_flops_per_token_matches_a_hand_count():
    model = GptConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    # head_dim 16. Per layer, GEMM weights: QKV 64 x (4 + 2 x 2) x 16 = 8192,
    # output 4 x 16 x 64 = 4096, SwiGLU 3 x 64 x 128 = 24576: 36864; two
    # layers 73728, plus the LM head 64 x 256 = 16384: 90112 weights, 6 FLOPs
    # each per token (forward 2, backward 4): 540672.
    # Attention at seq 16: a query sees (16 + 1) / 2 = 8.5 keys on average;
    # scores and weighted values are 2 x 8.5 x 4 heads x 16 each = 1088, 2176
    # forward, 6528 with the backward, 13056 over two layers.
    assert mfu.flops_per_token(model, 16) == 540672 + 13056


def test_mfu_is_tokens_times_flops_over_the_peak_and_none_without_one():
    assert mfu.mfu(1000.0, 6e9, 989e12) == pytest.approx(6e12 / 989e12)
    assert mfu.mfu(1000.0, 6e9, None) is None


def device(kind):
    return types.SimpleNamespace(device_kind=kind)


def test_the_peak_is_the_h200_dense_bf16_datasheet_value_per_device():
    peak, kind = mfu.peak_flops([device("NVIDIA H200")] * 2)
    assert (peak, kind) == (2 * 989e12, "NVIDIA H200")
    text = mfu.describe(peak, kind, 2)
    assert text == "MFU against the 989 TFLOP/s dense BF16 peak of 2 x NVIDIA H200"
    text = mfu.describe(peak, kind, 2, 0.4213)
    assert text == "MFU 42.1% against the 989 TFLOP/s dense BF16 peak of 2 x NVIDIA H200"


def test_the_bar_and_the_metrics_lines_show_the_mfu_where_there_is_one():
    record = {"step": 10, "loss": 2.0, "tokens_per_s": 1e5, "step_time_s": 0.5, "mfu": 0.4213}
    assert progress.postfix(record)["MFU"] == "42.1%"
    assert summary.metrics_line(record).endswith(", 500 ms/step, MFU 42.1%")
    del record["mfu"]
    assert "MFU" not in progress.postfix(record) and "MFU" not in summary.metrics_line(record)


@pytest.mark.parametrize("kind", ["cpu", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB"])
def test_no_peak_is_guessed_for_other_devices(kind):
    peak, _ = mfu.peak_flops([device(kind)])
    assert peak is None
    assert mfu.describe(peak, kind, 1) == f"MFU n/a: no known BF16 peak for {kind!r}"
