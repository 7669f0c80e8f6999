"""bench/layer.py on the CPU at a toy shape: every variant's row, what it holds, never its speed."""

import json
import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import harness
import layer


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")
def test_every_variant_is_timed_on_gradients_checked_not_zeros(tmp_path, monkeypatch):
    # Both presets' kinds of layer (gated: RMSNorm, SwiGLU, GQA; not: LayerNorm,
    # gelu, biases), shrunk: each row must pass the check that none of its
    # gradients (parameters, input, the FP8 states' new values) is all zeros.
    toy = {
        "te": layer.Shape(batch=2, seq=32, hidden=64, heads=4, kv_heads=4, ffn=128, gated=False),
        "llama3-8b": layer.Shape(batch=2, seq=32, hidden=64, heads=4, kv_heads=2, ffn=128,
                                 gated=True),
    }  # fmt: skip
    monkeypatch.setattr(layer, "PRESETS", toy)
    monkeypatch.setitem(harness._heat, "seconds", harness._heat["seconds"])
    for preset in toy:
        out = tmp_path / f"{preset}.json"
        argv = ["layer.py", "--preset", preset, "--attention", "xla", "--iters", "1",
                "--heat", "0", "--out", str(out)]  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        with jax.numpy_dtype_promotion("standard"):  # Flax's norms mix f32 and bf16, as run
            layer.main()
        rows = json.loads(out.read_text())["rows"]
        assert [r["name"] for r in rows] == layer.DEFAULT_VARIANTS
        for row in rows:
            assert row["gradient_leaves_checked"] > 0, row["name"]
            # A CPU compile runs FP8 dots in f32: the counts are the GPU's only.
            assert row["compile_s"] > 0 and row["gemms"] > 0 and "fp8_gemms" in row
            assert "peak_memory_gib" in row and row["pipelined_ms"] > 0
