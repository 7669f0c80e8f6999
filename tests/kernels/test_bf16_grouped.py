"""The BF16 grouped GEMM: where it runs, its custom_vjp's math, the MoE op's use of it.

The Mosaic GPU kernels do not run on the CPU; their custom_vjp does, on
each kernel's XLA twin (:func:`fp8jax.kernels.bf16_grouped._on_cuda` on a
host without a GPU), so the forward, dgrad and wgrad wiring is checked here
against an f32 reference and the kernels themselves on the H200 (``gpu``).

Budget: BF16 inputs, products exact in f32 and summed in f32 (``k * 2**-24``
of the magnitude sum ``M = |a| . |b|``, negligible at these depths), then one
rounding to the BF16 output, at most ``2**-9`` of ``|y| <= M``. ``2**-8 M``
elementwise covers both; a wrong group, transpose or operand errs by O(M).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fp8jax.sharding as fs
from fp8jax import kernels
from fp8jax.kernels import bf16_grouped
from fp8jax.ops import moe as moe_ops

M, K, N = 96, 128, 256
SIZES = (30, 0, 41, 17)  # uneven, one empty group, 8 rows past the groups
BUDGET = 2.0**-8


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (len(SIZES), K, N)) * K**-0.5).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
    return x, w, g, jnp.array(SIZES, jnp.int32)


def _f32(a):
    return np.asarray(a, np.float32)


def _reference(x, w, g, sizes):
    """y, dx, dw and their magnitude sums, group by group in f64 numpy."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    m = x.shape[0]
    y, dx, dw = np.zeros((m, N)), np.zeros((m, K)), np.zeros(w.shape)
    my, mdx, mdw = np.zeros((m, N)), np.zeros((m, K)), np.zeros(w.shape)
    start = 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + int(size))
        y[rows], my[rows] = x[rows] @ w[i], abs(x[rows]) @ abs(w[i])
        dx[rows], mdx[rows] = g[rows] @ w[i].T, abs(g[rows]) @ abs(w[i]).T
        dw[i], mdw[i] = x[rows].T @ g[rows], abs(x[rows]).T @ abs(g[rows])
        start += int(size)
    return (y, my), (dx, mdx), (dw, mdw)


def _vjp(f, x, w, g, sizes):
    y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
    return (y, *vjp(g))


def _check_against_reference(got, x, w, g, sizes):
    for name, value, (want, magnitude) in zip(
        ("y", "dx", "dw"), got, _reference(x, w, g, sizes), strict=True
    ):
        assert value.dtype == jnp.bfloat16, (name, value.dtype)
        err = np.abs(np.asarray(value, np.float64) - want)
        assert np.all(err <= BUDGET * magnitude + 1e-30), (name, float(err.max()))
    past = sum(SIZES)
    assert not np.any(_f32(got[0])[past:]) and not np.any(_f32(got[1])[past:])


def test_the_cpu_takes_lax_ragged_dot():
    assert bf16_grouped.placement(K, N, jnp.bfloat16) == kernels.XLA
    x, w, _, sizes = _inputs()
    loss = lambda x: bf16_grouped.ragged_dot(x, w, sizes).astype(jnp.float32).sum()  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(x))
    assert "ragged_dot_general" in jaxpr and "custom_vjp" not in jaxpr, jaxpr


def test_on_a_gpu_the_forward_traces_the_mosaic_kernel(monkeypatch):
    """The public op's dispatch on a GPU host (its forward: the wgrad kernel cannot be traced
    on a CPU host); no rows take lax.ragged_dot."""
    monkeypatch.setattr(bf16_grouped, "_gpu_host", lambda: True)
    x, w, _, sizes = _inputs()
    assert "mpmd_map" in str(jax.make_jaxpr(bf16_grouped.ragged_dot)(x, w, sizes))
    jaxpr = str(jax.make_jaxpr(bf16_grouped.ragged_dot)(x[:0], w, sizes))
    assert "mpmd_map" not in jaxpr and "ragged_dot_general" in jaxpr, jaxpr


def test_values_and_gradients_equal_lax_ragged_dot_on_the_cpu():
    x, w, g, sizes = _inputs()
    got = jax.jit(lambda *a: _vjp(bf16_grouped.ragged_dot, *a))(x, w, g, sizes)
    want = jax.jit(lambda *a: _vjp(jax.lax.ragged_dot, *a))(x, w, g, sizes)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(_f32(a), _f32(b))
    _check_against_reference(got, x, w, g, sizes)


