"""Under accumulation, the FP8 casts of loop-invariant values (the weights) per micro-batch.

With current scaling a weight's FP8 copy depends on the weight alone, so it could be
made once per step, before the micro-batch loop (issue 59). Today the scan body of
``make_train_step(..., accumulation_steps=n)`` computes the loss's value and gradient
per micro-batch, and the weights' casts inside it run n times; XLA's loop-invariant
code motion does not hoist them either (deviceless H200 compile of the ``tiny``
preset: every weight's cast stays in the while body).
"""

import jax
import jax.extend as jex
import jax.numpy as jnp
import pytest

from fp8jax.formats import is_fp8
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
        if all(v in invariant for v in ins):
            invariant.update(eqn.outvars)
            if any(is_fp8(str(jnp.dtype(v.aval.dtype))) for v in eqn.outvars):
                count += 1
            continue
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                if len(sub.invars) == len(eqn.invars):
                    inner = {s for s, v in zip(sub.invars, eqn.invars, strict=True)
                             if isinstance(v, jex.core.Literal) or v in invariant}  # fmt: skip
                    count += _invariant_fp8_casts(sub, inner)
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


@pytest.mark.xfail(strict=True, reason="issue 59: the weights' casts are not hoisted yet")
def test_weight_casts_are_made_once_per_step_not_per_micro_batch():
    assert _scan_body_casts(2) == 0
