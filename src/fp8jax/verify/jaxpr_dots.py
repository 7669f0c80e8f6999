"""Every dot_general in a function's jaxpr, with operand dtypes and source line.

The jaxpr is what fp8jax hands to XLA, before any compiler pass: if a GEMM is
not FP8 here, no backend will make it FP8. Sub-jaxprs (jit, custom_vjp,
scan, cond, remat, shard_map) are walked; a scan body counts once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax.formats import is_fp8


@dataclasses.dataclass(frozen=True)
class JaxprDot:
    """One dot_general equation."""

    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    precision: str
    source: str
    lhs_contracting: tuple[int, ...] = ()
    rhs_contracting: tuple[int, ...] = ()

    @property
    def is_fp8(self) -> bool:
        """Both operands are FP8."""
        return is_fp8(self.lhs_dtype) and is_fp8(self.rhs_dtype)

    @property
    def operand_formats(self) -> tuple[str, str]:
        """E.g. ``("float8_e5m2", "float8_e4m3fn")``."""
        return (self.lhs_dtype, self.rhs_dtype)


def _source(eqn) -> str:
    try:  # source_info_util is internal; a missing source must not break the walk.
        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
        return f"{frame.file_name}:{frame.start_line}" if frame else "?"
    except Exception:
        return "?"


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value, "consts"):
        yield value.jaxpr
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _sub_jaxprs(item)


def _walk(jaxpr, found: list[JaxprDot]) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            precision = eqn.params.get("precision")
            (lhs_contracting, rhs_contracting), _ = eqn.params["dimension_numbers"]
            found.append(
                JaxprDot(
                    lhs_dtype=str(jnp.dtype(lhs.dtype)),
                    rhs_dtype=str(jnp.dtype(rhs.dtype)),
                    out_dtype=str(jnp.dtype(eqn.outvars[0].aval.dtype)),
                    lhs_shape=tuple(lhs.shape),
                    rhs_shape=tuple(rhs.shape),
                    precision=str(precision),
                    source=_source(eqn),
                    lhs_contracting=tuple(int(a) for a in lhs_contracting),
                    rhs_contracting=tuple(int(a) for a in rhs_contracting),
                )
            )
        for param in _params_to_walk(eqn):
            for sub in _sub_jaxprs(param):
                _walk(sub, found)


def _params_to_walk(eqn):
    """The equation's parameters, with a platform-dependent cond reduced to its default branch.

    ``lax.platform_dependent`` traces one branch per platform and lowers only
    the one compiled for; fp8jax's FP8 dots use it to name their FP8
    algorithm on CUDA (:func:`fp8jax.ops.gemm.fp8_dot_general`). Walking
    every branch would count each GEMM twice; the default branch holds the
    same dot with the ``lax.Precision`` the recipe asked for.
    """
    platforms = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if not platforms or None not in platforms:
        return eqn.params.values()
    default = eqn.params["branches"][platforms.index(None)]
    return [value for key, value in eqn.params.items() if key != "branches"] + [default]


def jaxpr_dots(fn, *args, **kwargs) -> list[JaxprDot]:
    """Lists the dot_generals that ``fn(*args, **kwargs)`` traces to.

    Args:
      fn: any JAX-traceable function, e.g. ``jax.grad(loss)``.
      *args: arrays or ``jax.ShapeDtypeStruct``s.
      **kwargs: passed to ``fn``.

    Returns:
      One :class:`JaxprDot` per dot_general equation, in program order.

    Example:
      >>> import jax, jax.numpy as jnp, fp8jax
      >>> from fp8jax.verify.jaxpr_dots import jaxpr_dots
      >>> x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
      >>> loss = lambda x, w: fp8jax.dense(x, w).sum()
      >>> for dot in jaxpr_dots(jax.grad(loss, argnums=(0, 1)), x, w):
      ...     print(dot.operand_formats)
      ('float8_e4m3fn', 'float8_e4m3fn')
      ('float8_e5m2', 'float8_e4m3fn')
      ('float8_e4m3fn', 'float8_e5m2')
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    found: list[JaxprDot] = []
    _walk(closed.jaxpr, found)
    return found
