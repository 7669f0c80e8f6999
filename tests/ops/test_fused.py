"""layernorm_dense and layernorm_mlp: f32 references with derived budgets, jaxpr, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import norm_backward, norm_forward
from fp8jax.verify.jaxpr_dots import jaxpr_dots
from numerics import (
    OUTPUT_UNIT_ROUNDOFF,
    assert_within,
    current_scale,
    fake_quant_einsum,
    gemm_error_bound,
    relative_error,
)

NORMS = [("layernorm", False), ("rmsnorm", False), ("layernorm", True), ("rmsnorm", True)]
EPS = 1e-6


def ref_norm(x, gamma, beta, norm_type, zero_centered):
    """Textbook norm in plain jnp f32, differentiated by JAX itself."""
    x = x.astype(jnp.float32)
    g = gamma.astype(jnp.float32) + (1.0 if zero_centered else 0.0)
    if norm_type == "layernorm":
        x = x - jnp.mean(x, -1, keepdims=True)
    y = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * g[None, :]
    return y + beta.astype(jnp.float32)[None, :] if beta is not None else y


RECIPES = [fp8jax.CurrentScaling(), fp8jax.DelayedScaling()]
# The deviceless compiles below use XLA's default flags, under which fp8jax's FP8
# GEMMs are cuBLASLt calls (fp8jax.ops.gemm.fp8_dot_general), as they were under
# fp8jax.compiler_options() before. cuBLASLt reads FP8 operands with the contracted
# axis minor, so on XLA's path (no cast kernel) XLA writes a transposed FP8 copy, and
# these fusions then split apart as they did with the options; the one-pass forms
# were those of a Triton GEMM fusion, which reads any layout.
CUBLASLT_FORM = "cuBLASLt's operand layout splits XLA's fusion (also with compiler_options)"

# Deviceless H100 compiles, by a key that names the program: several tests read the same
# program's HLO (the same op, recipe and shapes), which is compiled once. Tests only read it.
_H100_HLO: dict = {}


def _h100_hlos(calls: dict) -> dict:
    """``{key: optimized HLO text}`` of ``{key: (fn, args)}``, compiled for an H100.

    A key must name its program; the kernel switch (fp8jax.kernels.dispatch.enabled,
    which the ops read when traced) is added to it. The programs not compiled
    before compile together, in one child process (``verify.compile_many``).
    """
    from fp8jax.verify import compile_many

    kernels = fp8jax.kernels.dispatch.enabled()
    missing = {key: call for key, call in calls.items() if (key, kernels) not in _H100_HLO}
    if missing:
        hlos = compile_many(list(missing.values()), target="h100")
        for key, hlo in zip(missing, hlos, strict=True):
            _H100_HLO[key, kernels] = hlo
    return {key: _H100_HLO[key, kernels] for key in calls}


def _params(norm_type, hidden, dtype, seed=0):
    kg, kb, kx = jax.random.split(jax.random.key(seed), 3)
    gamma = (1.0 + 0.3 * jax.random.normal(kg, (hidden,))).astype(dtype)
    beta = (
        (0.2 * jax.random.normal(kb, (hidden,))).astype(dtype) if norm_type == "layernorm" else None
    )
    x = (2.0 * jax.random.normal(kx, (48, hidden)) + 0.5).astype(dtype)
    return x, gamma, beta


def _ln_backward_error(bound_dn, x, gamma, norm_type, zero_centered):
    """Bound on |dx error| when dn is off by at most ``bound_dn`` elementwise.

    The norm's backward is linear in dn:
    dx = rstd * (g*dn - mean(g*dn) - xhat * mean(g*dn*xhat)) (no mean term for
    rmsnorm), so |error| <= rstd * (|g|B + mean(|g|B) + |xhat| mean(|g|B|xhat|)).
    """
    x = np.asarray(x, np.float64)
    g = np.abs(np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0))
    centred = x - x.mean(-1, keepdims=True) if norm_type == "layernorm" else x
    rstd = 1 / np.sqrt((centred**2).mean(-1, keepdims=True) + EPS)
    xhat = np.abs(centred * rstd)
    gb = g * bound_dn
    terms = gb + xhat * (gb * xhat).mean(-1, keepdims=True)
    if norm_type == "layernorm":
        terms = terms + gb.mean(-1, keepdims=True)
    return rstd * terms


@pytest.mark.parametrize(("norm_type", "zero_centered"), NORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layernorm_dense_matches_f32_within_fp8_bound(norm_type, zero_centered, dtype):
    hidden, feat = 64, 40
    x, gamma, beta = _params(norm_type, hidden, dtype)
    kernel = (0.1 * jax.random.normal(jax.random.key(9), (hidden, feat))).astype(dtype)
    g = jax.random.normal(jax.random.key(10), (48, feat)).astype(dtype)
    kw = dict(norm_type=norm_type, zero_centered_gamma=zero_centered, epsilon=EPS)

    def loss(x, gamma, beta, kernel):
        y = fp8jax.layernorm_dense(x, gamma, beta, kernel, **kw)
        return jnp.sum((y * g).astype(jnp.float32))

    y = fp8jax.layernorm_dense(x, gamma, beta, kernel, **kw)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3) if beta is not None else (0, 1, 3))(
        x, gamma, beta, kernel
    )
    dx, dgamma, dkernel = grads[0], grads[1], grads[-1]

    # References: exact normalized input n (f32 jnp, autodiff for the norm),
    # exact GEMMs in f64.
    n, norm_vjp = jax.vjp(lambda x, gm: ref_norm(x, gm, beta, norm_type, zero_centered), x, gamma)
    ns, ks, gs = (np.asarray(v, np.float64) for v in (n, kernel, g))
    dn_exact = gs @ ks.T
    ref_dx, ref_dgamma = norm_vjp(jnp.asarray(dn_exact, jnp.float32))
    u_out = OUTPUT_UNIT_ROUNDOFF[jnp.dtype(dtype)]
    # The f32 norm arithmetic (a handful of roundings, 2**-24 each) is allowed
    # 2**-18 of the magnitudes it feeds.
    f32_slack = 2.0**-18

    sn, sk, sg = current_scale(ns, "e4m3"), current_scale(ks, "e4m3"), current_scale(gs, "e5m2")
    y_bound = gemm_error_bound(ns, ks, "e4m3", "e4m3", sn, sk, "th,hf->tf", dtype)
    y_bound += f32_slack * np.abs(ns) @ np.abs(ks)
    assert_within(y, ns @ ks, y_bound, "forward")

    dn_bound = gemm_error_bound(gs, ks, "e5m2", "e4m3", sg, sk, "tf,hf->th", dtype)
    dx_bound = _ln_backward_error(dn_bound, x, gamma, norm_type, zero_centered)
    dx_bound += u_out * np.abs(np.asarray(ref_dx, np.float64)) * 2 + f32_slack * (
        _ln_backward_error(np.abs(dn_exact), x, gamma, norm_type, zero_centered)
    )
    assert_within(dx, ref_dx, dx_bound, "dx")

    xhat = np.abs(np.asarray(ref_norm(x, jnp.ones_like(gamma), None, norm_type, False)))
    dgamma_bound = (
        (dn_bound * xhat).sum(0) * (1 + f32_slack)
        + u_out * np.abs(np.asarray(ref_dgamma, np.float64))
        + f32_slack * (np.abs(dn_exact) * xhat).sum(0)
    )
    assert_within(dgamma, ref_dgamma, dgamma_bound, "dgamma")

    dk_bound = gemm_error_bound(ns, gs, "e4m3", "e5m2", sn, sg, "th,tf->hf", dtype)
    dk_bound += f32_slack * np.abs(ns).T @ np.abs(gs)
    assert_within(dkernel, ns.T @ gs, dk_bound, "dkernel")


def test_layernorm_dense_returns_normalized_and_its_gradient_flows():
    x, gamma, beta = _params("layernorm", 32, jnp.float32)
    kernel = 0.1 * jax.random.normal(jax.random.key(3), (32, 3, 8))
    y, normalized = fp8jax.layernorm_dense(x, gamma, beta, kernel, return_normalized=True)
    assert y.shape == (48, 3, 8)
    np.testing.assert_allclose(
        normalized, ref_norm(x, gamma, beta, "layernorm", False), rtol=1e-5, atol=1e-5
    )

    # Only the normalized output is used: the gradient is the plain norm's.
    def through_normalized(x):
        return jnp.sum(fp8jax.layernorm_dense(x, gamma, beta, kernel, return_normalized=True)[1])

    want = jax.grad(lambda x: jnp.sum(ref_norm(x, gamma, beta, "layernorm", False)))(x)
    np.testing.assert_allclose(jax.grad(through_normalized)(x), want, rtol=1e-4, atol=1e-4)


def _residual_step(op, passed: bool, recipe):
    """The gradients of ``x + op(x)`` squared; ``passed``: the residual from the op itself."""
    _, gamma, beta = _params("layernorm", 128, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(4), 3)
    # 128 token rows: whole programs of the norm's backward kernel.
    x = (2.0 * jax.random.normal(keys[2], (2, 64, 128)) + 0.5).astype(jnp.bfloat16)
    k1 = 0.05 * jax.random.normal(keys[0], (128, 2, 256))
    k2 = 0.05 * jax.random.normal(keys[1], (256, 128))
    delayed = isinstance(recipe, fp8jax.DelayedScaling)
    if op == "layernorm_dense":
        state = fp8jax.init_state(recipe) if delayed else None

        def block(x, gamma, beta, k1, k2, **kw):
            kernel = k2[: x.shape[-1]]  # (hidden, hidden)
            return fp8jax.layernorm_dense(x, gamma, beta, kernel, recipe=recipe, state=state, **kw)
    else:
        state = fp8jax.init_state(recipe, fp8jax.MlpScaleState) if delayed else None

        def block(x, gamma, beta, k1, k2, **kw):
            return fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=("silu", "linear"),
                                        recipe=recipe, state=state, **kw)  # fmt: skip

    def loss(x, gamma, beta, k1, k2):
        if passed:
            y, residual = block(x, gamma, beta, k1, k2, return_residual=True)
        else:
            y, residual = block(x, gamma, beta, k1, k2), x
        return jnp.sum(jnp.square((residual + y).astype(jnp.float32)))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (x, gamma, beta, k1, k2), block


@pytest.mark.parametrize("op", ["layernorm_dense", "layernorm_mlp"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_residual_passed_through_the_op_changes_no_gradient(op, recipe):
    # return_residual moves the residual's gradient into the op's backward,
    # where it is added to the norm's in f32 and rounded once. The other
    # gradients are computed from the same FP8 operands, so they must agree
    # exactly; x's may differ by rounding only. Each bf16 rounding is within
    # 2**-8 of what it rounds; the reference rounds the norm's dx, then the
    # sum, the op only the sum: within 2**-8 * (|dx_norm| + 2 |sum|).
    step_passed, args, block = _residual_step(op, True, recipe)
    step_added, _, _ = _residual_step(op, False, recipe)
    passed, added = step_passed(*args), step_added(*args)
    for a, b in zip(passed[1:], added[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    x = args[0]
    y, residual = block(*args, return_residual=True)
    np.testing.assert_array_equal(residual, x)
    # The residual's own gradient, as the loss gives it: 2 (x + y) in bf16.
    g_residual = np.asarray((2 * (x + y).astype(jnp.float32)).astype(jnp.bfloat16), np.float64)
    dx_passed, dx_added = (np.asarray(d, np.float64) for d in (passed[0], added[0]))
    dx_norm = dx_added - g_residual
    bound = 2**-8 * (np.abs(dx_norm) + 2 * np.abs(dx_added)) + 1e-6
    assert np.all(np.abs(dx_passed - dx_added) <= bound)


def test_residual_and_normalized_outputs_are_alternatives():
    x, gamma, beta = _params("layernorm", 32, jnp.bfloat16)
    kernel = jnp.ones((32, 8))
    with pytest.raises(ValueError, match="return_normalized and return_residual"):
        fp8jax.layernorm_dense(x, gamma, beta, kernel, return_normalized=True,
                               return_residual=True)  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["layernorm_dense", "layernorm_mlp"])
def test_residual_passed_through_the_op_saves_the_sum(op):
    # On one GPU the norm's backward kernel adds the residual's gradient:
    # compared with the residual added outside the op, the step writes one
    # x-sized bf16 array less (XLA's sum), and the kernel reads it as a third
    # x-sized operand.
    steps = {p: _residual_step(op, p, fp8jax.DelayedScaling()) for p in (True, False)}
    hlos = _h100_hlos({("residual", op, p): (step, args) for p, (step, args, _) in steps.items()})

    def x_sized_bf16_writes(passed):
        x = steps[passed][1][0]
        results = _written_results(hlos["residual", op, passed])
        return sum(1 for _, dtype, shape in results
                   if dtype == "bf16" and math.prod(shape) == x.size)  # fmt: skip

    assert x_sized_bf16_writes(True) == x_sized_bf16_writes(False) - 1


def _written_results(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each result a compiled GPU program writes to HBM.

    Every top-level instruction's result goes to HBM, except parameters,
    tuple plumbing, bitcasts and barriers, which alias buffers they are given.
    """
    from fp8jax.verify import _hlo

    aliases = ("parameter", "get-tuple-element", "bitcast", "tuple", "opt-barrier")
    return [
        (inst.name, t.dtype, t.shape)
        for inst in _hlo.parse_module(hlo).entry.instructions.values()
        if inst.opcode not in aliases
        for t in inst.types
    ]


