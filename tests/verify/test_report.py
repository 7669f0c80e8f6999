"""gemm_report on committed HLO samples (data/) and on hand-written HLO snippets."""

import json
import pathlib

import pytest

from fp8jax.verify import assert_fp8_gemms, fp8_relayouts, gemm_report

DATA = pathlib.Path(__file__).parent / "data"
SNIPPETS = DATA / "snippets"  # hand-written HLO, for cases a compile cannot pin down
SAMPLES = sorted(p.name.removesuffix(".expect.json") for p in DATA.glob("*.expect.json"))


def test_samples_are_present():
    # Deviceless and CPU samples from generate.py; live GPU samples join them.
    assert {"h100_dense_default", "h200_dense_cublas", "h100_qdq_triton", "cpu_dense"} <= set(
        SAMPLES
    )


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_matches_its_expectation(name):
    expected = json.loads((DATA / f"{name}.expect.json").read_text())
    report = gemm_report((DATA / f"{name}.hlo.txt").read_text())
    assert len(report.fp8_gemms) == expected["fp8_gemms"]
    assert len(report.non_fp8_gemms) == expected["non_fp8_gemms"]
    if "gemms" in expected:
        got = sorted([g.backend, g.lhs_dtype, g.rhs_dtype, g.upcast_from_fp8] for g in report.gemms)
        assert got == sorted(expected["gemms"])
    if "collectives" in expected:
        got = sorted([c.kind, c.dtype] for c in report.collectives)
        assert got == sorted(expected["collectives"])
    if "attention" in expected:
        assert len(report.attention) == expected["attention"]
    if "fp8_relayouts" in expected or "untiled_transposes" in expected:
        relayouts = fp8_relayouts((DATA / f"{name}.hlo.txt").read_text())
        assert len(relayouts) == expected.get("fp8_relayouts", len(relayouts))
        got = sorted([r.dtype, list(r.shape)] for r in relayouts if r.untiled_transpose)
        assert got == sorted(expected.get("untiled_transposes", got))
    if "source_file" in expected:
        for gemm in report.gemms:
            path, _, line = gemm.source.rpartition(":")
            assert pathlib.Path(path).name == expected["source_file"], gemm
            assert int(line) > 0


def test_no_e5m2_by_e5m2_gemm_in_any_sample():
    # cuBLASLt rejects E5M2 x E5M2; fp8jax must never ask for it.
    for name in SAMPLES:
        report = gemm_report((DATA / f"{name}.hlo.txt").read_text())
        assert all({g.lhs_dtype, g.rhs_dtype} != {"f8e5m2"} for g in report.gemms), name


def test_fsdp_sample_gathers_the_kernel_in_fp8():
    report = gemm_report((DATA / "h100_dense_fsdp8_default.hlo.txt").read_text())
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert [(c.dtype, c.shape, c.bytes, c.is_async) for c in gathers] == [
        ("f8e4m3fn", (512, 1024), 512 * 1024, True)
    ]
    assert report.num_partitions == 8


def _module(computations: str, entry: str) -> str:
    return f"HloModule m, num_partitions=1\n\n{computations}\nENTRY %main {entry}\n"


TRITON_QUANTIZE_INSIDE = (SNIPPETS / "triton_quantize_inside.hlo").read_text()


def test_triton_fusion_that_quantizes_inside_is_fp8():
    (gemm,) = gemm_report(TRITON_QUANTIZE_INSIDE).gemms
    assert (gemm.backend, gemm.lhs_dtype, gemm.rhs_dtype) == ("triton-fp8", "f8e4m3fn", "f8e4m3fn")
    assert gemm.is_fp8 and not gemm.upcast_from_fp8
    assert gemm.target == "__triton_nested_gemm_fusion"
    assert gemm.op_name == "jit(f)/dot_general"


def test_triton_fusion_that_dequantizes_inside_is_an_upcast():
    # Same fusion, but the f8 parameter is widened before the dot.
    hlo = TRITON_QUANTIZE_INSIDE.replace(
        "%convert_element_type.6 = f8e4m3fn[128,4,128]{2,1,0} convert(%parameter_0)",
        "%convert_element_type.6 = bf16[128,4,128]{2,1,0} copy(%parameter_0)",
    ).replace(
        "%transpose.1 = f8e4m3fn[4,128,1024]{1,0,2} transpose(%parameter_1)",
        "%up = bf16[128,1024,4]{1,0,2} convert(%parameter_1)\n"
        "  %transpose.1 = bf16[4,128,1024]{1,0,2} transpose(%up)",
    )
    (gemm,) = gemm_report(hlo).gemms
    assert (gemm.backend, gemm.lhs_dtype, gemm.rhs_dtype) == ("triton", "bf16", "bf16")
    assert gemm.upcast_from_fp8 and not gemm.is_fp8


CUBLAS_AFTER_GATHER = (SNIPPETS / "cublas_after_gather.hlo").read_text()


