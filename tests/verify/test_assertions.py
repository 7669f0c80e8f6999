"""assert_fp8_gemms: which programs pass, and failure messages that name the line."""

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from fp8jax.verify import Fp8VerificationError, assert_fp8_gemms, compile_many, gemm_report

DATA = pathlib.Path(__file__).parent / "data"
X = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
W = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)


def qdq_matmul(x, w):
    def qdq(a):
        scale = jnp.max(jnp.abs(a)).astype(jnp.float32) / jnp.float32(448.0)
        q = (a.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)
        return (q.astype(jnp.float32) * scale).astype(a.dtype)

    return jnp.dot(qdq(x), qdq(w))  # the QDQ GEMM


def bf16_matmul(x, w):
    return jnp.dot(x, w)  # the BF16 GEMM


def _line(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


QDQ_LINE = _line(qdq_matmul, "# the QDQ GEMM")
BF16_LINE = _line(bf16_matmul, "# the BF16 GEMM")


@pytest.fixture(scope="module")
def qdq_hlo():
    (text,) = compile_many([(qdq_matmul, (X, W))], target="h100")
    return text


@pytest.mark.deviceless
def test_qdq_fails_naming_this_file_and_line(qdq_hlo):
    with pytest.raises(Fp8VerificationError) as info:
        assert_fp8_gemms(hlo=qdq_hlo)
    message = str(info.value)
    assert f"test_assertions.py:{QDQ_LINE}" in message
    assert message.startswith("1 of 1 GEMMs are not FP8:")
    assert "GEMMs: 1 (0 FP8, 1 not FP8)" in message  # the table follows
    assert isinstance(info.value, AssertionError)
    assert info.value.report.non_fp8_gemms[0].lhs_dtype == "bf16"


@pytest.mark.deviceless
def test_bf16_fails_when_compiled_by_the_assertion():
    with pytest.raises(Fp8VerificationError, match=rf"test_assertions\.py:{BF16_LINE}\b"):
        assert_fp8_gemms(bf16_matmul, X, W, target="h100")


@pytest.mark.deviceless
def test_allow_excuses_gemms_by_source_or_op_name(qdq_hlo):
    report = assert_fp8_gemms(hlo=qdq_hlo, allow=rf"test_assertions\.py:{QDQ_LINE}", at_least=0)
    assert len(report.gemms) == 1
    assert_fp8_gemms(hlo=qdq_hlo, allow=[re.compile(r"dot_general$")], at_least=0)
    assert_fp8_gemms(hlo=qdq_hlo, allow=["in qdq_matmul"], at_least=0)  # a frame's function
    # Allowed, but still no FP8 GEMM: the default asks for at least one.
    with pytest.raises(Fp8VerificationError, match="found no FP8 GEMM at all"):
        assert_fp8_gemms(hlo=qdq_hlo, allow="dot_general")


def test_counts_of_fp8_gemms():
    hlo = (DATA / "h100_dense_default.hlo.txt").read_text()
    assert len(assert_fp8_gemms(hlo=hlo, expect=3).fp8_gemms) == 3
    assert_fp8_gemms(hlo=gemm_report(hlo), at_least=2)
    with pytest.raises(Fp8VerificationError, match="expected exactly 2 FP8 GEMMs, found 3"):
        assert_fp8_gemms(hlo=hlo, expect=2)
    with pytest.raises(Fp8VerificationError, match="expected at least 4 FP8 GEMMs, found 3"):
        assert_fp8_gemms(hlo=hlo, at_least=4)


def test_upcast_is_explained():
    hlo = (DATA / "h100_dequantized_kernel_triton.hlo.txt").read_text()
    with pytest.raises(Fp8VerificationError, match="dequantized from FP8"):
        assert_fp8_gemms(hlo=hlo)


HLO = (DATA / "h100_bf16_triton.hlo.txt").read_text()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((), {"hlo": HLO, "expect": 1, "at_least": 1}, ValueError, "pass expect or at_least"),
        ((), {"hlo": HLO, "expect": -1}, ValueError, "expect must be a non-negative int"),
        ((), {"hlo": HLO, "at_least": 1.5}, ValueError, "at_least must be a non-negative int"),
        ((), {}, TypeError, "pass either fn"),
        ((bf16_matmul,), {"hlo": HLO}, TypeError, "pass either fn"),
        ((), {"hlo": HLO, "target": "h100"}, TypeError, "only apply when compiling fn"),
        ((), {"hlo": HLO, "allow": "("}, ValueError, "allow pattern '\\(' is not a valid regex"),
        ((), {"hlo": HLO, "allow": [3]}, TypeError, "allow patterns must be str"),
    ],
)
def test_argument_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        assert_fp8_gemms(*args, **kwargs)
