"""bench/scale_paper.py's reading of collectives: kinds, dtypes, bytes, groups, loop trips.

A sharded scan compiled on the 8 CPU devices (its while loop and all-gathers
are XLA's own), replica-group spellings, and a deviceless FSDP compile of a
small GPT whose FP8 step must gather its block kernels in half the bytes.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import scale_paper as sp

LAYERS, WIDTH = 3, 64


def _scan_hlo() -> str:
    """A 3-layer FSDP scan: rows and kernels split over 8 devices, each layer's kernel gathered."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    kernels = jax.ShapeDtypeStruct(
        (LAYERS, WIDTH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))
    )
    rows = NamedSharding(mesh, P("fsdp"))
    x = jax.ShapeDtypeStruct((16, WIDTH), jnp.float32, sharding=rows)

    def f(x, kernels):
        def layer(h, w):
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
            return jax.lax.with_sharding_constraint(jnp.tanh(h @ w), rows), None

        return jax.lax.scan(layer, x, kernels)[0]

    return jax.jit(f, out_shardings=rows).lower(x, kernels).compile().as_text()


def test_a_gather_inside_the_layer_loop_counts_once_per_layer():
    gathers = [c for c in sp.read_collectives(_scan_hlo()) if c.kind == "all-gather"]
    assert gathers, "the CPU compile gathered no kernel"
    in_loop = [c for c in gathers if c.count == LAYERS]
    assert len(in_loop) == 1, gathers
    c = in_loop[0]
    assert (c.dtype, c.shape, c.group) == ("f32", (1, WIDTH, WIDTH), 8)  # one layer's slice
    # Ring all-gather: each device receives the 7 shards it lacks.
    assert c.full_bytes == WIDTH * WIDTH * 4
    assert c.step_bytes == LAYERS * 7 / 8 * WIDTH * WIDTH * 4


@pytest.mark.parametrize(
    ("attrs", "size", "first"),
    [
        ("replica_groups=[2,4]<=[8], dimensions={0}", 4, (0, 1, 2, 3)),
        ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 2, (0, 4)),
        ("replica_groups={{0,8,16},{1,9,17}}, dimensions={0}", 3, (0, 8, 16)),
        ("replica_groups={}, to_apply=%add", 16, tuple(range(16))),
        ("source_target_pairs={{0,1},{1,0}}", 2, (0, 1)),
    ],
)
def test_replica_groups_in_each_spelling(attrs, size, first):
    assert sp._groups(attrs, 16) == (size, first)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("all-gather", 3 / 4), ("reduce-scatter", 3 / 4), ("all-reduce", 6 / 4),
     ("collective-permute", 1.0)],
)  # fmt: skip
def test_wire_bytes_per_device_follow_the_ring_algorithms(kind, expected):
    c = sp.Collective(kind, "bf16", (8, 16), group=4, count=2, op_name="")
    assert c.full_bytes == 256
    assert c.wire_bytes == expected * 256 and c.step_bytes == 2 * expected * 256


def test_merged_kernel_dims_still_name_the_parameter():
    shapes = sp.param_shapes({"blocks": {"k": np.zeros((2, 8, 2, 32))}, "head": np.zeros((8, 5))})
    merged = sp.Collective("reduce-scatter", "f32", (8, 64), group=4, count=2, op_name="")
    assert sp.classify(merged, shapes) == ("gradient reduction", "blocks/k")
    gathered = sp.Collective("all-gather", "f8e4m3fn", (2, 8, 32), group=4, count=2, op_name="")
    assert sp.classify(gathered, shapes) == ("weight gather", "blocks/k")
    vector = sp.Collective("all-reduce", "f32", (), group=4, count=1, op_name="")
    assert sp.classify(vector, shapes)[0] == "other"


def test_a_tied_shape_is_named_by_the_op_and_every_wide_gather_has_a_reason():
    tied = sp.param_shapes(
        {"embed": {"embedding": np.zeros((9, 4))}, "lm_head": {"kernel": np.zeros((4, 9))}}
    )
    head = sp.Collective(
        "all-gather", "bf16", (4, 9), 4, 1, op_name="jit(step)/lm_head/dot_general"
    )
    assert sp.classify(head, tied) == ("weight gather", "lm_head/kernel")
    assert "LM head" in sp.why_wide("lm_head/kernel")
    assert sp.why_wide("blocks/layer/mlp/kernel_1").startswith("UNEXPLAINED")


@pytest.mark.deviceless
def test_an_fsdp_fp8_step_gathers_its_block_kernels_in_half_the_bytes():
    from fp8jax.training.config import PRESETS

    model = PRESETS["tiny"].model  # 2 layers, width 128: splits over 8
    result = sp.compile_pair(model, 8, "fsdp", seq_len=64)
    summary = sp.summarize(result)

    def block_gathers(precision):
        rows = [r for r in result[precision] if r["role"] == "weight gather"]
        return [r for r in rows if "kernel" in r["param"] and r["param"].startswith("blocks")]

    fp8, bf16 = block_gathers("fp8"), block_gathers("bf16")
    assert fp8 and {r["dtype"] for r in fp8} == {"f8e4m3fn"}
    assert {r["dtype"] for r in bf16} == {"bf16"}
    # Rolled layers: each gather in the loop runs once per layer.
    assert {r["count"] for r in fp8} == {model.layers}
    fp8_bytes, bf16_bytes = (sum(r["bytes"] for r in rows) for rows in (fp8, bf16))
    assert fp8_bytes == pytest.approx(bf16_bytes / 2, rel=1e-12)
    assert summary["gather_ratio"] <= 0.55
    # Whatever the FP8 step gathers wide has a stated reason.
    for param, (_, _, why) in summary["wide_gathers"].items():
        assert "UNEXPLAINED" not in why, param
