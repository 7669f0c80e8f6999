"""Misuse fails at construction or init with a message naming the argument (Linen and NNX)."""

import functools
import re

import flax
import flax_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax.flax import Fp8DotGeneral, TrainState, checkpoint, make_train_step
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx
from fp8jax.flax.rotary import apply_rotary

DELAYED = fp8jax.DelayedScaling(amax_history_len=4)
BLOCK = fp8jax.BlockScaling()
X = jnp.ones((2, 8, 32))


def linen_init(module, x=X):
    return module.init(jax.random.key(0), x)


def nnx_make(cls, *args, **kwargs):
    # eval_shape: build the module without running its initializers.
    return nnx.eval_shape(lambda: cls(*args, **kwargs, rngs=nnx.Rngs(0)))


# (id, Linen thunk, NNX thunk, message); each thunk must raise ValueError.
CASES = [
    (
        "num_heads must divide the width",
        lambda: linen_init(fnn.MultiHeadAttention(3)),
        lambda: nnx_make(fnnx.MultiHeadAttention, 3, 32),
        "MultiHeadAttention: num_heads=3 must divide the hidden size 32",
    ),
    (
        "num_kv_heads must divide num_heads",
        lambda: fnn.MultiHeadAttention(4, num_kv_heads=3),
        lambda: nnx_make(fnnx.MultiHeadAttention, 4, 32, num_kv_heads=3),
        "MultiHeadAttention: num_kv_heads=3 must divide num_heads=4",
    ),
    (
        "num_heads positive",
        lambda: fnn.TransformerLayer(0, 64),
        lambda: nnx_make(fnnx.TransformerLayer, 0, 32, 64),
        "TransformerLayer: num_heads must be an int >= 1, got 0",
    ),
    (
        # NNX's layer named its MultiHeadAttention, a module the user never built.
        "num_heads must divide the width in a layer",
        lambda: linen_init(fnn.TransformerLayer(3, 64)),
        lambda: nnx_make(fnnx.TransformerLayer, 3, 32, 64),
        "TransformerLayer: num_heads=3 must divide the hidden size 32",
    ),
    (
        "unknown norm_type in a layer",
        lambda: fnn.TransformerLayer(4, 64, norm_type="batchnorm"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, norm_type="batchnorm"),
        "TransformerLayer: norm_type must be one of ('layernorm', 'rmsnorm'), got 'batchnorm'",
    ),
    (
        "unknown activation",
        lambda: fnn.LayerNormMLP(64, activations=("swish", "linear")),
        lambda: nnx_make(fnnx.LayerNormMLP, 32, 64, activations=("swish", "linear")),
        "LayerNormMLP: activations must be one or two names from",
    ),
    (
        "unknown activation in a layer",
        lambda: fnn.TransformerLayer(4, 64, activations="gelu_fast"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, activations="gelu_fast"),
        "activations must be one or two names from",
    ),
    (
        "intermediate_dim",
        lambda: fnn.LayerNormMLP(0),
        lambda: nnx_make(fnnx.LayerNormMLP, 32, 0),
        "LayerNormMLP: intermediate_dim must be an int >= 1, got 0",
    ),
    (
        "unknown norm_type",
        lambda: fnn.LayerNorm(norm_type="batchnorm"),
        lambda: nnx_make(fnnx.LayerNorm, 32, norm_type="batchnorm"),
        "LayerNorm: norm_type must be one of ('layernorm', 'rmsnorm'), got 'batchnorm'",
    ),
    (
        "dropout_rate",
        lambda: fnn.TransformerLayer(4, 64, dropout_rate=1.0),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, dropout_rate=1.0),
        "TransformerLayer: dropout_rate must be in [0, 1), got 1.0",
    ),
    (
        # RoPE's frequencies base**(-2i / d) were inf or NaN: NaN outputs, no error.
        "rope_base positive",
        lambda: fnn.MultiHeadAttention(4, use_rope=True, rope_base=0.0),
        lambda: nnx_make(fnnx.MultiHeadAttention, 4, 32, use_rope=True, rope_base=0.0),
        "MultiHeadAttention: rope_base must be a finite number > 0 (10000.0 in the RoPE paper), "
        "got 0.0",
    ),
    (
        "rope_base finite in a layer",
        lambda: fnn.TransformerLayer(4, 64, use_rope=True, rope_base=float("nan")),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, use_rope=True, rope_base=float("nan")),
        "TransformerLayer: rope_base must be a finite number > 0",
    ),
    (
        "norm_position",
        lambda: fnn.TransformerLayer(4, 64, norm_position="sandwich"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, norm_position="sandwich"),
        "TransformerLayer: norm_position must be one of ('pre', 'post'), got 'sandwich'",
    ),
    (
        "unknown attention_implementation",
        lambda: fnn.MultiHeadAttention(4, attention_implementation="flash"),
        lambda: nnx_make(fnnx.MultiHeadAttention, 4, 32, attention_implementation="flash"),
        "MultiHeadAttention.attention_implementation must be one of "
        "(None, 'xla', 'cudnn', 'fp8'), got 'flash'",
    ),
    (
        "unknown attention_implementation in a layer",
        lambda: fnn.TransformerLayer(4, 64, attention_implementation="flash"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, attention_implementation="flash"),
        "TransformerLayer.attention_implementation must be one of "
        "(None, 'xla', 'cudnn', 'fp8'), got 'flash'",
    ),
    (
        "residual_from_norm needs pre-norm",
        lambda: fnn.TransformerLayer(4, 64, norm_position="post", residual_from_norm=True),
        lambda: nnx_make(
            fnnx.TransformerLayer, 4, 32, 64, norm_position="post", residual_from_norm=True
        ),
        "residual_from_norm=True needs norm_position='pre'",
    ),
    (
        "layernorm output needs a norm",
        lambda: fnn.MultiHeadAttention(4, input_layernorm=False, return_layernorm_output=True),
        lambda: nnx_make(
            fnnx.MultiHeadAttention, 4, 32, input_layernorm=False, return_layernorm_output=True
        ),
        "return_layernorm_output=True needs input_layernorm=True",
    ),
    (
        "residual output needs a norm",
        lambda: fnn.MultiHeadAttention(4, input_layernorm=False, return_residual=True),
        lambda: nnx_make(
            fnnx.MultiHeadAttention, 4, 32, input_layernorm=False, return_residual=True
        ),
        "return_residual=True needs input_layernorm=True",
    ),
    (
        "residual output or layernorm output",
        lambda: fnn.LayerNormMLP(64, return_layernorm_output=True, return_residual=True),
        lambda: nnx_make(
            fnnx.LayerNormMLP, 32, 64, return_layernorm_output=True, return_residual=True
        ),
        "LayerNormMLP: return_residual and return_layernorm_output are alternatives",
    ),
    (
        "custom dot_general cannot keep delayed state",
        lambda: fnn.DenseGeneral(8, dot_general=jax.lax.dot_general, recipe=DELAYED),
        lambda: nnx_make(fnnx.DenseGeneral, 32, 8, dot_general=jax.lax.dot_general, recipe=DELAYED),
        "DenseGeneral: dot_general= replaces the FP8 op, so it cannot use recipe=DelayedScaling",
    ),
    (
        "custom dot_general cannot apply a fine-grained recipe",
        lambda: fnn.DenseGeneral(8, dot_general=jax.lax.dot_general, recipe=BLOCK),
        lambda: nnx_make(fnnx.DenseGeneral, 32, 8, dot_general=jax.lax.dot_general, recipe=BLOCK),
        "DenseGeneral: dot_general= replaces the FP8 op, so it cannot use recipe=BlockScaling",
    ),
    (
        "kernel_axes length",
        lambda: linen_init(fnn.DenseGeneral(8, kernel_axes=("embed",))),
        lambda: nnx_make(fnnx.DenseGeneral, 32, 8, kernel_axes=("embed",)),
        "DenseGeneral: kernel_axes names 1 axes, but the parameter has 2",
    ),
    (
        "features",
        lambda: fnn.DenseGeneral(-4),
        lambda: nnx_make(fnnx.DenseGeneral, 32, -4),
        "features must be an int >= 1, got -4",
    ),
]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize(("case", "linen", "nnx_", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_configuration_is_named(api, case, linen, nnx_, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        (linen if api == "linen" else nnx_)()


# (id, Linen thunk, NNX thunk, message); each thunk must raise TypeError. A switch
# was read for its truth value: a config's "False" turned the causal mask, RoPE,
# a bias or a returned residual on, and deterministic="False" turned dropout off.
FLAG_CASES = [
    (
        "causal",
        lambda: fnn.MultiHeadAttention(4, causal="False"),
        lambda: nnx_make(fnnx.MultiHeadAttention, 4, 32, causal="False"),
        "MultiHeadAttention: causal must be a bool, got 'False'",
    ),
    (
        "use_rope in a layer",
        lambda: fnn.TransformerLayer(4, 64, use_rope="False"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, use_rope="False"),
        "TransformerLayer: use_rope must be a bool, got 'False'",
    ),
    (
        "use_bias",
        lambda: fnn.DenseGeneral(8, use_bias="False"),
        lambda: nnx_make(fnnx.DenseGeneral, 32, 8, use_bias="False"),
        "DenseGeneral: use_bias must be a bool, got 'False'",
    ),
    (
        "return_residual",
        lambda: fnn.LayerNormMLP(64, return_residual=0),
        lambda: nnx_make(fnnx.LayerNormMLP, 32, 64, return_residual=0),
        "LayerNormMLP: return_residual must be a bool, got 0",
    ),
    (
        "return_layernorm_output",
        lambda: fnn.LayerNormDenseGeneral(8, return_layernorm_output="no"),
        lambda: nnx_make(fnnx.LayerNormDenseGeneral, 32, 8, return_layernorm_output="no"),
        "LayerNormDenseGeneral: return_layernorm_output must be a bool, got 'no'",
    ),
    (
        "input_layernorm",
        lambda: fnn.MultiHeadAttention(4, input_layernorm="False"),
        lambda: nnx_make(fnnx.MultiHeadAttention, 4, 32, input_layernorm="False"),
        "MultiHeadAttention: input_layernorm must be a bool, got 'False'",
    ),
    (
        "residual_from_norm",
        lambda: fnn.TransformerLayer(4, 64, residual_from_norm="False"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, residual_from_norm="False"),
        "TransformerLayer: residual_from_norm must be a bool, got 'False'",
    ),
    (
        "deterministic",
        lambda: fnn.TransformerLayer(4, 64, dropout_rate=0.1, deterministic="False"),
        lambda: nnx_make(fnnx.TransformerLayer, 4, 32, 64, dropout_rate=0.1, deterministic="False"),
        "TransformerLayer: deterministic must be a bool, got 'False'",
    ),
]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize(
    ("case", "linen", "nnx_", "message"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES]
)
def test_a_switch_that_is_not_a_bool_is_named(api, case, linen, nnx_, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        (linen if api == "linen" else nnx_)()


def test_a_call_time_deterministic_that_is_not_a_bool_is_named():
    message = "MultiHeadAttention: deterministic must be a bool, got 'False'"
    layer = fnn.MultiHeadAttention(4, dropout_rate=0.5)
    variables = linen_init(layer.clone(deterministic=True))
    with pytest.raises(TypeError, match=re.escape(message)):
        layer.apply(variables, X, deterministic="False", rngs={"dropout": jax.random.key(1)})
    attn = nnx_make(fnnx.MultiHeadAttention, 4, 32, dropout_rate=0.5)
    with pytest.raises(TypeError, match=re.escape(message)):
        attn(X, deterministic="False")
    # NumPy's bool is a bool (a config read through NumPy).
    assert layer.clone(deterministic=np.True_).apply(variables, X).shape == X.shape


def test_a_kernel_init_of_the_wrong_shape_is_named():
    # The transposed shape has the right size: it was reshaped silently.
    def transposed(key, shape, dtype=jnp.float32):
        return jnp.ones(shape[::-1], dtype)

    message = "kernel_init must return the shape it is asked for, (32, 8) (the kernel (32, 8) "
    with pytest.raises(ValueError, match=re.escape(message + "flattened to 2-D), got (8, 32)")):
        linen_init(fnn.DenseGeneral(8, kernel_init=transposed))
    with pytest.raises(ValueError, match=re.escape(message + "flattened to 2-D), got (8, 32)")):
        fnnx.DenseGeneral(32, 8, kernel_init=transposed, rngs=nnx.Rngs(0))
    message = "kernel_init must return the shape it is asked for, (32, 128) (the kernel (32, 2, 64)"
    with pytest.raises(ValueError, match=re.escape(message)):
        fnnx.LayerNormMLP(32, 64, kernel_init=lambda *_: jnp.ones((3, 3)), rngs=nnx.Rngs(0))


def test_wrong_input_rank():
    message = "MultiHeadAttention: x must have rank 3, got shape (8, 32) (rank 2)"
    with pytest.raises(ValueError, match=re.escape(message)):
        linen_init(fnn.MultiHeadAttention(4), jnp.ones((8, 32)))
    attn = fnnx.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape(message)):
        attn(jnp.ones((8, 32)))
    with pytest.raises(ValueError, match=re.escape("TransformerLayer: x must have rank 3")):
        linen_init(fnn.TransformerLayer(4, 64), jnp.ones((2, 4, 8, 32)))
    with pytest.raises(ValueError, match=re.escape("DenseGeneral: axis=(1, 2) is out of range")):
        linen_init(fnn.DenseGeneral(8, axis=(1, 2)), jnp.ones((4, 32)))


@pytest.mark.parametrize(
    ("mask", "given"),
    [
        # JAX's error was "incompatible shapes for broadcasting", from inside its attention.
        (jnp.ones((2, 1, 8, 9), bool), "shape (2, 1, 8, 9), dtype bool"),
        (jnp.ones((2, 1, 8, 8), jnp.float32), "shape (2, 1, 8, 8), dtype float32"),
    ],
    ids=["shape", "dtype"],
)
def test_a_mask_that_does_not_fit_is_named(mask, given):
    message = (
        "MultiHeadAttention: mask must be a bool array that broadcasts to (batch, heads, q_len, "
        f"kv_len) = (2, 4, 8, 8) (True attends), got {given}."
    )
    layer = fnn.TransformerLayer(4, 64)
    with pytest.raises(ValueError, match=re.escape(message)):
        jax.eval_shape(functools.partial(layer.init, mask=mask), jax.random.key(0), X)
    attn = fnnx.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape(message)):
        attn(X, mask=mask)
    # A mask that broadcasts is taken: one (q, k) mask for every sequence and head.
    assert attn(X, mask=jnp.tril(jnp.ones((8, 8), bool))).shape == X.shape


def test_an_axis_that_is_not_an_int_is_named():
    # It failed later as a tuple index ("tuple indices must be integers"), naming no argument.
    message = "DenseGeneral: axis must be an int or a tuple of ints, got (1.5,)"
    with pytest.raises(ValueError, match=re.escape(message)):
        linen_init(fnn.DenseGeneral(8, axis=(1.5,)))
    with pytest.raises(ValueError, match=re.escape(message)):
        nnx_make(fnnx.DenseGeneral, 32, 8, axis=(1.5,))


def test_nnx_input_width_must_match_in_features():
    layer = fnnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))
    message = "LayerNormMLP: x has size (48,) on axes (-1,) (shape (2, 48)), but the module was "
    with pytest.raises(ValueError, match=re.escape(message + "built with in_features=32")):
        layer(jnp.ones((2, 48)))
    with pytest.raises(ValueError, match=re.escape("gives 1 sizes; give one size per axis")):
        nnx_make(fnnx.DenseGeneral, 32, 8, axis=(-2, -1))


