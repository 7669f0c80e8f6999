"""The FP8 cast kernel per device where data parallelism alone splits the arrays.

Under ``fp8jax.sharding.use_mesh`` with only batch axes (``dp``, ``fsdp``)
splitting, an activation's or a gradient's token rows are split and its
columns whole, so each device can cast its own rows with its transposed copy
in one kernel (``fp8jax.kernels.cast_transpose``, inside ``shard_map``). On the
CPU the same per-device code computes the values with XLA; the deviceless
H100 compiles check that the GPU program runs the Pallas kernel on each
device's rows and gathers nothing in high precision.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
import fp8jax.sharding as fs
from fp8jax.kernels import cast_transpose as ct
from fp8jax.kernels import norm_forward

DP_FSDP = {"dp": 2, "fsdp": 4}
ROW_AXES = ("dp", "fsdp")


def _g(rows, cols, seed=0):
    return (jax.random.normal(jax.random.key(seed), (rows, cols)) * 4).astype(jnp.bfloat16)


@pytest.mark.parametrize("fmt", [fp8jax.E5M2, fp8jax.E4M3], ids=lambda f: f.name)
def test_rows_cast_per_device_match_the_whole_cast(fmt):
    # The FP8 bytes and the amax are elementwise and a maximum: exact either
    # way. Column sums add the same f32 terms in another order (per device,
    # then across devices): any order of n f32 additions errs by at most
    # n * 2**-24 * sum(|g|) from the exact sum.
    rows, cols = 8 * 2 * ct.BLOCK_ROWS, 3 * ct.BLOCK_COLS
    g, scale = _g(rows, cols), jnp.float32(fmt.max / 8)
    whole = jax.jit(ct.cast_transpose, static_argnums=2)(g, scale, fmt)
    mesh = fs.make_mesh(**DP_FSDP)
    with fs.use_mesh(mesh):
        g_split = jax.device_put(g, NamedSharding(mesh, P(ROW_AXES)))
        split = jax.jit(ct.cast_transpose, static_argnums=(2, 3))(g_split, scale, fmt, ROW_AXES)
    assert split.q.sharding.is_equivalent_to(NamedSharding(mesh, P(ROW_AXES, None)), 2)
    assert split.q_t.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ROW_AXES)), 2)
    np.testing.assert_array_equal(split.q.astype(jnp.float32), whole.q.astype(jnp.float32))
    np.testing.assert_array_equal(split.q_t.astype(jnp.float32), whole.q_t.astype(jnp.float32))
    np.testing.assert_array_equal(split.maxima, whole.maxima)
    g64 = np.asarray(g, np.float64)
    bound = rows * 2.0**-24 * np.abs(g64).sum(axis=0)
    np.testing.assert_array_less(
        np.abs(np.asarray(split.column_sums, np.float64) - g64.sum(axis=0)), bound
    )


def test_pieces_cast_per_device_match_the_joined_cast():
    # A fused QKV gradient arrives as dq, dk, dv (ct.Interleaved); each
    # device reads its rows of every piece.
    rows, periods, widths = 8 * ct.BLOCK_ROWS, 2, (256, 128, 128)
    keys = jax.random.split(jax.random.key(3), len(widths))
    pieces = tuple(
        (jax.random.normal(k, (rows, periods * w)) * 4).astype(jnp.bfloat16)
        for k, w in zip(keys, widths, strict=True)
    )
    g, scale = ct.Interleaved(pieces, periods), jnp.float32(7.0)
    whole = jax.jit(ct.cast_transpose, static_argnums=2)(g.joined(), scale, fp8jax.E5M2)
    mesh = fs.make_mesh(fsdp=8)
    with fs.use_mesh(mesh):
        split = jax.jit(ct.cast_transpose, static_argnums=(2, 3))(g, scale, fp8jax.E5M2, ("fsdp",))
    np.testing.assert_array_equal(split.q.astype(jnp.float32), whole.q.astype(jnp.float32))
    np.testing.assert_array_equal(split.q_t.astype(jnp.float32), whole.q_t.astype(jnp.float32))
    np.testing.assert_array_equal(split.maxima, whole.maxima)


def test_rows_that_leave_a_device_part_of_a_tile_are_refused():
    g = _g(4 * ct.BLOCK_ROWS, ct.BLOCK_COLS)  # 32 rows a device over 8
    with fs.use_mesh(fs.make_mesh(fsdp=8)), pytest.raises(ValueError, match="multiple of 64 rows"):
        ct.cast_transpose(g, jnp.float32(1.0), fp8jax.E5M2, ("fsdp",))


@pytest.mark.parametrize(
    ("sizes", "want"),
    [
        ({"fsdp": 8}, ("fsdp",)),
        ({"dp": 2, "fsdp": 4}, ("dp", "fsdp")),
        ({"dp": 8, "tp": 1}, ("dp",)),  # an axis of size 1 splits nothing
        ({"fsdp": 4, "tp": 2}, None),  # tensor parallelism splits columns
        ({"dp": 4, "sp": 2}, None),
    ],
    ids=str,
)
def test_data_parallel_axes_names_the_batch_axes_when_only_they_split(sizes, want):
    config = fs.ShardingConfig(sp="sp") if "sp" in sizes else fs.DEFAULT
    with fs.use_mesh(fs.make_mesh(**sizes, config=config), config):
        assert fs.data_parallel_axes() == want


def test_no_data_parallel_axes_without_a_mesh_without_roles_or_under_explicit_axes():
    assert fs.data_parallel_axes() is None  # no mesh
    with jax.set_mesh(fs.make_mesh(fsdp=8)):  # a mesh, but no logical rules: roles unknown
        assert fs.data_parallel_axes() is None
    explicit = fs.make_mesh(fsdp=8, axis_types=AxisType.Explicit)
    with fs.use_mesh(explicit):
        assert fs.data_parallel_axes() is None


def _mlp_step_hlos(sizes, steps: list) -> list[str]:
    """layernorm_mlp's train step over 8 H100s (deviceless), tokens split as ``sizes`` say.

    One HLO text per ``(activations, recipe)`` of ``steps``, compiled in one child process.
    """
    from fp8jax import verify

    mesh = fs.make_mesh(**sizes)
    calls = [_mlp_step(mesh, activations, recipe) for activations, recipe in steps]
    with fs.use_mesh(mesh):
        return verify.compile_many(calls, target="h100", devices=8)


def _mlp_step(mesh, activations, recipe, tokens=8 * 128):
    """layernorm_mlp's train step and its abstract arguments, the token rows split on ``mesh``."""
    hidden, ffn, n, bf16 = 256, 512, len(activations), jnp.bfloat16
    rows = NamedSharding(mesh, fs.logical_spec(("batch", None), mesh=mesh))
    args = (
        jax.ShapeDtypeStruct((tokens, hidden), bf16, sharding=rows),
        jax.ShapeDtypeStruct((hidden,), jnp.float32),
        jax.ShapeDtypeStruct((hidden, n, ffn), bf16),
        jax.ShapeDtypeStruct((ffn, hidden), bf16),
        jax.ShapeDtypeStruct((n, ffn), bf16),
    )
    state = None
    if isinstance(recipe, fp8jax.DelayedScaling):
        state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, gamma, k1, k2, b1, state):
        y = fp8jax.layernorm_mlp(
            x, gamma, None, k1, k2, b1, activations=activations, recipe=recipe, state=state
        )
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    return jax.grad(loss, argnums=tuple(range(6))), (*args, state)


