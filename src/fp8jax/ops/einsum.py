"""FP8 einsum for the two-operand contractions transformer projections use.

The spec is turned into dot_general dimension numbers plus an output
transpose, so every einsum runs through the same FP8 custom_vjp as
:func:`fp8jax.dot_general`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.ops.dot_general import dot_general
from fp8jax.quantize import check_high_precision
from fp8jax.recipes import Recipe


def _split_spec(spec: str) -> tuple[str, str, str]:
    if not isinstance(spec, str) or spec.count("->") != 1 or spec.count(",") != 1:
        raise ValueError(
            f"spec must be an explicit two-operand einsum like '...d,dhk->...hk', got {spec!r}."
        )
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    if "..." in rhs:
        raise ValueError(f"spec {spec!r}: only x (the first operand) may use '...'.")
    if lhs.count("...") > 1 or out.count("...") != lhs.count("..."):
        raise ValueError(f"spec {spec!r}: '...' must appear once in x and once in the output.")
    return lhs, rhs, out


def _expand_ellipsis(lhs: str, out: str, ndim: int, spec: str) -> tuple[str, str]:
    n_named = len(lhs.replace("...", ""))
    if "..." not in lhs:
        return lhs, out
    n_ellipsis = ndim - n_named
    if n_ellipsis < 0:
        raise ValueError(f"spec {spec!r} names {n_named} axes of x, but x has rank {ndim}.")
    # Code points past Latin-1 cannot clash with the letters of a spec.
    fill = "".join(chr(0x400 + i) for i in range(n_ellipsis))
    return lhs.replace("...", fill), out.replace("...", fill)


def _check_labels(name: str, labels: str, ndim: int, spec: str) -> None:
    if len(labels) != ndim:
        raise ValueError(f"spec {spec!r} gives {name} {len(labels)} axes, but it has rank {ndim}.")
    if len(set(labels)) != len(labels):
        raise ValueError(f"spec {spec!r} repeats an axis label in {name}; traces are unsupported.")


def einsum(spec: str, x, w, *, recipe: Recipe | None = None, state=None,
           preferred_element_type=None):  # fmt: skip
    """FP8 ``jnp.einsum`` for ``x`` (activations) and ``w`` (kernel).

    Axes in both operands and the output are batch axes; axes in both
    operands but not the output are contracted. Each label appears at most
    once per operand, and every label of an operand that is not contracted
    must appear in the output.

    Args:
      spec: e.g. ``"...d,dhk->...hk"`` (QKV projection) or
        ``"...hk,hkd->...d"`` (attention output). ``...`` may stand for the
        leading axes of ``x``.
      x: activations, float32/bfloat16/float16.
      w: kernel.
      recipe: CurrentScaling (default) or DelayedScaling.
      state: DelayedScaling state from ``fp8jax.init_state(recipe)``.
      preferred_element_type: output dtype; defaults to what ``jnp.einsum``
        returns, the promoted dtype (float16 x float32 is float32).

    Returns:
      The contraction, with axes in the order the spec's output names them.

    Raises:
      ValueError: for a malformed spec, or one that does not fit the shapes.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> x = jnp.ones((2, 8, 64), jnp.bfloat16)
      >>> w = jnp.ones((64, 4, 16), jnp.bfloat16) * 0.01
      >>> fp8jax.einsum("...d,dhk->...hk", x, w).shape
      (2, 8, 4, 16)
    """
    check_high_precision("x", x)
    check_high_precision("w", w)
    lhs, rhs, out = _split_spec(spec)
    lhs, out = _expand_ellipsis(lhs, out, x.ndim, spec)
    _check_labels("x", lhs, x.ndim, spec)
    _check_labels("w", rhs, w.ndim, spec)
    _check_labels("the output", out, len(out), spec)
    for label in out:
        if label not in lhs and label not in rhs:
            raise ValueError(f"spec {spec!r}: output label {label!r} is in neither operand.")
    for name, labels, other in (("x", lhs, rhs), ("w", rhs, lhs)):
        for label in labels:
            if label not in out and label not in other:
                raise ValueError(
                    f"spec {spec!r}: label {label!r} appears only in {name} and not in the "
                    "output; sum it out before the einsum."
                )
    batch = [c for c in lhs if c in rhs and c in out]
    contract = [c for c in lhs if c in rhs and c not in out]
    if not contract:
        # Named here: dot_general's own message speaks of dimension numbers,
        # which the caller of einsum never wrote.
        raise ValueError(
            f"spec {spec!r} contracts no label (none is in x and w but not the output); an FP8 "
            "GEMM needs one. Use jnp.einsum for an outer or elementwise product."
        )
    dims = (
        (tuple(lhs.index(c) for c in contract), tuple(rhs.index(c) for c in contract)),
        (tuple(lhs.index(c) for c in batch), tuple(rhs.index(c) for c in batch)),
    )
    if preferred_element_type is None:
        # jnp.einsum's promotion (bfloat16 x float16 is float32). Asked for in
        # standard mode: the caller's strict mode refuses to promote implicitly,
        # but choosing the output dtype here is no implicit upcast of theirs.
        with jax.numpy_dtype_promotion("standard"):
            preferred_element_type = jnp.promote_types(x.dtype, w.dtype)
    y = dot_general(
        x, w, dims, recipe=recipe, state=state, preferred_element_type=preferred_element_type
    )
    produced = batch + [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
    permutation = tuple(produced.index(c) for c in out)
    if permutation == tuple(range(len(permutation))):
        return y
    return jnp.transpose(y, permutation)
