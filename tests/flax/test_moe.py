"""MoEBlock (Linen and NNX): an f32 per-token reference, gradients, scan, FP8 expert GEMMs.

The value budget chains tests/numerics.py's elementwise GEMM bound: the
first grouped GEMM (E4M3 x E4M3, each expert at its own scale), the gated
activation (|silu'| <= 1.1, so its error is at most 1.1 e_gate |up| +
|silu(gate)| e_up + 1.1 e_gate e_up), the second grouped GEMM with that
error on its input, then the gates' weighted sum (gates are computed in
f32 from the same input by both, so they agree).
"""

import flax.linen as nn
import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax import verify
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx
from fp8jax.ops import moe as moe_ops
from fp8jax.verify import _hlo
from numerics import assert_within, gemm_error_bound

T, H, F, E, K = 48, 64, 128, 4, 2
SILU_SLOPE = 1.1  # max |d silu / dx| = 1.0998


def _block(**kw):
    return fnn.MoEBlock(num_experts=E, top_k=K, ffn=F, **kw)


@pytest.fixture(scope="module")
def setup():
    x = jax.random.normal(jax.random.key(0), (2, T // 2, H))
    variables = jax.jit(_block().init)(jax.random.key(1), x)
    return x, nn.meta.unbox(variables)


def _reference(x, p):
    """The block in f64 numpy, token by token: outputs, routing, and each slot's pieces."""
    x2 = np.asarray(x, np.float64).reshape(-1, H)
    logits = x2 @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    gates = np.take_along_axis(probs, experts, -1)
    gates /= gates.sum(-1, keepdims=True)
    wi, wo = np.asarray(p["wi"], np.float64), np.asarray(p["wo"], np.float64)
    rows_x = np.repeat(x2, K, axis=0)
    rows_wi, rows_wo = wi[experts.reshape(-1)], wo[experts.reshape(-1)]
    h = np.einsum("rh,rhcf->rcf", rows_x, rows_wi)
    gate, up = h[:, 0], h[:, 1]
    a = gate / (1 + np.exp(-gate)) * up
    ys = np.einsum("rf,rfh->rh", a, rows_wo)
    y = np.einsum("tkh,tk->th", ys.reshape(-1, K, H), gates)
    return y, dict(rows_x=rows_x, rows_wi=rows_wi, rows_wo=rows_wo, gate=gate, up=up, a=a,
                   gates=gates, experts=experts)  # fmt: skip


def _expert_scales(w, experts):
    amax = np.abs(np.asarray(w, np.float64)).reshape(E, -1).max(axis=1)
    return (448.0 / amax)[experts.reshape(-1)]


# BlockScaling: the same bound holds. Each 1x128 tile's or 128x128 block's
# amax is at most its tensor's (or expert's), so its scale is at least the
# per-tensor one: the relative rounding is the format's, and the subnormal
# term half the smallest subnormal over a larger scale.
@pytest.mark.parametrize("recipe", [None, fp8jax.BlockScaling()], ids=["current", "block"])
def test_linen_block_matches_an_f32_per_token_reference_within_fp8_budgets(setup, recipe,
                                                                            request):  # fmt: skip
    x, p = setup
    y, state = jax.jit(lambda v, x: _block(recipe=recipe).apply(v, x, mutable=["intermediates"]))(
        {"params": p["params"]}, x
    )
    if recipe is not None:  # not a silent fallback to the per-tensor experts
        assert not np.array_equal(np.asarray(y), np.asarray(request.getfixturevalue("linen_y")))
    want, r = _reference(x, p["params"])
    scale_x = 448.0 / np.abs(r["rows_x"]).max()
    s_wi = _expert_scales(p["params"]["wi"], r["experts"])[:, None, None, None]
    h_bound = gemm_error_bound(r["rows_x"], r["rows_wi"], "e4m3", "e4m3", scale_x, s_wi,
                               "rh,rhcf->rcf", jnp.float32)  # fmt: skip
    e_gate, e_up = h_bound[:, 0], h_bound[:, 1]
    silu = r["gate"] / (1 + np.exp(-r["gate"]))
    a_err = SILU_SLOPE * e_gate * np.abs(r["up"]) + np.abs(silu) * e_up
    a_err = a_err + SILU_SLOPE * e_gate * e_up
    # The op's scale for a comes from its own amax, at most max(a_err) above the reference's.
    scale_a = 448.0 / (np.abs(r["a"]).max() + a_err.max())
    s_wo = _expert_scales(p["params"]["wo"], r["experts"])[:, None, None]
    ys_bound = gemm_error_bound(r["a"], r["rows_wo"], "e4m3", "e4m3", scale_a, s_wo,
                                "rf,rfh->rh", jnp.float32, a_error=a_err)  # fmt: skip
    bound = np.einsum("tkh,tk->th", ys_bound.reshape(-1, K, H), r["gates"])
    assert_within(np.asarray(y).reshape(-1, H), want, bound, "MoE output")
    assert np.abs(np.asarray(y).reshape(-1, H) - want).max() > 0
    aux = float(state["intermediates"]["aux_loss"][0])
    counts = np.bincount(r["experts"].reshape(-1), minlength=E) / (T * K)
    probs = np.exp(x.reshape(-1, H) @ p["params"]["router"])
    probs = np.asarray(probs / probs.sum(-1, keepdims=True), np.float64)
    np.testing.assert_allclose(aux, E * np.sum(counts * probs.mean(0)), rtol=1e-5)


def _gradients(params, x, fp8, recipe):
    """The gradients of ``sum(y * g)`` for the block's parameters and input."""
    g = jax.random.normal(jax.random.key(5), x.shape)

    def loss(params, x):
        block = _block(fp8=fp8, recipe=recipe)
        y, _ = block.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.sum(y * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


@pytest.fixture(scope="module")
def f32_gradients(setup):
    """The f32 block's (fp8=False) gradients: each recipe's test compares with the same."""
    x, p = setup
    return _gradients(p["params"], x, fp8=False, recipe=None)


@pytest.mark.parametrize("recipe", [None, fp8jax.BlockScaling(formats=fp8jax.HYBRID)],
                         ids=["current", "block"])  # fmt: skip
def test_gradients_track_the_f32_block(setup, f32_gradients, recipe):
    # The same block with fp8=False in f32 is the reference (its values are
    # lax.ragged_dot's); ref.MOE_GRADIENT_BUDGET says why its budget holds.
    # Under BlockScaling (HYBRID: the same formats) every tile's scale is at
    # least its tensor's, and the gradients are not converted to E5M2 a
    # second time: no larger error.
    x, p = setup
    errors = ref.gradient_errors(_gradients(p["params"], x, True, recipe), f32_gradients)
    assert all(0 < e < ref.MOE_GRADIENT_BUDGET for e in errors.values()), errors


@pytest.fixture(scope="module")
def linen_y(setup):
    """The per-tensor (default) Linen block's output: two tests compare with it."""
    x, p = setup
    return jax.jit(_block().apply)({"params": p["params"]}, x)


@pytest.mark.parametrize("recipe", [None, fp8jax.BlockScaling()], ids=["current", "block"])
def test_nnx_block_equals_linen_with_the_same_parameters(setup, recipe, request):
    x, p = setup
    block = fnnx.MoEBlock(H, num_experts=E, top_k=K, ffn=F, recipe=recipe, rngs=nnx.Rngs(0))
    for name in ("router", "wi", "wo"):
        getattr(block, name).set_value(p["params"][name])
    if recipe is None:
        want = request.getfixturevalue("linen_y")
    else:
        want = jax.jit(_block(recipe=recipe).apply)({"params": p["params"]}, x)
    got = nnx.jit(lambda block, x: block(x))(block, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(block.aux_loss[...]) > 0


def test_linen_block_under_nn_scan():
    # Two stacked blocks, parameters stacked on a leading axis.
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + _block(shared_experts=1, gating="sigmoid")(x), None

    stack = nn.scan(Layer, variable_axes={"params": 0, "intermediates": 0},
                    split_rngs={"params": True}, length=2,
                    metadata_params={nn.PARTITION_NAME: None})  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (T, H))
    variables = jax.jit(stack().init)(jax.random.key(1), x, None)
    assert nn.meta.unbox(variables)["params"]["MoEBlock_0"]["wi"].shape == (2, E, H, 2, F)
    run = jax.jit(lambda v, x: stack().apply(v, x, None, mutable=["intermediates"]))
    (y, _), state = run(variables, x)
    assert y.shape == x.shape and bool(jnp.isfinite(y).all())
    assert state["intermediates"]["MoEBlock_0"]["aux_loss"][0].shape == (2,)


def _h100_forward_and_backward(block):
    """``block``'s forward and backward on a (T, H) BF16 input, compiled for an H100 (HLO text)."""
    x = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    params = jax.eval_shape(lambda: nn.meta.unbox(block.init(jax.random.key(0), jnp.ones((T, H)))))

    def step(params, x):
        def f(params, x):
            return block.apply(params, x, mutable=["intermediates"])[0]

        y, vjp = jax.vjp(f, params, x)
        return vjp(y)

    return verify.compile_for(step, params, x, target="h100")


def test_every_expert_gemm_is_fp8_in_a_deviceless_h100_compile():
    # Forward and backward: the two grouped GEMMs x (fwd, dgrad, wgrad) are
    # Pallas FP8 kernels; the shared expert's GEMMs are FP8 dots; the only
    # other GEMM is the router (f32, [tokens, hidden] x [hidden, experts])
    # and its backward.
    report = verify.gemm_report(_h100_forward_and_backward(_block(shared_experts=1)))
    grouped = [g for g in report.gemms if g.target in verify.pallas_gemms.KERNELS]
    assert len(grouped) == 6 and all(g.backend == "pallas-fp8" for g in grouped)
    others = [g for g in report.non_fp8_gemms if g not in grouped]
    assert others and all(E in g.lhs_shape + g.rhs_shape for g in others), others
    shared = [g for g in report.fp8_gemms if g not in grouped]
    assert len(shared) == 6  # the shared expert's two dense GEMMs, fwd, dgrad, wgrad


@pytest.fixture(scope="module")
def block_scaled_hlo():
    """The BlockScaling block's forward and backward (one shared expert), compiled for an H100."""
    return _h100_forward_and_backward(_block(shared_experts=1, recipe=fp8jax.BlockScaling()))


def test_every_block_scaled_expert_gemm_is_the_block_kernel_in_a_deviceless_h100_compile(
    block_scaled_hlo,
):
    # Under BlockScaling (ALL_E4M3) each grouped GEMM, forward, dgrad and
    # wgrad, runs the block-scaled Mosaic GPU kernel batched over the
    # experts, a round of rows per expert at a time: 2 forward, 2 dgrad and
    # 2 x 2 wgrad (its first round, the accumulator, stands before the loop);
    # the shared expert's six are the same kernel on one batch; the rest is
    # the router.
    report = verify.gemm_report(block_scaled_hlo)
    kernel = [g for g in report.gemms if g.target == "fp8jax_block_scaled_gemm"]
    assert all(g.backend == "pallas-fp8" for g in kernel)
    experts = [g for g in kernel if g.lhs_shape[0] == E]
    assert len(experts) == 8
    assert len(kernel) - len(experts) == 6  # the shared expert's, fwd, dgrad, wgrad
    others = [g for g in report.gemms if g not in kernel]
    assert others and all(E in g.lhs_shape + g.rhs_shape for g in others), others


def _scatters(hlo: str) -> list[tuple[str, bool, tuple]]:
    """Every scatter in a compiled module: (combiner, in a loop body?, shape, unique indices?)."""
    module = _hlo.parse_module(hlo)
    bodies = {
        name
        for comp in module.computations.values()
        for inst in comp.instructions.values()
        if inst.opcode == "while"
        for name in inst.called  # its condition and body
    }
    out = []
    for comp in module.computations.values():
        for inst in comp.instructions.values():
            if inst.opcode == "scatter":
                root = module.computations[inst.called[-1]].root.opcode
                combiner = "set" if root == "parameter" else root
                looped = comp.name in bodies or _fused_in(module, comp, bodies)
                out.append((combiner, looped, inst.types[0].shape,
                            "unique_indices=true" in inst.attrs))  # fmt: skip
    return out


def _fused_in(module, comp, bodies) -> bool:
    """Whether ``comp`` (a fused computation) is called from one of ``bodies``."""
    return any(
        comp.name in inst.called
        for name in bodies
        for inst in module.computations[name].instructions.values()
    )


def test_block_scaled_block_has_no_scatter_max_in_a_deviceless_h100_compile(block_scaled_hlo):
    # The wgrad's token-tile amaxes are gathered tiles reduced densely: a
    # scatter-max (a segment max) serializes its atomics on the GPU. What
    # stays: each grouped GEMM's rounds set their rows in the output, in the
    # loop (forward and dgrad of both GEMMs), and the routing's two small
    # scatter-adds (the experts' row counts, the gates' gradient). The rows'
    # indices are unique (padding rows each go to their own dropped row):
    # with indices that may repeat, XLA sets each bf16 element by a
    # compare-and-swap loop.
    scatters = _scatters(block_scaled_hlo)
    assert not [s for s in scatters if s[0] == "maximum"], scatters
    # Rows of T * K slots: the forwards write 2 F (gate and up) and H padded
    # to 128; the dgrads write H padded to 128 and F (which is 128).
    rows = sorted(s[2] for s in scatters if s[:2] == ("set", True))
    assert rows == [(T * K, 128)] * 3 + [(T * K, 2 * F)], scatters
    assert all(s[3] for s in scatters if s[0] == "set"), scatters
    assert sorted(s[2] for s in scatters if s[0] == "add") == [(E,), (T, E)], scatters
    assert len(scatters) == 6, scatters


def test_permutations_backward_are_gathers_equal_to_the_transposed_takes():
    # To expert order (each token repeated top_k times) and back: the custom
    # backward passes gather by the inverse permutation where JAX's transpose
    # of jnp.take scatter-adds; same values (f32 sums of top_k terms, in
    # another order: a few ulps) and no scatter in the lowered backward.
    t, k, h, e = 40, 3, 8, 5
    keys = jax.random.split(jax.random.key(7), 4)
    flat = jax.random.randint(keys[0], (t * k,), 0, e)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    x2 = jax.random.normal(keys[1], (t, h))
    ys = jax.random.normal(keys[2], (t * k, h))
    g = jax.random.normal(keys[3], (t * k, h))

    def take_dispatch(x):
        return jnp.take(x, order // k, axis=0)

    pairs = [
        (lambda x: moe_ops.dispatch(x, order, inverse, k), take_dispatch, x2),
        (
            lambda y: moe_ops.combine(y, order, inverse),
            lambda y: jnp.take(y, inverse, axis=0),
            ys,
        ),
    ]
    for ours, reference, arg in pairs:
        (got, back), (want, back_ref) = jax.vjp(ours, arg), jax.vjp(reference, arg)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(back(g)[0], back_ref(g)[0], rtol=1e-6, atol=1e-6)
        lowered = jax.jit(lambda a, g, f=ours: jax.vjp(f, a)[1](g)).lower(arg, g).as_text()
        assert "scatter" not in lowered and "gather" in lowered


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"top_k": 5}, r"MoEBlock.top_k must be <= num_experts=4, got 5"),
        (
            {"gating": "relu"},
            r"MoEBlock.gating must be one of \('softmax', 'sigmoid'\), got 'relu'",
        ),
        ({"activation": "tanh"}, r"MoEBlock.activation must be one of .*got 'tanh'"),
        ({"shared_experts": -1}, r"MoEBlock.shared_experts must be an int >= 0, got -1"),
        ({"ffn": 0}, r"ffn must be an int >= 1, got 0"),
    ],
)
def test_bad_settings_name_the_argument_expected_and_given(kw, match):
    settings = {"num_experts": E, "top_k": K, "ffn": F, **kw}
    with pytest.raises(ValueError, match=match):
        fnn.MoEBlock(**settings)
    with pytest.raises(ValueError, match=match):
        fnnx.MoEBlock(H, **settings, rngs=nnx.Rngs(0))


