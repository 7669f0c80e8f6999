"""RowwiseScaling and BlockScaling under data parallelism and FSDP.

Both recipes are current scaling written in JAX ops (the per-row and
per-block amaxes are reductions XLA partitions, the block GEMM's kernel takes
XLA's path in a sharded program), so the partitioner shards them as it does
the per-tensor recipes:

* a deviceless 8-H100 compile of the TransformerLayer train step over
  ``fsdp8`` runs all 12 projection and MLP GEMMs in FP8, gathers each kernel
  in E4M3 (the FP8 copy, never BF16) and gathers nothing of two or more
  dimensions in high precision;
* on 8 CPU devices, ``dp8`` and ``fsdp8`` steps match the single-device run
  of the same recipe to ``sharded_layer.TOL``. The reasoning of
  test_sharded_train_step.py holds: every scale is a max, exact whatever
  the shards, so only f32 reordering and the FP8 rounding flips it causes
  remain.

Tensor and sequence parallelism are not covered: there the same compile
gathers activations in f32 (docs/design.md#fine-grained-scaling).
"""

import jax
import pytest
import sharded_layer as sl

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


@pytest.mark.parametrize("layout", ["dp8", "fsdp8"])
def test_sharded_step_matches_single_device(layout, recipe_and_reference):
    recipe, reference = recipe_and_reference
    sizes, config = sl.LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config)
    state, losses = sl.run(sl.model(recipe=recipe), sl.STEPS, mesh, config)
    sl.check_against_reference(sl.to_host(state), losses, reference)
