"""fp8jax.kernels.norm_forward: the norm's forward and FP8 cast in one pass, against f64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import norm_backward, norm_forward
from fp8jax.ops import norm
from fp8jax.ops.norm import NormConfig

ROWS, HIDDEN = 2 * norm_forward.ROWS_PER_PROGRAM, 256
# A row the kernel pads to a power of two (512) and stores masked, as Llama-3.2-3B's 3072.
PADDED_HIDDEN = 384
FMT = fp8jax.E4M3
# |y| stays below about 12 here; 448 / 32 keeps y * scale inside E4M3's range.
SCALE = FMT.max / 32
NORM_TYPES = ["layernorm", "rmsnorm"]


def _inputs(norm_type, seed=0, hidden=HIDDEN):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(k[0], (ROWS, hidden)) * 2 + 0.5).astype(jnp.bfloat16)
    gamma = jax.random.normal(k[1], (hidden,)) * 0.1 + 1
    beta = jax.random.normal(k[2], (hidden,)) * 0.1 if norm_type == "layernorm" else None
    return x, gamma, beta


def _reference(norm_type, x, gamma, beta):
    """y, mean (or None), rstd in f64 by the textbook formulas."""
    x, gamma = np.asarray(x, np.float64), np.asarray(gamma, np.float64)
    mean = x.mean(-1, keepdims=True) if norm_type == "layernorm" else None
    centred = x - mean if mean is not None else x
    rstd = 1 / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6)
    y = centred * rstd * gamma
    if beta is not None:
        y = y + np.asarray(beta, np.float64)
    return y, mean, rstd


def _run(path, x, gamma, beta, norm_type):
    kwargs = {"fmt": FMT, "centred": norm_type == "layernorm", "epsilon": 1e-6}
    beta = None if beta is None else beta[None]
    if path == "interpret":
        return norm_forward._pallas(x, gamma[None], beta, jnp.float32(SCALE), interpret=True,
                                    **kwargs)  # fmt: skip
    return norm_forward._xla(x, gamma[None], beta, jnp.float32(SCALE), **kwargs)


@pytest.mark.parametrize("hidden", [HIDDEN, PADDED_HIDDEN])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("path", ["interpret", "xla"])
def test_kernel_and_xla_path_match_the_f64_forward(norm_type, path, hidden):
    # Interpret mode runs the kernel's own body on the CPU, row by row.
    x, gamma, beta = _inputs(norm_type, hidden=hidden)
    q, *stats, maxima = _run(path, x, gamma, beta, norm_type)
    want_y, want_mean, want_rstd = _reference(norm_type, x, gamma, beta)
    assert q.dtype == FMT.dtype and q.shape == (ROWS, hidden)
    # One amax per program of ROWS_PER_PROGRAM rows.
    assert maxima.shape == (ROWS // norm_forward.ROWS_PER_PROGRAM, 1)
    assert len(stats) == (2 if norm_type == "layernorm" else 1)
    # The f32 statistics of HIDDEN bf16 terms: relative error a few 2**-24 per
    # operation, far inside 1e-5.
    if want_mean is not None:
        np.testing.assert_allclose(stats[0], want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[-1], want_rstd, rtol=1e-5)
    # The f32 output errs by about 1e-5 (|y| + 1) at most; E4M3 rounds it to
    # 4 significant bits (error <= 2**-4 |y|) above its subnormals, and by at
    # most half the subnormal step, 2**-10, in scaled units below them.
    y = np.asarray(q.astype(jnp.float32), np.float64) / SCALE
    bound = 2**-4 * np.abs(want_y) + 2e-5 * (np.abs(want_y) + 1) + 2**-10 / SCALE
    assert np.all(np.abs(y - want_y) <= bound), float(np.max(np.abs(y - want_y) - bound))
    # The amax is that of the f32 output, within its 1e-5 relative error.
    np.testing.assert_allclose(float(jnp.max(maxima)), np.abs(want_y).max(), rtol=1e-5)


@pytest.mark.parametrize("hidden", [HIDDEN, PADDED_HIDDEN])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("path", ["interpret", "xla", pytest.param("live", marks=pytest.mark.gpu)])
def test_maxima_pass_gives_the_cast_passes_maxima(norm_type, path, hidden):
    # Current scaling's first pass is the same kernel without the cast: its
    # maxima, from which the scale comes, are exactly those the cast pass
    # writes, so the scale is that of the output the cast pass quantizes.
    x, gamma, beta = _inputs(norm_type, seed=2, hidden=hidden)
    kwargs = {"centred": norm_type == "layernorm", "epsilon": 1e-6}
    beta = None if beta is None else beta[None]
    if path == "interpret":
        (maxima,) = norm_forward._pallas(x, gamma[None], beta, None, fmt=None, interpret=True,
                                         **kwargs)  # fmt: skip
    elif path == "live":
        pallas = jax.jit(norm_forward._pallas, static_argnames=("fmt", "centred", "epsilon"))
        (maxima,) = pallas(x, gamma[None], beta, None, fmt=None, **kwargs)
        *_, cast_maxima = pallas(x, gamma[None], beta, jnp.float32(SCALE), fmt=FMT, **kwargs)
    else:
        (maxima,) = norm_forward._xla(x, gamma[None], beta, None, fmt=None, **kwargs)
    if path != "live":
        *_, cast_maxima = _run(path, x, gamma, None if beta is None else beta[0], norm_type)
    assert maxima.shape == (ROWS // norm_forward.ROWS_PER_PROGRAM, 1)
    np.testing.assert_array_equal(maxima, cast_maxima)


@pytest.mark.parametrize("path", ["interpret", "xla"])
def test_statistics_of_rows_far_from_zero(path):
    # Rows of 4096 + 32 k, k in -2..2 (all exact in bf16): the mean is about
    # 90 times the spread. E[x^2] - E[x]^2 in f32 would cancel all but about
    # 1e-4 of its leading digits; the two-pass statistics keep rstd within
    # f32 rounding of the exact value.
    k = jax.random.randint(jax.random.key(3), (ROWS, HIDDEN), -2, 3)
    x = (4096 + 32 * k).astype(jnp.bfloat16)
    gamma, beta = jnp.ones(HIDDEN), jnp.zeros(HIDDEN)
    _, mean, rstd, _ = _run(path, x, gamma, beta, "layernorm")
    _, want_mean, want_rstd = _reference("layernorm", x, gamma, beta)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_normalize_and_cast_matches_the_norm_and_quantize(norm_type, zero_centered_gamma):
    # The public entry (here XLA's path, on the CPU) on a (2, rows/2, hidden)
    # input: the same bytes as quantize_with_scale of fp8jax.ops.norm's own
    # normalize, and its statistics.
    from fp8jax.quantize import quantize_with_scale

    x, gamma, beta = _inputs(norm_type, seed=1)
    x = x.reshape(2, ROWS // 2, HIDDEN)
    config = NormConfig(norm_type, zero_centered_gamma)
    q, maxima, mean, rstd = norm.normalize_and_cast(x, gamma, beta, config, jnp.float32(SCALE), FMT)
    y, want_mean, want_rstd = norm.normalize(x, gamma, beta, config)
    np.testing.assert_array_equal(q, quantize_with_scale(y, FMT, jnp.float32(SCALE)).data)
    # One maximum per ROWS_PER_PROGRAM rows.
    per_program = jnp.abs(y).reshape(-1, norm_forward.ROWS_PER_PROGRAM * HIDDEN).max(axis=1)
    np.testing.assert_array_equal(maxima, per_program[:, None])
    if norm_type == "layernorm":
        np.testing.assert_array_equal(mean, want_mean)
    else:
        assert mean is None
    np.testing.assert_array_equal(rstd, want_rstd)


P = norm_forward.ROWS_PER_PROGRAM


@pytest.mark.parametrize(
    ("rows", "shards", "fits"),
    [(2 * P, 1, True), (2 * P, 2, True), (2 * P, 4, False), (P + P // 2, 1, False)],
)
def test_fits_needs_whole_programs_of_rows_per_device(rows, shards, fits):
    assert norm_forward.fits((rows, 4096), shards) is fits


@pytest.mark.parametrize(
    ("hidden", "taken"),
    [(64, False), (128, True), (768, True), (3072, True), (4096, True), (16384, True),
     (16400, False), (32768, False)],
)  # fmt: skip
def test_fits_takes_the_hidden_sizes_the_backward_takes(hidden, taken):
    # A row padded to a power of two that registers can hold: the same rule both ways.
    assert norm_backward.hidden_fits(hidden) is taken
    assert norm_backward.fits((norm_backward.ROWS_PER_PROGRAM, hidden)) is taken
    assert norm_forward.fits((P, hidden)) is taken


FUSED_OPS = ["layernorm_dense", "layernorm_mlp"]
RECIPES = [fp8jax.CurrentScaling(), fp8jax.DelayedScaling()]


def _fused_op_step(op, recipe):
    """The gradient of a loss on ``op``'s output, and its abstract arguments."""
    delayed = isinstance(recipe, fp8jax.DelayedScaling)
    group = fp8jax.MlpScaleState if op == "layernorm_mlp" else fp8jax.DotScaleState
    state = fp8jax.init_state(recipe, group) if delayed else None
    x = jax.ShapeDtypeStruct((2, 512, 256), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((256,), jnp.float32)
    k1 = jax.ShapeDtypeStruct((256, 1, 512) if op == "layernorm_mlp" else (256, 384), jnp.bfloat16)
    k2 = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)

    def loss(x, gamma, beta, k1, k2, state):
        if op == "layernorm_mlp":
            y = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=("gelu",),
                                     recipe=recipe, state=state)  # fmt: skip
        else:
            y = fp8jax.layernorm_dense(x, gamma, beta, k1, recipe=recipe, state=state)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), (x, gamma, gamma, k1, k2, state)


