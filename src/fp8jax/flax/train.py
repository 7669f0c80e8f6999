"""Train steps that update params with optax and FP8 scale state by swapping it in.

The FP8 ops return their updated scale state as the gradient of their
``state`` argument. A train step therefore differentiates the loss with
respect to params *and* FP8 state, hands only the param gradients to optax,
and swaps the state "gradients" in with :func:`fp8jax.take_new_state`.

Scanned layers (``nn.scan``, ``nnx.scan``, ``jax.lax.scan``) stack each state
leaf along a leading layer axis, and the gradient of a scanned state is the
stack of each layer's new state. :func:`fp8jax.take_new_state` and
:func:`fp8jax.combine_states` treat those leading axes as independent
tensors, so one layer's amax never leaks into another's scale.

Gradient accumulation splits the batch into micro-batches, all of which start
from the same state; their new states are merged by max
(:func:`fp8jax.combine_states`), never summed as gradients are.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from fp8jax.flax import _hoist
from fp8jax.flax._common import positive_int
from fp8jax.recipes import DelayedScaling
from fp8jax.scaling import ScaleState, combine_states, take_new_state

# The named scope of a train step's optimizer update: profiles and compiled HLO name
# its fusions after it, so a step's time breakdown can tell the optimizer apart.
OPTIMIZER_SCOPE = "fp8jax.optimizer"

FP8_COLLECTION = "fp8_state"
"""The Linen variable collection that holds delayed-scaling state."""


class Fp8StateNotDifferentiatedWarning(UserWarning):
    """A module's parameters are differentiated but its DelayedScaling state is not.

    Its scales then never change (they stay at their initial 1.0): the ops
    return the next state as the state's gradient, which such a step drops.
    Raised at trace time by :func:`watch_state`. Make it an error with
    ``warnings.simplefilter("error", Fp8StateNotDifferentiatedWarning)``.
    """


def watch_state(state, param: jax.Array, owner: str):
    """``state`` as it is, warning when a gradient takes ``param`` but not ``state``.

    A hand-written step that differentiates only the parameters
    (``nnx.value_and_grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)``, or
    ``jax.grad`` over a Linen ``params`` tree) drops the new FP8 state that
    the ops return as its gradient, so the scales never move; with small
    gradients E5M2 then underflows and the loss stalls. JAX tells a
    custom_vjp which inputs are differentiated (``symbolic_zeros``), so the
    mistake is caught where it happens, once per trace, at no run-time
    cost. Gradients with respect to the inputs alone (saliency, say) take
    neither, and stay quiet.

    Args:
      state: the module's state group, or None (CurrentScaling: returned as is).
      param: one of the module's parameters (its kernel).
      owner: the module's class name, for the message.
    """
    if state is None:
        return None
    return _watch(state, param, owner)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _watch(state, param, owner):
    del param, owner
    return state


def _is_primal(node) -> bool:
    return isinstance(node, CustomVJPPrimal)


def _watch_fwd(state, param, owner):
    leaves = jax.tree.leaves(state, is_leaf=_is_primal)
    if param.perturbed and not any(leaf.perturbed for leaf in leaves):
        warnings.warn(
            f"fp8jax: a gradient is taken with respect to {owner}'s parameters but not its "
            "DelayedScaling state, so the FP8 scales will never be updated (they stay at 1.0 "
            "and small gradients underflow in E5M2). The ops return the next state as the "
            "state's gradient: use fp8jax.flax.nnx.train_step (NNX) or "
            "fp8jax.flax.make_train_step (Linen), or differentiate the state too (NNX: the "
            "fp8jax.flax.nnx.Fp8State variables; Linen: the 'fp8_state' collection) and swap "
            "its gradient in with fp8jax.take_new_state. See docs/flax.md, 'FP8 state'.",
            Fp8StateNotDifferentiatedWarning,
            stacklevel=_user_stacklevel(),
        )
    return jax.tree.map(lambda leaf: leaf.value, state, is_leaf=_is_primal), None


def _library_dirs() -> tuple[str, ...]:
    fp8jax_dir = os.path.dirname(os.path.dirname(__file__))
    dirs = tuple(os.path.dirname(p.__file__) + os.sep for p in (jax, flax, optax))
    dirs = (*dirs, fp8jax_dir + os.sep)
    # Decorators and partials from the standard library sit between JAX's frames.
    return (*dirs, contextlib.__file__, functools.__file__)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame above the caller outside JAX, Flax, optax and fp8jax.

    The warning fires while JAX traces a gradient, dozens of library frames
    below the user's call of the module; a fixed stacklevel would name a line
    of JAX's.
    """
    library = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(library):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _watch_bwd(owner, _, state_cotangent):
    del owner
    # A state whose op did not reach the loss gets a symbolic zero: a zero
    # scale, which take_new_state reads as "not consumed".
    state_cotangent = jax.tree.map(
        lambda c: jnp.zeros(c.aval.shape, c.aval.dtype) if isinstance(c, SymbolicZero) else c,
        state_cotangent,
        is_leaf=lambda n: isinstance(n, SymbolicZero),
    )
    return state_cotangent, None


