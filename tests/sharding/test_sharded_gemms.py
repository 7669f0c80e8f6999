"""Deviceless 8-GPU H100 compiles of the sharded train step: FP8 GEMMs, FP8 all-gathers.

For each mesh layout (but ``dp2_sp4``, see COMPILED) the TransformerLayer
train step (bf16 activations, as in training) is compiled for eight H100s and
its optimized HLO read with fp8jax.verify:

* every projection and MLP GEMM, forward and backward, is FP8 (12 of them:
  QKV, attention output, MLP fc1 and fc2, each forward, dgrad and wgrad);
  only the attention core's einsums, which fp8jax leaves in BF16, are not;
* no tensor is all-gathered in high precision: FSDP gathers each kernel's
  FP8 copy (f8e4m3fn, half the bytes of BF16), and Megatron sequence
  parallelism gathers the FP8 normalized activations (and E5M2 gradients)
  before the column-parallel GEMMs, then reduce-scatters the row-parallel
  outputs. Vectors (norm scales and biases) are gathered as they are.

XLA's collective combiners merge independent collectives into one tuple
collective of mixed dtypes; the compiles switch them off so that each
gathered value is reported with its own dtype (combining never changes one).
"""

import math

import jax
import pytest
import sharded_layer as sl

import fp8jax.sharding as fs
from fp8jax import verify

NO_COMBINING = " ".join(
    f"--xla_gpu_{kind}_combine_threshold_bytes=0"
    for kind in ("all_gather", "reduce_scatter", "all_reduce")
)
# JAX's XLA attention core: its einsums stay BF16 by design.
ATTENTION_CORE = r"BTNH,BSNH->BNTS|BNTS,BSNH->BTNH"
E4, E5 = "f8e4m3fn", "f8e5m2"
KERNELS = {  # tensor parallelism splits one axis of each (heads or the MLP width)
    "qkv": (sl.HIDDEN, sl.HEADS, 3, sl.HEAD_DIM),
    "out": (sl.HEADS, sl.HEAD_DIM, sl.HIDDEN),
    "fc1": (sl.HIDDEN, 2, sl.FFN),
    "fc2": (sl.FFN, sl.HIDDEN),
}


def compile_layout(layout: str):
    """The optimized HLO of the train step compiled for 8 H100s over ``layout``."""
    sizes, config = sl.LAYOUTS[layout]
    mesh = fs.make_mesh(**sizes, config=config)
    layer = sl.model(dtype="bfloat16")
    args = sl.abstract_args(layer, mesh, config)
    # Traced here, under the rules that turn on the activation constraints; JAX's
    # bf16 attention backward needs standard promotion (tests/flax/conftest.py).
    with fs.use_mesh(mesh, config), jax.numpy_dtype_promotion("standard"):
        return verify.compile_for(
            sl.make_step(layer), *args, target="h100", devices=8, xla_flags=NO_COMBINING
        )


# All layouts but the sequence on its own axis, whose extra traffic (K and V
# gathered in BF16 for attention) is not FP8 by design; its numerics are
# tested in test_sharded_train_step.py. A compile costs ~6 s.
COMPILED = sorted(set(sl.LAYOUTS) - {"dp2_sp4"})


# One test per layout: pytest-xdist would repeat a shared fixture on each worker.
@pytest.mark.deviceless
@pytest.mark.parametrize("layout", COMPILED)
def test_sharded_step_gemms_are_fp8_and_gathers_are_fp8(layout):
    sizes, _ = sl.LAYOUTS[layout]
    hlo = compile_layout(layout)
    report = verify.gemm_report(hlo)
    check_gemms(report)
    # fp8jax.kernels.cast_transpose's kernel runs per device only where data
    # parallelism alone splits (test_sharded_cast.py), on whole tiles of 64
    # rows: this layer's 128 tokens leave each device at most 32, so XLA
    # casts in every layout here.
    assert "fp8jax_cast_transpose" not in hlo
    check_no_high_precision_gather(layout, report)
    if sizes.get("fsdp", 1) > 1:
        check_fsdp_gathers_kernels_in_fp8(layout, sizes, report)
    if layout == "fsdp2_tp4_sp":
        check_sequence_parallel_collectives(sizes, report)


def check_gemms(report):
    """Every projection and MLP GEMM is FP8, with the format pairs of HYBRID."""
    verify.assert_fp8_gemms(hlo=report, expect=12, allow=ATTENTION_CORE)
    pairs = sorted(tuple(sorted((g.lhs_dtype, g.rhs_dtype))) for g in report.fp8_gemms)
    # Forward E4M3 x E4M3; dgrad and wgrad E4M3 x E5M2; never E5M2 x E5M2.
    assert pairs == [(E4, E4)] * 4 + [(E4, E5)] * 8


def check_no_high_precision_gather(layout, report):
    for c in report.collectives:
        if c.kind != "all-gather" or len(c.shape) < 2:
            continue  # norm scales and biases (vectors) travel as they are
        assert c.dtype in (E4, E5), f"{layout}: {c.kind} {c.dtype}{list(c.shape)} ({c.op_name})"


def check_fsdp_gathers_kernels_in_fp8(layout, sizes, report):
    tp = sizes.get("tp", 1)
    fp8_gathered = {
        math.prod(c.shape) for c in report.collectives if c.kind == "all-gather" and c.dtype == E4
    }
    for name, shape in KERNELS.items():
        local = math.prod(shape) // tp  # FSDP gathers the tensor-parallel shard
        assert local in fp8_gathered, f"{layout}: no f8e4m3fn all-gather of the {name} kernel"


def check_sequence_parallel_collectives(sizes, report):
    """Megatron SP: row-parallel outputs reduce-scattered, GEMM inputs gathered in FP8."""
    shard = (sl.BATCH // sizes["fsdp"], sl.SEQ // sizes["tp"], sl.HIDDEN)
    scatters = [c for c in report.collectives if c.kind == "reduce-scatter" and c.shape == shard]
    assert scatters and {c.dtype for c in scatters} == {"bf16"}
    whole = (sl.BATCH // sizes["fsdp"], sl.SEQ, sl.HIDDEN)
    gathers = {c.dtype for c in report.collectives if c.kind == "all-gather" and c.shape == whole}
    # The normalized input (E4M3) forward, the gradient (E5M2) backward.
    assert gathers == {E4, E5}