def test_the_kernels_custom_vjp_on_its_xla_twins_matches_the_reference():
    """The GPU path's forward, dgrad and wgrad wiring (each product on its XLA twin here)."""
    x, w, g, sizes = _inputs()
    got = jax.jit(lambda *a: _vjp(bf16_grouped._grouped, *a))(x, w, g, sizes)
    _check_against_reference(got, x, w, g, sizes)


@pytest.mark.parametrize(
    ("k", "n", "dtype", "fits"),
    [(128, 256, jnp.bfloat16, True), (256, 128, jnp.float16, True),
     (64, 256, jnp.bfloat16, False), (128, 192, jnp.bfloat16, False),
     (128, 256, jnp.float32, False)],
)  # fmt: skip
def test_the_shape_rule(k, n, dtype, fits):
    assert bf16_grouped.fits(k, n, dtype) is fits


def test_on_a_gpu_a_shape_the_kernels_cannot_take_warns_once(monkeypatch):
    monkeypatch.setattr(bf16_grouped, "_gpu_host", lambda: True)
    bf16_grouped._warn_once.cache_clear()
    assert bf16_grouped.placement(K, N, jnp.bfloat16).kernel
    with pytest.warns(RuntimeWarning, match="k=64, n=256, dtype bfloat16"):
        assert not bf16_grouped.placement(64, N, jnp.bfloat16).kernel
    with jax.set_mesh(fs.make_mesh(dp=8)), pytest.warns(RuntimeWarning, match="whole arrays only"):
        assert not bf16_grouped.placement(K, N, jnp.bfloat16).kernel
    with kernels.use_pallas(False):  # switched off: the user's choice, no warning
        assert bf16_grouped.placement(K, N, jnp.bfloat16) == kernels.XLA
    bf16_grouped._warn_once.cache_clear()


def test_mismatched_operands_are_refused_naming_them():
    x, w, _, sizes = _inputs()
    with pytest.raises(ValueError, match=r"one dtype, got bfloat16 and float32"):
        bf16_grouped.ragged_dot(x, w.astype(jnp.float32), sizes)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(4,\)"):
        bf16_grouped.ragged_dot(x, w, sizes[:3])
    with pytest.raises(ValueError, match=r"same k"):
        bf16_grouped.ragged_dot(x[:, :64], w, sizes)


def test_the_bf16_moe_experts_run_on_it(monkeypatch):
    calls = []

    def counting(a, b, sizes):
        calls.append((a.shape, b.shape))
        return jax.lax.ragged_dot(a, b, sizes)

    monkeypatch.setattr(bf16_grouped, "ragged_dot", counting)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (16, 32), jnp.bfloat16)
    wi = jax.random.normal(keys[1], (4, 32, 2, 16), jnp.bfloat16)
    wo = jax.random.normal(keys[2], (4, 16, 32), jnp.bfloat16)
    order = jnp.argsort(jnp.arange(32) % 4, stable=True)
    sizes = jnp.full((4,), 8, jnp.int32)
    moe_ops.routed_experts(x, order, 2, sizes, wi, wo, "silu", False, None)
    assert calls == [((32, 32), (4, 32, 32)), ((32, 16), (4, 16, 32))]


