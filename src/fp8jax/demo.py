"""``fp8jax demo``: one FP8 dense layer against its f32 reference, in a few seconds.

Prints, for each input dtype and recipe, the relative error of the forward
output and both gradients, and the operand formats of the three GEMMs the
layer traces to, so a new user sees both what FP8 costs in accuracy and that
the GEMMs really are FP8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.verify.jaxpr_dots import jaxpr_dots

_SHORT = {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}


def _gemm_name(lhs: str, rhs: str) -> str:
    return f"{_SHORT.get(lhs, lhs)}x{_SHORT.get(rhs, rhs)}"


def _relative_error(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def run(tokens: int = 512, hidden: int = 1024, out: int = 1024) -> list[dict]:
    """Runs the comparison and returns one row per (dtype, recipe)."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x32 = jax.random.normal(kx, (tokens, hidden), jnp.float32)
    w32 = jax.random.normal(kw, (hidden, out), jnp.float32) / hidden**0.5
    g32 = jax.random.normal(kg, (tokens, out), jnp.float32)

    def ref_loss(x, w):
        return jnp.sum(jnp.dot(x, w, precision="highest") * g32)

    ref_y = jnp.dot(x32, w32, precision="highest")
    ref_dx, ref_dw = jax.grad(ref_loss, argnums=(0, 1))(x32, w32)
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x, w, g = x32.astype(dtype), w32.astype(dtype), g32.astype(dtype)
        for recipe in (fp8jax.CurrentScaling(), fp8jax.DelayedScaling(amax_history_len=16)):
            state = fp8jax.init_state(recipe)

            def loss(x, w, state, recipe=recipe, g=g):
                y = fp8jax.dense(x, w, recipe=recipe, state=state)
                return jnp.sum((y * g).astype(jnp.float32))

            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            if state is not None:  # one step so delayed scaling has learned its scales
                state = fp8jax.take_new_state(state, step(x, w, state)[2])
            dx, dw, _ = step(x, w, state)
            y = fp8jax.dense(x, w, recipe=recipe, state=state)
            dots = jaxpr_dots(jax.grad(loss, argnums=(0, 1, 2)), x, w, state)
            rows.append(
                {
                    "dtype": jnp.dtype(dtype).name,
                    "recipe": type(recipe).__name__,
                    "forward": _relative_error(y, ref_y),
                    "dgrad": _relative_error(dx, ref_dx),
                    "wgrad": _relative_error(dw, ref_dw),
                    "gemms": [_gemm_name(d.lhs_dtype, d.rhs_dtype) for d in dots],
                }
            )
    return rows


def main() -> int:
    """Prints the demo table."""
    rows = run()
    print("fp8jax demo: dense 512x1024 @ 1024x1024, FP8 vs f32 reference (relative L2 error)")
    header = (
        f"{'inputs':<9} {'recipe':<15} {'forward':>8} {'dgrad':>8} {'wgrad':>8}"
        "  GEMMs (fwd, dgrad, wgrad)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['dtype']:<9} {r['recipe']:<15} {r['forward']:>8.4f} {r['dgrad']:>8.4f} "
            f"{r['wgrad']:>8.4f}  {', '.join(r['gemms'])}"
        )
    return 0
