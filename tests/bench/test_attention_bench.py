"""bench/attention.py on the CPU: its rows and the cuDNN FP8 call's wiring, never its speed."""

import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import attention as bench


def test_dry_run_times_fp8jax_against_bf16_and_measures_every_error(tmp_path):
    out = tmp_path / "attention.jsonl"
    # jax.nn's XLA attention promotes BF16 logits with f32 inside, which the
    # suite's strict promotion refuses; the script runs under JAX's default.
    with jax.numpy_dtype_promotion("standard"):
        rows = bench.main(["--dry-run", "--iters", "2", "--heat", "0", "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    (summary,) = [r for r in rows if "vs_bf16" in r]
    # No cuDNN on a CPU: XLA's BF16 attention is the named baseline.
    assert summary["baseline"] == "xla_bf16"
    assert sorted(summary["vs_bf16"]) == [
        "fp8jax_fwd", "fp8jax_fwd_bwd", "fp8jax_hadamard_fwd", "fp8jax_hadamard_fwd_bwd"
    ]  # fmt: skip
    assert all(r > 0 for r in summary["vs_bf16"].values())
    assert sorted(summary["vs_bf16_pipelined"]) == sorted(summary["vs_bf16"])
    # Every timed row's FLOP rate; no floor without a known peak (a CPU).
    assert len(summary["tflops"]) == 6 and all(r > 0 for r in summary["tflops"].values())
    assert summary["mma_floor_ms"] is None
    # Each timed row has its first compile, pipelined mean and peak memory; a
    # backward's dq, dk and dv were checked not to be zeros before it was timed.
    timed = [r for r in rows if "median_ms" in r]
    assert len(timed) == 6
    for row in timed:
        assert row["compile_s"] > 0 and row["pipelined_ms"] > 0 and "peak_memory_gib" in row
        assert row["gradient_leaves_checked"] == (3 if row["part"] == "fwd_bwd" else None), row
    skipped = [r for r in rows if "cudnn_fp8" in (r.get("impl"), r.get("errors_vs_f32"))]
    assert len(skipped) == 5 and all("NVIDIA GPU" in r["skipped"] for r in skipped)
    (mosaic,) = [r for r in rows if r.get("impl") == "mosaic_f16"]
    assert "NVIDIA GPU" in mosaic["skipped"]
    errors = [r for r in rows if r.get("errors_vs_f32", "cudnn_fp8") != "cudnn_fp8"]
    assert {(r["case"], r["causal"]) for r in errors} == {
        (case, causal) for case in bench.CASES for causal in (True, False)
    }
    for row in errors:
        values = [row[p] for p in ("out", "dq", "dk", "dv")]
        assert all(math.isfinite(e) and e > 0 for e in values), row
        # E4M3's Q and K err by up to 2**-4 an element, BF16's by 2**-9: FP8 above BF16,
        # both far below 1 (a wrong head, mask or scale errs by about 1).
        bound = 2.0**-6 if row["errors_vs_f32"] == "xla_bf16" else 0.5
        assert max(values) < bound, row


def test_tensor_rates_count_flash_attentions_products_at_each_precisions_peak(monkeypatch):
    from fp8jax.training import mfu

    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(mfu.BF16_PEAK_FLOPS, kind, 1e12)  # a made-up BF16 peak of 1 TFLOP/s
    shape = ("s", 1, 1024, 2, 1, 64, True)
    gemm = 2 * 2 * 1024 * 1024 * 64 / 2  # one T x T x d product a head, causal
    times = {(impl, part): {"median_ms": 1.0} for impl in ("fp8jax", "cudnn_bf16", "cudnn_fp8")
             for part in ("fwd", "fwd_bwd")}  # fmt: skip
    rates = bench.tensor_rates(shape, times)
    assert rates["tflops"]["fp8jax_fwd"] == pytest.approx(2 * gemm / 1e-3 / 1e12)
    assert rates["tflops"]["cudnn_bf16_fwd_bwd"] == pytest.approx(7 * gemm / 1e-3 / 1e12)
    floor = rates["mma_floor_ms"]
    # FP8 at twice BF16's peak: fp8jax's forward, and S again in its backward.
    assert floor["fp8jax_fwd"] == pytest.approx(1e3 * 2 * gemm / 2e12)
    assert floor["fp8jax_fwd_bwd"] == pytest.approx(1e3 * gemm * (3 / 2e12 + 4 / 1e12))
    assert floor["cudnn_bf16_fwd_bwd"] == pytest.approx(1e3 * 7 * gemm / 1e12)
    assert floor["cudnn_fp8_fwd_bwd"] == pytest.approx(1e3 * 7 * gemm / 2e12)


def test_cudnn_fp8_call_traces_with_every_scale_and_bf16_results(monkeypatch):
    """JAX's private cuDNN FP8 entry, traced on the CPU: the parameters it checks, the shapes."""
    module = bench._cudnn()
    monkeypatch.setattr(module, "check_cudnn_version", lambda: 91900)  # no cuDNN here
    params = bench._fp8_params(1.0, 1.0, 1.0, 1.0, dict.fromkeys(bench.SCALED, 1.0))
    assert sorted(params) == sorted(module.fp8_params_keys)
    forward, fwd_bwd = bench.cudnn_fp8(causal=True, scale=128**-0.5)
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    descales = dict.fromkeys(bench.SCALED, jax.ShapeDtypeStruct((), jnp.float32))
    out = jax.eval_shape(forward, q, kv, kv, descales)
    assert (out.shape, out.dtype) == (q.shape, jnp.bfloat16)
    results, amaxes = jax.eval_shape(fwd_bwd, q, kv, kv, q, descales)
    assert [(r.shape, r.dtype) for r in results] == [
        (q.shape, jnp.bfloat16), (q.shape, jnp.bfloat16),
        (kv.shape, jnp.bfloat16), (kv.shape, jnp.bfloat16),
    ]  # fmt: skip
    assert sorted(amaxes) == sorted(bench.SCALED)
    assert all(a.shape == () and a.dtype == jnp.float32 for a in amaxes.values())


def test_mosaic_gpu_f16_attention_traces_with_f16_results_and_gradients(monkeypatch):
    """The diagnostic row's JAX Mosaic GPU attention, traced on the CPU at llama-3b's heads."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    class Cuda13:  # no CUDA here; its causal path refuses 12.8.0 to 12.9.0 only
        @staticmethod
        def cuda_runtime_get_version():
            return 13000

    monkeypatch.setattr(attention_mgpu, "cuda_versions", Cuda13)
    f16 = jnp.float16
    q = jax.ShapeDtypeStruct((1, 512, 24, 128), f16)
    kv = jax.ShapeDtypeStruct((1, 512, 8, 128), f16)
    out = jax.eval_shape(bench.mosaic_f16(True), q, kv, kv)
    assert (out.shape, out.dtype) == (q.shape, f16)
    # Its backward is unmasked only (jax 0.10): a causal row's fwd_bwd is logged refused.
    out, dq, dk, dv = jax.eval_shape(bench.with_backward(bench.mosaic_f16(False)), q, kv, kv, q)
    assert [(x.shape, x.dtype) for x in (out, dq, dk, dv)] == [
        (q.shape, f16), (q.shape, f16), (kv.shape, f16), (kv.shape, f16)
    ]  # fmt: skip


def test_forward_builds_are_timed_beside_the_default_and_checked_against_it(tmp_path):
    """``--builds``: each build's forward row, its check against the default, its ratio."""
    out = tmp_path / "builds.jsonl"
    argv = ["--dry-run", "--skip-errors", "--builds", "p_registers,overlap", "--builds-only",
            "--parts", "fwd", "--iters", "2", "--heat", "0", "--out", str(out)]  # fmt: skip
    with jax.numpy_dtype_promotion("standard"):
        rows = bench.main(argv)
    timed = [(r["impl"], r["part"]) for r in rows if "median_ms" in r]
    assert timed == [("xla_bf16", "fwd"), ("fp8jax", "fwd"), ("fp8jax@p_registers", "fwd"),
                     ("fp8jax@overlap", "fwd")]  # fmt: skip
    checks = {r["impl"]: r["check_vs_default"] for r in rows if "check_vs_default" in r}
    assert sorted(checks) == ["fp8jax@overlap", "fp8jax@p_registers"]
    # On a CPU every build runs the XLA twin: the same output as the default.
    assert all(c["max_abs_diff"] == 0 and c["max_abs_default"] > 0 for c in checks.values())
    (summary,) = [r for r in rows if "vs_default" in r]
    assert sorted(summary["vs_default"]) == ["fp8jax@overlap_fwd", "fp8jax@p_registers_fwd"]
    with pytest.raises(SystemExit, match=r"--builds: unknown \['fast'\]"):
        bench.main(["--dry-run", "--builds", "fast", "--out", str(out)])


def test_backward_builds_are_timed_forward_and_backward_only(tmp_path):
    out = tmp_path / "builds.jsonl"
    argv = ["--dry-run", "--skip-errors", "--builds", "bwd_stages3", "--builds-only",
            "--iters", "2", "--heat", "0", "--out", str(out)]  # fmt: skip
    with jax.numpy_dtype_promotion("standard"):
        rows = bench.main(argv)
    timed = [(r["impl"], r["part"]) for r in rows if "median_ms" in r]
    assert ("fp8jax@bwd_stages3", "fwd_bwd") in timed
    assert ("fp8jax@bwd_stages3", "fwd") not in timed  # its forward is the default's
    (summary,) = [r for r in rows if "vs_default" in r]
    assert sorted(summary["vs_default"]) == ["fp8jax@bwd_stages3_fwd_bwd"]
    assert not [r for r in rows if "check_vs_default" in r]  # no forward of its own to check