def test_delayed_scaling_apply_without_state_names_the_collection():
    layer = fnn.DenseGeneral(8, recipe=DELAYED)
    params = {"params": ref.init(layer, X)["params"]}
    # Flax's own error, naming the collection; any other error that mentions
    # fp8_state (a TypeError inside the module, say) is not this one.
    with pytest.raises(flax.errors.ScopeCollectionNotFound, match='collection "fp8_state"'):
        layer.apply(params, X)


def test_dot_general_drop_in_refuses_delayed_scaling():
    with pytest.raises(
        TypeError, match=re.escape("Fp8DotGeneral.recipe must be fp8jax.CurrentScaling")
    ):
        Fp8DotGeneral(recipe=DELAYED)


def test_train_step_errors():
    layer = fnn.DenseGeneral(8, recipe=DELAYED)
    variables = ref.init(layer, X)
    tx = optax.sgd(0.1)
    state = TrainState.create(variables, tx)
    loss_fn = lambda v, b: jnp.mean(layer.apply(v, b))  # noqa: E731
    step = make_train_step(loss_fn, tx, accumulation_steps=2)
    with pytest.raises(ValueError, match=re.escape("needs recipe=<the DelayedScaling")):
        step(state, X)
    step = make_train_step(loss_fn, tx, accumulation_steps=3, recipe=DELAYED)
    with pytest.raises(ValueError, match=re.escape("accumulation_steps=3 must divide the batch")):
        step(state, X)
    with pytest.raises(ValueError, match=re.escape("accumulation_steps must be an int >= 1")):
        make_train_step(loss_fn, tx, accumulation_steps=0)(state, X)
    with pytest.raises(ValueError, match=re.escape("collections ['batch_stats']")):
        TrainState.create({**variables, "batch_stats": {}}, tx)