def test_cublas_custom_calls_take_dtypes_from_their_operands():
    report = gemm_report(CUBLAS_AFTER_GATHER)
    summary = [
        (g.backend, g.lhs_dtype, g.rhs_dtype, g.out_dtype, g.upcast_from_fp8) for g in report.gemms
    ]
    assert summary == [
        ("cublaslt-fp8", "f8e4m3fn", "f8e4m3fn", "bf16", False),
        # The gathered FP8 kernel goes through a convert fusion and a copy: an upcast.
        ("cublaslt", "bf16", "bf16", "bf16", True),
        ("cublas", "bf16", "bf16", "f32", False),
    ]
    assert [g.name for g in report.fp8_gemms] == ["cublas-gemm.1"]
    assert len(report.non_fp8_gemms) == 2


def test_cudnn_attention_is_reported_apart_from_gemms():
    (attention,) = gemm_report(CUBLAS_AFTER_GATHER).attention
    assert (attention.backend, attention.kind, attention.target) == (
        "cudnn",
        "attention",
        "__cudnn$fmhaSoftmax",
    )
    assert attention.lhs_shape == (2, 128, 4, 64)


def test_async_collectives_count_once():
    collectives = gemm_report(CUBLAS_AFTER_GATHER).collectives
    summary = [(c.kind, c.dtype, c.shape, c.is_async) for c in collectives]
    assert summary == [
        ("all-gather", "f8e4m3fn", (1024, 2048), True),
        ("reduce-scatter", "bf16", (128, 2048), True),
        ("all-reduce", "bf16", (64, 2048), False),
    ]
    assert collectives[0].bytes == 1024 * 2048  # the gathered tensor, 1 byte per element


def test_unfused_dot_on_upcast_operands():
    hlo = _module(
        "",
        """(a: f8e5m2[16,32], b: f32[32,8]) -> f32[16,8] {
  %a = f8e5m2[16,32]{1,0} parameter(0)
  %b = f32[32,8]{1,0} parameter(1)
  %wide = f32[16,32]{1,0} convert(%a)
  ROOT %dot = f32[16,8]{1,0} dot(%wide, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}""",
    )
    (gemm,) = gemm_report(hlo).gemms
    assert (gemm.backend, gemm.lhs_dtype, gemm.upcast_from_fp8) == ("dot", "f32", True)


def test_source_is_the_innermost_frame_outside_libraries():
    report = gemm_report((DATA / "h100_dense_default.hlo.txt").read_text())
    assert len(report.gemms) == 3  # forward, dgrad, wgrad: the loop checks each
    for gemm in report.gemms:
        assert "verify_programs.py" in gemm.source
        # The stack still shows where inside fp8jax the dot was built.
        assert any("/fp8jax/ops/dense.py:" in frame for frame in gemm.stack)
        assert not gemm.op_name.startswith("jit(call)/call_exported")


def test_to_json_and_str():
    report = gemm_report((DATA / "h100_dense_fsdp8_default.hlo.txt").read_text())
    data = json.loads(report.to_json())
    assert data["fp8_gemms"] == 3 and data["non_fp8_gemms"] == 0
    assert {g["backend"] for g in data["gemms"]} == {"cublaslt-fp8", "triton-fp8"}
    assert all(g["is_fp8"] for g in data["gemms"])
    assert {"kind", "dtype", "shape", "bytes", "source"} <= set(data["collectives"][0])
    lines = str(report).splitlines()
    assert lines[0] == "GEMMs: 3 (3 FP8, 0 not FP8)"
    header, *rows = lines[1:5]
    column = header.index("fp8 ")
    assert all(row[column : column + 4] == "yes " for row in rows)
    assert any(line.startswith("Collectives: 6") for line in lines)


def test_nested_fusions_and_async_wrappers():
    report = gemm_report((SNIPPETS / "nested_and_async.hlo").read_text())
    summary = [
        (g.name, g.backend, g.lhs_dtype, g.rhs_dtype, g.upcast_from_fp8) for g in report.gemms
    ]
    assert summary == [
        # The operand is quantized by a nested fusion inside the GEMM fusion.
        ("fp8", "triton-fp8", "f8e4m3fn", "f8e4m3fn", False),
        # The dot sits two fusions deep; its parameter traces back to convert(f8).
        ("upcast", "triton", "bf16", "bf16", True),
    ]
    (scatter,) = report.collectives
    assert (scatter.kind, scatter.dtype, scatter.shape, scatter.is_async) == (
        "reduce-scatter",
        "bf16",
        (128, 2048),
        True,
    )
    assert scatter.bytes == 1024 * 2048 * 2


def test_live_cudnn_attention_sample():
    report = gemm_report((DATA / "h200_live_attention.hlo.txt").read_text())
    assert [a.target for a in report.attention] == [
        "__cudnn$fmhaSoftmax",
        "__cudnn$fmhaSoftmaxBackward",
    ]
    assert {(a.backend, a.kind, a.lhs_dtype) for a in report.attention} == {
        ("cudnn", "attention", "bf16")
    }
    assert all("verify_programs.py:" in a.source for a in report.attention)
    assert "cuDNN attention: 2" in str(report)


