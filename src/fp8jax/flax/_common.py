"""What the Linen and NNX modules share: argument checks, kernel inits, axis names.

The axis names are :mod:`fp8jax.axes`'s, re-exported here for the modules.

Checks live here so that both APIs raise the same message for the same
mistake. Each names the module and the argument, and says what was expected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import activations as activations_

# Re-exported: the modules take their axis names from here.
from fp8jax.axes import ACT, BATCH, EMBED, HEADS, KV, LENGTH, MLP, QKV, RESIDUAL  # noqa: F401
from fp8jax.flax import rotary
from fp8jax.ops.norm import NORM_TYPES
from fp8jax.recipes import CurrentScaling, DelayedScaling, Recipe, resolve_recipe

NORM_POSITIONS = ("pre", "post")


def _name(owner: str, arg: str) -> str:
    return f"{owner}: {arg}"


def positive_int(owner: str, arg: str, value) -> int:
    """Returns ``value`` if it is an int >= 1; raises a named ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{_name(owner, arg)} must be an int >= 1, got {value!r}.")
    return int(value)


def as_tuple(owner: str, arg: str, value) -> tuple[int, ...]:
    """An int or a sequence of ints as a non-empty tuple."""
    values = (value,) if isinstance(value, numbers.Integral) else value
    # Each entry too: axis=(1.5,) failed later as a tuple index, naming no argument.
    if (
        not isinstance(values, Sequence)
        or isinstance(values, str)
        or not values
        or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values)
    ):
        raise ValueError(f"{_name(owner, arg)} must be an int or a tuple of ints, got {value!r}.")
    return tuple(int(v) for v in values)


def features(owner: str, value, arg: str = "features") -> tuple[int, ...]:
    """Output feature sizes as a tuple of positive ints."""
    return tuple(positive_int(owner, arg, f) for f in as_tuple(owner, arg, value))


def flags(owner: str, **values) -> None:
    """Raises a named TypeError unless every value is a bool.

    A switch is read for its truth value, so a config's string "false" would
    turn it on silently: causal masking, RoPE, a bias, a returned residual.
    """
    for arg, value in values.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{_name(owner, arg)} must be a bool, got {value!r}.")


def deterministic(owner: str, value) -> None:
    """``deterministic``, an attribute or a call's argument: None (unset) or a bool."""
    if value is not None:
        flags(owner, deterministic=value)


def norm_type(owner: str, value: str) -> str:
    if value not in NORM_TYPES:
        raise ValueError(f"{_name(owner, 'norm_type')} must be one of {NORM_TYPES}, got {value!r}.")
    return value


def activations(owner: str, value) -> tuple[str, ...]:
    """Activation names as a tuple; one name is a plain MLP, two a gated one."""
    return activations_.check(value, owner)


def dropout_rate(owner: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{_name(owner, 'dropout_rate')} must be in [0, 1), got {value!r}.")
    return float(value)


def rope_base(owner: str, value) -> float:
    if not rotary.valid_base(value):
        raise ValueError(
            f"{_name(owner, 'rope_base')} must be a finite number > 0 (10000.0 in the RoPE "
            f"paper), got {value!r}."
        )
    return float(value)


def norm_position(owner: str, value: str) -> str:
    if value not in NORM_POSITIONS:
        raise ValueError(
            f"{_name(owner, 'norm_position')} must be one of {NORM_POSITIONS}, got {value!r}."
        )
    return value


def heads(owner: str, num_heads, num_kv_heads) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)``; the latter defaults to the former and must divide it."""
    num_heads = positive_int(owner, "num_heads", num_heads)
    if num_kv_heads is None:
        return num_heads, num_heads
    num_kv_heads = positive_int(owner, "num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{_name(owner, 'num_kv_heads')}={num_kv_heads} must divide num_heads={num_heads}: "
            "each key/value head serves a whole group of query heads (GQA)."
        )
    return num_heads, num_kv_heads


def head_dim(owner: str, hidden: int, num_heads: int, value) -> int:
    """The per-head width: ``value``, or ``hidden // num_heads`` when that divides."""
    if value is not None:
        return positive_int(owner, "head_dim", value)
    if hidden % num_heads:
        raise ValueError(
            f"{_name(owner, 'num_heads')}={num_heads} must divide the hidden size {hidden} "
            "(x.shape[-1]) when head_dim is not given; pass head_dim= or another num_heads."
        )
    return hidden // num_heads


def rank(owner: str, x, *, expected: int | None = None, at_least: int | None = None) -> None:
    """Raises a ValueError naming ``x``'s shape unless its rank fits."""
    shape = tuple(getattr(x, "shape", ()))
    if expected is not None and len(shape) != expected:
        raise ValueError(
            f"{owner}: x must have rank {expected}, got shape {shape} (rank {len(shape)})."
        )
    if at_least is not None and len(shape) < at_least:
        raise ValueError(
            f"{owner}: x must have rank >= {at_least}, got shape {shape} (rank {len(shape)})."
        )


