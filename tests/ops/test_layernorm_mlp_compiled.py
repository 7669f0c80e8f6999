"""fp8jax.layernorm_mlp as compiled: what its train step writes to HBM and which kernels run.

Deviceless H100 compiles (tests/fused_cases._h100_hlos) of the op's train step; the numerics
and the errors it raises are in tests/ops/test_layernorm_mlp.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fused_cases import (
    CUBLASLT_FORM,
    RECIPES,
    _h100_hlos,
    _written_results,
)

TOKENS, HIDDEN, FFN = 1024, 256, 1024


def _results_of_mlp_step(
    activations, recipe, dtype: str, tokens=TOKENS, hidden=HIDDEN, ffn=FFN
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each ``dtype`` result written to HBM by layernorm_mlp's H100 train step."""
    hlo = _mlp_step_hlo(activations, recipe, tokens, hidden, ffn)
    return [(name, shape) for name, written, shape in _written_results(hlo) if written == dtype]


def _mlp_step_hlo(activations, recipe, tokens, hidden, ffn) -> str:
    """layernorm_mlp's train step (with bias_1), compiled deviceless for an H100."""
    return _mlp_step_hlos([(activations, recipe, tokens, hidden, ffn)])[0]


def _mlp_step_hlos(specs: list) -> list[str]:
    """:func:`_mlp_step_hlo` of each ``(activations, recipe, tokens, hidden, ffn)``."""
    hlos = _h100_hlos({("mlp", *spec): _mlp_step(*spec) for spec in specs})
    return [hlos["mlp", *spec] for spec in specs]


def _mlp_step(activations, recipe, tokens, hidden, ffn):
    """layernorm_mlp's train step (with bias_1) and its abstract arguments.

    The loss depends on y (not a plain mean), so the backward cannot start
    early and fuse with the forward, which would hide what a real model's
    step does.
    """
    n, bf16 = len(activations), jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((tokens, hidden), bf16),
        jax.ShapeDtypeStruct((hidden,), jnp.float32),
        jax.ShapeDtypeStruct((hidden,), jnp.float32),
        jax.ShapeDtypeStruct((hidden, n, ffn), bf16),
        jax.ShapeDtypeStruct((ffn, hidden), bf16),
        jax.ShapeDtypeStruct((n, ffn), bf16),
    )
    state = None
    if isinstance(recipe, fp8jax.DelayedScaling):
        state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, gamma, beta, k1, k2, b1, state):
        y = fp8jax.layernorm_mlp(
            x, gamma, beta, k1, k2, b1, activations=activations, recipe=recipe, state=state
        )
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    step = jax.grad(loss, argnums=tuple(range(7)))
    return step, (*args, state)


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize(
    "activations", [("silu", "linear"), ("gelu", "linear"), ("relu",), ("gelu",)]
)
def test_layernorm_mlp_step_writes_no_f32_copy_of_the_activation(activations, recipe):
    # The activation and its gradient reach HBM once each, in bf16
    # (quantize_operand, stored); the code before it wrote two f32 (tokens, ffn)
    # arrays here for every activation, and with jax.nn.gelu's erfc XLA kept
    # one f32 array from the forward for the backward (activations.gelu).
    n = len(activations)
    shapes = {(TOKENS, FFN), (TOKENS, n, FFN), (TOKENS, FFN, n), (TOKENS, n * FFN)}
    copies = [r for r in _results_of_mlp_step(activations, recipe, "f32") if r[1] in shapes]
    assert copies == []


@pytest.mark.deviceless
def test_gated_pre_activation_gradient_is_written_with_each_pair_side_by_side():
    # layernorm_mlp._interleave: kernel_1 (hidden, 2, ffn) is quantized as (hidden,
    # ffn, 2), so the pre-activation and, on XLA's path (current scaling),
    # its bf16 gradient are (tokens, ffn, 2). In kernel_1's own order XLA's
    # gradient fusion read each pre-activation element twice (GeGLU on the
    # H200: 1.22 against 0.87 ms). Delayed scaling's activation kernels read
    # the same layout (tests/kernels/test_activation_cast.py).
    written = _results_of_mlp_step(("silu", "linear"), fp8jax.CurrentScaling(), "bf16")
    shapes = {shape for _, shape in written}
    assert (TOKENS, FFN, 2) in shapes
    assert (TOKENS, 2, FFN) not in shapes


