"""fp8jax.models: the GPT in FP8 and BF16 has the same parameters; only its GEMMs differ."""

import doctest
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax.flax import TrainState, make_train_step
from fp8jax.models import Gpt, GptConfig, bf16_layer, gpt, next_token_loss
from fp8jax.verify.jaxpr_dots import jaxpr_dots

CONFIG = GptConfig(hidden=32, layers=2, heads=2, ffn=64)
TOKENS = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)


@functools.cache
def _init(precision, recipe=None):
    model = Gpt(config=CONFIG, precision=precision, recipe=recipe)
    return model, jax.jit(model.init)(jax.random.key(0), TOKENS[:, :-1])


@pytest.mark.parametrize("recipe", [None, fp8jax.DelayedScaling(amax_history_len=4)])
def test_fp8_and_bf16_models_start_from_the_same_parameters(recipe):
    _, fp8 = _init("fp8", recipe)
    _, bf16 = _init("bf16")
    assert jax.tree.structure(fp8["params"]) == jax.tree.structure(bf16["params"])
    for a, b in zip(jax.tree.leaves(fp8["params"]), jax.tree.leaves(bf16["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The same logical axis names, so both shard the same way.
    assert nn.get_partition_spec(fp8["params"]) == nn.get_partition_spec(bf16["params"])
    n = sum(x.size for x in jax.tree.leaves(nn.meta.unbox(fp8["params"])))
    assert n == CONFIG.num_params()
    assert ("fp8_state" in fp8) == (recipe is not None)


def test_layers_are_scanned_with_a_leading_layer_axis():
    _, variables = _init("fp8", fp8jax.DelayedScaling(amax_history_len=4))
    kernel = variables["params"]["blocks"]["layer"]["mlp"]["kernel_1"]
    assert kernel.value.shape == (CONFIG.layers, 32, 2, 64)
    assert kernel.names[0] == "layers"
    scales = variables["fp8_state"]["blocks"]["layer"]["mlp"]["scales"]
    assert scales.fc1.x.amax_history.shape == (CONFIG.layers, 4)


def _train_step(model, variables):
    """(SGD train step of ``model``, its initial TrainState)."""
    tx = optax.sgd(0.1)

    def loss_fn(v, batch):
        return next_token_loss(model.apply(v, batch[:, :-1]), batch[:, 1:])

    return make_train_step(loss_fn, tx), TrainState.create(nn.meta.unbox(variables), tx)


def _step_dots(precision, recipe=None):
    step, state = _train_step(*_init(precision, recipe))
    with jax.numpy_dtype_promotion("standard"):
        return jaxpr_dots(step, state, TOKENS)


@pytest.mark.parametrize("recipe", [None, fp8jax.DelayedScaling(amax_history_len=4)])
def test_fp8_train_step_runs_every_block_gemm_in_fp8(recipe):
    dots = _step_dots("fp8", recipe)
    fp8 = [d for d in dots if d.is_fp8]
    # Per layer (the scan body counts once): QKV, out, fc1, fc2, forward and 2 backward each.
    assert len(fp8) == 12
    formats = {d.operand_formats for d in fp8}
    assert formats == {
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
    }
    # The rest, by design not FP8: the attention core (2 forward, 4 backward), the LM head
    # (1 + 2, flax's Dense in linear.py) and the one-hot byte embedding (1 + its wgrad).
    rest = [d.source.rsplit("/", 1)[-1].split(":")[0] for d in dots if not d.is_fp8]
    assert sorted(rest) == ["_attention.py"] * 6 + ["gpt.py"] * 2 + ["linear.py"] * 3


@pytest.fixture(scope="module")
def h100_steps():
    """``{unroll_layers: HLO}``: the FP8 train step unrolled and rolled, in one child process."""
    from fp8jax.verify import compile_many

    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    _, variables = _init("fp8", recipe)
    calls = []
    for unroll_layers in (True, False):
        model = Gpt(config=CONFIG, precision="fp8", recipe=recipe, unroll_layers=unroll_layers)
        step, state = _train_step(model, variables)
        calls.append((step, (state, TOKENS)))
    with jax.numpy_dtype_promotion("standard"):
        return dict(zip((True, False), compile_many(calls, target="h100"), strict=True))


@pytest.mark.deviceless
@pytest.mark.parametrize("unroll_layers", [True, False])
def test_unrolled_layers_compile_to_no_layer_loop_and_all_fp8_gemms(unroll_layers, h100_steps):
    # Rolled, the scan is a while loop whose stacked saved activations the
    # GPU backend copies slot by slot (Gpt.unroll_layers); unrolled, no loop.
    from fp8jax.verify import _hlo, gemm_report

    hlo = h100_steps[unroll_layers]
    loops = [
        i for c in _hlo.parse_module(hlo).computations.values()
        for i in c.instructions.values() if i.opcode == "while"
    ]  # fmt: skip
    assert bool(loops) != unroll_layers
    report = gemm_report(hlo)
    # Rolled, the report walks the loop body once: one layer's GEMMs. Unrolled,
    # each layer's appear on their own.
    copies = CONFIG.layers if unroll_layers else 1
    # Per layer: QKV, out, fc1, fc2, forward and 2 backward each, all FP8.
    assert len(report.fp8_gemms) == 12 * copies
    assert {(g.lhs_dtype, g.rhs_dtype) for g in report.fp8_gemms} == {
        ("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"),
    }  # fmt: skip
    # The rest, by design not FP8 (as in the jaxpr test above): the attention
    # core (6 per layer), the LM head (3) and the byte embedding's gradient (2).
    assert len(report.non_fp8_gemms) == 6 * copies + 5
    assert not any(g.upcast_from_fp8 for g in report.gemms)


def test_bf16_train_step_has_the_same_gemms_in_bf16():
    dots = _step_dots("bf16")
    assert len(dots) == 23
    assert not any(d.is_fp8 for d in dots)
    blocks = [d for d in dots if "bf16_layer.py" in d.source]
    assert len(blocks) == 12
    assert {d.operand_formats for d in blocks} == {("bfloat16", "bfloat16")}


def test_fp8_and_bf16_logits_agree_to_fp8_precision():
    model8, variables = _init("fp8")
    model16, _ = _init("bf16")
    x = TOKENS[:, :-1]
    with jax.numpy_dtype_promotion("standard"):
        y8 = jax.jit(model8.apply)(variables, x).astype(jnp.float32)
        y16 = jax.jit(model16.apply)(variables, x).astype(jnp.float32)
    assert y8.shape == (2, 16, 256)
    err = float(jnp.linalg.norm(y8 - y16) / jnp.linalg.norm(y16))
    # Sixteen E4M3 roundings along the two layers: both operands of QKV, out, fc1 and fc2 in
    # each. A rounding errs by 0.425 u relative RMS (u = 2**-4, mantissas log-uniform;
    # tests/flax/flax_reference.py), k independent ones by sqrt(k) of that: 0.106 for 16,
    # and 1.5 times that is the budget (0.159). A block output 1.25 times the right one
    # errs by about 0.2 here.
    assert 0 < err < 1.5 * np.sqrt(16) * np.sqrt(0.541 / 3) * 2.0**-4, err


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="GptConfig.heads=3 must divide hidden=32"):
        GptConfig(hidden=32, layers=1, heads=3, ffn=64)
    with pytest.raises(ValueError, match="GptConfig.layers must be an int >= 1"):
        GptConfig(hidden=32, layers=0, heads=2, ffn=64)
    with pytest.raises(ValueError, match="precision must be one of"):
        Gpt(config=CONFIG, precision="fp16")
    with pytest.raises(ValueError, match="recipe=None"):
        Gpt(config=CONFIG, precision="bf16", recipe=fp8jax.CurrentScaling())


@pytest.mark.parametrize("module", [gpt, bf16_layer])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_one_hot_embedding_is_nn_embed_with_a_gemm_for_a_gradient():
    from fp8jax.models.gpt import ByteEmbed

    init = nn.initializers.normal(stddev=0.02)
    ours = ByteEmbed(256, 64, embedding_init=init)
    flax_embed = nn.Embed(256, 64, dtype=jnp.bfloat16, embedding_init=init)
    tokens = jax.random.randint(jax.random.key(3), (4, 32), 0, 256)
    params = ours.init(jax.random.key(0), tokens)
    # Same parameter name, shape and initial values as nn.Embed.
    want = flax_embed.init(jax.random.key(0), tokens)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, want))
    # Forward: each output row is one table row times 1, so bitwise the lookup.
    np.testing.assert_array_equal(ours.apply(params, tokens), flax_embed.apply(params, tokens))
    # Gradient: the same per-row sums. The GEMM accumulates in f32 and rounds once to bf16
    # (relative error <= 2**-8); the reference sums in f32 from bf16 cotangents.
    g = jax.random.normal(jax.random.key(4), (4, 32, 64)).astype(jnp.bfloat16)
    got = jax.grad(lambda p: jnp.vdot(ours.apply(p, tokens), g).astype(jnp.float32))(params)
    table_grad = np.zeros((256, 64), np.float32)
    np.add.at(table_grad, np.asarray(tokens).ravel(), np.asarray(g, np.float32).reshape(-1, 64))
    np.testing.assert_allclose(got["params"]["embedding"], table_grad, rtol=2**-8, atol=1e-6)
