"""RowwiseScaling and BlockScaling under data, FSDP, tensor and sequence parallelism.

Both recipes are current scaling written in JAX ops (the per-row and
per-block amaxes are reductions XLA partitions, the block GEMM's kernel takes
XLA's path in a sharded program), so the partitioner shards them as it does
the per-tensor recipes:

* a deviceless 8-H100 compile of the TransformerLayer train step over
  ``fsdp8`` runs all 12 projection and MLP GEMMs in FP8, gathers each kernel
  in E4M3 (the FP8 copy, never BF16) and gathers nothing of two or more
  dimensions in high precision;
* every scale is a max over the whole tensor, exact whatever the shards: one
  ``dot_general``'s values and gradients under ``dp8`` and ``fsdp8`` match
  the single-device ones to f32 reordering (1e-6), where scales taken from
  each shard's own rows or columns miss by FP8 rounding noise (measured
  4.5e-2 to 7e-2, checked below);
* on 8 CPU devices, ``dp8`` and ``fsdp8`` train steps of the layer (also over
  Explicit axes) match the single-device run within ``sharded_layer.GPU``. Not the CPU tolerances
  of test_sharded_train_step.py: there the per-tensor recipes' sharded
  programs compute bitwise what one device computes, so no FP8 rounding
  flips. These recipes' norm runs in XLA outside a fused op
  (fp8jax.ops.fine_grained), whose sharded fusions add f32 sums in another
  order (~1e-7). An element whose scaled value lies that close to a
  rounding midpoint then rounds the other way; measured on this layer, one
  such flip in the forward, passed through attention, the residual and
  the E5M2 gradients, moves the second loss by up to 6e-4 and an update by
  up to 4e-2 (normwise), and so does perturbing the inputs by 2**-22
  relative on one device. ``sharded_layer.GPU`` is derived for that noise
  (inputs perturbed by 2**-14) and still fails a replica that skips the
  gradient all-reduce, for these recipes too (checked below). Inside
  ``shard_map``, ``RowwiseScaling(amax_reduction_axes=...)`` over the token
  axis gives the whole tensor's column scales (checked below).

Under tensor and sequence parallelism (``fsdp2_tp4_sp``, Megatron's; ``dp2_sp4``,
an axis of its own) the steps match as well; there the compile gathers
activations in f32, a cost rather than an error
(docs/design.md#fine-grained-scaling).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
import sharded_layer as sl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs
from fp8jax import verify

RECIPES = {"row": fp8jax.RowwiseScaling(), "block": fp8jax.BlockScaling()}
NO_COMBINING = " ".join(
    f"--xla_gpu_{kind}_combine_threshold_bytes=0"
    for kind in ("all_gather", "reduce_scatter", "all_reduce")
)
ATTENTION_CORE = r"BTNH,BSNH->BNTS|BNTS,BSNH->BTNH"  # BF16 by design


@pytest.mark.deviceless
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fsdp_step_gemms_are_fp8_and_kernels_are_gathered_in_fp8(name):
    sizes, config = sl.LAYOUTS["fsdp8"]
    mesh = fs.make_mesh(**sizes, config=config)
    layer = sl.model(dtype="bfloat16", recipe=RECIPES[name])
    args = sl.abstract_args(layer, mesh, config)
    with fs.use_mesh(mesh, config), jax.numpy_dtype_promotion("standard"):
        hlo = verify.compile_for(
            sl.make_step(layer), *args, target="h100", devices=8, xla_flags=NO_COMBINING
        )
    report = verify.gemm_report(hlo)
    verify.assert_fp8_gemms(hlo=report, expect=12, allow=ATTENTION_CORE)
    gathers = [c for c in report.collectives if c.kind == "all-gather" and len(c.shape) >= 2]
    assert gathers and all(c.dtype in ("f8e4m3fn", "f8e5m2") for c in gathers), [
        (c.dtype, c.shape) for c in gathers
    ]
    # The four kernels (QKV, attention output, fc1, fc2), in the recipe's
    # forward copy and in the copy its dgrad reads: at least one E4M3 gather each.
    assert sum(c.dtype == "f8e4m3fn" for c in gathers) >= 4


@pytest.fixture(scope="module", params=sorted(RECIPES))
def recipe_and_reference(request):
    recipe = RECIPES[request.param]
    return recipe, sl.reference(recipe)


@pytest.mark.parametrize("layout", ["dp8", "fsdp8", "fsdp2_tp4_sp", "dp2_sp4"])
def test_sharded_step_matches_single_device(layout, recipe_and_reference):
    recipe, reference = recipe_and_reference
    sizes, config = sl.LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config)
    state, losses = sl.run(sl.model(recipe=recipe), sl.STEPS, mesh, config)
    sl.check_against_reference(sl.to_host(state), losses, reference, sl.GPU)


def test_explicit_axes_step_matches_single_device(recipe_and_reference):
    # Over Explicit axes the fine-grained GEMMs run with the axes Auto inside
    # (jax.sharding.auto_axes), their results sharded as the per-tensor ops'.
    recipe, reference = recipe_and_reference
    sizes, config = sl.LAYOUTS["fsdp8"]
    mesh = fs.make_mesh(**sizes, config=config, axis_types=jax.sharding.AxisType.Explicit)
    state, losses = sl.run(sl.model(recipe=recipe), sl.STEPS, mesh, config)
    sl.check_against_reference(sl.to_host(state), losses, reference, sl.GPU)


def test_step_tolerances_fail_a_replica_that_skips_the_all_reduce(recipe_and_reference):
    recipe, reference = recipe_and_reference
    x, y = sl.batch()
    # What one replica of dp=2 computes if its gradients are not all-reduced.
    state, losses = sl.run(sl.model(recipe=recipe), sl.STEPS, data=(x[:4], y[:4]))
    with pytest.raises(AssertionError):
        sl.check_against_reference(sl.to_host(state), losses, reference, sl.GPU)


# One dot_general, (tokens, K) . (K, N): f32 reordering only, no FP8 rounding after it.
DOT_TOL = 1e-6
DIMS = (((1,), (0,)), ((), ()))
# name: (x's spec, kernel's spec); tokens on the batch axes, the kernel's K on fsdp.
DOT_LAYOUTS = {"dp8": (P("dp"), P()), "fsdp8": (P("fsdp"), P("fsdp"))}


# Once per recipe: the tests' single-device runs of one recipe's step are then one
# jitted function, compiled once (ten compiles of two programs before).
@functools.cache
def _dot_values_and_grads(recipe):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (128, 64), jnp.float32)
    kernel = jax.random.normal(keys[1], (64, 96), jnp.float32) * 0.1
    r = jax.random.normal(keys[2], (128, 96), jnp.float32)  # a random output gradient

    def loss(x, kernel):
        y = fp8jax.dot_general(x, kernel, DIMS, recipe=recipe)
        return jnp.sum(y * r), y

    return x, kernel, r, jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


def _spec(x) -> tuple:
    """``x``'s PartitionSpec as one entry per axis."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


