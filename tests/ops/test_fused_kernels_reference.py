"""The fused ops through their Pallas kernels (interpret mode) against the fake-quant references.

On the CPU every kernel dispatch lets ``lax.platform_dependent`` pick the
XLA twin, so tests/ops/test_recipe_references.py checks the twins. Here
:func:`interpret` makes ``fp8jax.kernels.dispatch.on_each_device`` run the
kernels themselves in Pallas interpret mode: the norm forward and backward,
the output gradient's cast-transpose and the activation kernels, with
margins and both amax algorithms, and erf's gelu (which
``fp8jax.layernorm_mlp`` keeps on XLA's path on the GPU, by measurement)
sent to the activation kernels too. The budgets are test_recipe_references.py's.
"""

import dataclasses

import jax
import pytest
import test_recipe_references as rr

import fp8jax
import references as ref
from fp8jax import activations as activations_
from fp8jax.kernels import dispatch


@pytest.fixture
def interpret(monkeypatch):
    """Kernels run in Pallas interpret mode wherever the dispatcher would run them; yields
    the list of the kernels' names, one per call traced."""
    called = []

    def on_each_device(pallas_fn, xla_fn, operands, n_row_split, out_layouts, row_axes=()):
        if not dispatch.enabled():
            return xla_fn(*operands)
        assert not row_axes, "these tests run on whole arrays"
        fn = getattr(pallas_fn, "func", pallas_fn)
        called.append(f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}")
        return pallas_fn(*operands, interpret=True)

    monkeypatch.setattr(dispatch, "on_each_device", on_each_device)
    # erf's gelu to the activation kernels as well (the registry keeps it off them).
    gelu = dataclasses.replace(activations_.REGISTRY["gelu"], kernel=True)
    monkeypatch.setitem(activations_.REGISTRY, "gelu", gelu)
    return called


RECIPES = {
    "delayed-max-margin1": rr.RECIPES["delayed-max-margin1"],
    "delayed-most-recent-margin2": fp8jax.DelayedScaling(
        amax_history_len=3, amax_compute_algo="most_recent", margin=2
    ),
    "current-margin2": rr.RECIPES["current-margin2"],
}
NORM_KERNELS = {"norm_forward._pallas", "norm_backward._pallas"}


def _layernorm_dense_case(recipe, norm_type, rows):
    x, gamma, beta = rr._norm_inputs(norm_type, 128, rows, seed=3)
    kernel = 0.1 * jax.random.normal(jax.random.key(9), (128, 128))
    c = jax.random.normal(jax.random.key(10), (rows, 128))

    def probe(r):
        return ref.layernorm_dense(x, gamma, beta, kernel, None, c, r, norm_type=norm_type)

    state, rec = rr._setup(recipe, fp8jax.DotScaleState, probe)

    def op(x, gamma, beta, kernel, state):
        return fp8jax.layernorm_dense(x, gamma, beta, kernel, norm_type=norm_type, recipe=recipe,
                                      state=state)  # fmt: skip

    y, grads, new_state = rr.run(op, (x, gamma, beta, kernel), state, c)
    want_y, want = probe(rec)
    names = ("x", "gamma", "beta", "kernel")
    got = {n: g for n, g in zip(names, grads, strict=True) if g is not None}
    rr._check_relative({"y": y, **got}, {"y": want_y, **want}, rr.FUSED_RTOL, norm_type)
    rr._check_state(recipe, rec, new_state, "layernorm_dense")


# LayerNorm under every recipe, RMSNorm under one.
DENSE_CASES = [*(("layernorm", r) for r in RECIPES), ("rmsnorm", "delayed-most-recent-margin2")]


@pytest.mark.parametrize(("norm_type", "name"), DENSE_CASES,
                         ids=[f"{n}-{r}" for n, r in DENSE_CASES])  # fmt: skip
def test_layernorm_dense_kernels_match_fake_quant_reference(interpret, norm_type, name):
    _layernorm_dense_case(RECIPES[name], norm_type, 128)
    assert NORM_KERNELS | {"cast_transpose._pallas_partials"} <= set(interpret), interpret


# erf's gelu and SwiGLU under every recipe, the other kernel activations under one.
MLP_CASES = [*((a, r) for a in (("gelu",), ("silu", "linear")) for r in RECIPES),
             *((a, "delayed-most-recent-margin2") for a in
               (("gelu", "linear"), ("gelu_tanh",), ("relu",)))]  # fmt: skip


@pytest.mark.parametrize(("activations", "name"), MLP_CASES,
                         ids=["/".join(a) + f"-{r}" for a, r in MLP_CASES])  # fmt: skip
def test_layernorm_mlp_kernels_match_fake_quant_reference(interpret, activations, name):
    recipe = RECIPES[name]
    rr._mlp_case(activations, recipe, rr.SHAPES["kernel-tiles"], rr.F32, rr.FUSED_RTOL,
                 rr.STATE_RTOL, seed=4)  # fmt: skip
    kernels = {"activation_cast._pallas_forward"} | NORM_KERNELS
    if isinstance(recipe, fp8jax.DelayedScaling):  # the backward kernel needs the scale first
        kernels.add("activation_cast._pallas_gradient")
    assert kernels <= set(interpret), interpret


# Without the fixture: the XLA twins of the kernels (kernel-tile shapes) and
# XLA's own path (shapes off the tiles), under the recipes test_recipe_references.py
# does not run the fused ops with.
TWIN_RECIPES = ("delayed-most-recent-margin2", "current-margin2")


@pytest.mark.parametrize(("name", "rows"), list(zip(TWIN_RECIPES, (128, 48), strict=True)),
                         ids=[f"{r}-{s}" for r, s in zip(TWIN_RECIPES, ("kernel-tiles", "xla-path"),
                                                          strict=True)])  # fmt: skip
def test_layernorm_dense_twins_match_fake_quant_reference(name, rows):
    _layernorm_dense_case(RECIPES[name], "layernorm", rows)


# Each recipe on each path, erf's gelu with one and SwiGLU with the other.
TWIN_CASES = [(("gelu",), TWIN_RECIPES[0], "kernel-tiles"),
              (("gelu",), TWIN_RECIPES[1], "xla-path"),
              (("silu", "linear"), TWIN_RECIPES[1], "kernel-tiles"),
              (("silu", "linear"), TWIN_RECIPES[0], "xla-path")]  # fmt: skip


@pytest.mark.parametrize(("activations", "name", "shape"), TWIN_CASES,
                         ids=["/".join(a) + f"-{r}-{s}" for a, r, s in TWIN_CASES])  # fmt: skip
def test_layernorm_mlp_twins_match_fake_quant_reference(activations, name, shape):
    rr._mlp_case(activations, RECIPES[name], rr.SHAPES[shape], rr.F32, rr.FUSED_RTOL,
                 rr.STATE_RTOL, seed=5)  # fmt: skip