def test_fp8_setting_must_be_a_bool():
    # Taken for its truth value, a config's "false" ran the FP8 experts.
    settings = {"num_experts": E, "top_k": K, "ffn": F, "fp8": "false"}
    with pytest.raises(TypeError, match=r"MoEBlock.fp8 must be a bool, got 'false'"):
        fnn.MoEBlock(**settings)
    with pytest.raises(TypeError, match=r"MoEBlock.fp8 must be a bool, got 'false'"):
        fnnx.MoEBlock(H, **settings, rngs=nnx.Rngs(0))


def test_numpy_int_settings_give_the_python_int_block():
    # The settings' checks take NumPy ints (a config read with NumPy); top_k
    # then failed at the first call, in fp8jax.moe_mlp, and shared_experts
    # was refused as "must be an int".
    # Each call jitted, as a model runs (the settings are static: traced the same way);
    # eagerly, every step of the block compiled on its own (5 s).
    x = jax.random.normal(jax.random.key(0), (2, 4, 16))
    ints = dict(num_experts=4, top_k=2, ffn=8, shared_experts=1)
    numpy_ints = {name: np.int64(value) for name, value in ints.items()}
    block = fnn.MoEBlock(**ints)
    variables = jax.jit(block.init)(jax.random.key(1), x)
    want = jax.jit(block.apply)(variables, x)
    np.testing.assert_array_equal(jax.jit(fnn.MoEBlock(**numpy_ints).apply)(variables, x), want)
    model = fnnx.MoEBlock(16, **numpy_ints, rngs=nnx.Rngs(0))
    assert nnx.jit(lambda model, x: model(x))(model, x).shape == x.shape
    logits = x.reshape(-1, 16) @ nn.meta.unbox(variables)["params"]["router"]
    args = (x.reshape(-1, 16), logits, jnp.ones((4, 16, 2, 8)), jnp.ones((4, 8, 16)))
    moe = jax.jit(fp8jax.moe_mlp, static_argnames="top_k")
    np.testing.assert_array_equal(moe(*args, top_k=np.int64(2))[0], moe(*args, top_k=2)[0])


