"""fp8jax.ragged_dot under data parallelism: each device's rows, FP8 weights gathered in FP8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs
from fp8jax import verify
from fp8jax.kernels import grouped_gemm

M, K, N, G = 8 * 64, 128, 256, 4
SIZES = [100, 0, 250, 130]  # groups straddle the devices' 64-row blocks; 32 rows in none


def _fwd_bwd(x, w, sizes, g):
    y, vjp = jax.vjp(lambda x, w: fp8jax.ragged_dot(x, w, sizes), x, w)
    return y, *vjp(g)


def test_each_devices_rows_give_the_unsharded_values():
    # Quantization is global (one amax over all rows, reduced across devices),
    # so each output row is the same product as without a mesh, only summed
    # in its own order: f32 sums of d terms differ by at most 2 d 2**-24 of
    # the magnitude sum, at most d max|a| max|b| (1 + 2**-3)**2 for the
    # quantized operands. The weights' gradient is summed over the devices'
    # partial products.
    keys = jax.random.split(jax.random.key(0), 3)
    x, g = jax.random.normal(keys[0], (M, K)), jax.random.normal(keys[1], (M, N))
    w = jax.random.normal(keys[2], (G, K, N)) * K**-0.5
    sizes = jnp.array(SIZES, jnp.int32)
    want = jax.jit(_fwd_bwd)(x, w, sizes, g)
    mesh = fs.make_mesh(fsdp=8)
    with fs.use_mesh(mesh):
        rows = NamedSharding(mesh, P("fsdp", None))
        run = jax.jit(_fwd_bwd)
        assert "shard_map" in str(jax.make_jaxpr(run)(x, w, sizes, g))
        got = run(jax.device_put(x, rows), w, sizes, jax.device_put(g, rows))
    peak = {n: float(jnp.abs(v).max()) for n, v in (("x", x), ("g", g), ("w", w))}
    operands = (("x", "w", K), ("g", "w", N), ("x", "g", M))
    for name, a, b, (p, q, depth) in zip(("y", "dx", "dw"), got, want, operands, strict=True):
        b = np.asarray(b, np.float64)
        bound = 2 * depth * 2.0**-24 * depth * peak[p] * peak[q] * (1 + 2.0**-3) ** 2
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=bound,
                                   err_msg=name)  # fmt: skip
    assert not np.asarray(got[0][sum(SIZES) :]).any()


def test_permuted_rows_under_data_parallelism_give_the_unsharded_values():
    # permuted_ragged_dot (an MoE block's tokens to expert order and back,
    # top-2): under data parallelism the gather and the permutation back run
    # in XLA around each device's kernels. Same quantization as without a
    # mesh, so only the devices' f32 sums differ, bounded as above; a token's
    # gradient sums its two slots'.
    from fp8jax.ops import ragged_dot as rd

    t, top_k = M // 2, 2
    keys = jax.random.split(jax.random.key(1), 4)
    x, g = jax.random.normal(keys[0], (t, K)), jax.random.normal(keys[1], (M, N))
    w = jax.random.normal(keys[2], (G, K, N)) * K**-0.5
    expert = jax.random.randint(keys[3], (M,), 0, G)
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(expert, length=G).astype(jnp.int32)

    def fwd_bwd(x, w, g):
        def run(x, w):
            return rd.permuted_ragged_dot(x, w, sizes, lhs_slots=order, repeats=top_k,
                                          out_slots=order)  # fmt: skip

        y, vjp = jax.vjp(run, x, w)
        return (y, *vjp(g))

    want = jax.jit(fwd_bwd)(x, w, g)
    mesh = fs.make_mesh(fsdp=8)
    with fs.use_mesh(mesh):
        rows = NamedSharding(mesh, P("fsdp", None))
        got = jax.jit(fwd_bwd)(jax.device_put(x, rows), w, jax.device_put(g, rows))
    peak = {n: float(jnp.abs(v).max()) for n, v in (("x", x), ("g", g), ("w", w))}
    operands = (("x", "w", K, 1), ("g", "w", N, top_k), ("x", "g", M, 1))
    for name, a, b, (p, q, depth, terms) in zip(("y", "dx", "dw"), got, want, operands,
                                                strict=True):  # fmt: skip
        bound = terms * 2 * depth * 2.0**-24 * depth * peak[p] * peak[q] * (1 + 2.0**-3) ** 2
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=0, atol=bound, err_msg=name)  # fmt: skip


@pytest.mark.deviceless
def test_fsdp_weights_are_gathered_in_fp8_and_every_grouped_gemm_is_fp8():
    # 8 H100s (deviceless): rows and the weights' hidden axis split over fsdp.
    # Each device runs the three grouped GEMMs (Pallas, FP8) on its 64 rows;
    # the weights reach it by all-gathers of their FP8 copies, never in bf16.
    mesh = fs.make_mesh(fsdp=8)
    rows = NamedSharding(mesh, P("fsdp", None))
    bf16 = jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((M, K), bf16, sharding=rows),
        jax.ShapeDtypeStruct((G, K, N), bf16, sharding=NamedSharding(mesh, P(None, "fsdp"))),
        jax.ShapeDtypeStruct((G,), jnp.int32),
        jax.ShapeDtypeStruct((M, N), bf16, sharding=rows),
    )
    with fs.use_mesh(mesh):
        hlo = verify.compile_for(_fwd_bwd, *args, target="h100", devices=8)
    report = verify.gemm_report(hlo)
    tiles = grouped_gemm.DEFAULT_TILES

    def whole(d, tile):  # padded to whole tiles
        return -(-d // tile) * tile

    local = M // 8  # a device's rows, which the forward and dgrad kernels read by index
    # the wgrad kernel reads them gathered into tile-padded places (the groups and the
    # rows past them), transposed
    places = whole(local + (G + 1) * (tiles.m - 1), tiles.m)
    k_rows = whole(K, max(tiles.wgrad_k, grouped_gemm.GATHER_COLS))
    assert sorted((g.target, g.lhs_shape) for g in report.gemms) == [
        ("fp8jax_grouped_gemm", (local, whole(K, tiles.k))),  # forward
        ("fp8jax_grouped_gemm", (local, whole(N, tiles.k))),  # dgrad
        ("fp8jax_grouped_gemm_wgrad", (k_rows, places)),
    ]
    assert len(report.fp8_gemms) == 3
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert gathers and all(c.dtype.startswith("f8") for c in gathers), gathers


def test_under_tensor_parallelism_the_gemms_warn_and_take_lax_ragged_dot():
    # The kernels run on whole arrays or each device's rows; a tp mesh splits
    # neither way, so the GEMMs take lax.ragged_dot on the same FP8 operands,
    # with a RuntimeWarning that says so (never silently).
    keys = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(keys[0], (M, K))
    w = jax.random.normal(keys[1], (G, K, N)) * K**-0.5
    sizes = jnp.array(SIZES, jnp.int32)
    want = jax.jit(lambda x, w: fp8jax.ragged_dot(x, w, sizes))(x, w)
    with fs.use_mesh(fs.make_mesh(tp=8)), pytest.warns(RuntimeWarning, match="lax.ragged_dot"):
        got = jax.jit(lambda x, w: fp8jax.ragged_dot(x, w, sizes))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
