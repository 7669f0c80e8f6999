"""A loop body's narrow values computed from its loop-invariant inputs alone, made once.

Under gradient accumulation every micro-batch reads the same weights, so with current
scaling each weight's FP8 copies (and its scale, its transposed copy, its BF16 copy) are
the same in every micro-batch. XLA's loop-invariant code motion leaves them in the while
body (their amax reduction and the casts are fusions it does not hoist), so the step
splits the traced body itself: JAX's partial evaluator (the one ``jax.checkpoint`` runs)
separates the computation that reads only invariant inputs, and a policy decides which
of its values the loop receives instead of recomputing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.extend as jex
import numpy as np

# The partial evaluator that jax.checkpoint and scan's linearization use; JAX has no
# public name for it (jax.interpreters.partial_eval re-exports only its rule tables).
from jax._src.interpreters import partial_eval as pe

# Values up to this many elements (scales, amaxes) are kept whatever their dtype.
_SMALL = 4096


def _out_avals(primitive, avals, params):
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *structs)
    return out if primitive.multiple_results else [out]


def _kept(primitive, *avals, **params) -> bool:
    """Whether an invariant value is made once and kept: the partial evaluator's policy.

    Kept: narrow (at most 2 bytes an element: FP8 and BF16 copies, FP8 transposes)
    or small (scales) results that read a large input. Recomputed in the loop: wide
    large results (an f32 transpose costs as much to reread as to keep) and large
    results of small inputs (a broadcast zero, an iota), which would only hold memory.
    """
    sizes = [math.prod(a.shape) for a in avals if hasattr(a, "shape")]
    try:
        outs = _out_avals(primitive, avals, params)
    except Exception:  # A primitive that cannot be bound abstractly is recomputed.
        return False
    out_sizes = [math.prod(o.shape) for o in outs]
    if any(s > _SMALL for s in out_sizes) and all(s <= _SMALL for s in sizes):
        return False
    return all(
        s <= _SMALL or np.dtype(o.dtype).itemsize <= 2 for o, s in zip(outs, out_sizes, strict=True)
    )


def _as_fun(jaxpr):
    return jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(jaxpr, []))


def hoist_invariants(body: Callable, invariant, example_variant) -> tuple[Callable, list]:
    """Splits ``body(invariant, variant)`` into values made once and a body that reads them.

    Args:
      body: ``body(invariant, variant) -> out``, pure.
      invariant: the pytree the loop reads unchanged (the weights, the FP8 state).
      example_variant: the pytree that changes per iteration (arrays or
        ``jax.ShapeDtypeStruct`` leaves), for tracing.

    Returns:
      ``(loop_body, kept)``: ``loop_body(kept, variant)`` returns what ``body(invariant,
      variant)`` returns, computed by the same operations; ``kept`` is the list of
      invariant values computed here, once.
    """
    inv_leaves, inv_tree = jax.tree.flatten(invariant)
    var_leaves, var_tree = jax.tree.flatten(example_variant)

    def flat_body(*leaves):
        inv = jax.tree.unflatten(inv_tree, leaves[: len(inv_leaves)])
        var = jax.tree.unflatten(var_tree, leaves[len(inv_leaves) :])
        return body(inv, var)

    closed, out_shape = jax.make_jaxpr(flat_body, return_shape=True)(*inv_leaves, *var_leaves)
    out_tree = jax.tree.structure(out_shape)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    n_consts, n_inv = len(closed.consts), len(inv_leaves)
    unknowns = [False] * (n_consts + n_inv) + [True] * len(var_leaves)
    known, staged, _, _, n_kept = pe.partial_eval_jaxpr_custom(
        jaxpr, unknowns, in_inst=True, ensure_out_unknowns=True, ensure_out_inst=True,
        saveable=_kept,
    )  # fmt: skip
    # The known program computes every invariant value; only the kept ones leave it.
    known, _ = pe.dce_jaxpr(known, [True] * len(known.outvars), instantiate=True)
    staged, used = pe.dce_jaxpr(staged, [True] * len(staged.outvars), instantiate=False)
    kept = _as_fun(known)(*closed.consts, *inv_leaves)
    # The staged program's inputs: the kept values, then every input of the body.
    used_kept, used_ins = used[:n_kept], used[n_kept:]
    kept = [k for k, u in zip(kept, used_kept, strict=True) if u]
    used_fixed, used_var = used_ins[: n_consts + n_inv], used_ins[n_consts + n_inv :]
    fixed = [x for x, u in zip([*closed.consts, *inv_leaves], used_fixed, strict=True) if u]

    def loop_body(kept, variant):
        leaves = jax.tree.leaves(variant)
        leaves = [x for x, u in zip(leaves, used_var, strict=True) if u]
        outs = _as_fun(staged)(*kept, *fixed, *leaves)
        return jax.tree.unflatten(out_tree, outs)

    return loop_body, kept