def _model_step():
    """A two-layer GPT's gradient (hidden 128, the kernels' smallest), and its abstract arguments.

    One op's step (above) did not show what a whole model's did: XLA merging
    the backward's norm kernel call with the forward's identical one.
    """
    from fp8jax.models import Gpt, GptConfig, next_token_loss

    model = Gpt(config=GptConfig(hidden=128, layers=2, heads=2, ffn=256), precision="fp8",
                recipe=fp8jax.CurrentScaling(), attention_implementation="xla")  # fmt: skip
    tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
    variables = jax.eval_shape(
        model.init, jax.random.key(0), jax.ShapeDtypeStruct((8, 128), jnp.int32)
    )

    def loss(variables, batch):
        return next_token_loss(model.apply(variables, batch[:, :-1]), batch[:, 1:])

    return jax.grad(loss), (variables, tokens)


@pytest.fixture(scope="module")
def fused_op_hlos():
    """``{(op, recipe): H100 HLO}`` of each op and recipe, and the model's, in one child process."""
    from fp8jax.verify import compile_many

    keys = [(op, recipe) for op in FUSED_OPS for recipe in RECIPES]
    calls = [_fused_op_step(*key) for key in keys] + [_model_step()]
    with jax.numpy_dtype_promotion("standard"):  # as the model's other tests compile it
        hlos = compile_many(calls, target="h100")
    return dict(zip([*keys, "model"], hlos, strict=True))