def test_an_optimizer_factory_is_named():
    # optax.adam, not optax.adam(lr): AttributeError "'function' object has no attribute 'init'".
    message = "optimizer must be an optax.GradientTransformation (with init and update)"
    hint = "adam is the function that builds one: call it, e.g. adam(1e-3)."
    with pytest.raises(TypeError, match=re.escape(message) + ".*" + re.escape(hint)):
        TrainState.create({"params": {}}, optax.adam)
    with pytest.raises(TypeError, match="make_train_step: " + re.escape(message)):
        make_train_step(lambda v, b: 0.0, optax.adam)


def test_restore_without_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint for step None"):
        checkpoint.restore(tmp_path / "empty", {"w": jnp.zeros(2)})


def test_rotary_errors():
    with pytest.raises(ValueError, match="even head_dim, got 5"):
        apply_rotary(jnp.ones((1, 4, 2, 5)), jnp.arange(4))
    with pytest.raises(ValueError, match=re.escape("positions must have shape (4,) or (1, 4)")):
        apply_rotary(jnp.ones((1, 4, 2, 8)), jnp.arange(5))
    for base in (0.0, -10000.0, float("inf")):
        with pytest.raises(
            ValueError, match=re.escape(f"base must be a finite number > 0, got {base}")
        ):
            apply_rotary(jnp.ones((1, 4, 2, 8)), jnp.arange(4), base=base)