@pytest.mark.deviceless
def test_deviceless_h200_forward_and_dgrad_are_mosaic_gpu_kernels():
    """The forward and dgrad kernels compile for the H200 from a CPU host.

    The wgrad kernel (``transposed_ragged_dot_mgpu``) reads the SM count of
    ``jax.devices()[0]`` when traced (jax 0.10.2), which a CPU device lacks,
    so a CPU host takes ``lax.ragged_dot`` for the whole op; the full op is
    checked on the GPU below.
    """
    from fp8jax import verify
    from fp8jax.verify import _hlo, pallas_gemms

    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((len(SIZES), K, N), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((len(SIZES),), jnp.int32)

    def both(x, w, g, s):
        return bf16_grouped._forward_kernel(x, w, s), bf16_grouped._dgrad_kernel(g, w, s)

    hlo = verify.compile_for(both, x, w, g, s, target="h200")
    targets = [
        inst.custom_call_target for inst in _hlo.parse_module(hlo).entry.instructions.values()
    ]
    assert targets.count(pallas_gemms.MOSAIC_GPU_TARGET) == 2, targets
    # No dense GEMM over all groups (XLA's lowering of lax.ragged_dot).
    assert not verify.gemm_report(hlo).gemms, str(verify.gemm_report(hlo))


@pytest.mark.gpu
def test_gpu_the_op_runs_three_mosaic_kernels_and_matches_the_reference():
    x, w, g, sizes = _inputs()
    assert bf16_grouped.placement(K, N, jnp.bfloat16).kernel
    step = jax.jit(lambda *a: _vjp(bf16_grouped.ragged_dot, *a))
    hlo = step.lower(x, w, g, sizes).compile().as_text()
    assert hlo.count('custom_call_target="mosaic_gpu') == 3, hlo
    _check_against_reference(step(x, w, g, sizes), x, w, g, sizes)


def _op_inside_shard_map(x, w, g, sizes):
    """y, dx, dw of the op inside a one-device shard_map under ``jax.set_mesh``.

    The mesh's axis is ``Auto``, as the MoE blocks' meshes are (they call
    shard_map only over ``Auto`` axes): ``jax.make_mesh`` defaults to
    ``Explicit`` axes, where shard_map refuses inputs whose sharding differs
    from its ``in_specs`` instead of resharding them.
    """
    mesh = fs.make_mesh(dp=1, devices=jax.devices()[:1])
    sharded = jax.shard_map(
        bf16_grouped.ragged_dot, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp")
    )
    with jax.set_mesh(mesh):
        return jax.jit(lambda *a: _vjp(sharded, *a))(x, w, g, sizes)


def test_the_op_inside_shard_map_under_set_mesh_matches_the_reference():
    """The GPU test's harness, on the CPU's XLA path: it must run under JAX's ``set_mesh``."""
    x, w, g, sizes = _inputs()
    _check_against_reference(_op_inside_shard_map(x, w, g, sizes), x, w, g, sizes)


@pytest.mark.gpu
def test_gpu_the_op_inside_shard_map_matches_the_reference():
    """Inside shard_map (the MoE blocks route each device's tokens there, JAX's default
    check_vma) the kernels' results are typed as their operands vary (``varying_like``)."""
    x, w, g, sizes = _inputs()
    _check_against_reference(_op_inside_shard_map(x, w, g, sizes), x, w, g, sizes)


@pytest.mark.parametrize("check_vma", [True, False])
def test_the_kernel_path_inside_shard_map_sums_the_weights_gradient(check_vma):
    """Each device runs its own rows (the MoE blocks' local routing); replicated weights'
    gradient is the sum of the devices' (on the kernels' XLA twins here)."""
    x, w, g, _ = _inputs()
    local = jnp.array([3, 0, 5, 2], jnp.int32)  # of each device's 12 rows, 2 past the groups
    mesh = fs.make_mesh(dp=8)
    # Differentiated outside, as a model's loss is: the library's MoE shard_maps
    # take check_vma=False, the default is True.
    sharded = jax.shard_map(
        bf16_grouped._kernel_path,
        mesh=mesh,
        in_specs=(P("dp"), P(), P()),
        out_specs=P("dp"),
        check_vma=check_vma,
    )
    with jax.set_mesh(mesh):
        y, dx, dw = jax.jit(lambda *a: _vjp(sharded, *a))(x, w, g, local)
    rows = M // 8
    want_dw, magnitude = np.zeros(w.shape), np.zeros(w.shape)
    for d in range(8):
        part = slice(d * rows, (d + 1) * rows)
        (yd, my), (dxd, mdx), (dwd, mdw) = _reference(x[part], w, g[part], np.asarray(local))
        for got, want, mag in ((y[part], yd, my), (dx[part], dxd, mdx)):
            assert np.all(np.abs(np.asarray(got, np.float64) - want) <= BUDGET * mag + 1e-30)
        want_dw, magnitude = want_dw + dwd, magnitude + mdw
    # The sum over 8 devices of BF16-rounded partials: one more rounding each.
    err = np.abs(np.asarray(dw, np.float64) - want_dw)
    assert np.all(err <= 8 * BUDGET * magnitude + 1e-30), float(err.max())
