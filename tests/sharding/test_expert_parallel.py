"""MoEBlock under expert parallelism (ShardingConfig.ep): values, compiled structure, errors.

On the 8 fake CPU devices the exchange is the all_to_all emulation of
``ragged_all_to_all`` (XLA:CPU has no lowering for the latter), which takes
the same plan (offsets and sizes), so these tests check the plan end to end;
the deviceless 8-H100 compile checks that CUDA gets ``ragged-all-to-all``.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs
from fp8jax import verify
from fp8jax.flax import _expert_parallel
from fp8jax.flax import linen as fnn
from fp8jax.flax import nnx as fnnx
from fp8jax.ops import moe as moe_ops

E, K, H, F = 16, 2, 64, 32
B, S = 8, 12  # 96 tokens, 12 per device
U = 2.0**-24  # f32 unit roundoff
EP = fs.ShardingConfig(ep="ep")
LAYOUTS = {  # mesh sizes, config
    "ep8": ({"ep": 8}, EP),
    "dp2_ep4": ({"dp": 2, "ep": 4}, EP),
    "ep_on_dp8": ({"dp": 8}, fs.ShardingConfig(ep="dp")),
    # the experts take fsdp before their hidden axis could: whole experts per device
    "ep_on_fsdp8": ({"fsdp": 8}, fs.ShardingConfig(ep="fsdp")),
}


# Budgets relative to each output's peak (derived in
# test_expert_parallel_block_gives_the_single_device_values).
FORWARD = 2 * U * (H + H + F + K)
BACKWARD = FORWARD + 2 * U * (2 * F + H + B * S * K)
AUX = 2 * U * (E + B * S * K)


def _assert_within(got, want, budget, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    peak = np.abs(want).max()
    assert peak > 0, name
    np.testing.assert_allclose(got, want, rtol=0, atol=budget * peak, err_msg=name)


def _block(fp8=True, **kw):
    return fnn.MoEBlock(num_experts=E, top_k=K, ffn=F, fp8=fp8, **kw)


def _skewed_inputs():
    """Inputs and parameters whose routing is uneven: hot experts, and expert 3 gets no token.

    Feature 0 of every token is 4, and router row 0 adds a per-expert bias
    of 4 * row0 to the logits: +3 for experts 0 and 1, -40 for expert 3.
    """
    x = jax.random.normal(jax.random.key(0), (B, S, H)).at[..., 0].set(4.0)
    params = nn.meta.unbox(jax.jit(_block().init)(jax.random.key(1), x))["params"]
    bias = jnp.zeros((E,)).at[jnp.array([0, 1])].set(3.0).at[3].set(-40.0)
    params["router"] = params["router"].at[0].set(bias / 4.0)
    return x, params


def _loss(block):
    def loss(params, x):
        y, state = block.apply({"params": params}, x, mutable=["intermediates"])
        aux = state["intermediates"]["aux_loss"][0]
        weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y * weights) + aux, (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def skewed():
    return _skewed_inputs()


# The blocks the layouts' tests compare with themselves on one device.
ONE_DEVICE_BLOCKS = {
    "fp8": {},
    "no_fp8": {"fp8": False},
    "block_scaled": {"recipe": fp8jax.BlockScaling()},
}


@pytest.fixture(scope="module")
def one_device(skewed):
    """``run(name)``: ``_loss`` of the block ``ONE_DEVICE_BLOCKS[name]`` on the skewed inputs,
    on one device (no mesh), computed once.

    Every layout's test compares with the same single-device step of the same
    block on the same inputs; each compiled and ran it again (12 runs of 3
    programs).
    """
    x, params = skewed
    results = {}

    def run(name):
        if name not in results:
            results[name] = _loss(_block(**ONE_DEVICE_BLOCKS[name]))(params, x)
        return results[name]

    return run


def test_the_skewed_routing_is_uneven_and_leaves_an_expert_empty(skewed):
    x, params = skewed
    _, experts, _ = moe_ops.route(x.reshape(-1, H) @ params["router"], K, "softmax")
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=E)
    assert counts[3] == 0 and counts.max() >= 4 * counts.sum() / E, counts


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "no_fp8"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_block_gives_the_single_device_values(skewed, one_device, layout, fp8):
    # Both runs compute the same math on the same values: the EP run quantizes
    # with the same scales (every per-tensor amax is max-reduced over the token
    # axes, each expert's weights are whole on one device) and sends each row
    # to its expert and back unchanged, so the FP8 operands are identical. What
    # differs is the order of f32 sums: GEMM reductions over rows or columns
    # (XLA's blocking may change with the array sizes), the sums over the
    # devices (router gradient, aux-loss statistics, replicated-weight
    # gradients) and the slots' sum. A d-term f32 sum computed in another order
    # moves by at most 2 (d - 1) u times the sum of its terms' magnitudes; an
    # output fed by sums of d_1, d_2, ... terms in turn moves by at most
    # 2 u (d_1 + d_2 + ...) times its peak where the terms' magnitudes sum to
    # about the result's (no cancellation: these inputs are random). The
    # depths: the router's (H) and the two expert GEMMs' (H, then F) for the
    # forward, their transposes (2F, H) and the sums over all tokens' slots
    # (B S K) for the gradients. Where values are re-quantized (the gated
    # activation, the gradients) a moved sum could round to the next FP8 value
    # instead; with the same rows in the same order it does not on XLA:CPU,
    # which this bound (far below an FP8 step, 2**-3) would catch.
    x, params = skewed
    block = _block(fp8=fp8)
    (_, (want_y, want_aux)), want_grads = one_device("fp8" if fp8 else "no_fp8")
    sizes, config = LAYOUTS[layout]
    with fs.use_mesh(fs.make_mesh(**sizes, config=config), config):
        step = _loss(block)
        jaxpr = str(jax.make_jaxpr(step)(params, x))
        (_, (y, aux)), grads = step(params, x)
    # the exchange: ragged_all_to_all on CUDA, its emulation here
    assert "ragged_all_to_all" in jaxpr and "all_to_all[" in jaxpr.replace(" ", "")
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=AUX)
    _assert_within(y, want_y, FORWARD, "y")
    _assert_within(grads[1], want_grads[1], BACKWARD, "dx")
    for name in ("router", "wi", "wo"):
        _assert_within(grads[0][name], want_grads[0][name], BACKWARD, f"d{name}")
    # The empty expert gets no gradient in either run.
    for run in (grads, want_grads):
        assert not np.asarray(run[0]["wi"][3]).any() and not np.asarray(run[0]["wo"][3]).any()


# Not dp2_ep4: there each expert's rows are split over the dp replicas, and
# each replica's weight gradient tiles its own share of the rows (from its
# first row), other tiles than one device's: another FP8 rounding, by design.
@pytest.mark.parametrize("layout", ["ep8", "ep_on_fsdp8"])
def test_block_scaled_experts_under_ep_give_the_single_device_values(skewed, one_device, layout):
    # BlockScaling's tiles and blocks lie within one device: each expert's
    # rows are all received by the device holding it, in the same order, so
    # its token tiles (from the group's first row) and weight blocks are the
    # single device's, and the budgets above hold for the same reasons.
    x, params = skewed
    block = _block(**ONE_DEVICE_BLOCKS["block_scaled"])
    (_, (want_y, _)), want_grads = one_device("block_scaled")
    sizes, config = LAYOUTS[layout]
    with fs.use_mesh(fs.make_mesh(**sizes, config=config), config):
        (_, (y, _)), grads = _loss(block)(params, x)
    _assert_within(y, want_y, FORWARD, "y")
    _assert_within(grads[1], want_grads[1], BACKWARD, "dx")
    for name in ("router", "wi", "wo"):
        _assert_within(grads[0][name], want_grads[0][name], BACKWARD, f"d{name}")
    per_tensor = one_device("fp8")[0][1][0]  # _block()'s
    assert not np.array_equal(np.asarray(y), np.asarray(per_tensor))


def test_nnx_block_takes_the_expert_parallel_path_with_the_same_values(skewed):
    x, params = skewed
    block = fnnx.MoEBlock(H, num_experts=E, top_k=K, ffn=F, rngs=nnx.Rngs(0))
    for name in ("router", "wi", "wo"):
        getattr(block, name)[...] = params[name]
    want = nnx.jit(lambda block, x: block(x))(block, x)
    want_aux = float(block.aux_loss[...])
    with fs.use_mesh(fs.make_mesh(ep=8, config=EP), EP):
        graph, state = nnx.split(block)
        jaxpr = str(jax.make_jaxpr(lambda state, x: nnx.merge(graph, state)(x))(state, x))
        got = nnx.jit(lambda block, x: block(x))(block, x)
    assert "all_to_all" in jaxpr
    _assert_within(got, want, FORWARD, "y")
    np.testing.assert_allclose(float(block.aux_loss[...]), want_aux, rtol=AUX)


def test_shared_experts_are_added_outside_the_exchange(skewed):
    x, params = skewed
    block = _block(shared_experts=1)
    variables = nn.meta.unbox(jax.jit(block.init)(jax.random.key(2), x))
    variables["params"].update({n: params[n] for n in ("router", "wi", "wo")})
    apply = jax.jit(block.apply)
    want = apply(variables, x)
    with fs.use_mesh(fs.make_mesh(ep=8, config=EP), EP):
        got = apply(variables, x)
    _assert_within(got, want, FORWARD, "y")


def test_a_transformer_layer_with_moe_under_ep_gives_the_single_device_step():
    # The rest of the layer sees ep as a data-parallel axis (its kernels run per
    # device; no warning); the attention adds sums over H (QKV, output) and S
    # (scores, values) terms to the chains of the block's budget.
    layer = fnn.TransformerLayer(4, F, moe=fnn.MoEConfig(E, K), num_kv_heads=2, causal=True,
                                 norm_type="rmsnorm", activations=("silu", "linear"))  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (B, S, H))
    params = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(1), x))["params"]

    def loss(params, x):
        y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.sum(jnp.square(y)) + sum(jax.tree.leaves(state)), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (want_loss, want_y), want = step(params, x)
    mesh = fs.make_mesh(ep=8, config=EP)
    with fs.use_mesh(mesh, EP), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to XLA's path, no kernel warning
        abstract = jax.eval_shape(layer.init, jax.random.key(1), x)
        shardings = nn.meta.unbox(fs.variable_shardings(abstract, mesh, EP))["params"]
        assert shardings["moe"]["wi"].spec[0] == "ep"
        params_here = jax.device_put(params, shardings)
        assert "ragged_all_to_all" in str(jax.make_jaxpr(step)(params_here, x))
        (got_loss, got_y), got = step(params_here, x)
    budget = BACKWARD + 2 * U * (2 * H + 2 * S)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=budget)
    _assert_within(got_y, want_y, FORWARD + 2 * U * (2 * H + 2 * S), "y")
    _assert_within(got[1], want[1], budget, "dx")
    for path, g in jax.tree_util.tree_leaves_with_path(want[0]):
        mine = got[0]
        for key in path:
            mine = mine[key.key]
        _assert_within(mine, g, budget, jax.tree_util.keystr(path))


def test_exchange_and_its_reverse_put_every_row_back():
    # A direct check of the plan: rows sent by it and back by the reversed plan
    # return unchanged, and each device receives exactly its experts' rows.
    mesh = fs.make_mesh(ep=8, config=EP)
    peers, per_device, local = 8, 6, 2
    rng = np.random.default_rng(0)
    experts = np.sort(rng.integers(0, peers * local, (peers, per_device)), axis=1)
    experts[:, :] = np.where(experts // local == 5, 0, experts)  # device 5 gets nothing
    experts = np.sort(experts, axis=1)
    rows = np.arange(peers * per_device, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    chunk = per_device  # at most every row of a device to one peer

    def local_fn(x, e):
        sizes = jnp.zeros((peers * local,), jnp.int32).at[e[0]].add(1)
        p, received = _expert_parallel.plan(sizes, "ep", peers)
        there = _expert_parallel.exchange(x, p, peers * chunk, "ep", chunk)
        back = _expert_parallel.exchange(there, p.reversed(), per_device, "ep", chunk)
        return there[None], back, jnp.sum(received)[None]

    run = jax.jit(jax.shard_map(local_fn, mesh=mesh, in_specs=(P("ep"), P("ep")),
                                out_specs=(P("ep"),) * 3, check_vma=False))  # fmt: skip
    there, back, counts = run(jnp.asarray(rows), jnp.asarray(experts))
    np.testing.assert_array_equal(np.asarray(back), rows)
    owner = experts.reshape(-1) // local
    for d in range(peers):
        mine = rows[owner == d]  # in source order, each source's rows in its order
        assert int(counts[d]) == len(mine)
        np.testing.assert_array_equal(np.asarray(there[d][: len(mine)]), mine)
        assert not np.asarray(there[d][len(mine) :]).any()
    assert int(counts[5]) == 0


@pytest.mark.deviceless
def test_h100_compile_sends_rows_by_ragged_all_to_all_and_runs_every_expert_gemm_in_fp8():
    # 8 H100s, ep=8: 16 experts, 2 per device; the forward and backward.
    mesh = fs.make_mesh(ep=8, config=EP)
    block = _block(dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8, 128, 256), jnp.bfloat16)
    abstract = jax.eval_shape(block.init, jax.random.key(0), x)
    shardings = nn.meta.unbox(fs.variable_shardings(abstract, mesh, EP))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.meta.unbox(abstract), shardings)["params"]  # fmt: skip
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fs.named_sharding(mesh, ("batch",), EP))

    def step(params, x):
        def loss(params, x):
            y, _ = block.apply({"params": params}, x, mutable=["intermediates"])
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    with fs.use_mesh(mesh, EP):
        hlo = verify.compile_for(step, params, x, target="h100", devices=8)
    report = verify.gemm_report(hlo)
    grouped = [g for g in report.gemms if g.target in verify.pallas_gemms.KERNELS]
    # The two expert GEMMs' forward, dgrad and wgrad, each a Pallas FP8 kernel.
    assert len(grouped) == 6 and all(g.backend == "pallas-fp8" for g in grouped), grouped
    # Each device's two experts: the forward kernels read [2, ...] weights.
    forward = [g for g in grouped if g.target == "fp8jax_grouped_gemm"]
    assert forward and all(g.rhs_shape[0] == 2 for g in forward), grouped
    # The rest is the router (f32 [tokens, hidden] x [hidden, experts] and its gradients).
    rest = report.non_fp8_gemms
    assert rest and all(g.lhs_dtype == g.rhs_dtype == "f32" for g in rest), rest
    assert all(E in g.lhs_shape + g.rhs_shape for g in rest), rest
    kinds = [c.kind for c in report.collectives]
    # Rows there and back, forward and backward: four ragged exchanges, no emulation
    # (whose all_to_all would move bf16 rows) and no gather of the expert weights.
    assert kinds.count("ragged-all-to-all") == 4, kinds
    assert "ragged-all-to-all" in hlo
    # The group sizes go ahead of the rows by all-to-all, in s32; none at all
    # would mean the exchange is not the one this test is about.
    counts = [c for c in report.collectives if c.kind == "all-to-all"]
    assert counts and all(c.dtype == "s32" for c in counts), kinds
    assert not [c for c in report.collectives if c.kind == "all-gather" and len(c.shape) >= 2]


@pytest.mark.deviceless
def test_h100_compile_under_fsdp_gathers_the_expert_weights_in_fp8():
    # 8 H100s, fsdp=8 and no expert parallelism: the experts' weights are
    # split along their hidden axis, the tokens along the batch. Each device
    # runs the six grouped GEMMs (Pallas, FP8) on its rows, and the weights
    # reach it by all-gathers of their FP8 copies, never in bf16; so do the
    # shared experts' (FP8 dense GEMMs).
    mesh = fs.make_mesh(fsdp=8)
    block = _block(dtype=jnp.bfloat16, shared_experts=1)
    x = jax.ShapeDtypeStruct((8, 128, 256), jnp.bfloat16)
    abstract = jax.eval_shape(block.init, jax.random.key(0), x)
    shardings = nn.meta.unbox(fs.variable_shardings(abstract, mesh))
    assert shardings["params"]["wi"].spec[:2] == (None, "fsdp")  # hidden split, experts whole
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.meta.unbox(abstract), shardings)["params"]  # fmt: skip
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fs.named_sharding(mesh, ("batch",)))

    def step(params, x):
        def loss(params, x):
            y, _ = block.apply({"params": params}, x, mutable=["intermediates"])
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    # Uncombined collectives, so that each gather reports its own dtype and shape.
    no_combining = " ".join(f"--xla_gpu_{kind}_combine_threshold_bytes=0"
                            for kind in ("all_gather", "reduce_scatter", "all_reduce"))  # fmt: skip
    with fs.use_mesh(mesh):
        hlo = verify.compile_for(step, params, x, target="h100", devices=8,
                                 xla_flags=no_combining)  # fmt: skip
    report = verify.gemm_report(hlo)
    grouped = [g for g in report.gemms if g.target in verify.pallas_gemms.KERNELS]
    assert len(grouped) == 6 and all(g.backend == "pallas-fp8" for g in grouped), grouped
    forward = [g for g in grouped if g.target == "fp8jax_grouped_gemm"]
    assert forward and all(g.rhs_shape[0] == E for g in forward), grouped
    shared = [g for g in report.fp8_gemms if g not in grouped]
    assert len(shared) == 6  # the shared expert's two dense GEMMs: forward, dgrad, wgrad
    rest = report.non_fp8_gemms
    assert rest and all(g.lhs_dtype == g.rhs_dtype == "f32" for g in rest), rest  # the router
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    weights = [c for c in gathers if c.shape[:1] == (E,) or c.shape[:1] == (H,)]
    # The experts' (wi, wo: [E, ...]) and the shared expert's ([H, 2, F]) FP8 copies.
    assert sum(c.shape[0] == E for c in weights) >= 2, [(c.dtype, c.shape) for c in gathers]
    assert all(c.dtype.startswith("f8") for c in weights), [(c.dtype, c.shape) for c in weights]
    # Never a weight in high precision (token rows stay put: test_local_routing.py).
    assert not [c for c in gathers if not c.dtype.startswith("f8") and E in c.shape[:1]]


# On GPUs both runs feed the FP8 tensor cores the same operands (global scales),
# but the wgrad kernel sums an expert's rows in an order its row layout sets, in
# an accumulator of about 14 bits (docs/design.md#grouped-expert-gemms), and a
# value moved that way can round to the next FP8 value where it is quantized
# again: test_sharded_train_step.py puts such noise at <= 1e-3 normwise. A
# per-device amax instead of the global one moves this block's output by 9.4e-3
# and its gradients by 1.5e-2 to 3.4e-2 normwise (on the CPU); 3e-3 sits between.
LIVE_NORMWISE = 3e-3


@pytest.mark.gpu
def test_live_expert_parallel_block_runs_ragged_all_to_all_and_matches_one_gpu(skewed):
    # Unrun so far: needs 2 or more GPUs (FP8JAX_TEST_GPU=1 pytest -m gpu).
    from sharded_layer import _normwise

    gpus = jax.device_count()
    if gpus < 2 or E % gpus or (B * S) % gpus:
        pytest.skip(f"needs 2, 4, 8 or 16 GPUs for ep over every GPU; {gpus} visible")
    x, params = skewed
    block = _block()
    (_, (want_y, want_aux)), want = _loss(block)(params, x)  # one GPU: no mesh
    mesh = fs.make_mesh(ep=gpus, config=EP)
    with fs.use_mesh(mesh, EP):
        step = _loss(block)
        hlo = step.lower(params, x).compile().as_text()
        (_, (y, aux)), got = step(params, x)
    assert "ragged-all-to-all" in hlo
    np.testing.assert_allclose(float(aux), float(want_aux), rtol=1e-5)
    assert _normwise(y, want_y) < LIVE_NORMWISE
    assert _normwise(got[1], want[1]) < LIVE_NORMWISE
    for name in ("router", "wi", "wo"):
        assert _normwise(got[0][name], want[0][name]) < LIVE_NORMWISE, name


@pytest.mark.parametrize(
    "x_shape,experts,match",
    [
        ((8, 12, H), 12, r"num_experts must be divisible by the expert-parallel axis 'ep' "
                         r"\(size 8\), got num_experts=12"),
        ((3, 4, H), E, r"tokens .* must be divisible by the 8 devices of the token axes "
                       r"\('ep',\) under expert parallelism, got 12 tokens"),
    ],
)  # fmt: skip
def test_indivisible_experts_or_tokens_name_the_argument(x_shape, experts, match):
    block = fnn.MoEBlock(num_experts=experts, top_k=K, ffn=F)
    x = jnp.ones(x_shape)
    variables = jax.eval_shape(block.init, jax.random.key(0), x)
    with fs.use_mesh(fs.make_mesh(ep=8, config=EP), EP), pytest.raises(ValueError, match=match):
        jax.eval_shape(block.apply, variables, x)


SP = fs.ShardingConfig(ep="ep", sp="sp")


@pytest.mark.parametrize(
    "sizes,config,match",
    [  # fsdp splits the experts' hidden axis, tp their ffn axis: gathered in high precision
        ({"fsdp": 2, "ep": 4}, EP, r"mesh axis 'fsdp' \(size 2\) also splitting the expert"),
        ({"tp": 2, "ep": 4}, EP, r"mesh axis 'tp' \(size 2\) also splitting the expert"),
        ({"sp": 2, "ep": 4}, SP, r"mesh axis 'sp' \(size 2\), which does not split the tokens"),
    ],
    ids=["fsdp", "tp", "sp"],
)  # fmt: skip
def test_a_mesh_expert_parallelism_does_not_handle_is_refused(sizes, config, match):
    block = _block()
    x = jnp.ones((8, 4, H))
    variables = jax.eval_shape(block.init, jax.random.key(0), x)
    with (
        fs.use_mesh(fs.make_mesh(**sizes, config=config), config),
        pytest.raises(ValueError, match=match),
    ):
        jax.eval_shape(block.apply, variables, x)


def test_explicit_mesh_axes_are_refused():
    mesh = fs.make_mesh(ep=8, config=EP, axis_types=jax.sharding.AxisType.Explicit)
    with (
        fs.use_mesh(mesh, EP),
        pytest.raises(ValueError, match=r"AxisType.Auto mesh axes, got Explicit \['ep'\]"),
    ):
        _expert_parallel.layout()


def test_the_ep_role_is_off_by_default_and_checked():
    assert fs.DEFAULT.ep is None and "ep" not in fs.make_mesh(dp=8).shape
    assert ("expert", None) in fs.DEFAULT.logical_rules()
    assert fs.ShardingConfig(ep="dp").batch_axes == ("dp", "fsdp")
    assert EP.batch_axes == ("dp", "fsdp", "ep")
    with pytest.raises(ValueError, match="also the tp or sp axis"):
        fs.ShardingConfig(ep="tp")
    with pytest.raises(ValueError, match=r"make_mesh: ep=2, but config.ep is None"):
        fs.make_mesh(dp=4, ep=2)
