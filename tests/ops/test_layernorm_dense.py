"""fp8jax.layernorm_dense: f32 references with derived budgets, its kernels, split outputs."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.kernels import norm_backward, norm_forward
from fused_cases import (
    CUBLASLT_FORM,
    EPS,
    NORMS,
    RECIPES,
    _h100_hlos,
    _ln_backward_error,
    _params,
    _written_results,
    ref_norm,
)
from numerics import (
    OUTPUT_UNIT_ROUNDOFF,
    assert_within,
    current_scale,
    gemm_error_bound,
)


@pytest.mark.parametrize(("norm_type", "zero_centered"), NORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layernorm_dense_matches_f32_within_fp8_bound(norm_type, zero_centered, dtype):
    hidden, feat = 64, 40
    x, gamma, beta = _params(norm_type, hidden, dtype)
    kernel = (0.1 * jax.random.normal(jax.random.key(9), (hidden, feat))).astype(dtype)
    g = jax.random.normal(jax.random.key(10), (48, feat)).astype(dtype)
    kw = dict(norm_type=norm_type, zero_centered_gamma=zero_centered, epsilon=EPS)

    def loss(x, gamma, beta, kernel):
        y = fp8jax.layernorm_dense(x, gamma, beta, kernel, **kw)
        return jnp.sum((y * g).astype(jnp.float32))

    # The op, its gradients and the reference norm's each one jitted program: eagerly
    # every step compiled on its own.
    y = jax.jit(lambda *a: fp8jax.layernorm_dense(*a, **kw))(x, gamma, beta, kernel)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if beta is not None else (0, 1, 3)))(
        x, gamma, beta, kernel
    )
    dx, dgamma, dkernel = grads[0], grads[1], grads[-1]

    # References: exact normalized input n (f32 jnp, autodiff for the norm),
    # exact GEMMs in f64.
    def reference(x, gm):
        return ref_norm(x, gm, beta, norm_type, zero_centered)

    def reference_vjp(x, gm, dn):
        return jax.vjp(reference, x, gm)[1](dn)

    n = jax.jit(reference)(x, gamma)
    ns, ks, gs = (np.asarray(v, np.float64) for v in (n, kernel, g))
    dn_exact = gs @ ks.T
    ref_dx, ref_dgamma = jax.jit(reference_vjp)(x, gamma, jnp.asarray(dn_exact, jnp.float32))
    u_out = OUTPUT_UNIT_ROUNDOFF[jnp.dtype(dtype)]
    # The f32 norm arithmetic (a handful of roundings, 2**-24 each) is allowed
    # 2**-18 of the magnitudes it feeds.
    f32_slack = 2.0**-18

    sn, sk, sg = current_scale(ns, "e4m3"), current_scale(ks, "e4m3"), current_scale(gs, "e5m2")
    y_bound = gemm_error_bound(ns, ks, "e4m3", "e4m3", sn, sk, "th,hf->tf", dtype)
    y_bound += f32_slack * np.abs(ns) @ np.abs(ks)
    assert_within(y, ns @ ks, y_bound, "forward")

    dn_bound = gemm_error_bound(gs, ks, "e5m2", "e4m3", sg, sk, "tf,hf->th", dtype)
    dx_bound = _ln_backward_error(dn_bound, x, gamma, norm_type, zero_centered)
    dx_bound += u_out * np.abs(np.asarray(ref_dx, np.float64)) * 2 + f32_slack * (
        _ln_backward_error(np.abs(dn_exact), x, gamma, norm_type, zero_centered)
    )
    assert_within(dx, ref_dx, dx_bound, "dx")

    xhat = np.abs(np.asarray(ref_norm(x, jnp.ones_like(gamma), None, norm_type, False)))
    dgamma_bound = (
        (dn_bound * xhat).sum(0) * (1 + f32_slack)
        + u_out * np.abs(np.asarray(ref_dgamma, np.float64))
        + f32_slack * (np.abs(dn_exact) * xhat).sum(0)
    )
    assert_within(dgamma, ref_dgamma, dgamma_bound, "dgamma")

    dk_bound = gemm_error_bound(ns, gs, "e4m3", "e5m2", sn, sg, "th,tf->hf", dtype)
    dk_bound += f32_slack * np.abs(ns).T @ np.abs(gs)
    assert_within(dkernel, ns.T @ gs, dk_bound, "dkernel")


def test_layernorm_dense_returns_normalized_and_its_gradient_flows():
    x, gamma, beta = _params("layernorm", 32, jnp.float32)
    kernel = 0.1 * jax.random.normal(jax.random.key(3), (32, 3, 8))
    # Jitted, one program each: eagerly every step of the op compiled on its own.
    y, normalized = jax.jit(
        lambda *a: fp8jax.layernorm_dense(*a, return_normalized=True)
    )(x, gamma, beta, kernel)  # fmt: skip
    assert y.shape == (48, 3, 8)
    np.testing.assert_allclose(
        normalized, ref_norm(x, gamma, beta, "layernorm", False), rtol=1e-5, atol=1e-5
    )

    # Only the normalized output is used: the gradient is the plain norm's.
    def through_normalized(x):
        return jnp.sum(fp8jax.layernorm_dense(x, gamma, beta, kernel, return_normalized=True)[1])

    want = jax.jit(jax.grad(lambda x: jnp.sum(ref_norm(x, gamma, beta, "layernorm", False))))(x)
    got = jax.jit(jax.grad(through_normalized))(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _residual_step(op, passed: bool, recipe):
    """The gradients of ``x + op(x)`` squared; ``passed``: the residual from the op itself."""
    _, gamma, beta = _params("layernorm", 128, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(4), 3)
    # 128 token rows: whole programs of the norm's backward kernel.
    x = (2.0 * jax.random.normal(keys[2], (2, 64, 128)) + 0.5).astype(jnp.bfloat16)
    k1 = 0.05 * jax.random.normal(keys[0], (128, 2, 256))
    k2 = 0.05 * jax.random.normal(keys[1], (256, 128))
    delayed = isinstance(recipe, fp8jax.DelayedScaling)
    if op == "layernorm_dense":
        state = fp8jax.init_state(recipe) if delayed else None

        def block(x, gamma, beta, k1, k2, **kw):
            kernel = k2[: x.shape[-1]]  # (hidden, hidden)
            return fp8jax.layernorm_dense(x, gamma, beta, kernel, recipe=recipe, state=state, **kw)
    else:
        state = fp8jax.init_state(recipe, fp8jax.MlpScaleState) if delayed else None

        def block(x, gamma, beta, k1, k2, **kw):
            return fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=("silu", "linear"),
                                        recipe=recipe, state=state, **kw)  # fmt: skip

    def loss(x, gamma, beta, k1, k2):
        if passed:
            y, residual = block(x, gamma, beta, k1, k2, return_residual=True)
        else:
            y, residual = block(x, gamma, beta, k1, k2), x
        return jnp.sum(jnp.square((residual + y).astype(jnp.float32)))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (x, gamma, beta, k1, k2), block


@pytest.mark.parametrize("op", ["layernorm_dense", "layernorm_mlp"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_residual_passed_through_the_op_changes_no_gradient(op, recipe):
    # return_residual moves the residual's gradient into the op's backward,
    # where it is added to the norm's in f32 and rounded once. The other
    # gradients are computed from the same FP8 operands, so they must agree
    # exactly; x's may differ by rounding only. Each bf16 rounding is within
    # 2**-8 of what it rounds; the reference rounds the norm's dx, then the
    # sum, the op only the sum: within 2**-8 * (|dx_norm| + 2 |sum|).
    # Jitted: run eagerly, the two steps and the block compiled their primitives one
    # by one (1 to 2 s a case); the programs compute the same ops on the same values.
    step_passed, args, block = _residual_step(op, True, recipe)
    step_added, _, _ = _residual_step(op, False, recipe)
    passed, added = jax.jit(step_passed)(*args), jax.jit(step_added)(*args)
    for a, b in zip(passed[1:], added[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    x = args[0]
    y, residual = jax.jit(functools.partial(block, return_residual=True))(*args)
    np.testing.assert_array_equal(residual, x)
    # The residual's own gradient, as the loss gives it: 2 (x + y) in bf16.
    g_residual = np.asarray((2 * (x + y).astype(jnp.float32)).astype(jnp.bfloat16), np.float64)
    dx_passed, dx_added = (np.asarray(d, np.float64) for d in (passed[0], added[0]))
    dx_norm = dx_added - g_residual
    bound = 2**-8 * (np.abs(dx_norm) + 2 * np.abs(dx_added)) + 1e-6
    assert np.all(np.abs(dx_passed - dx_added) <= bound)


def test_residual_and_normalized_outputs_are_alternatives():
    x, gamma, beta = _params("layernorm", 32, jnp.bfloat16)
    kernel = jnp.ones((32, 8))
    with pytest.raises(ValueError, match="return_normalized and return_residual"):
        fp8jax.layernorm_dense(x, gamma, beta, kernel, return_normalized=True,
                               return_residual=True)  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["layernorm_dense", "layernorm_mlp"])
def test_residual_passed_through_the_op_saves_the_sum(op):
    # On one GPU the norm's backward kernel adds the residual's gradient:
    # compared with the residual added outside the op, the step writes one
    # x-sized bf16 array less (XLA's sum), and the kernel reads it as a third
    # x-sized operand.
    steps = {p: _residual_step(op, p, fp8jax.DelayedScaling()) for p in (True, False)}
    hlos = _h100_hlos({("residual", op, p): (step, args) for p, (step, args, _) in steps.items()})

    def x_sized_bf16_writes(passed):
        x = steps[passed][1][0]
        results = _written_results(hlos["residual", op, passed])
        return sum(1 for _, dtype, shape in results
                   if dtype == "bf16" and math.prod(shape) == x.size)  # fmt: skip

    assert x_sized_bf16_writes(True) == x_sized_bf16_writes(False) - 1


@pytest.mark.deviceless
def test_layernorm_dense_forward_writes_no_high_precision_normalized_copy():
    # Besides x itself, no result may be a bf16/f32 tensor of x's shape: the
    # normalized activations must leave the norm's fusion only as f8.
    from fp8jax.verify import compile_for

    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    gamma = beta = jax.ShapeDtypeStruct((512,), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    hlo = compile_for(
        lambda x, g, b, k: fp8jax.layernorm_dense(x, g, b, k),
        x,
        gamma,
        beta,
        kernel,
        target="h100",
    )
    results = [r for r in _written_results(hlo) if r[2] == (256, 512)]
    assert [r for r in results if r[1] in ("bf16", "f32")] == []
    assert any(r[1] == "f8e4m3fn" for r in results)


def _biased_step_outputs(op, recipe) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each kernel's results in the H100 train step of ``op`` with a (3, 128) bias."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    x = jax.ShapeDtypeStruct((2, 512, 256), bf16)
    norm = jax.ShapeDtypeStruct((256,), f32)
    kernel = jax.ShapeDtypeStruct((256, 3, 128), bf16)
    bias = jax.ShapeDtypeStruct((3, 128), f32)

    def loss(x, gamma, beta, kernel, bias, state):
        if op == "dense":
            y = fp8jax.dense(x, kernel, bias, recipe=recipe, state=state)
        else:
            y = fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state)
        return jnp.sum(jnp.square(y.astype(f32)))

    step = jax.grad(loss, argnums=tuple(range(6)))
    hlos = _h100_hlos({("biased", op, recipe): (step, (x, norm, norm, kernel, bias, state))})
    outputs = {}
    for name, dtype, shape in _written_results(hlos["biased", op, recipe]):
        outputs.setdefault(name, []).append((dtype, shape))
    return outputs


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["dense", "layernorm_dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_output_gradient_and_bias_gradient_share_one_pass(op, recipe, monkeypatch, request):
    if isinstance(recipe, fp8jax.DelayedScaling):
        request.applymarker(pytest.mark.xfail(strict=True, reason=CUBLASLT_FORM))
    # quantize_operand with column_sums, XLA's path (where the cast kernel
    # does not run, here switched off): the amax of
    # the output gradient is taken as column maxima, like the bias gradient's
    # column sums, so one kernel computes both; under delayed scaling the FP8
    # gradient comes out of the same kernel. With row maxima XLA needs a
    # kernel for each reduction (the transformer layer's QKV gradient: 0.31 +
    # 0.41 ms on the H200, then one 0.59 ms kernel).
    monkeypatch.setattr(fp8jax.kernels.dispatch, "enabled", lambda: False)  # kernels off

    def column_results(outs):
        return [d for d, shape in outs if d == "f32" and shape[-2:] == (3, 128)]

    outputs = _biased_step_outputs(op, recipe)
    both = [name for name, outs in outputs.items() if len(column_results(outs)) == 2]
    assert len(both) == 1
    fp8_gradient = [n for n, outs in outputs.items() if any(d == "f8e5m2" for d, _ in outs)]
    if isinstance(recipe, fp8jax.DelayedScaling):
        assert fp8_gradient == both
    else:
        assert fp8_gradient and both[0] not in fp8_gradient


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["dense", "layernorm_dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_dense_operands_come_cast_and_transposed_from_one_kernel(op, recipe):
    # quantize_operand with transpose (kernels, dense's own input and the
    # output gradients): on one GPU the kernel's FP8 copies for the
    # forward GEMM (transposed) and the dgrad GEMM, the output gradient's for
    # the dgrad and the wgrad GEMM (transposed) with the bias's column sums,
    # and dense's input's for the forward and the wgrad GEMM (transposed),
    # each come out of one Pallas kernel. Its f32 results are one maximum per
    # 64 x 128 tile and, for the output gradient alone (the only one with a
    # bias to sum for), column sums per 64-row tile. layernorm_dense's
    # normalized input comes, under delayed scaling, from the norm's forward
    # kernel (fp8jax.kernels.norm_forward), with the row statistics and one
    # maximum per program's rows, under both recipes (current scaling's
    # maxima-only first pass writes no FP8).
    outputs = _biased_step_outputs(op, recipe)
    # The norm's backward kernel (fp8jax.kernels.norm_backward) writes no FP8.
    kernels = {
        frozenset(outs)
        for name, outs in outputs.items()
        if name.startswith("pallas_call") and any(dtype.startswith("f8") for dtype, _ in outs)
    }

    def cast_transposed(dtype, rows, cols, column_sums=False):
        sums = {("f32", (rows // 64, cols))} if column_sums else set()
        return frozenset({
            (dtype, (rows, cols)), (dtype, (cols, rows)), ("f32", (rows // 64, cols // 128)),
            *sums,
        })  # fmt: skip

    tokens, hidden, columns = 2 * 512, 256, 3 * 128
    want = {cast_transposed("f8e4m3fn", hidden, columns),
            cast_transposed("f8e5m2", tokens, columns, column_sums=True)}  # fmt: skip
    if op == "dense":
        want.add(cast_transposed("f8e4m3fn", tokens, hidden))
    else:
        statistics = ("f32", (tokens, 1))  # the mean and rstd
        want.add(frozenset({("f8e4m3fn", (tokens, hidden)), statistics,
                            ("f32", (tokens // norm_forward.ROWS_PER_PROGRAM, 1))}))  # fmt: skip
    assert kernels == want


@pytest.mark.deviceless
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_norm_backward_is_one_kernel(recipe):
    # fp8jax.kernels.norm_backward on one GPU: x's gradient, and per-program
    # (64-row) column sums for gamma and beta, from one Pallas kernel. No XLA
    # fusion writes an f32 array of x's size (the norm's products stay in
    # registers) or x's gradient. Under current scaling the norm forward's
    # maxima-only pass (fp8jax.kernels.norm_forward) is the one other kernel
    # without FP8 outputs: one maximum per program's rows.
    outputs = _biased_step_outputs("layernorm_dense", recipe)
    tokens, hidden = 2 * 512, 256
    norm_kernels = [
        outs for name, outs in outputs.items()
        if name.startswith("pallas_call") and not any(d.startswith("f8") for d, _ in outs)
    ]  # fmt: skip
    sums = ("f32", (tokens // norm_backward.ROWS_PER_PROGRAM, hidden))
    want = [[("bf16", (tokens, hidden)), sums, sums]]
    if isinstance(recipe, fp8jax.CurrentScaling):
        want.append([("f32", (tokens // norm_forward.ROWS_PER_PROGRAM, 1))])
    assert sorted(norm_kernels) == sorted(want)
    f32_of_x_size = [
        name for name, outs in outputs.items()
        if any(d == "f32" and math.prod(shape) == tokens * hidden for d, shape in outs)
    ]  # fmt: skip
    assert f32_of_x_size == []


def _qkv_loss(split: bool, recipe, state, op="layernorm_dense"):
    """A fused QKV (2 key/value heads, 2 query heads each) and a loss on q, k, v apart.

    ``op``: ``"layernorm_dense"``, or ``"dense"`` (the norm's parameters unused).
    """
    f32 = jnp.float32

    def project(x, gamma, beta, kernel, bias, **kw):
        if op == "dense":
            # In x's dtype, as the Flax modules ask (f32 kernel: JAX's promotion gives f32).
            return fp8jax.dense(x, kernel, bias, recipe=recipe, state=state,
                                preferred_element_type=x.dtype, **kw)  # fmt: skip
        return fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state,
                                      **kw)  # fmt: skip

    def loss(x, gamma, beta, kernel, bias):
        if split:
            q, k, v = project(x, gamma, beta, kernel, bias, split=(2, 1, 1))
        else:
            y = project(x, gamma, beta, kernel, bias)
            q, k, v = y[..., :2, :], y[..., 2:3, :], y[..., 3:, :]
        q, k, v = (t.astype(f32) for t in (q, k, v))
        return jnp.sum(q * q) + jnp.sum(3 * k) + jnp.sum(v * v * v)

    return loss


def _qkv_args(head_dim, hidden=256):
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (2, 128, hidden), jnp.bfloat16)
    kernel = jax.random.normal(keys[1], (hidden, 2, 4, head_dim)) * hidden**-0.5
    bias = 0.1 * jax.random.normal(keys[2], (2, 4, head_dim))
    return x, jnp.ones(hidden), jnp.zeros(hidden), kernel, bias


@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_split_output_and_its_gradients_are_the_whole_outputs_cut(recipe, head_dim, op):
    # layernorm_dense(split=...) must compute exactly what slicing its whole
    # output computes: the same GEMMs on the same FP8 bytes. The gradient's
    # cast reads the pieces (kernels.cast_transpose.Interleaved; on the CPU XLA
    # joins them), in 64 x 128 tiles for head_dim 128 and 128 x 64 for 64.
    # Both must match the unsplit op bit for bit.
    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    args = _qkv_args(head_dim)
    step = {
        split: jax.jit(
            jax.value_and_grad(_qkv_loss(split, recipe, state, op), argnums=(0, 1, 2, 3, 4))
        )
        for split in (True, False)
    }
    got, want = step[True](*args), step[False](*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# The tokens of _qkv_args's gradient; its pieces are q's (tokens, 2 * 2 *
# head_dim) and k's and v's (tokens, 2 * head_dim).
_QKV_TOKENS = 2 * 128


def _qkv_gradient_cast_reads(hlo: str, head_dim: int = 128) -> list[tuple[int, ...]]:
    """Shapes of what the Pallas kernel writing the FP8 QKV gradient reads, sorted."""
    from fp8jax.verify import _hlo

    entry = _hlo.parse_module(hlo).entry
    casts = [
        inst for inst in entry.instructions.values()
        if inst.custom_call_target == "__gpu$xla.gpu.triton"
        and ("f8e5m2", (_QKV_TOKENS, 8 * head_dim)) in {(t.dtype, t.shape) for t in inst.types}
    ]  # fmt: skip
    assert len(casts) == 1
    return sorted(t.shape for o in casts[0].operands for t in entry.instructions[o].types)


def _qkv_pieces_read(head_dim: int = 128) -> list[tuple[int, ...]]:
    """dq, dk, dv as the kernel reads them, then the scale."""
    return [(1,), (_QKV_TOKENS, 2 * head_dim), (_QKV_TOKENS, 2 * head_dim),
            (_QKV_TOKENS, 4 * head_dim)]  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_split_qkv_gradient_is_cast_from_its_pieces(recipe, op, head_dim):
    # Sliced outside the op, the pieces' gradients are padded and summed into
    # the whole (tokens, 2, 4, head_dim) gradient, written in bf16 and read
    # again by the FP8 cast (the transformer layer on the H200: 0.27 ms). Split
    # inside the op (ops.split), the cast kernel reads dq, dk and dv
    # themselves; with head_dim 64 in tiles half as wide (kernels.cast_transpose).
    from fp8jax.verify import gemm_report

    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _qkv_args(head_dim))

    def step(split):
        return jax.grad(_qkv_loss(split, recipe, state, op), argnums=(0, 1, 2, 3, 4))

    # Split and unsplit, in one child.
    hlos = _h100_hlos({("qkv", recipe, op, head_dim, s): (step(s), args) for s in (True, False)})

    def compiled(split):
        hlo = hlos["qkv", recipe, op, head_dim, split]
        assert len(gemm_report(hlo).fp8_gemms) == 3
        return hlo

    def whole_gradients_written(hlo):
        from fp8jax.verify import _hlo

        entry = _hlo.parse_module(hlo).entry
        return [
            shape for name, dtype, shape in _written_results(hlo)
            if dtype == "bf16" and math.prod(shape) == _QKV_TOKENS * 8 * head_dim
            and "transpose(jvp" in entry.instructions[name].metadata.get("op_name", "")
        ]  # fmt: skip

    split = compiled(split=True)
    assert _qkv_gradient_cast_reads(split, head_dim) == _qkv_pieces_read(head_dim)
    assert whole_gradients_written(split) == []
    assert whole_gradients_written(compiled(split=False))  # the pass the split removes


def _bias_broadcasts(hlo: str, whole: int, bias_size: int) -> list[str]:
    """Results of ``whole`` bf16 elements a program writes from nothing larger than the bias."""
    from fp8jax.verify import _hlo

    entry = _hlo.parse_module(hlo).entry

    def size(name):
        return max((math.prod(t.shape) for t in entry.instructions[name].types), default=0)

    return [
        name for name, dtype, shape in _written_results(hlo)
        if dtype == "bf16" and math.prod(shape) == whole
        and all(size(op) <= bias_size for op in entry.instructions[name].operands
                if op in entry.instructions)
    ]  # fmt: skip


@pytest.mark.deviceless
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
def test_split_outputs_bias_is_added_where_the_pieces_are_copied(op):
    # With the GEMMs on cuBLAS (fp8jax.compiler_options, as every program
    # fp8jax jits), XLA folded a bias over (heads, 3, head_dim) into the GEMM
    # as its whole (tokens, features) addend, broadcast by a fusion of its
    # own first: 0.24 ms of the TE-config layer's step on the H200. Split,
    # the op adds it in the pieces' copy (ops.split.split_output_with_bias).
    from fp8jax.verify import compile_many, gemm_report

    head_dim, recipe = 128, fp8jax.CurrentScaling()
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _qkv_args(head_dim))
    step = jax.grad(_qkv_loss(True, recipe, None, op), argnums=(0, 1, 2, 3, 4))
    (hlo,) = compile_many([(step, args)], target="h100",
                          xla_flags="--xla_gpu_enable_triton_gemm=false")  # fmt: skip
    assert [g.backend for g in gemm_report(hlo).fp8_gemms] == ["cublaslt-fp8"] * 3
    assert _bias_broadcasts(hlo, _QKV_TOKENS * 8 * head_dim, 8 * head_dim) == []


def test_one_device_mesh_lets_the_kernel_run(one_device):
    from fp8jax.kernels import dispatch

    assert jax.device_count() > 1 and dispatch.is_local()


def _live_split_and_unsplit_steps(recipe, op, head_dim):
    """The QKV train step's results split and unsplit, after checking the split one's cast.

    Returns ``(split results, unsplit results, (args, state))``.
    """
    state = fp8jax.init_state(recipe) if isinstance(recipe, fp8jax.DelayedScaling) else None
    args = _qkv_args(head_dim)
    steps = {
        split: jax.jit(
            jax.value_and_grad(_qkv_loss(split, recipe, state, op), argnums=(0, 1, 2, 3, 4))
        )
        for split in (True, False)
    }
    compiled = steps[True].lower(*args).compile()
    assert _qkv_gradient_cast_reads(compiled.as_text(), head_dim) == _qkv_pieces_read(head_dim)
    return compiled(*args), steps[False](*args), (args, state)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_device")
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_split_gradient_cast_from_pieces_matches_the_joined_one(recipe, op):
    # On the CPU both builds cast the QKV gradient on XLA's path, so only a GPU
    # runs the kernel that reads the pieces. Same tiles, same arithmetic as the
    # one-matrix kernel the unsplit op uses on the joined gradient: every
    # gradient and the loss must agree bit for bit.
    got, want, _ = _live_split_and_unsplit_steps(recipe, op, head_dim=128)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@pytest.mark.usefixtures("one_device")
@pytest.mark.parametrize("op", ["layernorm_dense", "dense"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_live_narrow_pieces_cast_matches_the_joined_one(recipe, op):
    # head_dim 64: the kernel reads dq, dk, dv in 128 x 64 tiles, the unsplit
    # op's kernel the joined gradient in 64 x 128. The FP8 bytes and amax do not
    # depend on the tiles, so the loss and every gradient but the bias's agree
    # bit for bit. The bias gradient is a column sum of the bf16 output
    # gradient, added in another grouping: each must be within n * 2**-24 *
    # sum(|g|) of the f64 sum (n tokens), g being 2q, 3 and 3v^2 in bf16.
    got, want, (args, state) = _live_split_and_unsplit_steps(recipe, op, head_dim=64)
    (loss, (*grads, d_bias)), (want_loss, (*want_grads, want_d_bias)) = got, want
    for a, b in zip(jax.tree.leaves((loss, grads)), jax.tree.leaves((want_loss, want_grads)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    x, gamma, beta, kernel, bias = args
    if op == "dense":
        y = fp8jax.dense(x, kernel, bias, recipe=recipe, state=state)
    else:
        y = fp8jax.layernorm_dense(x, gamma, beta, kernel, bias, recipe=recipe, state=state)
    y = np.asarray(y, np.float32)
    g = np.concatenate([2 * y[..., :2, :], np.full_like(y[..., 2:3, :], 3.0),
                        3 * y[..., 3:, :] ** 2], axis=-2)  # fmt: skip
    g = np.asarray(jnp.asarray(g).astype(jnp.bfloat16), np.float64)
    exact, bound = (
        g.sum(axis=(0, 1)),
        g.shape[0] * g.shape[1] * 2.0**-24 * np.abs(g).sum(axis=(0, 1)),
    )
    for d in (d_bias, want_d_bias):
        np.testing.assert_array_less(np.abs(np.asarray(d, np.float64) - exact), bound)