_watch.defvjp(_watch_fwd, _watch_bwd, symbolic_zeros=True)


def _is_scale_state(node) -> bool:
    return isinstance(node, ScaleState)


def _combine_identity(state):
    # History 0 and scale +inf: combining with it returns the other state
    # exactly (the fallback scale is min(inf, s) = s), and an unused state's
    # zero cotangent stays a zero scale, which take_new_state ignores.
    return jax.tree.map(
        lambda s: ScaleState(jnp.zeros_like(s.amax_history), jnp.full_like(s.scale, jnp.inf)),
        state,
        is_leaf=_is_scale_state,
    )


def _micro_batches(batch, n: int):
    def split(a):
        if jnp.ndim(a) == 0 or a.shape[0] % n:
            raise ValueError(
                f"accumulation_steps={n} must divide the batch's leading axis, got a leaf of "
                f"shape {jnp.shape(a)}."
            )
        return a.reshape(n, a.shape[0] // n, *a.shape[1:])

    return jax.tree.map(split, batch)


def _has_state(fp8_state) -> bool:
    return bool(jax.tree.leaves(fp8_state))


def grads_and_fp8_state(
    loss_fn: Callable,
    params,
    fp8_state,
    carry,
    batch,
    *,
    accumulation_steps: int = 1,
    recipe: DelayedScaling | None = None,
):
    """Loss, mean param gradients and the next FP8 state, over micro-batches.

    Args:
      loss_fn: ``loss_fn(params, fp8_state, carry, batch) -> (loss, carry)``;
        ``carry`` is threaded through micro-batches undifferentiated (NNX uses
        it for RNG counts).
      params: differentiated; their gradients are averaged.
      fp8_state: differentiated; its "gradients" are new states, merged by max.
      carry: any pytree.
      batch: a pytree whose leaves share a leading batch axis.
      accumulation_steps: number of micro-batches the batch is split into.
      recipe: the DelayedScaling of the state; needed to merge micro-batches.

    Returns:
      ``(loss, param_grads, new_fp8_state, carry)``.
    """
    n = positive_int("train step", "accumulation_steps", accumulation_steps)
    value_and_grad = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    if n == 1:
        (loss, carry), (grads, state_grads) = value_and_grad(params, fp8_state, carry, batch)
        return loss, grads, take_new_state(fp8_state, state_grads), carry
    if _has_state(fp8_state) and not isinstance(recipe, DelayedScaling):
        raise ValueError(
            f"accumulation_steps={n} with FP8 scale state needs recipe=<the DelayedScaling the "
            f"model uses> to merge micro-batch states by max; got recipe={recipe!r}."
        )

    def micro_step(invariant, acc_micro):
        params, fp8_state = invariant
        (grad_sum, merged, loss_sum, carry), micro = acc_micro
        (loss, carry), (grads, state_grads) = value_and_grad(params, fp8_state, carry, micro)
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        if _has_state(fp8_state):
            merged = combine_states(merged, state_grads, recipe=recipe)
        return grad_sum, merged, loss_sum + loss.astype(jnp.float32), carry

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, _combine_identity(fp8_state), jnp.zeros((), jnp.float32), carry)
    micro_batches = _micro_batches(batch, n)
    # The weights' FP8 (and BF16) copies depend on the weights alone: made once
    # here, read by every micro-batch (fp8jax.flax._hoist).
    example = (init, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                  micro_batches))  # fmt: skip
    loop_body, kept = _hoist.hoist_invariants(micro_step, (params, fp8_state), example)
    (grad_sum, merged, loss_sum, carry), _ = jax.lax.scan(
        lambda acc, micro: (loop_body(kept, (acc, micro)), None), init, micro_batches
    )
    grads = jax.tree.map(lambda g: g / jnp.asarray(n, g.dtype), grad_sum)
    return loss_sum / jnp.float32(n), grads, take_new_state(fp8_state, merged), carry


