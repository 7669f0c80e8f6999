"""FP8 ops under ``jax.checkpoint`` with a policy that saves their residuals.

JAX rounds every saved floating residual with ``reduce_precision`` at its
dtype's ``finfo``, IEEE semantics: for float8_e4m3fn that turns values above
240 into Inf/NaN, and current scaling puts each tensor's amax at 448. The ops
save their FP8 residuals as uint8 bits (fp8jax.ops.residuals), so a remat
policy changes nothing: values and gradients are bitwise those without it.
"""

import jax
import jax.numpy as jnp
import pytest

import fp8jax

EVERYTHING = jax.checkpoint_policies.everything_saveable


def _x_w(k=128, n=64):
    x = jax.random.normal(jax.random.key(0), (64, k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.1
    return x, w


def _same_with_and_without_checkpoint(loss, *args):
    plain = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))(*args)
    saved = jax.jit(
        jax.value_and_grad(jax.checkpoint(loss, policy=EVERYTHING), argnums=tuple(range(len(args))))
    )(*args)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(saved), strict=True):
        assert bool(jnp.isfinite(b).all())
        assert bool(jnp.array_equal(a, b)), float(jnp.abs(a - b).max())


@pytest.mark.parametrize(
    "recipe", [fp8jax.CurrentScaling(), fp8jax.RowwiseScaling(), fp8jax.BlockScaling()],
    ids=lambda r: type(r).__name__,
)  # fmt: skip
def test_dense_under_an_everything_saveable_checkpoint(recipe):
    x, w = _x_w()
    _same_with_and_without_checkpoint(
        lambda x, w: jnp.sum(fp8jax.dense(x, w, recipe=recipe) ** 2), x, w
    )


def test_the_fused_ops_under_an_everything_saveable_checkpoint():
    x, w = _x_w()
    gamma, beta = jnp.ones((128,)), jnp.zeros((128,))
    k1 = jax.random.normal(jax.random.key(2), (128, 2, 256)) * 0.1
    k2 = jax.random.normal(jax.random.key(3), (256, 128)) * 0.1

    def loss(x, w, k1, k2):
        y = fp8jax.layernorm_dense(x, gamma, beta, w)
        z = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, activations=("silu", "linear"))
        return jnp.sum(y**2) + jnp.sum(z**2)

    _same_with_and_without_checkpoint(loss, x, w, k1, k2)


@pytest.mark.parametrize(
    "recipe", [fp8jax.CurrentScaling(), fp8jax.BlockScaling()], ids=lambda r: type(r).__name__
)
def test_ragged_dot_under_an_everything_saveable_checkpoint(recipe):
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (4, 128, 32), jnp.float32) * 0.1
    sizes = jnp.array([16, 0, 40, 8], jnp.int32)
    _same_with_and_without_checkpoint(
        lambda x, w: jnp.sum(fp8jax.ragged_dot(x, w, sizes, recipe=recipe) ** 2), x, w
    )


def test_fp8_attention_under_an_everything_saveable_checkpoint():
    # Q, K and V are quantized per 128 rows and head with their amax at 448: saved
    # as E4M3, every value above 240 would come back Inf and the gradients NaN.
    # Not bitwise, unlike the GEMM ops: the checkpointed program fuses the softmax's
    # f32 sums in another order, which may move a BF16 gradient's last rounding by
    # one step (an ulp is at most 2**-7 of the value, so of the largest one) and the
    # f32 loss by an ulp.
    q, k, v = (jax.random.normal(key, (1, 256, 2, 64), jnp.float32).astype(jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 3))  # fmt: skip

    def loss(q, k, v):
        y = fp8jax.dot_product_attention(q, k, v, causal=True)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.value_and_grad
    plain = jax.jit(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    saved = jax.jit(grad(jax.checkpoint(loss, policy=EVERYTHING), argnums=(0, 1, 2)))(q, k, v)
    (value, grads), (saved_value, saved_grads) = plain, saved
    assert abs(float(saved_value) - float(value)) <= 2**-22 * abs(float(value))
    for a, b in zip(grads, saved_grads, strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert bool(jnp.isfinite(b).all())
        assert float(jnp.abs(a - b).max()) <= 2**-7 * float(jnp.abs(a).max())


def test_no_fp8_residual_is_rounded_by_the_checkpoint():
    x, w = _x_w()
    grad = jax.grad(jax.checkpoint(lambda x, w: jnp.sum(fp8jax.dense(x, w)), policy=EVERYTHING))
    text = str(jax.make_jaxpr(grad)(x, w))
    rounded = [line for line in text.splitlines() if "reduce_precision" in line and ":f8" in line]
    assert rounded == []


SECOND_ORDER_OPS = {
    "dense": lambda x, w: fp8jax.dense(x, w),
    "dense_rowwise": lambda x, w: fp8jax.dense(x, w, recipe=fp8jax.RowwiseScaling()),
    "layernorm_dense": lambda x, w: fp8jax.layernorm_dense(x, jnp.ones((x.shape[-1],)), None, w),
}


@pytest.mark.parametrize("op", list(SECOND_ORDER_OPS))
def test_a_gradient_of_the_gradient_is_refused(op):
    # The residuals' bits carry no tangent: a second derivative missed the
    # terms through them and came out 80-90% off (a dense, f32 reference).
    fn = SECOND_ORDER_OPS[op]
    x, w = _x_w(k=32, n=8)

    def loss(x):
        return jnp.sum(jnp.tanh(fn(x, w) / 30) ** 2)

    # Traced under jit, as a training step takes it: the refusal comes while tracing, and
    # nothing runs op by op first (eagerly, each of the op's steps compiled on its own:
    # 6-9 s a case on a 2-core machine).
    with pytest.raises(TypeError, match="differentiable once"):
        jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(loss)(x))))(x)
    with pytest.raises(TypeError, match="differentiable once"):
        jax.jit(jax.hessian(lambda x: loss(x[None])[()]))(x[0])


def test_a_vjp_differentiated_in_its_cotangent_alone_is_still_allowed():
    # Linear in the cotangent, with the residuals constant: nothing is lost.
    x, w = _x_w(k=32, n=8)
    ct = jnp.ones((x.shape[0], w.shape[1]))

    @jax.jit  # one program, not each step of the op compiled on its own
    def grad(ct):
        _, vjp = jax.vjp(lambda x: fp8jax.dense(x, w), x)
        return jax.grad(lambda ct: jnp.sum(vjp(ct)[0]))(ct)

    grad = grad(ct)
    assert grad.shape == ct.shape and bool(jnp.isfinite(grad).all())