@pytest.mark.parametrize("layout", sorted(DOT_LAYOUTS))
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_sharded_dot_scales_are_the_whole_tensors(name, layout):
    recipe = RECIPES[name]
    x, kernel, r, step = _dot_values_and_grads(recipe)
    (_, want_y), want_grads = step(x, kernel)
    axis = DOT_LAYOUTS[layout][0][0]
    mesh = jax.make_mesh((8,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    x_spec, kernel_spec = DOT_LAYOUTS[layout]
    sharded = (jax.device_put(x, NamedSharding(mesh, x_spec)),
               jax.device_put(kernel, NamedSharding(mesh, kernel_spec)))  # fmt: skip
    (_, y), grads = step(*sharded)
    assert sl._normwise(y, want_y) < DOT_TOL
    for got, want in zip(grads, want_grads, strict=True):
        assert sl._normwise(got, want) < DOT_TOL

    # Each device scaling its own rows of tokens: what a scale taken from one
    # shard gives (measured 7e-2 row, 4.5e-2 block). The op sums the replicated
    # kernel's per-device gradients over the axis itself. The tolerance fails it.
    def local(x, r):
        def shard_loss(kernel):
            return jnp.sum(fp8jax.dot_general(x, kernel, DIMS, recipe=recipe) * r)

        return jax.grad(shard_loss)(kernel)

    per_shard = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=P())
    )(x, r)
    assert 100 * DOT_TOL < sl._normwise(per_shard, want_grads[1]) < 0.2