@pytest.mark.deviceless
@pytest.mark.parametrize("activations", [("gelu", "linear"), ("gelu",)])
def test_forward_activation_reaches_hbm_in_bf16_only_under_current_scaling(activations):
    # Current scaling needs the activation's amax before its scale, so the
    # forward writes the activation once in bf16 and the quantize pass reads
    # it back (quantize_operand, stored). Delayed scaling knows the scale first:
    # the FP8 cast fuses into the activation's kernel and no bf16 copy is
    # written (quantizing.Recomputed). GEMMs and the backward (its pinned
    # activation gradient) write bf16 (tokens, ffn) arrays too; they do not
    # count.
    from fp8jax.verify import _hlo, gemm_report

    tokens, hidden, ffn = 512, 256, 1024
    recipes = (fp8jax.CurrentScaling(), fp8jax.DelayedScaling())
    specs = [(activations, recipe, tokens, hidden, ffn) for recipe in recipes]
    hlos = dict(zip(recipes, _mlp_step_hlos(specs), strict=True))  # both in one child

    def bf16_activations(recipe):
        hlo = hlos[recipe]
        entry = _hlo.parse_module(hlo).entry.instructions
        gemms = {g.name for g in gemm_report(hlo).gemms}
        return [
            name
            for name, dtype, shape in _written_results(hlo)
            if (dtype, shape) == ("bf16", (tokens, ffn))
            and name not in gemms
            and "transpose(jvp" not in entry[name].metadata.get("op_name", "")
        ]

    assert len(bf16_activations(recipes[0])) == 1
    assert bf16_activations(recipes[1]) == []


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("activations", [("gelu", "linear"), ("gelu",)])
def test_each_operand_and_its_transposed_copy_come_from_one_kernel(activations, recipe):
    # The cast kernel (quantize_operand, transpose): on one GPU, every GEMM operand that both of
    # its GEMMs read in a different layout is cast to FP8 with its transposed
    # copy in one Pallas kernel (fp8jax.kernels.cast_transpose) that reads it
    # once: the pre-activation gradient (with bias_1's sums), the output
    # gradient (with bias_2's), kernel_2 and, ungated, kernel_1. XLA made a
    # cast kernel and an FP8 transpose of each (GeGLU's gradient on the H200:
    # 0.78 + 0.46 against 0.63 ms). Gated, kernel_1 is read interleaved, a
    # transpose XLA fuses into its own cast. All six GEMMs stay FP8. (erf's
    # gelu stays on XLA's activation path under either recipe,
    # fp8jax.activations.Activation.kernel.)
    from collections import Counter

    from fp8jax.verify import _hlo, gemm_report

    n = len(activations)
    hlo = _mlp_step_hlo(activations, recipe, TOKENS, HIDDEN, FFN)
    kernels = [
        inst
        for inst in _hlo.parse_module(hlo).entry.instructions.values()
        if "fp8jax_cast_transpose" in inst.metadata.get("op_name", "")
        and inst.custom_call_target == "__gpu$xla.gpu.triton"
    ]
    written = Counter(
        frozenset((t.dtype, t.shape) for t in inst.types if t.dtype.startswith("f8"))
        for inst in kernels
    )

    def both(dtype, rows, cols):
        return frozenset({(dtype, (rows, cols)), (dtype, (cols, rows))})

    # A gated pair's gradient is transposed branch-major, as (2, ffn, tokens),
    # for kernel_1's wgrad to write the parameter's layout (_branch_major).
    dpre_t = (TOKENS, FFN * n) if n == 1 else (n, FFN, TOKENS)
    want = Counter([frozenset({("f8e5m2", (TOKENS, FFN * n)), ("f8e5m2", dpre_t)}),
                    both("f8e5m2", TOKENS, HIDDEN), both("f8e4m3fn", FFN, HIDDEN)])  # fmt: skip
    if n == 1:
        want[both("f8e4m3fn", HIDDEN, FFN)] += 1
    assert written == want
    report = gemm_report(hlo)
    assert len(report.gemms) == 6 and len(report.fp8_gemms) == 6


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("activations", [("gelu_tanh",), ("silu", "linear")], ids="-".join)
def test_activation_and_its_gradient_are_computed_in_the_cast_kernels(activations, recipe):
    # fp8jax.kernels.activation_cast: under delayed scaling one Pallas kernel reads
    # pre and writes h in FP8; another reads pre and dh and writes pre's
    # gradient in FP8 in both layouts and h again, transposed, for kernel_2's
    # wgrad. No bf16 (tokens, ffn) array is written but the GEMMs' outputs.
    # XLA's path wrote h, the gradient in bf16, its cast and h's FP8 transpose
    # (docs/design.md#the-activation-inside-the-cast-kernels). Current scaling
    # needs each amax before its cast: XLA's path, which writes h and the
    # gradient in bf16. All six GEMMs are FP8 either way.
    from fp8jax.verify import _hlo, gemm_report

    n = len(activations)
    hlo = _mlp_step_hlo(activations, recipe, TOKENS, HIDDEN, FFN)
    report = gemm_report(hlo)
    assert len(report.gemms) == 6 and len(report.fp8_gemms) == 6
    gemms = {g.name for g in report.gemms}
    kernel_outputs = {
        inst.metadata["op_name"].rsplit("/", 2)[-2]: sorted((t.dtype, t.shape) for t in inst.types)
        for inst in _hlo.parse_module(hlo).entry.instructions.values()
        if inst.custom_call_target == "__gpu$xla.gpu.triton"
        and "activation" in inst.metadata.get("op_name", "")
    }
    activation_kernels = {
        name: [out for out in outs if out[0].startswith("f8")]
        for name, outs in kernel_outputs.items()
    }
    bf16_written = [
        name for name, dtype, shape in _written_results(hlo)
        if dtype == "bf16" and shape in ((TOKENS, FFN), (TOKENS, FFN, n)) and name not in gemms
    ]  # fmt: skip
    if isinstance(recipe, fp8jax.DelayedScaling):
        assert activation_kernels == {
            "fp8jax_cast_activation": [("f8e4m3fn", (TOKENS, FFN))],
            "fp8jax_cast_activation_gradient": sorted([
                ("f8e4m3fn", (FFN, TOKENS)),
                ("f8e5m2", (FFN * n, TOKENS) if n == 1 else (n, FFN, TOKENS)),
                ("f8e5m2", (TOKENS, FFN * n)),
            ]),
        }  # fmt: skip
        assert bf16_written == []
    else:
        # Current scaling: the forward kernel casts at a scale from a pass
        # that only reads pre (no bf16 h); the gradient, whose scale needs its
        # own amax first, goes through XLA and HBM in bf16.
        assert activation_kernels == {"fp8jax_cast_activation": [("f8e4m3fn", (TOKENS, FFN))]}
        assert len(bf16_written) == 1
    # The forward kernel writes h's tile maxima for the delayed state's
    # update; current scaling has the amax from its scale pass, and the
    # kernel skips the reduction, most of its time (activation_cast).
    forward_f32 = [out for out in kernel_outputs["fp8jax_cast_activation"] if out[0] == "f32"]
    assert len(forward_f32) == isinstance(recipe, fp8jax.DelayedScaling), forward_f32