# The data-parallel steps the tests below read: (activations, recipe).
DP_STEPS = [
    (("gelu", "linear"), fp8jax.CurrentScaling()),
    (("gelu", "linear"), fp8jax.DelayedScaling()),
    (("gelu_tanh",), fp8jax.DelayedScaling()),
    (("silu", "linear"), fp8jax.DelayedScaling()),
]


@pytest.fixture(scope="module")
def dp_step_hlos():
    """``{(activations, recipe): HLO}`` of DP_STEPS over dp=2 x fsdp=4, in one child process."""
    return dict(zip(DP_STEPS, _mlp_step_hlos(DP_FSDP, DP_STEPS), strict=True))


def _cast_kernel_outputs(hlo, kernel="fp8jax_cast_transpose", fp8_only=True) -> list[frozenset]:
    """The FP8 (or all) (dtype, shape) pairs each Pallas kernel ``kernel`` of ``hlo`` writes."""
    from fp8jax.verify import _hlo

    return sorted(
        (
            frozenset(
                (t.dtype, t.shape) for t in inst.types if t.dtype.startswith("f8") or not fp8_only
            )
            for comp in _hlo.parse_module(hlo).computations.values()
            for inst in comp.instructions.values()
            if inst.metadata.get("op_name", "").endswith(f"/{kernel}/pallas_call")
            and inst.custom_call_target == "__gpu$xla.gpu.triton"
        ),
        key=sorted,
    )


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", [fp8jax.CurrentScaling(), fp8jax.DelayedScaling()],
                         ids=lambda r: type(r).__name__)  # fmt: skip
