"""Format pairs other than HYBRID, and margin > 0, through the ops.

The values are chosen so that each setting changes an exact result: a
HYBRID-only library, a dropped margin or a margin applied as 2**margin the
wrong way round gives a different number, not a slightly larger error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.verify.jaxpr_dots import jaxpr_dots

E4, E5 = "float8_e4m3fn", "float8_e5m2"
N = 16


def _identity_case(first_row):
    """x whose row 0 is ``first_row`` (rest zero), and the identity kernel.

    The kernel's last diagonal entry, 448, makes its amax E4M3's maximum, so
    its scale is 1 and the identity part is exact; row 0 of x never meets that
    entry. So y's row 0 is x's quantized values and dx's row 0 the
    cotangent's, exactly.
    """
    x = jnp.zeros((N, N), jnp.float32).at[0, : len(first_row)].set(jnp.asarray(first_row))
    return x, jnp.eye(N, dtype=jnp.float32).at[N - 1, N - 1].set(448.0)


def _dx(recipe, cotangent_row):
    x, w = _identity_case([1.0])
    g = jnp.zeros((N, N), jnp.float32).at[0, : len(cotangent_row)].set(jnp.asarray(cotangent_row))

    @jax.jit  # one program: eagerly every step of the op compiled on its own
    def dx(x, g):
        _, vjp = jax.vjp(lambda x: fp8jax.dense(x, w, recipe=recipe), x)
        return vjp(g)[0]

    return np.asarray(dx(x, g))


@pytest.mark.parametrize(
    ("formats", "want"),
    [
        # amax 448 gives E4M3 scale 1 and E5M2 scale 128 (57344 / 448): 1.125 is
        # E4M3 (3 mantissa bits) but halfway between E5M2's 1.0 and 1.25, and
        # rounds to the even 1.0.
        (fp8jax.ALL_E4M3, 1.125),
        (fp8jax.HYBRID, 1.0),
    ],
)
def test_the_gradient_format_decides_how_the_cotangent_rounds(formats, want):
    dx = _dx(fp8jax.CurrentScaling(formats=formats), [448.0, 1.125])
    assert dx[0, 0] == 448.0
    assert dx[0, 1] == want


_K = jax.random.split(jax.random.key(1), 2)
OPS = {
    "dense": (lambda x, p, r: fp8jax.dense(x, p[0], recipe=r), (jax.random.normal(_K[0], (N, N)),)),
    "einsum": (
        lambda x, p, r: fp8jax.einsum("bd,df->bf", x, p[0], recipe=r),
        (jax.random.normal(_K[0], (N, N)),),
    ),
    "layernorm_dense": (
        lambda x, p, r: fp8jax.layernorm_dense(x, jnp.ones((N,)), None, p[0], recipe=r),
        (jax.random.normal(_K[0], (N, N)),),
    ),
    "layernorm_mlp": (  # GeGLU: kernel_1 is (hidden, 2 activations, ffn)
        lambda x, p, r: fp8jax.layernorm_mlp(x, jnp.ones((N,)), None, *p, recipe=r),
        (jax.random.normal(_K[0], (N, 2, 2 * N)), jax.random.normal(_K[1], (2 * N, N))),
    ),
}


@pytest.mark.parametrize("name", OPS)
def test_all_e4m3_quantizes_every_gemm_operand_to_e4m3(name):
    op, params = OPS[name]
    x = jax.random.normal(jax.random.key(0), (N, N))

    def formats(pair):
        recipe = fp8jax.CurrentScaling(formats=pair)
        loss = lambda x, p: op(x, p, recipe).astype(jnp.float32).sum()  # noqa: E731
        dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1)), x, params)
        assert dots and all(d.is_fp8 for d in dots), dots
        return {f for d in dots for f in d.operand_formats}

    assert formats(fp8jax.ALL_E4M3) == {E4}
    assert formats(fp8jax.HYBRID) == {E4, E5}  # the same op does use E5M2 by default


# 3 * 2**-9 is an E4M3 subnormal (step 2**-9 below 2**-6). With amax 448,
# margin 0 gives scale 1: exact. Margin 1 halves the scale: 1.5 * 2**-9 rounds
# to the even 2 * 2**-9, so the dequantized value is 2**-7. Margin 2 quarters
# it: 0.75 * 2**-9 rounds to 2**-9, dequantized 4 * 2**-9.
@pytest.mark.parametrize(("margin", "want"), [(0, 3 * 2.0**-9), (1, 2.0**-7), (2, 2.0**-7)])
def test_current_scaling_margin_divides_the_scale_by_two_to_the_margin(margin, want):
    x, w = _identity_case([448.0, 3 * 2.0**-9])
    y = np.asarray(fp8jax.dense(x, w, recipe=fp8jax.CurrentScaling(margin=margin)))
    assert y[0, 0] == 448.0
    assert y[0, 1] == want


def test_quantize_margin_doubles_scale_inv_per_power_of_two():
    x = jnp.asarray([448.0, -3.0, 0.5], jnp.float32)
    inv = [float(fp8jax.quantize(x, fp8jax.E4M3, margin=m)[0].scale_inv) for m in (0, 1, 3)]
    assert inv == [1.0, 2.0, 8.0]


def test_delayed_scaling_margin_halves_every_new_scale():
    x = jax.random.normal(jax.random.key(0), (N, N))
    w = jax.random.normal(jax.random.key(1), (N, N))
    g = jax.random.normal(jax.random.key(2), (N, N))

    def new_state(margin):
        recipe = fp8jax.DelayedScaling(amax_history_len=4, margin=margin)
        state = fp8jax.init_state(recipe, fp8jax.DotScaleState)

        @jax.jit  # one program: eagerly every step of the op compiled on its own
        def grad(state):
            _, vjp = jax.vjp(lambda s: fp8jax.dense(x, w, recipe=recipe, state=s), state)
            return vjp(g)[0]

        return grad(state)

    zero, one = new_state(0), new_state(1)
    for role in ("x", "kernel", "grad"):
        s0, s1 = float(getattr(zero, role).scale), float(getattr(one, role).scale)
        assert s0 != 1.0  # the state was updated from the amaxes, not left at init
        assert s1 == s0 / 2, role
