"""``fp8jax demo``: the table it prints, and that its numbers are FP8's.

The demo's own shapes take half a minute on a CPU, so the test runs the same
code at smaller shapes (``demo.run``'s arguments).
"""

import contextlib
import functools
import io
import math

import pytest

from fp8jax import cli, demo

# Relative RMS rounding error of a format with unit roundoff u, taking the
# error uniform in [-u, u]: u / sqrt(3). A GEMM of two quantized operands:
# the two errors add in quadrature. E4M3 has u = 2**-4, E5M2 u = 2**-3.
E4, E5 = 2.0**-4, 2.0**-3
FORWARD = math.sqrt(2) * E4 / math.sqrt(3)  # E4M3 x E4M3
GRADIENT = math.sqrt(E4**2 + E5**2) / math.sqrt(3)  # E5M2 x E4M3, either order
ROWS = [
    ("float32", "CurrentScaling"),
    ("float32", "DelayedScaling"),
    ("bfloat16", "CurrentScaling"),
    ("bfloat16", "DelayedScaling"),
]


@pytest.fixture(scope="module")
def printed():
    """What ``fp8jax demo`` prints, at 128 tokens x 256 -> 128."""
    small = functools.partial(demo.run, tokens=128, hidden=256, out=128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "run", small)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(["demo"])
    return status, out.getvalue()


def _rows(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    return [line.split(None, 5) for line in lines[start:] if line.strip()]


def test_demo_prints_one_row_per_dtype_and_recipe_with_fp8_gemms(printed):
    status, text = printed
    assert status == 0
    assert text.startswith("fp8jax demo: dense")
    rows = _rows(text)
    assert [(r[0], r[1]) for r in rows] == ROWS
    for r in rows:
        assert r[5] == "E4M3xE4M3, E5M2xE4M3, E4M3xE5M2", r


def test_demo_errors_are_fp8_rounding_errors(printed):
    for dtype, recipe, *errors, _ in _rows(printed[1]):
        forward, dgrad, wgrad = map(float, errors)
        what = f"{dtype} {recipe}"
        # Within 1.5 times the estimate, and above a quarter of it: a GEMM in
        # bf16 or f32 would be 16 times or more below.
        assert FORWARD / 4 < forward < 1.5 * FORWARD, what
        for grad in (dgrad, wgrad):
            assert GRADIENT / 4 < grad < 1.5 * GRADIENT, what
            # An E5M2 operand rounds twice as coarsely as E4M3.
            assert grad > 1.2 * forward, what
