"""fp8jax.flax.linen.TransformerLayer: against a Flax-built block; its FP8 GEMM count."""

import flax.linen as nn
import flax_reference as ref
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax.flax import linen as fnn
from fp8jax.verify.jaxpr_dots import jaxpr_dots

CASES = [
    {},
    {"norm_position": "post", "causal": True},
    {
        "residual_from_norm": True,
        "num_kv_heads": 2,
        "use_rope": True,
        "causal": True,
        "norm_type": "rmsnorm",
        "activations": ("silu", "linear"),
    },
]


@pytest.mark.parametrize("kwargs", CASES, ids=["pre", "post", "swiglu-gqa-rope-rms"])
def test_matches_flax_block(kwargs):
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = fnn.TransformerLayer(4, 64, **kwargs)
    params = ref.init_params(layer, x)
    y = ref.apply(layer, {"params": params}, x)
    rope = 10000.0 if kwargs.get("use_rope") else None
    static = {k: v for k, v in kwargs.items() if k != "use_rope"}
    want = ref.run(ref.transformer, params, x, num_heads=4, rope_base=rope, **static)
    # Four FP8 GEMMs, eight E4M3 operands, measured on what the block adds to
    # its input (the residual stream itself is exact).
    baseline = (
        None if kwargs.get("norm_position") == "post" or kwargs.get("residual_from_norm") else x
    )
    assert ref.relative_error(y, want, baseline) < ref.fp8_budget(8)
    # The same block with every GEMM operand rounded to E4M3 as the layer
    # rounds it: only f32 roundoff remains, so a wrong head grouping or a
    # rotation applied to the queries alone (a few percent) cannot hide in
    # the FP8 budget above.
    fake = ref.run(ref.transformer, params, x, num_heads=4, rope_base=rope, fake_quant=True,
                   **static)  # fmt: skip
    assert ref.relative_error(y, fake, baseline) < ref.FAKE_QUANT_BUDGET


@pytest.mark.parametrize("recipe", [None, fp8jax.DelayedScaling(amax_history_len=4)])
def test_forward_backward_has_twelve_fp8_gemms(recipe):
    layer = fnn.TransformerLayer(4, 64, num_kv_heads=2, causal=True, use_rope=True, recipe=recipe)
    x = jnp.ones((2, 8, 32), jnp.bfloat16)
    variables = ref.init(layer, x)

    def loss(variables, x):
        return jnp.mean(jnp.square(layer.apply(variables, x).astype(jnp.float32)))

    dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1)), variables, x)
    fp8 = [d for d in dots if d.is_fp8]
    # QKV, out-proj, fc1, fc2: forward, dgrad, wgrad each.
    assert len(fp8) == 12
    formats = sorted(d.operand_formats for d in fp8)
    assert formats.count(("float8_e4m3fn", "float8_e4m3fn")) == 4  # forward
    assert formats.count(("float8_e5m2", "float8_e4m3fn")) == 4  # dgrad
    assert formats.count(("float8_e4m3fn", "float8_e5m2")) == 4  # wgrad
    # Everything else is the attention core (QK^T, PV and their gradients),
    # traced from the module's one dot_product_attention call.
    rest = [d for d in dots if not d.is_fp8]
    assert len(rest) == 6
    assert all("_attention.py" in d.source for d in rest), [d.source for d in rest]


def test_logical_axes_cover_every_param():
    layer = fnn.TransformerLayer(4, 64)
    variables = ref.init(layer, jnp.ones((1, 4, 32)))
    boxes = jax.tree.leaves(variables["params"], is_leaf=lambda b: isinstance(b, nn.Partitioned))
    assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
    assert all(len(b.names) == b.value.ndim for b in boxes)
    names = {n for b in boxes for n in b.names}
    assert names == {"embed", "mlp", "act", "heads", "qkv", "kv"}


# standard_promotion: JAX's bf16 attention backward (conftest.py).
@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.deviceless
def test_h100_compile_runs_twelve_fp8_gemms():
    from fp8jax import verify

    layer = fnn.TransformerLayer(4, 128, causal=True, dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((2, 16, 64), jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)

    def step(variables, x):
        # value_and_grad: with the loss's value unused, XLA would drop the fc2 forward GEMM.
        loss = lambda v: jnp.mean(jnp.square(layer.apply(v, x).astype(jnp.float32)))  # noqa: E731
        return jax.value_and_grad(loss)(variables)

    # The attention core (QK^T, PV and their four gradients) stays BF16/F32 by
    # design: jax.nn.dot_product_attention's vmapped einsums under "attention".
    report = verify.assert_fp8_gemms(
        step, variables, x, target="h100", expect=12, allow=(r"/attention/vmap\(",)
    )
    assert len(report.non_fp8_gemms) == 6
    assert all("/attention/vmap(" in row.op_name for row in report.non_fp8_gemms)
    names = [row.op_name for row in report.fp8_gemms]
    for projection, count in (("attention/qkv", 3), ("attention/out", 3), ("mlp", 6)):
        assert sum(f"/{projection}/" in n for n in names) == count, names


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.deviceless
def test_h200_compile_takes_the_qkv_gradients_row_maxima_per_token():
    # Under current scaling the QKV gradient's amax comes out of the fusion
    # that applies the RoPE backward to the attention's dq, dk and dv. Reduced
    # over rows of one 128-wide head, that fusion ran at under half the speed
    # it runs with a token's rows (docs/design.md#the-amax-over-rows-of-a-token):
    # every QKV maxima fusion of the backward reduces to (batch, tokens) or less.
    import re

    from fp8jax import verify

    layer = fnn.TransformerLayer(
        4, 1024, num_kv_heads=2, head_dim=128, use_rope=True, causal=True, norm_type="rmsnorm",
        activations=("silu", "linear"), use_bias=False, dtype=jnp.bfloat16,
    )  # fmt: skip
    x = jax.ShapeDtypeStruct((2, 128, 512), jnp.bfloat16)
    variables = jax.eval_shape(layer.init, jax.random.key(0), x)

    def step(variables, x):
        loss = lambda v, x: jnp.mean(jnp.square(layer.apply(v, x).astype(jnp.float32)))  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1))(variables, x)

    hlo = verify.compile_for(step, variables, x, target="h200")
    fusion = re.compile(r"= \(?(?:bf16|f32)\[([\d,]*)\][^\n]*? fusion\([^\n]*qkv/reduce_max")
    backward = [line for line in hlo.splitlines() if "transpose(jvp(" in line]
    maxima = [m.group(1) for line in backward if (m := fusion.search(line))]
    assert maxima, "no QKV maxima fusion in the backward"
    assert all(len(dims.split(",")) <= 2 for dims in maxima if dims), maxima
    assert "2,128" in maxima, maxima


def test_logical_names_shard_over_a_mesh():
    # Auto axes: the FP8 ops take no out_sharding, which Explicit axes would need.
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
    rules = (("embed", None), ("mlp", "model"), ("heads", "model"), ("batch", "data"))
    layer = fnn.TransformerLayer(4, 64, num_kv_heads=4)
    x = jnp.ones((2, 8, 32))
    abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    variables = jax.jit(layer.init, out_shardings=shardings)(jax.random.key(0), x)
    kernel = variables["params"]["mlp"]["kernel_1"].value
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    qkv = variables["params"]["attention"]["qkv"]["kernel"].value
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, None)
    assert jax.jit(layer.apply)(variables, x).shape == x.shape