def _check_optimizer(owner: str, optimizer) -> None:
    """``optimizer`` is an optax transformation, not the function that makes one."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    name = getattr(optimizer, "__qualname__", None)
    hint = (
        f" {name} is the function that builds one: call it, e.g. {name}(1e-3)."
        if callable(optimizer) and name
        else ""
    )
    raise TypeError(
        f"{owner}: optimizer must be an optax.GradientTransformation (with init and update), "
        f"such as optax.adam(1e-3); got {optimizer!r}.{hint}"
    )


class TrainState(NamedTuple):
    """Everything a Linen train step updates (a pytree; checkpoint it whole).

    Attributes:
      step: int32 scalar, the number of steps taken.
      params: the ``"params"`` collection.
      opt_state: the optax state of ``params``.
      fp8_state: the ``"fp8_state"`` collection; ``{}`` under CurrentScaling.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    fp8_state: Any

    @classmethod
    def create(cls, variables, optimizer: optax.GradientTransformation) -> TrainState:
        """Splits ``model.init(...)``'s variables and initializes the optimizer on params.

        Raises:
          ValueError: if ``variables`` has collections other than params and fp8_state.
          TypeError: if ``optimizer`` is not an optax transformation.
        """
        _check_optimizer("TrainState.create", optimizer)
        extra = sorted(set(variables) - {"params", FP8_COLLECTION})
        if extra:
            raise ValueError(
                f"variables has collections {extra} besides 'params' and {FP8_COLLECTION!r}; "
                "TrainState carries only those two."
            )
        params = variables["params"]
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            fp8_state=dict(variables.get(FP8_COLLECTION, {})),
        )


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    accumulation_steps: int = 1,
    recipe: DelayedScaling | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, jax.Array]]:
    """Builds a Linen train step: optax on params, FP8 state swapped in.

    Args:
      loss_fn: ``loss_fn(variables, batch) -> scalar loss``, where ``variables``
        is ready for ``model.apply`` (``{"params": ..., "fp8_state": ...}``).
        For dropout, put a key in ``batch`` and pass ``rngs={"dropout": key}``.
      optimizer: an optax GradientTransformation; it never sees FP8 state.
      accumulation_steps: split each batch into this many micro-batches along
        its leading axis, average the gradients and merge FP8 states by max.
      recipe: the model's DelayedScaling; required when accumulating with state.

    Returns:
      ``train_step(state, batch) -> (state, loss)``, a pure function to jit.

    Example:
      >>> import jax, jax.numpy as jnp, optax, fp8jax
      >>> from fp8jax.flax import linen as fnn, TrainState, make_train_step
      >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
      >>> model = fnn.DenseGeneral(features=8, recipe=recipe)
      >>> x, y = jnp.ones((16, 32)), jnp.zeros((16, 8))
      >>> state = TrainState.create(model.init(jax.random.key(0), x), optax.sgd(0.1))
      >>> loss_fn = lambda v, b: jnp.mean((model.apply(v, b[0]) - b[1]) ** 2)
      >>> step = jax.jit(make_train_step(loss_fn, optax.sgd(0.1)))
      >>> state, loss = step(state, (x, y))
      >>> float(state.fp8_state["scales"].x.scale)
      448.0
    """

    _check_optimizer("make_train_step", optimizer)

    def split_loss(params, fp8_state, carry, batch):
        variables = {"params": params}
        if fp8_state:
            variables[FP8_COLLECTION] = fp8_state
        return loss_fn(variables, batch), carry

    def train_step(state: TrainState, batch):
        loss, grads, fp8_state, _ = grads_and_fp8_state(
            split_loss,
            state.params,
            state.fp8_state,
            None,
            batch,
            accumulation_steps=accumulation_steps,
            recipe=recipe,
        )
        # The scope names the update's fusions in profiles and HLO (bench/breakdown.py).
        with jax.named_scope(OPTIMIZER_SCOPE):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state, fp8_state), loss

    return train_step
