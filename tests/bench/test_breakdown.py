"""bench/breakdown.py's kernel classes, on HLO the verifier tests already hold."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import breakdown  # noqa: E402

DATA = ROOT / "tests" / "verify" / "data"


def test_fp8_gemms_and_quantize_kernels_are_told_apart():
    hlo = (DATA / "h100_dense_default.hlo.txt").read_text()
    classes = breakdown.fusion_classes(hlo)
    # dense fwd+bwd with default flags: three cuBLASLt FP8 calls (each dot names
    # its FP8 algorithm, which Triton does not take).
    assert sorted(k for k, v in classes.items() if v == "gemm") == [
        "cublas_batch_gemm_2", "cublas_batch_gemm_3", "cublas_gemm_1",
    ]  # fmt: skip
    # x, the kernel and the gradient are each quantized from high precision by
    # one fp8jax.kernels.cast_transpose call; the trace names all three after the
    # one pallas_call, and no XLA fusion quantizes.
    assert sorted(k for k, v in classes.items() if v == "quantize") == ["fp8jax_cast_transpose"]
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 3
    assert "fp8-relayout" not in classes.values()


def test_sharded_quantize_fusions_and_the_fp8_transposes_are_told_apart():
    # Under FSDP the operands are quantized by XLA fusions, not the kernel
    # (sample h100_dense_fsdp8_default), and FP8 transposes are relayouts.
    classes = breakdown.fusion_classes((DATA / "h100_dense_fsdp8_default.hlo.txt").read_text())
    assert sorted(k for k, v in classes.items() if v == "quantize") == [
        "input_convert_reduce_fusion", "input_convert_transpose_fusion", "input_transpose_fusion",
        "loop_convert_fusion",
    ]  # fmt: skip
    assert sorted(k for k, v in classes.items() if v == "fp8-relayout") == [
        "transpose_1", "transpose_2_1_clone_1", "transpose_3_1",
    ]  # fmt: skip
    # Two cuBLASLt calls and the one Triton FP8 GEMM fusion the sample keeps.
    assert sorted(k for k, v in classes.items() if v == "gemm") == [
        "cublas_batch_gemm_1", "cublas_gemm_1", "gemm_fusion_dot_3",
    ]  # fmt: skip


def test_fp8_to_fp8_transposes_are_relayouts_not_quantization():
    classes = breakdown.fusion_classes((DATA / "h200_live_dense_cublas.hlo.txt").read_text())
    assert classes["wrapped_transpose"] == "fp8-relayout"
    assert classes["loop_convert_fusion"] == "quantize"
    assert sum(v == "gemm" for v in classes.values()) == 3  # cuBLASLt custom calls


def test_the_pallas_cast_transpose_kernel_is_a_quantize_pass_under_its_own_name():
    # fp8jax.kernels.cast_transpose: a Triton custom call that reads the bf16
    # gradient and writes FP8. The trace names the kernel after its
    # pallas_call (the scope above "pallas_call" in op_name), not the HLO.
    hlo = (
        "  %g = bf16[128,256]{1,0} parameter(0)\n"
        "  %s = f32[1]{0} parameter(1)\n"
        "  %pallas_call.0 = (f8e5m2[128,256]{1,0}, f8e5m2[256,128]{1,0}, f32[2,256]{1,0}) "
        'custom-call(%g, %s), custom_call_target="__gpu$xla.gpu.triton", '
        'metadata={op_name="jit(step)/transpose(jvp())/fp8jax_cast_transpose/pallas_call"}\n'
    )
    classes = breakdown.fusion_classes(hlo)
    assert classes == {"fp8jax_cast_transpose": "quantize"}
    # Several calls in one program run as NAME, NAME__1, ... (seen on the H200).
    assert breakdown.classify("fp8jax_cast_transpose__5", classes) == "quantize"
    assert breakdown.classify("fusion__5", classes) == "other"


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-gather"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce-scatter"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "all-reduce"),
        ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
        ("input_scatter_fusion", "other"),
    ],
)
def test_library_kernels_are_classified_by_name(kernel, kind):
    assert breakdown.classify(kernel, {}) == kind


@pytest.mark.parametrize("suffix", ["", "_mosaic_gpu_kernel", "__3"])
def test_fp8jax_attention_kernels_are_attention(suffix):
    """The FP8 attention's forward, dK/dV and dQ kernels (Mosaic GPU, named by the library)."""
    from fp8jax.kernels import attention, attention_backward

    names = (attention.KERNEL_NAME, attention_backward.DKV_KERNEL, attention_backward.DQ_KERNEL)
    assert len(set(names)) == 3
    for name in names:
        assert breakdown.classify(name + suffix, {}) == "attention", name + suffix
    # Neither the block-scaled GEMM (also Mosaic GPU) nor a fusion named alike.
    assert breakdown.classify("fp8jax_block_scaled_gemm_mosaic_gpu_kernel", {}) == "gemm"
    assert breakdown.classify("loop_attention_fusion", {}) == "other"


def test_each_kernel_is_described_by_its_result_and_source_op():
    described = breakdown.fusion_descriptions((DATA / "h200_live_dense_cublas.hlo.txt").read_text())
    assert described["loop_convert_fusion"] == "f8e4m3fn[256,512]{1,0} | jvp()/convert_element_type"


def test_idle_gaps_are_measured_between_overlapping_kernels_union():
    # Two streams overlap from 0 to 30 us; the GPU idles 5 us, then 200 us.
    intervals = [(0, 20_000), (10_000, 30_000), (35_000, 40_000), (240_000, 250_000)]
    assert breakdown.idle_gaps_us(intervals) == [5.0, 200.0]
    assert breakdown.idle_gaps_us(list(reversed(intervals))) == [5.0, 200.0]
    assert breakdown.idle_gaps_us([]) == []


def test_fusions_under_the_train_steps_optimizer_scope_are_the_optimizer():
    import jax
    import jax.numpy as jnp
    import optax

    from fp8jax.flax import TrainState, make_train_step
    from fp8jax.flax import linen as fnn

    model = fnn.DenseGeneral(features=8)
    x, y = jnp.ones((16, 32)), jnp.zeros((16, 8))
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 and f32
        state = TrainState.create(model.init(jax.random.key(0), x), optax.adamw(0.1))

        def loss_fn(v, b):
            return jnp.mean((model.apply(v, b[0]) - b[1]) ** 2)

        step = jax.jit(make_train_step(loss_fn, optax.adamw(0.1)))
        hlo = step.lower(state, (x, y)).compile().as_text()
    classes = breakdown.fusion_classes(hlo)
    scoped = {
        breakdown._kernel_name(m.group(1))
        for m in breakdown._INSTRUCTION.finditer(hlo)
        if "/fp8jax.optimizer/" in hlo[m.start() : hlo.find("\n", m.end())]
    }
    optimizer = {k for k, v in classes.items() if v == "optimizer"}
    # Exactly the instructions under the scope, and never the loss's or the gradients'.
    assert optimizer and optimizer == scoped
    assert "dot" not in " ".join(optimizer)