@pytest.mark.deviceless
def test_layernorm_dense_forward_writes_no_high_precision_normalized_copy():
    # Besides x itself, no result may be a bf16/f32 tensor of x's shape: the
    # normalized activations must leave the norm's fusion only as f8.
    from fp8jax.verify import compile_for

    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    gamma = beta = jax.ShapeDtypeStruct((512,), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    hlo = compile_for(
        lambda x, g, b, k: fp8jax.layernorm_dense(x, g, b, k),
        x,
        gamma,
        beta,
        kernel,
        target="h100",
    )
    results = [r for r in _written_results(hlo) if r[2] == (256, 512)]
    assert [r for r in results if r[1] in ("bf16", "f32")] == []
    assert any(r[1] == "f8e4m3fn" for r in results)


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

    want = Counter([both("f8e5m2", TOKENS, FFN * n), both("f8e5m2", TOKENS, HIDDEN),
                    both("f8e4m3fn", FFN, HIDDEN)])  # fmt: skip
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
                ("f8e4m3fn", (FFN, TOKENS)), ("f8e5m2", (FFN * n, TOKENS)),
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
    # (docs/design.md#the-activation-cast-under-current-scaling).
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


def _biased_step_outputs(op, recipe) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each kernel's results in the H100 train step of ``op`` with a (3, 128) bias."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    x = jax.ShapeDtypeStruct((2, 512, 256), bf16)
    norm = jax.ShapeDtypeStruct((256,), f32)
    kernel = jax.ShapeDtypeStruct((256, 3, 128), bf16)
    bias = jax.ShapeDtypeStruct((3, 128), f32)

    def loss(x, gamma, beta, kernel, bias, state):
        if op == "dense":
            y = fp8jax.dense(x, kernel, bias, recipe=recipe, state=state)
        else:
            y = fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state)
        return jnp.sum(jnp.square(y.astype(f32)))

    step = jax.grad(loss, argnums=tuple(range(6)))
    hlos = _h100_hlos({("biased", op, recipe): (step, (x, norm, norm, kernel, bias, state))})
    outputs = {}
    for name, dtype, shape in _written_results(hlos["biased", op, recipe]):
        outputs.setdefault(name, []).append((dtype, shape))
    return outputs


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["dense", "layernorm_dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_output_gradient_and_bias_gradient_share_one_pass(op, recipe, monkeypatch, request):
    if isinstance(recipe, fp8jax.DelayedScaling):
        request.applymarker(pytest.mark.xfail(strict=True, reason=CUBLASLT_FORM))
    # quantize_operand with column_sums, XLA's path (where the cast kernel
    # does not run, here switched off): the amax of
    # the output gradient is taken as column maxima, like the bias gradient's
    # column sums, so one kernel computes both; under delayed scaling the FP8
    # gradient comes out of the same kernel. With row maxima XLA needs a
    # kernel for each reduction (the transformer layer's QKV gradient: 0.31 +
    # 0.41 ms on the H200, then one 0.59 ms kernel).
    monkeypatch.setattr(fp8jax.kernels.dispatch, "enabled", lambda: False)  # kernels off

    def column_results(outs):
        return [d for d, shape in outs if d == "f32" and shape[-2:] == (3, 128)]

    outputs = _biased_step_outputs(op, recipe)
    both = [name for name, outs in outputs.items() if len(column_results(outs)) == 2]
    assert len(both) == 1
    fp8_gradient = [n for n, outs in outputs.items() if any(d == "f8e5m2" for d, _ in outs)]
    if isinstance(recipe, fp8jax.DelayedScaling):
        assert fp8_gradient == both
    else:
        assert fp8_gradient and both[0] not in fp8_gradient


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["dense", "layernorm_dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_dense_operands_come_cast_and_transposed_from_one_kernel(op, recipe):
    # quantize_operand with transpose (kernels, dense's own input and the
    # output gradients): on one GPU the kernel's FP8 copies for the
    # forward GEMM (transposed) and the dgrad GEMM, the output gradient's for
    # the dgrad and the wgrad GEMM (transposed) with the bias's column sums,
    # and dense's input's for the forward and the wgrad GEMM (transposed),
    # each come out of one Pallas kernel. Its f32 results are one maximum per
    # 64 x 128 tile and, for the output gradient alone (the only one with a
    # bias to sum for), column sums per 64-row tile. layernorm_dense's
    # normalized input comes, under delayed scaling, from the norm's forward
    # kernel (fp8jax.ops.norm_forward), with the row statistics and one
    # maximum per program's rows, under both recipes (current scaling's
    # maxima-only first pass writes no FP8).
    outputs = _biased_step_outputs(op, recipe)
    # The norm's backward kernel (fp8jax.ops.norm_backward) writes no FP8.
    kernels = {
        frozenset(outs)
        for name, outs in outputs.items()
        if name.startswith("pallas_call") and any(dtype.startswith("f8") for dtype, _ in outs)
    }

    def cast_transposed(dtype, rows, cols, column_sums=False):
        sums = {("f32", (rows // 64, cols))} if column_sums else set()
        return frozenset({
            (dtype, (rows, cols)), (dtype, (cols, rows)), ("f32", (rows // 64, cols // 128)),
            *sums,
        })  # fmt: skip

    tokens, hidden, columns = 2 * 512, 256, 3 * 128
    want = {cast_transposed("f8e4m3fn", hidden, columns),
            cast_transposed("f8e5m2", tokens, columns, column_sums=True)}  # fmt: skip
    if op == "dense":
        want.add(cast_transposed("f8e4m3fn", tokens, hidden))
    else:
        statistics = ("f32", (tokens, 1))  # the mean and rstd
        want.add(frozenset({("f8e4m3fn", (tokens, hidden)), statistics,
                            ("f32", (tokens // norm_forward.ROWS_PER_PROGRAM, 1))}))  # fmt: skip
    assert kernels == want


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_norm_backward_is_one_kernel(recipe):
    # fp8jax.ops.norm_backward on one GPU: x's gradient, and per-program
    # (64-row) column sums for gamma and beta, from one Pallas kernel. No XLA
    # fusion writes an f32 array of x's size (the norm's products stay in
    # registers) or x's gradient. Under current scaling the norm forward's
    # maxima-only pass (fp8jax.ops.norm_forward) is the one other kernel
    # without FP8 outputs: one maximum per program's rows.
    outputs = _biased_step_outputs("layernorm_dense", recipe)
    tokens, hidden = 2 * 512, 256
    norm_kernels = [
        outs for name, outs in outputs.items()
        if name.startswith("pallas_call") and not any(d.startswith("f8") for d, _ in outs)
    ]  # fmt: skip
    sums = ("f32", (tokens // norm_backward.ROWS_PER_PROGRAM, hidden))
    want = [[("bf16", (tokens, hidden)), sums, sums]]
    if isinstance(recipe, fp8jax.CurrentScaling):
        want.append([("f32", (tokens // norm_forward.ROWS_PER_PROGRAM, 1))])
    assert sorted(norm_kernels) == sorted(want)
    f32_of_x_size = [
        name for name, outs in outputs.items()
        if any(d == "f32" and math.prod(shape) == tokens * hidden for d, shape in outs)
    ]  # fmt: skip
    assert f32_of_x_size == []


def _qkv_loss(split: bool, recipe, state, op="layernorm_dense"):
    """A fused QKV (2 key/value heads, 2 query heads each) and a loss on q, k, v apart.

    ``op``: ``"layernorm_dense"``, or ``"dense"`` (the norm's parameters unused).
    """
    f32 = jnp.float32

    def project(x, gamma, beta, kernel, bias, **kw):
        if op == "dense":
            return fp8jax.dense(x, kernel, bias, recipe=recipe, state=state, **kw)
        return fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state,
                                      **kw)  # fmt: skip

    def loss(x, gamma, beta, kernel, bias):
        if split:
            q, k, v = project(x, gamma, beta, kernel, bias, split=(2, 1, 1))
        else:
            y = project(x, gamma, beta, kernel, bias)
            q, k, v = y[..., :2, :], y[..., 2:3, :], y[..., 3:, :]
        q, k, v = (t.astype(f32) for t in (q, k, v))
        return jnp.sum(q * q) + jnp.sum(3 * k) + jnp.sum(v * v * v)

    return loss


def _qkv_args(head_dim, hidden=256):
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (2, 128, hidden), jnp.bfloat16)
    kernel = jax.random.normal(keys[1], (hidden, 2, 4, head_dim)) * hidden**-0.5
    bias = 0.1 * jax.random.normal(keys[2], (2, 4, head_dim))
    return x, jnp.ones(hidden), jnp.zeros(hidden), kernel, bias


@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_split_output_and_its_gradients_are_the_whole_outputs_cut(recipe, head_dim, op):
    # layernorm_dense(split=...) must compute exactly what slicing its whole
    # output computes: the same GEMMs on the same FP8 bytes. The gradient's
    # cast reads the pieces (kernels.cast_transpose.Interleaved; on the CPU XLA
    # joins them), in 64 x 128 tiles for head_dim 128 and 128 x 64 for 64.
    # Both must match the unsplit op bit for bit.
    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    args = _qkv_args(head_dim)
    step = {
        split: jax.jit(
            jax.value_and_grad(_qkv_loss(split, recipe, state, op), argnums=(0, 1, 2, 3, 4))
        )
        for split in (True, False)
    }
    got, want = step[True](*args), step[False](*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# The tokens of _qkv_args's gradient; its pieces are q's (tokens, 2 * 2 *
# head_dim) and k's and v's (tokens, 2 * head_dim).
_QKV_TOKENS = 2 * 128


def _qkv_gradient_cast_reads(hlo: str, head_dim: int = 128) -> list[tuple[int, ...]]:
    """Shapes of what the Pallas kernel writing the FP8 QKV gradient reads, sorted."""
    from fp8jax.verify import _hlo

    entry = _hlo.parse_module(hlo).entry
    casts = [
        inst for inst in entry.instructions.values()
        if inst.custom_call_target == "__gpu$xla.gpu.triton"
        and ("f8e5m2", (_QKV_TOKENS, 8 * head_dim)) in {(t.dtype, t.shape) for t in inst.types}
    ]  # fmt: skip
    assert len(casts) == 1
    return sorted(t.shape for o in casts[0].operands for t in entry.instructions[o].types)


def _qkv_pieces_read(head_dim: int = 128) -> list[tuple[int, ...]]:
    """dq, dk, dv as the kernel reads them, then the scale."""
    return [(1,), (_QKV_TOKENS, 2 * head_dim), (_QKV_TOKENS, 2 * head_dim),
            (_QKV_TOKENS, 4 * head_dim)]  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_split_qkv_gradient_is_cast_from_its_pieces(recipe, op, head_dim):
    # Sliced outside the op, the pieces' gradients are padded and summed into
    # the whole (tokens, 2, 4, head_dim) gradient, written in bf16 and read
    # again by the FP8 cast (the transformer layer on the H200: 0.27 ms). Split
    # inside the op (ops.split), the cast kernel reads dq, dk and dv
    # themselves; with head_dim 64 in tiles half as wide (kernels.cast_transpose).
    from fp8jax.verify import gemm_report

    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _qkv_args(head_dim))

    def step(split):
        return jax.grad(_qkv_loss(split, recipe, state, op), argnums=(0, 1, 2, 3, 4))

    # Split and unsplit, in one child.
    hlos = _h100_hlos({("qkv", recipe, op, head_dim, s): (step(s), args) for s in (True, False)})

    def compiled(split):
        hlo = hlos["qkv", recipe, op, head_dim, split]
        assert len(gemm_report(hlo).fp8_gemms) == 3
        return hlo

    def whole_gradients_written(hlo):
        from fp8jax.verify import _hlo

        entry = _hlo.parse_module(hlo).entry
        return [
            shape for name, dtype, shape in _written_results(hlo)
            if dtype == "bf16" and math.prod(shape) == _QKV_TOKENS * 8 * head_dim
            and "transpose(jvp" in entry.instructions[name].metadata.get("op_name", "")
        ]  # fmt: skip

    split = compiled(split=True)
    assert _qkv_gradient_cast_reads(split, head_dim) == _qkv_pieces_read(head_dim)
    assert whole_gradients_written(split) == []
    assert whole_gradients_written(compiled(split=False))  # the pass the split removes


def _bias_broadcasts(hlo: str, whole: int, bias_size: int) -> list[str]:
    """Results of ``whole`` bf16 elements a program writes from nothing larger than the bias."""
    from fp8jax.verify import _hlo

    entry = _hlo.parse_module(hlo).entry

    def size(name):
        return max((math.prod(t.shape) for t in entry.instructions[name].types), default=0)

    return [
        name for name, dtype, shape in _written_results(hlo)
        if dtype == "bf16" and math.prod(shape) == whole
        and all(size(op) <= bias_size for op in entry.instructions[name].operands
                if op in entry.instructions)
    ]  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
def test_split_outputs_bias_is_added_where_the_pieces_are_copied(op):
    # With the GEMMs on cuBLAS (fp8jax.compiler_options, as every program
    # fp8jax jits), XLA folded a bias over (heads, 3, head_dim) into the GEMM
    # as its whole (tokens, features) addend, broadcast by a fusion of its
    # own first: 0.24 ms of the TE-config layer's step on the H200. Split,
    # the op adds it in the pieces' copy (ops.split.split_output_with_bias).
    from fp8jax.verify import compile_many, gemm_report

    head_dim, recipe = 128, fp8jax.CurrentScaling()
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _qkv_args(head_dim))
    step = jax.grad(_qkv_loss(True, recipe, None, op), argnums=(0, 1, 2, 3, 4))
    (hlo,) = compile_many([(step, args)], target="h100",
                          xla_flags="--xla_gpu_enable_triton_gemm=false")  # fmt: skip
    assert [g.backend for g in gemm_report(hlo).fp8_gemms] == ["cublaslt-fp8"] * 3
    assert _bias_broadcasts(hlo, _QKV_TOKENS * 8 * head_dim, 8 * head_dim) == []


def test_one_device_mesh_lets_the_kernel_run(one_device):
    from fp8jax.kernels import dispatch

    assert jax.device_count() > 1 and dispatch.is_local()


def _live_split_and_unsplit_steps(recipe, op, head_dim):
    """The QKV train step's results split and unsplit, after checking the split one's cast.

    Returns ``(split results, unsplit results, (args, state))``.
    """
    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    args = _qkv_args(head_dim)
    steps = {
        split: jax.jit(
            jax.value_and_grad(_qkv_loss(split, recipe, state, op), argnums=(0, 1, 2, 3, 4))
        )
        for split in (True, False)
    }
    compiled = steps[True].lower(*args).compile()
    assert _qkv_gradient_cast_reads(compiled.as_text(), head_dim) == _qkv_pieces_read(head_dim)
    return compiled(*args), steps[False](*args), (args, state)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_device")
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_split_gradient_cast_from_pieces_matches_the_joined_one(recipe, op):
    # On the CPU both builds cast the QKV gradient on XLA's path, so only a GPU
    # runs the kernel that reads the pieces. Same tiles, same arithmetic as the
    # one-matrix kernel the unsplit op uses on the joined gradient: every
    # gradient and the loss must agree bit for bit.
    got, want, _ = _live_split_and_unsplit_steps(recipe, op, head_dim=128)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@pytest.mark.usefixtures("one_device")
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_narrow_pieces_cast_matches_the_joined_one(recipe, op):
    # head_dim 64: the kernel reads dq, dk, dv in 128 x 64 tiles, the unsplit
    # op's kernel the joined gradient in 64 x 128. The FP8 bytes and amax do not
    # depend on the tiles, so the loss and every gradient but the bias's agree
    # bit for bit. The bias gradient is a column sum of the bf16 output
    # gradient, added in another grouping: each must be within n * 2**-24 *
    # sum(|g|) of the f64 sum (n tokens), g being 2q, 3 and 3v^2 in bf16.
    got, want, (args, state) = _live_split_and_unsplit_steps(recipe, op, head_dim=64)
    (loss, (*grads, d_bias)), (want_loss, (*want_grads, want_d_bias)) = got, want
    for a, b in zip(jax.tree.leaves((loss, grads)), jax.tree.leaves((want_loss, want_grads)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    x, gamma, beta, kernel, bias = args
    if op == "dense":
        y = fp8jax.dense(x, kernel, bias, recipe=recipe, state=state)
    else:
        y = fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state)
    y = np.asarray(y, np.float32)
    g = np.concatenate([2 * y[..., :2, :], np.full_like(y[..., 2:3, :], 3.0),
                        3 * y[..., 3:, :] ** 2], axis=-2)  # fmt: skip
    g = np.asarray(jnp.asarray(g).astype(jnp.bfloat16), np.float64)
    exact, bound = (
        g.sum(axis=(0, 1)),
        g.shape[0] * g.shape[1] * 2.0**-24 * np.abs(g).sum(axis=(0, 1)),
    )
    for d in (d_bias, want_d_bias):
        np.testing.assert_array_less(np.abs(np.asarray(d, np.float64) - exact), bound)


def test_gelu_stays_within_f32_rounding_of_the_exact_definition():
    # fused.gelu writes Phi through erf where jax.nn.gelu uses erfc. Bound:
    # 4 f32 ulps of max(|x|, 1): a couple for x * (1 + erf) * 0.5's own
    # roundings, a couple for XLA's erf polynomial (about 1 ulp of 1), which
    # 1 + erf turns into an absolute error on the negative side.
    import math

    from fp8jax.activations import gelu

    x = np.linspace(-12, 12, 48001, dtype=np.float32)
    exact = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    slope = np.array(
        [0.5 * math.erfc(-v / math.sqrt(2)) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)
         for v in x.astype(np.float64)]
    )  # fmt: skip
    ulps = 4 * 2.0**-23 * np.maximum(np.abs(x), 1)
    value = np.asarray(jax.jit(gelu)(x), np.float64)
    grad = np.asarray(jax.jit(jax.vmap(jax.grad(gelu)))(x), np.float64)
    assert np.all(np.abs(value - exact) <= ulps)
    assert np.all(np.abs(grad - slope) <= ulps)


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


ACTIVATIONS = [
    ("gelu", "linear"),
    ("silu", "linear"),
    ("relu", "linear"),
    ("gelu_tanh", "linear"),
    ("gelu",),
    ("relu",),
    ("silu",),
    ("linear",),
]
# Largest |derivative| of each activation (gelu: 1.129 at x ~ 2.4; silu:
# 1.0998 at x ~ 2.4); they carry the first GEMM's error into the second.
LIPSCHITZ = {"gelu": 1.13, "gelu_tanh": 1.13, "silu": 1.1, "relu": 1.0, "linear": 1.0}
NP_ACT = {
    "gelu": lambda v: jax.nn.gelu(v, approximate=False),
    "gelu_tanh": lambda v: jax.nn.gelu(v, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda v: v,
}


def _mlp_inputs(n_act, hidden=32, ffn=64, dtype=jnp.float32):
    x, gamma, beta = _params("layernorm", hidden, dtype, seed=4)
    k1 = (jax.random.normal(jax.random.key(5), (hidden, n_act, ffn)) / hidden**0.5).astype(dtype)
    k2 = (jax.random.normal(jax.random.key(6), (ffn, hidden)) / ffn**0.5).astype(dtype)
    return x, gamma, beta, k1, k2


def _ref_mlp(x, gamma, beta, k1, k2, activations, einsum=jnp.einsum):
    n = ref_norm(x, gamma, beta, "layernorm", False)
    pre = einsum("th,haf->taf", n, k1.astype(jnp.float32))
    h = NP_ACT[activations[0]](pre[:, 0])
    for i, name in enumerate(activations[1:], start=1):
        h = h * NP_ACT[name](pre[:, i])
    return einsum("tf,fo->to", h, k2.astype(jnp.float32))


@pytest.mark.parametrize("activations", ACTIVATIONS, ids="-".join)
def test_layernorm_mlp_forward_within_propagated_fp8_bound(activations):
    x, gamma, beta, k1, k2 = _mlp_inputs(len(activations))
    y = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=activations)
    n = np.asarray(ref_norm(x, gamma, beta, "layernorm", False), np.float64)
    k1s, k2s = np.asarray(k1, np.float64), np.asarray(k2, np.float64)
    pre = np.einsum("th,haf->taf", n, k1s)
    pre_bound = gemm_error_bound(
        n,
        k1s,
        "e4m3",
        "e4m3",
        current_scale(n, "e4m3"),
        current_scale(k1s, "e4m3"),
        "th,haf->taf",
        jnp.float32,
    ) + 2.0**-18 * np.einsum("th,haf->taf", np.abs(n), np.abs(k1s))
    acts = [
        np.asarray(NP_ACT[a](jnp.asarray(pre[:, i], jnp.float32)), np.float64)
        for i, a in enumerate(activations)
    ]
    errs = [LIPSCHITZ[a] * pre_bound[:, i] for i, a in enumerate(activations)]
    h, h_bound = acts[0], errs[0]
    if len(activations) == 2:
        # |ab - a'b'| <= |a||db| + |b||da| + |da||db|
        h, h_bound = (
            h * acts[1],
            (np.abs(acts[0]) * errs[1] + np.abs(acts[1]) * errs[0] + errs[0] * errs[1]),
        )
    h_bound = h_bound + 2.0**-20 * np.abs(h)  # f32 activation arithmetic
    h_scale = 448.0 / (np.abs(h).max() + h_bound.max())
    y_bound = gemm_error_bound(
        h,
        k2s,
        "e4m3",
        "e4m3",
        h_scale,
        current_scale(k2s, "e4m3"),
        "tf,fo->to",
        jnp.float32,
        a_error=h_bound,
    )
    assert_within(y, h @ k2s, y_bound, "mlp forward")


@pytest.mark.parametrize(
    "activations", [("gelu", "linear"), ("silu", "linear"), ("relu",)], ids="-".join
)
def test_layernorm_mlp_gradients_match_fake_quant_and_f32(activations):
    x, gamma, beta, k1, k2 = _mlp_inputs(len(activations))
    r = jax.random.normal(jax.random.key(8), (48, 32))

    def loss(x, gamma, beta, k1, k2):
        return jnp.sum(fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=activations) * r)

    def emulated(x, gamma, beta, k1, k2):
        return jnp.sum(_ref_mlp(x, gamma, beta, k1, k2, activations, fake_quant_einsum) * r)

    def exact(x, gamma, beta, k1, k2):
        return jnp.sum(
            _ref_mlp(
                x,
                gamma,
                beta,
                k1,
                k2,
                activations,
                lambda s, a, b: jnp.einsum(s, a, b, precision="highest"),
            )
            * r
        )

    args = (x, gamma, beta, k1, k2)
    got = jax.grad(loss, argnums=range(5))(*args)
    fake = jax.grad(emulated, argnums=range(5))(*args)
    ref = jax.grad(exact, argnums=range(5))(*args)
    for name, g, f, e in zip(["dx", "dgamma", "dbeta", "dk1", "dk2"], got, fake, ref, strict=True):
        # Same arithmetic as the emulation: only f32 roundoff (about 2**-16
        # after a few dozen operations and 64-term sums) and the rare FP8
        # flip it causes, one step (2**-3 of an element) in one of 48 x 64
        # elements, normwise 2**-3 / sqrt(48 * 64) ~ 2**-8.8 each. 2**-8
        # allows one such flip; an E5M2 operand where E4M3 belongs errs by
        # about 2**-3 / sqrt(3) ~ 2**-3.8 normwise.
        assert relative_error(g, f) < 2.0**-8, name
        # Against exact f32: the gradient passes through at most three FP8
        # GEMMs with an E5M2 operand. Independent rounding errors give each a
        # relative error near sqrt(u5**2 + u4**2) / sqrt(3) = 0.08; allow the
        # three to add up.
        assert relative_error(g, e) < 3 * 0.081, name


def test_llama_shape_swiglu_traces_six_fp8_gemms():
    # hidden 4096, ffn 11008, SwiGLU: traced abstractly, nothing is allocated.
    x = jax.ShapeDtypeStruct((2, 128, 4096), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((4096,), jnp.float32)
    k1 = jax.ShapeDtypeStruct((4096, 2, 11008), jnp.float32)
    k2 = jax.ShapeDtypeStruct((11008, 4096), jnp.float32)

    def loss(x, gamma, k1, k2):
        y = fp8jax.layernorm_mlp(
            x, gamma, None, k1, k2, activations=("silu", "linear"), norm_type="rmsnorm"
        )
        return jnp.sum(y.astype(jnp.float32))

    dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1, 2, 3)), x, gamma, k1, k2)
    assert len(dots) == 6 and all(d.is_fp8 for d in dots)
    assert sorted(d.operand_formats for d in dots).count(("float8_e5m2", "float8_e5m2")) == 0


@pytest.mark.parametrize(
    "recipe", [fp8jax.CurrentScaling(), fp8jax.DelayedScaling(amax_history_len=4)], ids=repr
)
def test_jaxpr_dot_counts(recipe):
    x, gamma, beta, k1, k2 = _mlp_inputs(2)
    mlp_state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)
    dense_state = fp8jax.init_state(recipe)

    def mlp_loss(x, k1, k2, state):
        return jnp.sum(fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, recipe=recipe, state=state))

    def ln_dense_loss(x, k1, state):
        return jnp.sum(fp8jax.layernorm_dense(x, gamma, beta, k1, recipe=recipe, state=state))

    mlp = jaxpr_dots(jax.grad(mlp_loss, argnums=(0, 1, 2, 3)), x, k1, k2, mlp_state)
    ln_dense = jaxpr_dots(jax.grad(ln_dense_loss, argnums=(0, 1, 2)), x, k1, dense_state)
    assert len(mlp) == 6 and all(d.is_fp8 for d in mlp)
    assert [d.operand_formats for d in ln_dense] == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
    ]


def test_delayed_state_of_mlp_updates_every_tensor():
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)
    x, gamma, beta, k1, k2 = _mlp_inputs(2)
    grads = jax.grad(
        lambda s: jnp.sum(fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, recipe=recipe, state=s))
    )(state)
    new = fp8jax.take_new_state(state, grads)
    for leaf in jax.tree.leaves(new, is_leaf=lambda n: isinstance(n, fp8jax.ScaleState)):
        assert float(leaf.amax_history[0]) > 0 and float(leaf.scale) != 1.0


_X = jnp.ones((4, 32))
_G = jnp.ones((32,))
_K1 = jnp.ones((32, 2, 64))
_K2 = jnp.ones((64, 32))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, _K2, activations=("gelu", "swish")),
            ValueError,
            r"activations must be one or two names from \['gelu', 'gelu_tanh', 'linear', "
            r"'relu', 'silu'\].*got \('gelu', 'swish'\)",
        ),
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, _K2, activations=("gelu",)),
            ValueError,
            r"kernel_1 must have shape \(hidden=32, len\(activations\)=1, ffn\), "
            r"got \(32, 2, 64\)",
        ),
        (
            lambda: fp8jax.layernorm_mlp(jnp.ones((4, 16)), jnp.ones(16), None, _K1, _K2),
            ValueError,
            r"kernel_1 must have shape \(hidden=16",
        ),
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, jnp.ones((63, 32))),
            ValueError,
            r"kernel_2 must have shape \(ffn=64, hidden_out\), got \(63, 32\)",
        ),
        (
            lambda: fp8jax.layernorm_mlp(_X, _G, None, _K1, _K2, epsilon=0.0),
            ValueError,
            "epsilon must be a number > 0, got 0.0",
        ),
        (
            lambda: fp8jax.layernorm_dense(_X, _G, None, jnp.ones((16, 8))),
            ValueError,
            r"kernel must have shape \(hidden=32, \*features\), got \(16, 8\)",
        ),
        (
            lambda: fp8jax.layernorm_dense(_X, _G, None, jnp.ones((32, 4, 8)), split=(2, 1)),
            ValueError,
            r"split must be positive integers summing to the output's axis -2 \(4\), got \(2, 1\)",
        ),
        (
            lambda: fp8jax.dense(_X, jnp.ones((32, 4, 8)), split=(3, 2)),
            ValueError,
            r"split must be positive integers summing to the output's axis -2 \(4\), got \(3, 2\)",
        ),
        (
            lambda: fp8jax.layernorm_dense(_X, _G, None, jnp.ones((32, 8)), split=(4, 4)),
            ValueError,
            r"split_axis must name one of the output's 1 feature axes, counted from the end "
            r"\(-1 to -1\), got -2",
        ),
        (
            lambda: fp8jax.layernorm_mlp(
                _X,
                _G,
                None,
                _K1,
                _K2,
                recipe=fp8jax.DelayedScaling(amax_history_len=2),
                state=fp8jax.init_state(fp8jax.DelayedScaling(amax_history_len=2)),
            ),
            TypeError,
            r"state must be a MlpScaleState from fp8jax.init_state\(recipe, MlpScaleState\)",
        ),
    ],
)
def test_bad_input_is_explained(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_mlp_step_transposes_fp8_only_with_tiled_kernels(recipe):
    # Before the forward kernel became an explicit matrix transpose
    # (ops.gemm.as_kernel_matrices), XLA relayouted both GeGLU kernels with untiled kLoop
    # transposes at ~0.3 TB/s on the H200 (jaxlib 0.11.2; docs/design.md).
    # Shapes are the benchmark's, scaled down 4x in each dimension.
    from fp8jax import verify

    tokens, hidden, ffn = 4096, 1024, 4096
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((hidden,), jnp.float32)
    k1 = jax.ShapeDtypeStruct((hidden, 2, ffn), jnp.bfloat16)
    k2 = jax.ShapeDtypeStruct((ffn, hidden), jnp.bfloat16)
    state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, gamma, k1, k2, state):
        y = fp8jax.layernorm_mlp(x, gamma, gamma, k1, k2, recipe=recipe, state=state)
        return jnp.sum(y.astype(jnp.float32))

    step = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    hlo = verify.compile_for(step, x, gamma, k1, k2, state, target="live")
    relayouts = verify.fp8_relayouts(hlo)
    assert relayouts, "expected the wgrad transposes of the activations at least"
    assert [r for r in relayouts if r.untiled_transpose] == []