def _kernel_calls(hlo: str, kernel: str) -> tuple[int, int]:
    """``(forward, backward)``: the calls of the Pallas kernel ``kernel``, by their op_name."""
    from fp8jax.verify import _hlo

    op_names = [
        inst.metadata.get("op_name", "")
        for comp in _hlo.parse_module(hlo).computations.values()
        for inst in comp.instructions.values()
        if inst.custom_call_target == "__gpu$xla.gpu.triton"
    ]
    calls = [name for name in op_names if name.endswith(f"/{kernel}/pallas_call")]
    backward = sum("transpose(" in name for name in calls)
    return len(calls) - backward, backward


@pytest.mark.deviceless
@pytest.mark.parametrize("op", FUSED_OPS)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fused_ops_run_the_kernel_under_both_recipes(op, recipe, fused_op_hlos):
    # Current scaling needs the whole output's amax before the cast: the
    # maxima-only pass runs first, under that recipe only (module docstring).
    # The backward casts the output again from x rather than keeping it
    # (docs/design.md#the-norms-fp8-output-cast-again-in-the-backward).
    hlo = fused_op_hlos[op, recipe]
    current = isinstance(recipe, fp8jax.CurrentScaling)
    assert _kernel_calls(hlo, "fp8jax_norm_forward") == (1, 1)
    assert _kernel_calls(hlo, "fp8jax_norm_maxima") == (int(current), 0)


@pytest.mark.deviceless
def test_a_model_step_casts_each_norm_output_again_in_its_backward(fused_op_hlos):
    # Two layers, two fused norms each. Without the optimization barrier in
    # fp8jax.ops._fused.fp8_output, XLA merged each backward call into the
    # forward's (4, 0), and the kernel's FP8 output stayed in memory between them.
    assert _kernel_calls(fused_op_hlos["model"], "fp8jax_norm_forward") == (4, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [HIDDEN, PADDED_HIDDEN])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.usefixtures("one_device")
