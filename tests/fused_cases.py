"""What the fused ops' tests share: norms, recipes, parameters, deviceless H100 compiles."""

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax

NORMS = [("layernorm", False), ("rmsnorm", False), ("layernorm", True), ("rmsnorm", True)]
EPS = 1e-6


def ref_norm(x, gamma, beta, norm_type, zero_centered):
    """Textbook norm in plain jnp f32, differentiated by JAX itself."""
    x = x.astype(jnp.float32)
    g = gamma.astype(jnp.float32) + (1.0 if zero_centered else 0.0)
    if norm_type == "layernorm":
        x = x - jnp.mean(x, -1, keepdims=True)
    y = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * g[None, :]
    return y + beta.astype(jnp.float32)[None, :] if beta is not None else y


RECIPES = [fp8jax.CurrentScaling(), fp8jax.DelayedScaling()]
# The deviceless compiles use XLA's default flags, under which fp8jax's FP8 GEMMs
# are cuBLASLt calls (fp8jax.ops.gemm.fp8_dot_general), as they were under
# fp8jax.compiler_options() before. cuBLASLt reads FP8 operands with the contracted
# axis minor, so on XLA's path (no cast kernel) XLA writes a transposed FP8 copy, and
# some fusions then split apart as they did with the options; their one-pass forms
# were those of a Triton GEMM fusion, which reads any layout.
CUBLASLT_FORM = "cuBLASLt's operand layout splits XLA's fusion (also with compiler_options)"

# Deviceless H100 compiles, by a key that names the program: several tests read the same
# program's HLO (the same op, recipe and shapes), which is compiled once. Tests only read it.
_H100_HLO: dict = {}


def _h100_hlos(calls: dict) -> dict:
    """``{key: optimized HLO text}`` of ``{key: (fn, args)}``, compiled for an H100.

    A key must name its program; the kernel switch (fp8jax.kernels.dispatch.enabled,
    which the ops read when traced) is added to it. The programs not compiled
    before compile together, in one child process (``verify.compile_many``).
    """
    from fp8jax.verify import compile_many

    kernels = fp8jax.kernels.dispatch.enabled()
    missing = {key: call for key, call in calls.items() if (key, kernels) not in _H100_HLO}
    if missing:
        hlos = compile_many(list(missing.values()), target="h100")
        for key, hlo in zip(missing, hlos, strict=True):
            _H100_HLO[key, kernels] = hlo
    return {key: _H100_HLO[key, kernels] for key in calls}


def _params(norm_type, hidden, dtype, seed=0):
    kg, kb, kx = jax.random.split(jax.random.key(seed), 3)
    gamma = (1.0 + 0.3 * jax.random.normal(kg, (hidden,))).astype(dtype)
    beta = (
        (0.2 * jax.random.normal(kb, (hidden,))).astype(dtype) if norm_type == "layernorm" else None
    )
    x = (2.0 * jax.random.normal(kx, (48, hidden)) + 0.5).astype(dtype)
    return x, gamma, beta


def _ln_backward_error(bound_dn, x, gamma, norm_type, zero_centered):
    """Bound on |dx error| when dn is off by at most ``bound_dn`` elementwise.

    The norm's backward is linear in dn:
    dx = rstd * (g*dn - mean(g*dn) - xhat * mean(g*dn*xhat)) (no mean term for
    rmsnorm), so |error| <= rstd * (|g|B + mean(|g|B) + |xhat| mean(|g|B|xhat|)).
    """
    x = np.asarray(x, np.float64)
    g = np.abs(np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0))
    centred = x - x.mean(-1, keepdims=True) if norm_type == "layernorm" else x
    rstd = 1 / np.sqrt((centred**2).mean(-1, keepdims=True) + EPS)
    xhat = np.abs(centred * rstd)
    gb = g * bound_dn
    terms = gb + xhat * (gb * xhat).mean(-1, keepdims=True)
    if norm_type == "layernorm":
        terms = terms + gb.mean(-1, keepdims=True)
    return rstd * terms


def _written_results(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of each result a compiled GPU program writes to HBM.

    Every top-level instruction's result goes to HBM, except parameters,
    tuple plumbing, bitcasts and barriers, which alias buffers they are given.
    """
    from fp8jax.verify import _hlo

    aliases = ("parameter", "get-tuple-element", "bitcast", "tuple", "opt-barrier")
    return [
        (inst.name, t.dtype, t.shape)
        for inst in _hlo.parse_module(hlo).entry.instructions.values()
        if inst.opcode not in aliases
        for t in inst.types
    ]