def test_only_the_live_sample_has_untiled_fp8_transposes():
    """The slow kernel transposes (docs/design.md) appear in live jaxlib 0.11.2 compiles only.

    The deviceless samples (jaxlib 0.10.x) write both layouts of an FP8 operand
    in one fusion, so no deviceless test can catch them; the live sample keeps
    the detector honest.
    """
    untiled = {
        name: [r.shape for r in fp8_relayouts((DATA / f"{name}.hlo.txt").read_text())
               if r.untiled_transpose]
        for name in SAMPLES
    }  # fmt: skip
    assert untiled.pop("h200_live_geglu_mlp") == [(4096, 32768), (16384, 4096)]
    assert not any(untiled.values()), untiled


def test_quantize_fusions_are_not_relayouts():
    # The GeGLU sample quantizes four bf16 arrays; only the FP8-to-FP8 kernels are relayouts.
    rows = fp8_relayouts((DATA / "h200_live_geglu_mlp.hlo.txt").read_text())
    assert [r.kind for r in rows].count("kLoop") == 2
    assert all(r.kind == "kInput" for r in rows if not r.untiled_transpose)
    assert {r.dtype for r in rows} == {"f8e4m3fn", "f8e5m2"}


def test_a_custom_call_with_one_operand_is_no_gemm_and_no_error():
    # A CPU program's custom calls (host callbacks, LAPACK, ...) can take one
    # operand; the report must skip them, not index a second operand.
    hlo = _module(
        "",
        "{\n"
        "  %p = f32[8]{0} parameter(0)\n"
        '  ROOT %cc = f32[8]{0} custom-call(%p), custom_call_target="xla_ffi_python_cpu_callback"\n'
        "}",
    )
    report = gemm_report(hlo)
    assert not report.gemms and not report.attention


def test_a_scaled_dot_is_a_gemm_and_not_fp8():
    # jax.lax.scaled_dot (block-scaled, MXFP8 style) compiles, deviceless for an
    # H100 (jax 0.10.2), to a Triton GEMM fusion around a `scaled-dot`, not a
    # `dot`. Its PTX converts the E4M3 operands to 16 bits and runs BF16 wgmma:
    # Hopper has no block-scaled FP8 MMA. The HLO is the same for a B200, whose
    # PTX runs tcgen05 mxf8f6f4, so the report cannot call it FP8 either way.
    report = gemm_report((SNIPPETS / "scaled_dot_hopper.hlo").read_text())
    summary = [(g.name, g.backend, g.lhs_dtype, g.rhs_dtype, g.is_fp8) for g in report.gemms]
    assert summary == [
        ("fusion", "triton-scaled", "f8e4m3fn", "f8e4m3fn", False),
        ("gemm", "triton-fp8", "f8e4m3fn", "f8e4m3fn", True),
    ]
    assert report.gemms[0].upcast_from_fp8
    with pytest.raises(AssertionError, match="1 of 2 GEMMs are not FP8"):
        assert_fp8_gemms(hlo=report)


def _mosaic_gemm(module_text: str) -> str:
    # A Mosaic GPU kernel's custom call as the HLO prints it (shapes shrunk): its
    # serialized module carries the kernel's inline PTX, wgmma included.
    return _module(
        "",
        "{\n"
        "  %a = f8e4m3fn[128,256]{1,0} parameter(0)\n"
        "  %b = f8e4m3fn[128,256]{1,0} parameter(1)\n"
        "  ROOT %mpmd_map.0 = bf16[128,128]{1,0} custom-call(%a, %b), "
        'custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, '
        'metadata={op_name="jit(f)/fp8jax_block_scaled_gemm/mpmd_map"}, '
        f'backend_config={{kernel_hash = "\\BCo", module = "ML\\EFR\\01{module_text}\\00"}}\n'
        "}",
    )


def test_a_mosaic_gpu_kernel_is_fp8_only_if_its_code_issues_an_fp8_wgmma():
    fp8 = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {$0,$1}"
    (gemm,) = gemm_report(_mosaic_gemm(fp8)).gemms
    assert (gemm.backend, gemm.target, gemm.fp8_mma) == (
        "pallas-fp8", "fp8jax_block_scaled_gemm", True)  # fmt: skip
    assert gemm.is_fp8 and not gemm.upcast_from_fp8
    # The same f8 operands widened in the kernel: a BF16 wgmma, a silent fallback.
    bf16 = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {$0,$1}"
    report = gemm_report(_mosaic_gemm(bf16))
    (gemm,) = report.gemms
    assert (gemm.backend, gemm.fp8_mma, gemm.is_fp8, gemm.upcast_from_fp8) == (
        "pallas", False, False, True)  # fmt: skip
    with pytest.raises(AssertionError, match="1 of 1 GEMMs are not FP8"):
        assert_fp8_gemms(hlo=report)