def test_data_parallel_mlp_step_casts_each_devices_rows_in_the_kernel(recipe, dp_step_hlos):
    # 1024 tokens over dp=2 x fsdp=4: 128 rows a device. The pre-activation
    # gradient (tokens, 2 * ffn) and the output gradient (tokens, hidden) are
    # cast with their transposed copies by the Pallas kernel on each device's
    # rows; nothing is gathered in high precision and all six GEMMs are FP8.
    # (GeGLU's erf gelu stays on XLA's activation path,
    # fp8jax.activations.Activation.kernel; the test below covers the activation kernels.)
    from fp8jax import verify

    hlo = dp_step_hlos[("gelu", "linear"), recipe]
    local = 1024 // 8
    # The gated gradient's transposed copy is branch-major, (2, ffn, rows), for
    # kernel_1's wgrad to write the parameter's layout (layernorm_mlp._branch_major).
    want = [
        frozenset({("f8e5m2", (local, 1024)), ("f8e5m2", (2, 512, local))}),
        frozenset({("f8e5m2", (local, 256)), ("f8e5m2", (256, local))}),
    ]
    assert _cast_kernel_outputs(hlo) == sorted(want, key=sorted)
    # The norm's backward (fp8jax.kernels.norm_backward) on each device's rows too:
    # x's gradient and one row of gamma's column sums per 64-row program.
    norm = frozenset({("bf16", (local, 256)), ("f32", (local // 64, 256))})
    assert _cast_kernel_outputs(hlo, "fp8jax_norm_backward", fp8_only=False) == [norm]
    # The norm's forward and FP8 cast (fp8jax.kernels.norm_forward) as well: the
    # FP8 output, the row statistics, one maximum per program; under current
    # scaling after a first pass on each device's rows that writes only the
    # maxima (whose all-reduced maximum gives the scale). It runs twice: the
    # backward casts the output again rather than keep it
    # (docs/design.md#the-norms-fp8-output-cast-again-in-the-backward).
    forward = _cast_kernel_outputs(hlo, "fp8jax_norm_forward", fp8_only=False)
    programs = local // norm_forward.ROWS_PER_PROGRAM
    want_forward = {("f8e4m3fn", (local, 256)), ("f32", (local, 1)), ("f32", (programs, 1))}
    assert forward == [frozenset(want_forward)] * 2
    maxima_pass = _cast_kernel_outputs(hlo, "fp8jax_norm_maxima", fp8_only=False)
    current = isinstance(recipe, fp8jax.CurrentScaling)
    assert maxima_pass == [frozenset({("f32", (programs, 1))})] * current
    report = verify.gemm_report(hlo)
    assert report.num_partitions == 8
    assert len(report.gemms) == 6 and len(report.fp8_gemms) == 6
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    high = [c for c in gathers if not c.dtype.startswith("f8")]
    assert all(c.bytes < 4096 for c in high), high  # vectors at most, never token rows


@pytest.mark.deviceless
def test_tensor_parallel_mlp_step_keeps_xla_cast():
    # With tp splitting the MLP width the gradient's columns are split too;
    # the kernel is not used (fs.data_parallel_axes() is None) and XLA casts.
    from fp8jax import verify

    (hlo,) = _mlp_step_hlos({"fsdp": 4, "tp": 2}, [(("gelu", "linear"), fp8jax.DelayedScaling())])
    assert _cast_kernel_outputs(hlo) == []
    assert _cast_kernel_outputs(hlo, "fp8jax_norm_backward", fp8_only=False) == []
    assert len(verify.gemm_report(hlo).fp8_gemms) == 6


def test_activation_kernels_per_device_match_the_whole():
    # fp8jax.kernels.activation_cast on each device's rows, SwiGLU's interleaved
    # pre-activation: elementwise FP8 values and maxima are exact either way;
    # the gradient's column sums add the same f32 terms in another order
    # (bound as in the cast test above).
    from fp8jax.kernels import activation_cast as ac

    acts, rows, cols = ("silu", "linear"), 8 * ct.BLOCK_ROWS, 2 * ct.BLOCK_COLS
    pre, dh = _g(rows, 2 * cols, seed=4), _g(rows, cols, seed=5)
    bias = _g(1, 2 * cols, seed=6)[0]
    scales = (jnp.float32(200.0), fp8jax.E5M2, jnp.float32(4.0), fp8jax.E4M3)
    forward = jax.jit(ac.cast_activation, static_argnums=(2, 4, 5))
    gradient = jax.jit(ac.cast_activation_gradient, static_argnums=(3, 5, 7, 8))
    whole_h = forward(pre, bias, acts, scales[2], scales[3])
    whole_g, whole_h_t = gradient(dh, pre, bias, acts, *scales)
    mesh = fs.make_mesh(**DP_FSDP)
    with fs.use_mesh(mesh):
        split = NamedSharding(mesh, P(ROW_AXES))
        pre_s, dh_s = jax.device_put(pre, split), jax.device_put(dh, split)
        h = forward(pre_s, bias, acts, scales[2], scales[3], ROW_AXES)
        g, h_t = gradient(dh_s, pre_s, bias, acts, *scales, ROW_AXES)
    assert h_t.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ROW_AXES)), 2)
    for got, want in ((h[0], whole_h[0]), (g.q, whole_g.q), (g.q_t, whole_g.q_t),
                      (h_t, whole_h_t)):  # fmt: skip
        np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))
    np.testing.assert_array_equal(h[1], whole_h[1])
    np.testing.assert_array_equal(g.maxima, whole_g.maxima)
    x = pre.astype(jnp.float32) + bias.astype(jnp.float32)[None, :]
    gate, linear = x[:, 0::2], x[:, 1::2]
    silu, silu_slope = ac.activation_and_slope("silu", gate)
    d_pre = jnp.stack([silu_slope * linear, silu], axis=-1).reshape(rows, 2 * cols)
    d_pre = d_pre * jnp.repeat(dh.astype(jnp.float32), 2, axis=1)
    d_pre = np.asarray(d_pre.astype(jnp.bfloat16), np.float64)
    bound = 2 * rows * 2.0**-24 * np.abs(d_pre).sum(axis=0)  # each sum's error, twice
    np.testing.assert_array_less(
        np.abs(np.asarray(g.column_sums, np.float64) - np.asarray(whole_g.column_sums)), bound
    )


