"""``assert_fp8_gemms``: fail loudly, naming the line, when a GEMM is not FP8."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from fp8jax.verify.compilation import compile_for
from fp8jax.verify.report import GemmRow, Report, gemm_report, short_path, tensor_text


class Fp8VerificationError(AssertionError):
    """A compiled program has GEMMs that are not FP8, or not the expected number.

    Attributes:
      report: the ``Report`` the verdict was reached on.
    """

    def __init__(self, message: str, report: Report):
        super().__init__(message)
        self.report = report


def assert_fp8_gemms(
    fn: Callable[..., Any] | str | None = None,
    /,
    *args: Any,
    hlo: str | Report | None = None,
    expect: int | None = None,
    at_least: int | None = None,
    allow: str | Iterable[str | re.Pattern[str]] = (),
    **compile_kw: Any,
) -> Report:
    """Compiles ``fn(*args)`` for a GPU and asserts that its GEMMs run in FP8.

    Every GEMM must read FP8 operands (cuBLASLt ``$f8`` or a Triton GEMM fusion
    on f8 values), unless ``allow`` matches it. Without ``expect`` or
    ``at_least``, at least one FP8 GEMM must exist, so a program whose GEMMs
    were optimized away does not pass by having none.

    Args:
      fn: the function to compile, as for ``compile_for``. Leave it out and
        pass ``hlo=`` to check text compiled elsewhere.
      *args: its arguments, as for ``compile_for``.
      hlo: optimized HLO text, or a ``Report``, instead of ``fn``.
      expect: the exact number of FP8 GEMMs.
      at_least: a lower bound on the number of FP8 GEMMs.
      allow: regular expressions for GEMMs meant to stay in high precision
        (an LM head, say); each is searched in the GEMM's source line, its
        op_name and every frame of its stack.
      **compile_kw: ``target``, ``devices``, ``mesh``, ``xla_flags`` and the
        rest of ``compile_for``'s options.

    Returns:
      The ``Report``, for further checks (collective dtypes, say).

    Raises:
      Fp8VerificationError: an AssertionError whose message names each
        offending GEMM with its source line, followed by the full report.
      TypeError, ValueError: for inconsistent arguments.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.verify import assert_fp8_gemms
      >>> x = jax.ShapeDtypeStruct((64, 128), jnp.float8_e4m3fn)
      >>> mm = lambda a, b: jax.lax.dot(a, b.T, preferred_element_type=jnp.bfloat16)
      >>> len(assert_fp8_gemms(mm, x, x, expect=1).fp8_gemms)
      1
    """
    patterns = allow_patterns(allow)
    for name, value in (("expect", expect), ("at_least", at_least)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ValueError(f"{name} must be a non-negative int or None, got {value!r}.")
    if expect is not None and at_least is not None:
        raise ValueError(
            f"pass expect or at_least, not both (got expect={expect}, at_least={at_least})."
        )
    if (fn is None) == (hlo is None):
        raise TypeError(
            "pass either fn (with its args) to compile, or hlo= with compiled text; "
            f"got fn={'set' if fn is not None else 'None'} and hlo={'set' if hlo else 'None'}."
        )
    if hlo is not None:
        if args or compile_kw:
            raise TypeError(
                "args and compile options only apply when compiling fn; "
                f"got hlo= together with {len(args)} args and options {sorted(compile_kw)}."
            )
        report = hlo if isinstance(hlo, Report) else gemm_report(hlo)
    else:
        report = gemm_report(compile_for(fn, *args, **compile_kw))
    problems = check(report, expect=expect, at_least=at_least, allow=patterns)
    if problems:
        raise Fp8VerificationError("\n".join(problems) + "\n\n" + str(report), report)
    return report


def check(
    report: Report,
    *,
    expect: int | None = None,
    at_least: int | None = None,
    allow: Iterable[re.Pattern[str]] = (),
) -> list[str]:
    """The reasons ``report`` fails, one line each; empty when it passes."""
    allow = list(allow)
    offenders = [row for row in report.non_fp8_gemms if not _allowed(row, allow)]
    count = len(report.fp8_gemms)
    problems = []
    if offenders:
        problems.append(f"{len(offenders)} of {len(report.gemms)} GEMMs are not FP8:")
        problems.extend(f"  - {_describe(row)}" for row in offenders)
    if expect is not None and count != expect:
        problems.append(f"expected exactly {expect} FP8 GEMMs, found {count}.")
    if at_least is not None and count < at_least:
        problems.append(f"expected at least {at_least} FP8 GEMMs, found {count}.")
    if expect is None and at_least is None and count == 0:
        problems.append("found no FP8 GEMM at all; pass at_least=0 if that is intended.")
    return problems


def _describe(row: GemmRow) -> str:
    lhs, rhs = tensor_text(row.lhs_dtype, row.lhs_shape), tensor_text(row.rhs_dtype, row.rhs_shape)
    where = short_path(row.source) if row.source else "unknown source"
    text = f"{row.backend} GEMM {lhs} x {rhs} -> {row.out_dtype} at {where} ({row.op_name})"
    if row.upcast_from_fp8:
        text += "; its operand was dequantized from FP8, so the GEMM runs in high precision"
    return text


def _allowed(row: GemmRow, patterns: list[re.Pattern[str]]) -> bool:
    texts = (row.source, row.op_name, *row.stack)
    return any(p.search(t) for p in patterns for t in texts)


def allow_patterns(allow) -> list[re.Pattern[str]]:
    """Compiles ``allow``; a lone string is one pattern, not a sequence of letters."""
    if isinstance(allow, str | re.Pattern):
        allow = [allow]
    patterns = []
    for pattern in allow:
        if isinstance(pattern, re.Pattern):
            patterns.append(pattern)
            continue
        if not isinstance(pattern, str):
            raise TypeError(f"allow patterns must be str or re.Pattern, got {pattern!r}.")
        try:
            patterns.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"allow pattern {pattern!r} is not a valid regex: {e}.") from None
    return patterns