def test_live_kernel_matches_the_f64_forward(norm_type, hidden):
    device = jax.devices()[0]
    assert device.platform == "gpu"
    x, gamma, beta = jax.device_put(_inputs(norm_type, hidden=hidden), device)
    step = jax.jit(norm.normalize_and_cast, static_argnums=(3, 5))
    args = (x, gamma, beta, NormConfig(norm_type), jnp.float32(SCALE), FMT)
    assert "fp8jax_norm_forward" in step.lower(*args).as_text()
    q, maxima, mean, rstd = step(*args)
    amax = jnp.max(maxima)
    want_y, want_mean, want_rstd = _reference(norm_type, x, gamma, beta)
    if want_mean is not None:
        np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)
    y = np.asarray(q.astype(jnp.float32), np.float64) / SCALE
    bound = 2**-4 * np.abs(want_y) + 2e-5 * (np.abs(want_y) + 1) + 2**-10 / SCALE
    assert np.all(np.abs(y - want_y) <= bound), float(np.max(np.abs(y - want_y) - bound))
    np.testing.assert_allclose(float(amax), np.abs(want_y).max(), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_device")
@pytest.mark.parametrize("op", FUSED_OPS)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_output_cast_again_gives_the_gradients_of_the_output_kept(op, recipe, monkeypatch):
    # The backward's kernel call reads the forward's x, gamma and scale: the
    # same FP8 bytes, so every gradient (and the delayed state) agrees bit for bit.
    from fp8jax.ops import _fused

    grad, args = _fused_op_step(op, recipe)
    keys = iter(jax.random.split(jax.random.key(3), len(args)))
    args = tuple(
        (jax.random.normal(next(keys), a.shape) * 0.1 + (1 if a.ndim == 1 else 0)).astype(a.dtype)
        if isinstance(a, jax.ShapeDtypeStruct) else a
        for a in args
    )  # fmt: skip
    again = jax.jit(lambda *a: grad(*a)).lower(*args).compile()
    assert _kernel_calls(again.as_text(), "fp8jax_norm_forward") == (1, 1)
    monkeypatch.setattr(_fused, "saved_output", lambda normed, norm: normed.fp8)
    kept = jax.jit(lambda *a: grad(*a)).lower(*args).compile()
    assert _kernel_calls(kept.as_text(), "fp8jax_norm_forward") == (1, 0)
    for a, b in zip(jax.tree.leaves(again(*args)), jax.tree.leaves(kept(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _with_residual(norm_type, hidden=HIDDEN, seed=3):
    x, gamma, beta = _inputs(norm_type, seed=seed, hidden=hidden)
    branch = (jax.random.normal(jax.random.key(seed + 1), x.shape) * 0.5).astype(x.dtype)
    return x, branch, gamma, beta


@pytest.mark.parametrize("hidden", [HIDDEN, PADDED_HIDDEN])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("path", ["interpret", "xla"])
@pytest.mark.parametrize("cast", [True, False], ids=["cast", "maxima"])
def test_the_residual_add_in_the_pass_matches_the_f64_norm_of_the_sum(norm_type, path, hidden,
                                                                     cast):  # fmt: skip
    """The kernel reads x and the branch output, writes their bf16 sum and the norm of it."""
    x, branch, gamma, beta = _with_residual(norm_type, hidden)
    kwargs = {"fmt": FMT if cast else None, "centred": norm_type == "layernorm", "epsilon": 1e-6}
    scale = jnp.float32(SCALE) if cast else None
    beta2 = None if beta is None else beta[None]
    if path == "interpret":
        out = norm_forward._pallas(x, gamma[None], beta2, scale, branch, interpret=True, **kwargs)
    else:
        out = norm_forward._xla(x, gamma[None], beta2, scale, branch, **kwargs)
    *rest, total, maxima = out
    # The sum is the bf16 add's: exact f32 sum of two bf16 values, rounded once.
    exact = np.asarray(x, np.float64) + np.asarray(branch, np.float64)
    assert total.dtype == x.dtype and total.shape == x.shape
    assert np.all(np.abs(np.asarray(total, np.float64) - exact) <= 2**-8 * np.abs(exact))
    np.testing.assert_array_equal(total, x + branch)
    want_y, _, _ = _reference(norm_type, total, gamma, beta)
    # The maxima are those of the f32 output of the sum, within its 1e-5 relative error.
    np.testing.assert_allclose(float(jnp.max(maxima)), np.abs(want_y).max(), rtol=1e-5)
    if cast:
        # Bound as in test_kernel_and_xla_path_match_the_f64_forward.
        y = np.asarray(rest[0].astype(jnp.float32), np.float64) / SCALE
        bound = 2**-4 * np.abs(want_y) + 2e-5 * (np.abs(want_y) + 1) + 2**-10 / SCALE
        assert np.all(np.abs(y - want_y) <= bound), float(np.max(np.abs(y - want_y) - bound))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("path", ["interpret", "xla"])
def test_the_residual_add_in_the_pass_gives_the_bytes_of_the_pass_over_the_sum(norm_type, path):
    """Folding the add in changes no value: same FP8 bytes, statistics and maxima."""
    x, branch, gamma, beta = _with_residual(norm_type)
    kwargs = {"fmt": FMT, "centred": norm_type == "layernorm", "epsilon": 1e-6}
    beta2 = None if beta is None else beta[None]
    fn = (functools.partial(norm_forward._pallas, interpret=True) if path == "interpret"
          else norm_forward._xla)  # fmt: skip
    fused = fn(x, gamma[None], beta2, jnp.float32(SCALE), branch, **kwargs)
    separate = fn(x + branch, gamma[None], beta2, jnp.float32(SCALE), **kwargs)
    np.testing.assert_array_equal(fused[-2], x + branch)
    for got, want in zip((*fused[:-2], fused[-1]), separate, strict=True):
        np.testing.assert_array_equal(got, want)
