"""With default XLA flags every FP8 GEMM of fp8jax's ops and layers is cuBLASLt's, none Triton's.

A Triton FP8 GEMM fusion is autotuned against cuBLASLt on a live GPU's first
compile, minutes for one layer; fp8jax's dots name their FP8 algorithm on CUDA
so that XLA leaves them to cuBLASLt (fp8jax.ops.gemm.fp8_dot_general). XLA's GEMM
fusion decision is the same deviceless, so an H200 compile with no flags shows
it. The BF16 dots of XLA's own attention are not fp8jax's and may be Triton's.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax.flax import linen as fnn
from fp8jax.verify import compile_many, gemm_report
from fp8jax.verify.jaxpr_dots import jaxpr_dots

BF16 = jnp.bfloat16
TOKENS, HIDDEN, FFN = 128, 256, 512


def _sds(*shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _loss(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _dense(x, kernel):
    return _loss(fp8jax.dense(x, kernel))


def _layernorm_dense(x, gamma, beta, kernel):
    return _loss(fp8jax.layernorm_dense(x, gamma, beta, kernel))


def _layernorm_mlp(x, gamma, kernel_1, kernel_2):
    y = fp8jax.layernorm_mlp(
        x, gamma, None, kernel_1, kernel_2, activations=("silu", "linear"), norm_type="rmsnorm"
    )
    return _loss(y)


def _layer_program(gated: bool):
    layer = fnn.TransformerLayer(
        num_heads=4, num_kv_heads=2 if gated else 4, intermediate_dim=FFN,
        activations=("silu", "linear") if gated else ("gelu_tanh",),
        norm_type="rmsnorm" if gated else "layernorm", use_bias=not gated, causal=True,
        attention_implementation="xla", dtype=BF16, recipe=fp8jax.CurrentScaling(),
    )  # fmt: skip
    x = _sds(2, TOKENS // 2, HIDDEN)
    variables = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.zeros(x.shape, BF16)))
    # BF16 matrices, as the benchmarks' layers have them.
    params = jax.tree.map(lambda p: _sds(*p.shape) if p.ndim > 1 else p, variables["params"])

    def loss(params, x):
        return _loss(layer.apply({"params": params}, x))

    return loss, (params, x)


def _programs():
    x = _sds(TOKENS, HIDDEN)
    return {
        "dense": (_dense, (x, _sds(HIDDEN, FFN))),
        "layernorm_dense": (
            _layernorm_dense, (x, _sds(HIDDEN), _sds(HIDDEN), _sds(HIDDEN, 3 * HIDDEN)),
        ),
        "layernorm_mlp": (
            _layernorm_mlp, (x, _sds(HIDDEN), _sds(HIDDEN, 2, FFN), _sds(FFN, HIDDEN)),
        ),
        "te_layer": _layer_program(gated=False),
        "llama_layer": _layer_program(gated=True),
    }  # fmt: skip


def _value_and_grad(fn, args):
    return jax.value_and_grad(fn, argnums=tuple(range(len(args))))


@pytest.fixture(scope="module")
def reports():
    """Each program's fwd+bwd: (FP8 dots in its jaxpr, the GEMM report of its H200 compile)."""
    programs = _programs()
    calls = [(_value_and_grad(fn, args), args) for fn, args in programs.values()]
    # JAX's CUDA lowering of XLA attention's BF16 dots promotes a bf16 with an
    # f32 internally, which tests/conftest.py's strict promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        texts = compile_many(calls, target="h200")  # no xla_flags: XLA's defaults
    out = {}
    for (name, (fn, args)), text in zip(programs.items(), texts, strict=True):
        fp8_dots = sum(d.is_fp8 for d in jaxpr_dots(_value_and_grad(fn, args), *args))
        out[name] = (fp8_dots, gemm_report(text), text)
    return out


@pytest.mark.deviceless
@pytest.mark.parametrize(
    ("name", "expected_fp8_gemms"),
    [("dense", 3), ("layernorm_dense", 3), ("layernorm_mlp", 6), ("te_layer", 12),
     ("llama_layer", 12)],
)  # fmt: skip
def test_default_flags_give_cublaslt_for_every_fp8_gemm(reports, name, expected_fp8_gemms):
    fp8_dots, report, _ = reports[name]
    assert fp8_dots == expected_fp8_gemms
    backends = [g.backend for g in report.fp8_gemms]
    assert backends == ["cublaslt-fp8"] * expected_fp8_gemms, str(report)


@pytest.mark.deviceless
def test_each_gemm_keeps_the_accumulation_its_recipe_asks_for(reports):
    # CurrentScaling: forward DEFAULT (cuBLASLt fast accumulation), dgrad and wgrad
    # HIGHEST (split accumulation); XLA reads the same from the algorithm each names.
    _, _, text = reports["dense"]
    algorithms = re.findall(r'"algorithm":"(ALG_[A-Z0-9_]+)"', text)
    assert sorted(algorithms) == [
        "ALG_DOT_ANY_F8_ANY_F8_F32", "ALG_DOT_ANY_F8_ANY_F8_F32",
        "ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM",
    ]  # fmt: skip