@pytest.mark.deviceless
@pytest.mark.parametrize("activations", [("gelu_tanh",), ("silu", "linear")], ids="-".join)
def test_data_parallel_step_runs_the_activation_kernels_per_device(activations, dp_step_hlos):
    # Under delayed scaling the activation and its gradient are computed in
    # their Pallas kernels (fp8jax.kernels.activation_cast) on each device's 128
    # rows; nothing is gathered in high precision.
    from fp8jax import verify
    from fp8jax.verify import _hlo

    n = len(activations)
    hlo = dp_step_hlos[activations, fp8jax.DelayedScaling()]
    local = 1024 // 8
    written = sorted(
        (t.dtype, t.shape)
        for comp in _hlo.parse_module(hlo).computations.values()
        for inst in comp.instructions.values()
        if "fp8jax_cast_activation" in inst.metadata.get("op_name", "")
        and inst.custom_call_target == "__gpu$xla.gpu.triton"
        for t in inst.types
        if t.dtype.startswith("f8")
    )
    h = [("f8e4m3fn", (local, 512)), ("f8e4m3fn", (512, local))]
    # A gated pair's transposed copy is branch-major, (2, ffn, rows).
    d_pre_t = (n * 512, local) if n == 1 else (n, 512, local)
    d_pre = [("f8e5m2", (local, n * 512)), ("f8e5m2", d_pre_t)]
    assert written == sorted(h + d_pre)
    report = verify.gemm_report(hlo)
    assert len(report.gemms) == 6 and len(report.fp8_gemms) == 6
    high = [c for c in report.collectives
            if c.kind == "all-gather" and not c.dtype.startswith("f8")]  # fmt: skip
    assert all(c.bytes < 4096 for c in high), high