@pytest.mark.parametrize("recipe", [fp8jax.MXFP8Scaling(), fp8jax.RowwiseScaling(),
                                    fp8jax.DelayedScaling()])  # fmt: skip
def test_recipes_the_expert_gemms_cannot_take_are_refused_at_construction(recipe):
    # MX scaling used to fail inside the op with an AttributeError, rowwise to
    # run per-tensor scaling, bitwise CurrentScaling.
    name = type(recipe).__name__
    match = rf"MoEBlock: the expert GEMMs take CurrentScaling or BlockScaling.*Got recipe={name}"
    with pytest.raises(ValueError, match=match):
        _block(recipe=recipe)
    with pytest.raises(ValueError, match=match):
        fnnx.MoEBlock(H, num_experts=E, top_k=K, ffn=F, recipe=recipe, rngs=nnx.Rngs(0))
    _block(recipe=recipe, fp8=False)  # BF16 experts take no FP8 recipe: nothing to refuse


@pytest.mark.parametrize("shape", [(0, 8, H), (2, 0, H)])
@pytest.mark.parametrize("fp8", [True, False])
def test_zero_tokens_give_the_empty_result_and_zero_gradients(shape, fp8):
    # Used to raise ZeroDivisionError (a reshape of zero rows by -1).
    block = _block(shared_experts=1, fp8=fp8)
    variables = nn.meta.unbox(jax.jit(block.init)(jax.random.key(1), jnp.ones((2, 8, H))))
    x = jnp.zeros(shape)

    def loss(variables, x):
        y, state = block.apply(variables, x, mutable=["intermediates"])
        return jnp.sum(y) + state["intermediates"]["aux_loss"][0], y

    # Init and steps jitted: run eagerly, the block's few hundred primitives were
    # each compiled for their shapes (6 s); the shapes, so the reshapes, are the same.
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (value, y), grads = step(variables, x)
    assert y.shape == shape and value == 0
    for g in jax.tree.leaves(grads):
        assert not np.any(np.asarray(g)), g
    assert grads[1].shape == shape
    model = fnnx.MoEBlock(H, num_experts=E, top_k=K, ffn=F, shared_experts=1, fp8=fp8,
                          rngs=nnx.Rngs(0))  # fmt: skip
    grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)) + m.aux_loss[...], argnums=(0, 1)))
    grads = grad(model, x)
    assert nnx.jit(lambda m, x: m(x))(model, x).shape == shape
    assert float(model.aux_loss[...]) == 0
    for g in jax.tree.leaves(grads):
        assert not np.any(np.asarray(g)), g