@pytest.mark.deviceless
def test_fp8jax_pallas_0_keeps_xla_cast_and_transpose(monkeypatch):
    # The switch (fp8jax.kernels.dispatch.enabled), read when the op is traced.
    from fp8jax.verify import gemm_report

    monkeypatch.setattr(fp8jax.kernels.dispatch, "enabled", lambda: False)  # kernels off
    hlo = _mlp_step_hlo(("gelu", "linear"), fp8jax.DelayedScaling(), TOKENS, HIDDEN, FFN)
    assert "fp8jax_cast_transpose" not in hlo
    assert len(gemm_report(hlo).fp8_gemms) == 6


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("activations", [("gelu", "linear"), ("silu", "linear"), ("gelu",)])
def test_activation_amax_takes_no_pass_of_its_own(activations, recipe, request):
    if activations == ("gelu", "linear") and isinstance(recipe, fp8jax.DelayedScaling):
        request.applymarker(pytest.mark.xfail(strict=True, reason=CUBLASLT_FORM))
    # Every kernel that reads an activation-sized array also writes one: the
    # activation's amax rides along with its FP8 cast or with the backward
    # (quantizing.Recomputed, and the stored pass). A pass that only reduces
    # it (0.40 ms for GeGLU on the H200) means XLA split them apart.
    # One exception, by design: under current scaling the forward cast kernel
    # needs h's scale first, and that amax pass reads pre alone
    # (docs/design.md#the-activation-inside-the-cast-kernels).
    from fp8jax.verify import _hlo, gemm_report

    tokens, hidden, ffn = 4096, 256, 2048
    n = len(activations)
    sizes = {tokens * ffn * n, tokens * ffn}
    hlo = _mlp_step_hlo(activations, recipe, tokens, hidden, ffn)
    module, gemms = _hlo.parse_module(hlo), {g.name for g in gemm_report(hlo).gemms}
    types = {name: inst.types for name, inst in module.entry.instructions.items()}

    def large(ts):
        return any(math.prod(t.shape) in sizes for t in ts)

    reduce_only = [
        inst.name
        for inst in module.entry.instructions.values()
        if inst.opcode == "fusion"
        and inst.name not in gemms
        and not large(inst.types)
        and any(large(types.get(o, ())) for o in inst.operands)
    ]
    kernel_serves = fp8jax.activations.kernel_serves(activations)
    expected = 1 if isinstance(recipe, fp8jax.CurrentScaling) and kernel_serves else 0
    assert len(reduce_only) == expected, reduce_only


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_norm_backward_writes_no_f32_tokens_by_hidden_array(recipe):
    # dgamma and dbeta are column sums of dy * xhat and dy. With the row mean
    # recomputed inside the fusion (a row reduction), XLA cannot also
    # column-reduce there and wrote dy * xhat to HBM in f32; from the saved
    # mean, the products fuse into the column reduction (norm.normalize_backward).
    # At the benchmarks' shape: XLA's choice depends on the size, and at
    # 4096 x 1024 tokens x hidden it still writes one f32 product either way.
    tokens, hidden = 16384, 4096
    results = _results_of_mlp_step(("silu", "linear"), recipe, "f32", tokens, hidden, ffn=16384)
    assert [r for r in results if r[1] == (tokens, hidden)] == []


