"""MoEBlock under data parallelism and FSDP: each device routes its own tokens.

No expert axis: each device sorts its own ``(token, slot)`` pairs by expert
and runs every expert on its own rows inside one ``shard_map``
(:func:`fp8jax.flax._expert_parallel.local`), the FSDP-split expert weights
all-gathered in FP8 and their gradients reduce-scattered. On 8 CPU devices
the values and gradients equal one device's; the deviceless 8-H100 compiles
move no token row between devices.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_expert_parallel import BACKWARD, FORWARD, _assert_within, _block, _loss

import fp8jax
import fp8jax.sharding as fs
from fp8jax import verify
from fp8jax.flax import linen as fnn

E = 16
MESHES = {"fsdp8": {"fsdp": 8}, "dp2_fsdp4": {"dp": 2, "fsdp": 4}, "dp8": {"dp": 8}}


@pytest.fixture(scope="module")
def inputs():
    x = jax.random.normal(jax.random.key(0), (8, 12, 64))
    params = nn.meta.unbox(jax.jit(_block().init)(jax.random.key(1), x))["params"]
    return x, params, {}  # the one-device runs, by fp8


@pytest.mark.parametrize(
    "mesh,fp8",
    [("fsdp8", True), ("dp2_fsdp4", True), ("dp2_fsdp4", False), ("dp8", True)],
    ids=["fsdp8-fp8", "dp2_fsdp4-fp8", "dp2_fsdp4-bf16", "dp8-fp8"],
)
def test_local_routing_gives_the_single_device_values_and_gradients(inputs, mesh, fp8):
    # The same FP8 operands on both sides: every per-tensor amax is max-reduced
    # over the token axes and each expert's weight amax over the FSDP axes, so
    # only the order of f32 sums differs; the budgets are test_expert_parallel's.
    x, params, one_device = inputs
    block = _block(fp8=fp8)
    if fp8 not in one_device:
        one_device[fp8] = _loss(block)(params, x)
    (_, (want_y, want_aux)), want_grads = one_device[fp8]
    with fs.use_mesh(fs.make_mesh(**MESHES[mesh])):
        step = _loss(block)
        jaxpr = str(jax.make_jaxpr(step)(params, x))
        (_, (y, aux)), grads = step(params, x)
    assert "shard_map" in jaxpr and "all_to_all" not in jaxpr
    if fp8 and "fsdp" in MESHES[mesh]:  # the FP8 weights gathered, their gradients scattered
        assert "all_gather" in jaxpr and "reduce_scatter" in jaxpr
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=1e-5)
    _assert_within(y, want_y, FORWARD, "y")
    _assert_within(grads[1], want_grads[1], BACKWARD, "dx")
    for name in ("router", "wi", "wo"):
        _assert_within(grads[0][name], want_grads[0][name], BACKWARD, f"d{name}")


@pytest.mark.parametrize("placed", [False, True], ids=["whole", "placed"])
def test_explicit_fsdp_axes_route_locally_and_give_the_single_device_values(inputs, placed):
    # Under Explicit axes the block reshards into the same shard_map as under
    # Auto ones (no all_to_all, the FSDP weights gathered): inputs given whole
    # are split there, and inputs already split over the batch (as the train
    # step places them) stay where they are. The result is sharded like x.
    # No warning: the grouped GEMMs run on each device's rows, not lax.ragged_dot.
    x, params, one_device = inputs
    block = _block()
    if True not in one_device:
        one_device[True] = _loss(block)(params, x)
    (_, (want_y, want_aux)), want_grads = one_device[True]
    explicit = fs.make_mesh(fsdp=8, axis_types=jax.sharding.AxisType.Explicit)
    if placed:
        abstract = jax.eval_shape(block.init, jax.random.key(1), x)
        shardings = nn.meta.unbox(fs.variable_shardings(abstract, explicit))["params"]
        params = jax.device_put(params, shardings)
        x = jax.device_put(x, fs.named_sharding(explicit, ("batch",)))
    with fs.use_mesh(explicit):
        step = _loss(block)
        jaxpr = str(jax.make_jaxpr(step)(params, x))
        (_, (y, aux)), grads = step(params, x)
    assert "shard_map" in jaxpr and "all_to_all" not in jaxpr
    assert "all_gather" in jaxpr and "reduce_scatter" in jaxpr
    like_x = fs.named_sharding(explicit, ("batch",) if placed else ())
    assert y.sharding.is_equivalent_to(like_x, y.ndim), y.sharding
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=1e-5)
    _assert_within(y, want_y, FORWARD, "y")
    _assert_within(grads[1], want_grads[1], BACKWARD, "dx")
    for name in ("router", "wi", "wo"):
        _assert_within(grads[0][name], want_grads[0][name], BACKWARD, f"d{name}")


# Uncombined collectives, so that each reports its own dtype and shape.
NO_COMBINING = " ".join(f"--xla_gpu_{kind}_combine_threshold_bytes=0"
                        for kind in ("all_gather", "reduce_scatter", "all_reduce"))  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("mesh", ["fsdp8", "dp2_fsdp4", "fsdp8_explicit"])
def test_h100_train_step_moves_no_token_row_and_runs_every_expert_gemm_in_fp8(mesh):
    # 8 H100s, 768 tokens of hidden 256 (96 per device, 192 slots): the six
    # grouped GEMMs (forward, dgrad, wgrad of both) are Pallas FP8 kernels on
    # each device's rows; what crosses devices is the experts' weights in FP8
    # (all-gathers), their gradients (reduce-scatters), the router's gradient
    # and scalar statistics: no collective has a token or slot dimension.
    t, hidden = 768, 256
    if mesh == "fsdp8_explicit":  # placed as the step's inputs are: no reshard moves rows
        sharding_mesh = fs.make_mesh(fsdp=8, axis_types=jax.sharding.AxisType.Explicit)
    else:
        sharding_mesh = fs.make_mesh(**MESHES[mesh])
    block = _block(dtype=jnp.bfloat16, shared_experts=1)
    x = jax.ShapeDtypeStruct((8, t // 8, hidden), jnp.bfloat16)
    abstract = jax.eval_shape(block.init, jax.random.key(0), x)
    shardings = nn.meta.unbox(fs.variable_shardings(abstract, sharding_mesh))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.meta.unbox(abstract), shardings)["params"]  # fmt: skip
    x = jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=fs.named_sharding(sharding_mesh, ("batch",))
    )

    def step(params, x):
        def loss(params, x):
            y, _ = block.apply({"params": params}, x, mutable=["intermediates"])
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    with fs.use_mesh(sharding_mesh):
        hlo = verify.compile_for(step, params, x, target="h100", devices=8,
                                 xla_flags=NO_COMBINING)  # fmt: skip
    report = verify.gemm_report(hlo)
    grouped = [g for g in report.gemms if g.target in verify.pallas_gemms.KERNELS]
    assert len(grouped) == 6 and all(g.backend == "pallas-fp8" for g in grouped), grouped
    assert all(g.rhs_shape[0] == E for g in grouped if g.target == "fp8jax_grouped_gemm")
    rest = report.non_fp8_gemms
    assert rest and all(g.lhs_dtype == g.rhs_dtype == "f32" for g in rest), rest  # the router
    collectives = [(c.kind, c.dtype, tuple(c.shape)) for c in report.collectives]
    rows = {t, t // 8, 2 * t, 2 * t // 8}  # tokens and slots, global and per device
    assert not [c for c in collectives if rows & set(c[2])], collectives
    assert not [c for c in collectives if c[0] == "all-to-all"], collectives
    gathers = [c for c in collectives if c[0] == "all-gather"]
    experts = [c for c in gathers if c[2][:1] == (E,)]
    assert len(experts) >= 2 and all(c[1].startswith("f8") for c in experts), gathers
    scatters = [c for c in collectives if c[0] == "reduce-scatter" and c[2][:1] == (E,)]
    assert len(scatters) >= 2, collectives


def test_block_scaled_fsdp_experts_are_quantized_per_shard_and_gathered_in_fp8():
    # Hidden 1024 over fsdp=8: each device's shard is one 128-row block of
    # every expert's weights, quantized there and all-gathered in FP8. The
    # forward and the input gradient read each token's 1x128 tiles and the
    # whole experts' blocks, the same FP8 operands as one device: only f32
    # sums move (test_expert_parallel's budgets; the router's gradient
    # follows from them). The weights' gradients tile each device's own
    # rows of a group, not one device's: another rounding of the same
    # values, each within ((1 + 2**-4)**2 - 1) of its |.|-products of the
    # exact one (E4M3 both operands), normwise far less; the two runs differ
    # by at most twice that.
    # Four experts, not the module's 16: on 8 CPU devices each device runs every
    # expert's 128-row rounds on its own rows, so the sharded step's time grows
    # with the experts (7.5 s at 16, 1.8 s at 4), and nothing above depends on
    # their count; the wgrads' relative differences were 0.027 at 16, 0.036 at 4.
    hidden, experts = 1024, 4
    x = jax.random.normal(jax.random.key(0), (8, 12, hidden))
    block = fnn.MoEBlock(num_experts=experts, top_k=2, ffn=128, recipe=fp8jax.BlockScaling())
    params = nn.meta.unbox(jax.jit(block.init)(jax.random.key(1), x))["params"]
    (_, (want_y, _)), want_grads = _loss(block)(params, x)
    with fs.use_mesh(fs.make_mesh(fsdp=8)):
        step = _loss(block)
        jaxpr = str(jax.make_jaxpr(step)(params, x))
        (_, (y, _)), grads = step(params, x)
    assert "all_gather" in jaxpr and "reduce_scatter" in jaxpr
    _assert_within(y, want_y, FORWARD, "y")
    _assert_within(grads[1], want_grads[1], BACKWARD, "dx")
    _assert_within(grads[0]["router"], want_grads[0]["router"], BACKWARD, "drouter")
    for name in ("wi", "wo"):
        got, want = np.asarray(grads[0][name]), np.asarray(want_grads[0][name])
        relative = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 0 < relative < 2 * ((1 + 2.0**-4) ** 2 - 1), (name, relative)


def test_block_scaled_fsdp_shards_of_partial_blocks_are_refused(inputs):
    # hidden 64 over fsdp=8: 8 rows a shard, no whole 128x128 block.
    x, params, _ = inputs
    block = _block(recipe=fp8jax.BlockScaling())
    match = r"whole 128x128 blocks.*shard of shape \(16, 8, 64\)"
    with fs.use_mesh(fs.make_mesh(fsdp=8)), pytest.raises(ValueError, match=match):
        _loss(block)(params, x)