@pytest.mark.parametrize("layout", sorted(DOT_LAYOUTS))
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_explicit_axes_dot_matches_and_shards_gradients_like_their_primals(name, layout):
    x, kernel, _, step = _dot_values_and_grads(RECIPES[name])
    (_, want_y), want_grads = step(x, kernel)
    axis = DOT_LAYOUTS[layout][0][0]
    mesh = jax.make_mesh((8,), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))
    shardings = [NamedSharding(mesh, spec) for spec in DOT_LAYOUTS[layout]]
    sharded = [jax.device_put(a, sh) for a, sh in zip((x, kernel), shardings, strict=True)]
    with jax.set_mesh(mesh):
        (_, y), grads = step(*sharded)
    assert _spec(y) == (axis, None)  # the activation's rows
    assert sl._normwise(y, want_y) < DOT_TOL
    for got, want, sharding in zip(grads, want_grads, shardings, strict=True):
        assert _spec(got) == tuple(sharding.spec) + (None,) * (got.ndim - len(sharding.spec))
        assert sl._normwise(got, want) < DOT_TOL


def test_block_scales_inside_shard_map_are_the_whole_tensors_on_whole_tiles():
    # BlockScaling's weight gradient scales 128-token tiles along M. With a
    # multiple of 128 tokens on each device, every tile lies on one device, so
    # each device's own scales are the whole tensor's: no reduction is needed
    # (with 16 tokens each, as above, the padded tiles differ).
    recipe = fp8jax.BlockScaling()
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (8 * 128, 256), jnp.float32)
    kernel = jax.random.normal(keys[1], (256, 128), jnp.float32) * 0.1
    r = jax.random.normal(keys[2], (8 * 128, 128), jnp.float32)

    def kernel_grad(x, r):
        return jax.grad(lambda k: jnp.sum(fp8jax.dot_general(x, k, DIMS, recipe=recipe) * r))(
            kernel
        )

    want = jax.jit(kernel_grad)(x, r)
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    per_device = jax.shard_map(kernel_grad, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P())
    assert sl._normwise(jax.jit(per_device)(x, r), want) < DOT_TOL


@pytest.mark.parametrize("layout", sorted(DOT_LAYOUTS))
def test_rowwise_amax_reduction_axes_give_shard_map_the_whole_tensors_scales(layout):
    # Inside shard_map each device sees its own tokens. With the token axis in
    # amax_reduction_axes the column maxima (the weight gradient's operands,
    # per feature over tokens) are max-reduced over it, so the values and every
    # gradient match one device's to f32 reordering, where the test above
    # measures a per-shard error over 100 times that.
    x, kernel, r, step = _dot_values_and_grads(RECIPES["row"])
    (_, want_y), want_grads = step(x, kernel)
    axis = DOT_LAYOUTS[layout][0][0]
    mesh = jax.make_mesh((8,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    recipe = fp8jax.RowwiseScaling(amax_reduction_axes=(axis,))

    def local(x, r):
        def shard_loss(x, kernel):
            y = fp8jax.dot_general(x, kernel, DIMS, recipe=recipe)
            return jnp.sum(y * r), y

        (_, y), grads = jax.value_and_grad(shard_loss, (0, 1), has_aux=True)(x, kernel)
        return y, grads

    per_device = jax.shard_map(
        local, mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=(P(axis), (P(axis), P()))
    )
    y, grads = jax.jit(per_device)(x, r)
    assert sl._normwise(y, want_y) < DOT_TOL
    for got, want in zip(grads, want_grads, strict=True):
        assert sl._normwise(got, want) < DOT_TOL


def test_rowwise_amax_reduction_axes_outside_shard_map_are_refused_by_name():
    x, kernel, _, _ = _dot_values_and_grads(RECIPES["row"])
    recipe = fp8jax.RowwiseScaling(amax_reduction_axes=("dp",))
    with pytest.raises(ValueError, match=r"amax_reduction_axes=\('dp',\) names a mesh axis"):
        jax.jit(lambda x, k: fp8jax.dot_general(x, k, DIMS, recipe=recipe))(x, kernel)
    with pytest.raises(TypeError, match="RowwiseScaling.amax_reduction_axes must be a tuple"):
        fp8jax.RowwiseScaling(amax_reduction_axes="dp")