def axis_names(owner: str, arg: str, names, ndim: int, default) -> tuple:
    """Logical axis names of a parameter: ``names``, or ``default`` for None; one per axis."""
    names = default if names is None else tuple(names)
    if len(names) != ndim:
        raise ValueError(
            f"{owner}: {arg} names {len(names)} axes, but the parameter has {ndim}: {names!r}."
        )
    return names


def contracted_axes(owner: str, axis, ndim: int) -> tuple[int, ...]:
    """``axis`` as non-negative axes of an ``ndim``-rank input."""
    axes = as_tuple(owner, "axis", axis)
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(
            f"{_name(owner, 'axis')}={axis!r} is out of range for an input of rank {ndim}."
        )
    normalized = tuple(a % ndim for a in axes)
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"{_name(owner, 'axis')}={axis!r} repeats an axis.")
    return normalized


def is_delayed(recipe: Recipe | None) -> bool:
    """Whether the recipe keeps FP8 scale state (validates it on the way)."""
    return isinstance(resolve_recipe(recipe), DelayedScaling)


def no_custom_dot_with_state(owner: str, dot_general, recipe: Recipe | None) -> None:
    """Raises where ``dot_general=`` would leave ``recipe`` unused: any but CurrentScaling."""
    if dot_general is not None and is_delayed(recipe):
        raise ValueError(
            f"{owner}: dot_general= replaces the FP8 op, so it cannot use "
            "recipe=DelayedScaling (whose state the FP8 op updates); pass one or the other."
        )
    if dot_general is not None and not isinstance(resolve_recipe(recipe), CurrentScaling):
        raise ValueError(
            f"{owner}: dot_general= replaces the FP8 op, so it cannot use "
            f"recipe={type(recipe).__name__} (which only the FP8 op applies; the GEMM would "
            "run in the custom dot_general's precision); pass one or the other."
        )


def fan_in_init(init, n_in: int):
    """``init`` on the kernel flattened to 2-D, so fan-in is the product of the contracted axes.

    This is how flax's DenseGeneral initializes multi-axis kernels.
    """

    def wrapped(key, shape, dtype=jnp.float32):
        flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
        value = init(key, flat, dtype)
        # Checked before the reshape: a wrong shape of the same size would be
        # reshaped silently, and another one failed in jnp.reshape, unnamed.
        if tuple(jnp.shape(value)) != flat:
            raise ValueError(
                f"kernel_init must return the shape it is asked for, {flat} (the kernel "
                f"{tuple(shape)} flattened to 2-D), got {tuple(jnp.shape(value))}."
            )
        return jnp.reshape(value, shape)

    return wrapped


def gamma_init(zero_centered_gamma: bool, scale_init):
    """Ones, or zeros for zero-centred gamma (whose effective scale is 1 + gamma)."""
    if scale_init is not None:
        return scale_init
    return jax.nn.initializers.zeros if zero_centered_gamma else jax.nn.initializers.ones


def norm_beta(norm: str) -> bool:
    """Whether the norm has a shift parameter (rmsnorm does not)."""
    return norm == "layernorm"


def layernorm_output(owner: str, return_layernorm_output: bool, has_norm: bool) -> None:
    if return_layernorm_output and not has_norm:
        raise ValueError(
            f"{owner}: return_layernorm_output=True needs input_layernorm=True; "
            "without a norm there is no normalized input to return."
        )


def residual_output(owner: str, return_residual: bool, return_layernorm_output: bool,
                    has_norm: bool = True) -> None:  # fmt: skip
    if not return_residual:
        return
    if not has_norm:
        raise ValueError(
            f"{owner}: return_residual=True needs input_layernorm=True; it passes the norm's "
            "input through so that the residual's gradient joins the norm's backward."
        )
    if return_layernorm_output:
        raise ValueError(
            f"{owner}: return_residual and return_layernorm_output are alternatives (a residual "
            "taken before the norm, or after it); got both True."
        )


def residual_from_norm(owner: str, value: bool, position: str) -> None:
    if value and position != "pre":
        raise ValueError(
            f"{owner}: residual_from_norm=True needs norm_position='pre'; post-norm residuals "
            "already come from the norm's output."
        )


def in_features(owner: str, x, axes, expected: tuple[int, ...]) -> None:
    """Raises unless ``x`` has the sizes an NNX module was built for on ``axes``."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) < max(len(axes), 1) or any(not -len(shape) <= a < len(shape) for a in axes):
        raise ValueError(f"{owner}: x of shape {shape} has no axes {tuple(axes)} to contract.")
    got = tuple(shape[a] for a in axes)
    if got != tuple(expected):
        raise ValueError(
            f"{owner}: x has size {got} on axes {tuple(axes)} (shape {shape}), but the module "
            f"was built with in_features={expected if len(expected) > 1 else expected[0]}."
        )