# Llama's MLP (RMSNorm, SwiGLU, no biases, f32 parameters) at small shapes:
# whole kernel tiles (the cast kernels' branch-major transposed copy: under
# current scaling cast_transpose's, under delayed scaling the activation
# gradient kernel's) and rows off them (XLA's quantize passes, its own FP8
# transpose for the wgrad; the same under either recipe).
LLAMA_MLP_PATHS = {"kernel-tiles": 256, "xla-path": 96}
LLAMA_MLP_CASES = [("CurrentScaling", "kernel-tiles"), ("DelayedScaling", "kernel-tiles"),
                   ("CurrentScaling", "xla-path")]  # fmt: skip
_LLAMA_HIDDEN, _LLAMA_FFN = 256, 512


def _llama_mlp_step(recipe, tokens):
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((tokens, _LLAMA_HIDDEN), jnp.bfloat16),
            jax.ShapeDtypeStruct((_LLAMA_HIDDEN,), f32),
            jax.ShapeDtypeStruct((_LLAMA_HIDDEN, 2, _LLAMA_FFN), f32),
            jax.ShapeDtypeStruct((_LLAMA_FFN, _LLAMA_HIDDEN), f32))  # fmt: skip
    state = None
    if isinstance(recipe, fp8jax.DelayedScaling):
        state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, gamma, k1, k2, state):
        y = fp8jax.layernorm_mlp(x, gamma, None, k1, k2, activations=("silu", "linear"),
                                 norm_type="rmsnorm", recipe=recipe, state=state)  # fmt: skip
        return jnp.sum(jnp.square(y.astype(f32)))

    return jax.grad(loss, argnums=tuple(range(5))), (*args, state)


@pytest.fixture(scope="module")
def llama_mlp_hlos():
    """{(recipe name, path): optimized H100 HLO} of :func:`_llama_mlp_step`, in one child."""
    recipes = {type(r).__name__: r for r in RECIPES}
    calls = {
        ("llama_mlp", name, path): _llama_mlp_step(recipes[name], LLAMA_MLP_PATHS[path])
        for name, path in LLAMA_MLP_CASES
    }
    return {key[1:]: hlo for key, hlo in _h100_hlos(calls).items()}


@pytest.mark.deviceless
@pytest.mark.parametrize(("recipe", "path"), LLAMA_MLP_CASES,
                         ids=[f"{r}-{p}" for r, p in LLAMA_MLP_CASES])  # fmt: skip