def _residual_mlp_step(mesh, recipe, tokens=8 * 128):
    """layernorm_mlp(x, residual=r) and its abstract arguments, x's and r's rows split."""
    hidden, ffn, bf16 = 256, 512, jnp.bfloat16
    rows = NamedSharding(mesh, fs.logical_spec(("batch", None), mesh=mesh))
    stream = jax.ShapeDtypeStruct((tokens, hidden), bf16, sharding=rows)
    kernels = (
        jax.ShapeDtypeStruct((hidden, 2, ffn), bf16),
        jax.ShapeDtypeStruct((ffn, hidden), bf16),
    )
    args = (stream, stream, jax.ShapeDtypeStruct((hidden,), jnp.float32), *kernels)
    state = None
    if isinstance(recipe, fp8jax.DelayedScaling):
        state = fp8jax.init_state(recipe, fp8jax.MlpScaleState)

    def loss(x, r, gamma, k1, k2, state):
        y, h = fp8jax.layernorm_mlp(
            x, gamma, None, k1, k2, activations=("silu", "linear"), recipe=recipe, state=state,
            residual=r, return_residual=True,
        )  # fmt: skip
        return jnp.sum(jnp.square(y.astype(jnp.float32))) + jnp.sum(h.astype(jnp.float32))

    return jax.grad(loss, argnums=tuple(range(6))), (*args, state)


@pytest.mark.deviceless
def test_data_parallel_residual_add_runs_in_the_norm_kernel_on_each_devices_rows():
    """With residual=, the norm's forward kernel reads x's and the residual's local rows and
    writes their local sum: in the maxima pass (current scaling) or the one cast pass
    (delayed), with nothing gathered in high precision."""
    from fp8jax import verify

    mesh = fs.make_mesh(**DP_FSDP)
    recipes = [fp8jax.CurrentScaling(), fp8jax.DelayedScaling()]
    with fs.use_mesh(mesh):
        hlos = verify.compile_many([_residual_mlp_step(mesh, r) for r in recipes], target="h100",
                                   devices=8)  # fmt: skip
    local = 1024 // 8
    programs = local // norm_forward.ROWS_PER_PROGRAM
    total, maxima = ("bf16", (local, 256)), ("f32", (programs, 1))
    cast = {("f8e4m3fn", (local, 256)), ("f32", (local, 1)), maxima}
    for recipe, hlo in zip(recipes, hlos, strict=True):
        forward = _cast_kernel_outputs(hlo, "fp8jax_norm_forward", fp8_only=False)
        maxima_pass = _cast_kernel_outputs(hlo, "fp8jax_norm_maxima", fp8_only=False)
        if isinstance(recipe, fp8jax.CurrentScaling):
            # The maxima pass writes the sum, which the cast pass and its recast read.
            assert maxima_pass == [frozenset({total, maxima})]
            assert forward == [frozenset(cast)] * 2
        else:
            assert maxima_pass == []
            # The forward's cast writes the sum; the backward's recast reads it.
            assert forward == sorted([frozenset(cast | {total}), frozenset(cast)], key=sorted)
        report = verify.gemm_report(hlo)
        assert len(report.gemms) == 6 and len(report.fp8_gemms) == 6
        gathers = [c for c in report.collectives if c.kind == "all-gather"]
        assert all(c.bytes < 4096 for c in gathers if not c.dtype.startswith("f8"))
