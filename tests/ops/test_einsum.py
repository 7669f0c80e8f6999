"""fp8jax.einsum: projection forms against f32 references, jaxpr structure, spec errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.verify.jaxpr_dots import jaxpr_dots
from numerics import assert_within, current_scale, gemm_error_bound

FORMS = [
    # (spec, explicit numpy spec, x shape, w shape)
    ("...d,dhk->...hk", "bsd,dhk->bshk", (2, 8, 32), (32, 4, 8)),
    ("...hk,hkd->...d", "bshk,hkd->bsd", (2, 8, 4, 8), (4, 8, 32)),
    ("bsd,df->bsf", "bsd,df->bsf", (2, 8, 32), (32, 16)),
    ("ebd,edf->ebf", "ebd,edf->ebf", (3, 8, 32), (3, 32, 16)),
    ("bd,hdk->bhk", "bd,hdk->bhk", (8, 32), (4, 32, 8)),
]

# test_dense.py's derivation: rounding to a format with unit roundoff u errs
# by 0.425 u RMS relative, so a dot product of an E5M2 (u = 2**-3) and an E4M3
# (u = 2**-4) operand by sqrt(0.053**2 + 0.0265**2) = 0.059 normwise; 20% more
# for the few hundred outputs here.
TYPICAL_E5M2_DOT_ERROR = 1.2 * 0.059


@pytest.mark.parametrize(("spec", "np_spec", "x_shape", "w_shape"), FORMS)
def test_einsum_forward_within_fp8_bound_and_three_fp8_dots(spec, np_spec, x_shape, w_shape):
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, x_shape)
    w = jax.random.normal(kw, w_shape) * 0.1
    # Jitted, one program each: eagerly every step of the op compiled on its own.
    y = jax.jit(fp8jax.einsum, static_argnums=0)(spec, x, w)
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = np.einsum(np_spec, xs, ws)
    assert y.shape == ref.shape
    bound = gemm_error_bound(
        xs,
        ws,
        "e4m3",
        "e4m3",
        current_scale(xs, "e4m3"),
        current_scale(ws, "e4m3"),
        np_spec,
        jnp.float32,
    )
    assert_within(y, ref, bound, spec)

    def loss(x, w):
        return jnp.sum(fp8jax.einsum(spec, x, w) ** 2)

    def reference_vjp(x, w, cotangent):
        return jax.vjp(lambda a, b: jnp.einsum(np_spec, a, b), x, w)[1](cotangent)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    want_dx, want_dw = jax.jit(reference_vjp)(x, w, 2 * y)
    for got, want in ((dx, want_dx), (dw, want_dw)):
        # Same cotangent, FP8 operands: E5M2 x E4M3, normwise
        # TYPICAL_E5M2_DOT_ERROR (derived below); a gradient 1.1 times too
        # large errs by about 0.11.
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < TYPICAL_E5M2_DOT_ERROR, err
    dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1)), x, w)
    assert len(dots) == 3 and all(d.is_fp8 for d in dots)


@pytest.mark.parametrize(
    ("spec", "w_shape", "message"),
    [
        ("...d,dhk", (32, 4), "explicit two-operand einsum"),
        ("...d,...dk->...k", (32, 4), "only x"),
        ("...d,dk->k", (32, 4), "'...' must appear once in x and once in the output"),
        ("bsd,dk->bsz", (32, 4), "output label 'z' is in neither operand"),
        ("bsd,dkq->bsk", (32, 4, 2), "label 'q' appears only in w"),
        ("bsd,dd->bsd", (32, 32), "repeats an axis label in w"),
        ("bs,dk->bsk", (32, 4), "gives x 2 axes, but it has rank 3"),
        ("bsd,k->bsdk", (4,), r"spec 'bsd,k->bsdk' contracts no label"),  # outer product
        ("bsd,sd->bsd", (8, 32), "contracts no label"),  # elementwise
    ],
)
def test_bad_specs_are_explained(spec, w_shape, message):
    with pytest.raises(ValueError, match=message):
        fp8jax.einsum(spec, jnp.ones((2, 8, 32)), jnp.ones(w_shape))