def test_gate_up_weight_gradient_is_written_in_the_parameters_layout(llama_mlp_hlos, recipe,
                                                                     path):  # fmt: skip
    # kernel_1 is (hidden, 2, ffn); the GEMMs read it interleaved, (hidden, ffn,
    # 2) (layernorm_mlp._interleave). Its wgrad GEMM reads pre's FP8 gradient
    # branch-major (the cast kernel's transposed copy, or XLA's own FP8
    # transpose of the gradient viewed as (tokens, 2, ffn)), so the GEMM's f32
    # output is the gradient as returned. Before, the GEMM wrote (hidden, ffn,
    # 2) and XLA transposed it back in f32 in a pass of its own: at llama-3b's
    # hidden 3072 and ffn 8192, 201 MB read and 201 MB written a layer step.
    # The six GEMMs stay FP8.
    from fp8jax.verify import _hlo, gemm_report

    hlo = llama_mlp_hlos[recipe, path]
    report = gemm_report(hlo)
    assert len(report.gemms) == 6 and len(report.fp8_gemms) == 6
    gemms = {g.name for g in report.gemms}
    size = _LLAMA_HIDDEN * 2 * _LLAMA_FFN
    copies = [
        (name, shape) for name, dtype, shape in _written_results(hlo)
        if dtype == "f32" and math.prod(shape) == size and name not in gemms
    ]  # fmt: skip
    assert copies == []
    # The returned gradient (the third of the step's outputs) is the GEMM's
    # result, through nothing but aliases.
    entry = _hlo.parse_module(hlo).entry
    name = entry.root.operands[2]
    while entry.instructions[name].opcode in ("bitcast", "get-tuple-element"):
        name = entry.instructions[name].operands[0]
    assert name in gemms, entry.instructions[name].opcode


def test_branch_major_wgrad_is_the_interleaved_wgrad_transposed_bit_for_bit():
    # Reading pre's gradient branch-major, kernel_1's wgrad GEMM computes the
    # same dot products over the same tokens as it did interleaved, each only
    # placed in another column: the (hidden, 2, ffn) gradient is bit for bit
    # the interleaved GEMM's output transposed (XLA's dot on the CPU; cuBLASLt
    # runs one algorithm over the same M, N, K and layouts). Against the f64
    # product of the FP8 values, f32 accumulation over `tokens` terms errs by
    # at most tokens * 2**-24 * sum |a b|.
    from fp8jax.kernels import cast_transpose as ct
    from fp8jax.ops import gemm
    from fp8jax.ops.operand import Fp8Layout, transposed_copy
    from fp8jax.quantize import Fp8Array, quantize_with_scale

    tokens, hidden, ffn = 256, 128, 256
    ka, kg = jax.random.split(jax.random.key(7))
    normed = quantize_with_scale(jax.random.normal(ka, (tokens, hidden)), fp8jax.E4M3,
                                 jnp.float32(64.0))  # fmt: skip
    g = (jax.random.normal(kg, (tokens, 2 * ffn)) * 0.01).astype(jnp.bfloat16)
    scale = jnp.float32(fp8jax.E5M2.max / 0.05)
    recipe = fp8jax.CurrentScaling()

    def wgrad(branches, shape):
        out = ct.cast_transpose(g, scale, fp8jax.E5M2, branches=branches, column_sums=False)
        g_t = transposed_copy(Fp8Array(out.q_t, 1 / scale, fp8jax.E5M2))
        return gemm.wgrad_over_tokens(Fp8Layout(normed), g_t, shape, jnp.float32, recipe), out.q

    interleaved, q = jax.jit(wgrad, static_argnums=(0, 1))(1, (hidden, ffn, 2))
    branch_major, _ = jax.jit(wgrad, static_argnums=(0, 1))(2, (hidden, 2, ffn))
    np.testing.assert_array_equal(np.swapaxes(np.asarray(interleaved), 1, 2), branch_major)
    a = np.asarray(normed.data.astype(jnp.float32), np.float64) / 64.0
    b = np.asarray(q.astype(jnp.float32), np.float64).reshape(tokens, ffn, 2) / float(scale)
    exact = np.einsum("th,tfk->hkf", a, b)
    bound = tokens * 2.0**-24 * np.einsum("th,tfk->hkf", np.abs(a), np.abs(b))
    assert np.all(np.abs(np.asarray(branch_major, np.float64) - exact) <= bound + 1e-30)
