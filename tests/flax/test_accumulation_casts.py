"""Under accumulation, the FP8 casts of loop-invariant values (the weights) per micro-batch.

With current scaling a weight's FP8 copy depends on the weight alone, so it could be
made once per step, before the micro-batch loop (issue 59). Today the scan body of
``make_train_step(..., accumulation_steps=n)`` computes the loss's value and gradient
per micro-batch, and the weights' casts inside it run n times; XLA's loop-invariant
code motion does not hoist them either (deviceless H200 compile of the ``tiny``
preset: every weight's cast stays in the while body).
"""

import math
import re

import jax
import jax.extend as jex
import jax.numpy as jnp
import pytest

from fp8jax.flax.train import grads_and_fp8_state
from fp8jax.formats import is_fp8
from fp8jax.scaling import combine_states, take_new_state
from fp8jax.training.config import TrainOptions, resolve
from fp8jax.training.program import TrainProgram


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value, "consts"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _sub_jaxprs(item)


def _invariant_fp8_casts(jaxpr, invariant: set) -> int:
    """FP8-typed results computed from ``invariant`` variables alone, at any depth."""
    count = 0
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, jex.core.Literal)]
        subs = [sub for param in eqn.params.values() for sub in _sub_jaxprs(param)]
        if not subs:
            if all(v in invariant for v in ins):
                invariant.update(eqn.outvars)
                count += any(is_fp8(str(jnp.dtype(v.aval.dtype))) for v in eqn.outvars)
            continue
        # A call, loop or cond is looked into: what counts is the work inside it (a
        # cond whose branches pass a made-once FP8 value through casts nothing).
        # A cond's branches take its operands after the index.
        outer = eqn.invars[1:] if eqn.primitive.name == "cond" else eqn.invars
        for sub in (sub for sub in subs if len(sub.invars) == len(outer)):
            inner = {s for s, v in zip(sub.invars, outer, strict=True)
                     if isinstance(v, jex.core.Literal) or v in invariant}  # fmt: skip
            count += _invariant_fp8_casts(sub, inner)
        if all(v in invariant for v in ins):
            invariant.update(eqn.outvars)
    return count


def _scan_body_casts(accumulation_steps: int) -> int:
    options = TrainOptions(out="unused", config="tiny", precision="fp8", recipe="current",
                           accumulation_steps=accumulation_steps, batch_size=4)  # fmt: skip
    config = resolve(options)
    with jax.numpy_dtype_promotion("standard"):
        program = TrainProgram(config, None, "xla", True, materialize=False)
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
        closed = jax.make_jaxpr(program.raw_step)(program.initial_state, batch)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr
    return _invariant_fp8_casts(body, set(body.invars[: scan.params["num_consts"]]))


def test_weight_casts_are_made_once_per_step_not_per_micro_batch():
    assert _scan_body_casts(2) == 0


def _variables(params, fp8_state):
    return {"params": params} | ({"fp8_state": fp8_state} if fp8_state else {})


def _unhoisted(program, state, batch, n, recipe):
    """The accumulated step as a loop over micro-batches, every cast in each."""
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda p, s, b: program.loss(_variables(p, s), b), argnums=(0, 1)
    ))  # fmt: skip
    losses, grads, states = [], [], []
    for micro in jnp.split(batch, n):
        loss, (g, s) = value_and_grad(state.params, state.fp8_state, micro)
        losses.append(loss), grads.append(g), states.append(s)
    grad_sum, merged = grads[0], states[0]
    for g, s in zip(grads[1:], states[1:], strict=True):
        grad_sum = jax.tree.map(jnp.add, grad_sum, g)
        merged = combine_states(merged, s, recipe=recipe) if recipe else merged
    new_state = take_new_state(state.fp8_state, merged) if recipe else state.fp8_state
    return sum(losses[1:], losses[0]) / n, jax.tree.map(lambda g: g / n, grad_sum), new_state


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_hoisted_step_matches_the_step_that_casts_per_micro_batch(recipe):
    """Same loss, gradients and new FP8 state, bitwise: the hoisted casts are the same ops."""
    n = 2
    options = TrainOptions(out="unused", config="tiny", precision="fp8", recipe=recipe,
                           accumulation_steps=n, batch_size=4)  # fmt: skip
    config = resolve(options)
    delayed = config.fp8_recipe() if recipe == "delayed" else None

    def step(state, batch):
        return grads_and_fp8_state(
            lambda p, f, c, b: (program.loss(_variables(p, f), b), c),
            state.params, state.fp8_state, None, batch, accumulation_steps=n, recipe=delayed,
        )  # fmt: skip

    with jax.numpy_dtype_promotion("standard"):
        program = TrainProgram(config, None, "xla", True)
        batch = jax.random.randint(jax.random.key(1), (4, config.seq_len + 1), 0, 256)
        state = program.initial_state
        loss, grads, new_state, _ = jax.jit(step)(state, batch)
        expected = _unhoisted(program, state, batch, n, delayed)
    got = (loss, grads, new_state)
    for (path, g), e in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(expected),
                            strict=True):  # fmt: skip
        assert jnp.array_equal(g, e), (jax.tree_util.keystr(path), float(jnp.max(jnp.abs(g - e))))


_KERNEL = r"\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (?:fusion|custom-call|convert)\((.*)"


def _as_matrices(shape: tuple) -> set:
    """A weight's shape and the matrices a cast kernel may read it as."""
    return {shape, (shape[0], math.prod(shape[1:])), (math.prod(shape[:-1]), shape[-1])}


def _while_body_weight_casts(hlo: str, weight_shapes: set) -> int:
    """FP8-writing kernels (fusions, custom calls) of the while bodies that read an f32 weight."""
    bodies = set(re.findall(r" while\(.*?body=%?([\w.\-]+)", hlo))
    count, current = 0, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
            continue
        made = re.match(_KERNEL, line)
        if current in bodies and made and "f8e" in made.group(1):
            shapes = re.findall(r"f32\[([\d,]+)\]", made.group(2))
            count += bool({tuple(map(int, s.split(","))) for s in shapes} & weight_shapes)
    return count


@pytest.mark.deviceless
def test_the_compiled_micro_batch_loop_reads_no_weight_to_cast_it():
    """Deviceless H100 compile: no FP8 cast kernel of the while body reads an f32 weight.

    Before the hoist, the ``tiny`` step's loop body had six (QKV, attention out and
    kernel_2 of each layer, by the cast kernel).
    """
    from fp8jax import verify

    options = TrainOptions(out="unused", config="tiny", precision="fp8", recipe="current",
                           accumulation_steps=4, batch_size=8)  # fmt: skip
    config = resolve(options)
    with jax.numpy_dtype_promotion("standard"):
        program = TrainProgram(config, None, "xla", True, materialize=False)
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
        hlo = verify.compile_for(program.raw_step, program.initial_state, batch, target="h100")
    # The block kernels, stacked over layers.
    params = jax.tree.leaves(program.initial_state.params)
    weights = set().union(*(_as_matrices(p.shape[1:]) for p in params if p.ndim >= 3))
    assert " while(" in hlo
    assert _while_body_weight_casts(hlo, weights) == 0
