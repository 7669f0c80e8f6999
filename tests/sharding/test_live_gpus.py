"""The sharded train step on real GPUs: NCCL collectives, cuBLASLt FP8 GEMMs (issue 9).

The same checks as the deviceless compiles (test_sharded_gemms.py) and the
CPU numerics (test_sharded_train_step.py), run where they matter: every
projection and MLP GEMM FP8 in the live compile, FSDP kernels gathered in
FP8, and the sharded run agreeing with the single-GPU run within the same
budget. The layouts are the ones the visible GPUs can hold; a mesh uses
every GPU. On a machine with GPUs:

    FP8JAX_TEST_GPU=1 python -m pytest -m gpu tests/sharding/test_live_gpus.py
"""

import math

import jax
import pytest
import sharded_layer as sl
from test_sharded_gemms import (
    NO_COMBINING,
    check_fsdp_gathers_kernels_in_fp8,
    check_gemms,
    check_no_high_precision_gather,
)

import fp8jax
import fp8jax.sharding as fs
from fp8jax import verify


def live_layouts(n: int) -> dict:
    """Mesh layouts over ``n`` GPUs: each parallelism alone, then the combinations that fit."""
    layouts = {
        f"dp{n}": ({"dp": n}, fs.DEFAULT),
        f"fsdp{n}": ({"fsdp": n}, fs.DEFAULT),
        f"tp{n}": ({"tp": n}, fs.DEFAULT),
        f"tp{n}_megatron_sp": ({"tp": n}, sl.MEGATRON_SP),
    }
    if n >= 4 and n % 2 == 0:
        layouts[f"fsdp{n // 2}_tp2"] = ({"fsdp": n // 2, "tp": 2}, fs.DEFAULT)
        layouts[f"dp2_sp{n // 2}"] = ({"dp": 2, "sp": n // 2}, sl.CONTEXT_SP)
    if n >= 8 and n % 4 == 0:
        layouts[f"dp2_fsdp{n // 4}_tp2"] = ({"dp": 2, "fsdp": n // 4, "tp": 2}, fs.DEFAULT)
    return layouts


# Evaluated at collection: on the CPU (where these tests are skipped) it names 8 devices.
LAYOUTS = live_layouts(jax.device_count())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_live_sharded_step_runs_fp8_gemms_and_gathers_fp8(layout):
    sizes, config = LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config)
    layer = sl.model(dtype="bfloat16")
    args = sl.abstract_args(layer, mesh, config)
    with fs.use_mesh(mesh, config), jax.numpy_dtype_promotion("standard"):
        hlo = verify.compile_for(
            sl.make_step(layer), *args, target="live", devices=mesh.size,
            xla_flags=NO_COMBINING,
        )  # fmt: skip
    report = verify.gemm_report(hlo)
    check_gemms(report)
    if config is not sl.CONTEXT_SP:  # K and V travel in BF16 there, by design
        check_no_high_precision_gather(layout, report)
    if sizes.get("fsdp", 1) > 1:
        check_fsdp_gathers_kernels_in_fp8(layout, sizes, report)


# Split accumulation in every GEMM. With the default fast-accumulating forward
# GEMM, on the H200 (2026-11-29), tp2 and tp2_megatron_sp matched the single
# GPU at step 1 (loss within 5e-6) but not at step 2 (1.1e-3).
#
# With this recipe every layout still missed the CPU's loss tolerance (rtol
# 1e-5), by up to 5e-5 at step 1 and 1.1e-3 at step 2 (relative; 2 H200s,
# 2026-11-29). A rerun with jax.default_matmul_precision("highest") around
# both runs missed it alike, so TF32 is not the cause. The likeliest cause is
# the FP8 tensor cores' accumulator precision (not proven: noise of that size
# gives differences of that size in a CPU proxy). The comparison therefore uses the GPU tolerances
# derived in test_sharded_train_step.py. With them all 4 layouts passed on 2
# H200s (2026-11-29).
F32_ACCURATE = fp8jax.DelayedScaling(
    amax_history_len=sl.RECIPE.amax_history_len, forward_precision=jax.lax.Precision.HIGHEST
)


@pytest.fixture(scope="module")
def f32_accurate_reference():
    return sl.reference(F32_ACCURATE)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_live_sharded_step_matches_the_single_gpu_step(layout, f32_accurate_reference):
    sizes, config = LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config)
    state, losses = sl.run(sl.model(recipe=F32_ACCURATE), sl.STEPS, mesh, config)
    sl.check_against_reference(sl.to_host(state), losses, f32_accurate_reference, sl.GPU)


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_every_live_layout_uses_every_gpu_and_is_named_by_its_sizes(gpus):
    layouts = live_layouts(gpus)
    assert len(layouts) == {2: 4, 4: 6, 8: 7}[gpus]
    for name, (sizes, _) in layouts.items():
        assert math.prod(sizes.values()) == gpus, name
        assert all(f"{axis}{size}" in name for axis, size in sizes.items()), name
