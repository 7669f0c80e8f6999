"""A behaviour fingerprint of the public ops: jaxprs, outputs and gradients, for refactors.

A refactor that claims "behaviour unchanged" (issue 58) is checked by running
this script on the commit before and after it and diffing the two outputs:

    PYTHONPATH=src python bench/jaxpr_snapshot.py > /tmp/before.txt   # on the old commit
    PYTHONPATH=src python bench/jaxpr_snapshot.py > /tmp/after.txt    # on the new one
    diff /tmp/before.txt /tmp/after.txt && echo identical

For every op (``dense``, ``dot_general``, ``layernorm_dense``,
``layernorm_mlp``, ``ragged_dot``), every recipe (Current, Delayed,
Rowwise, Block, MXFP8) and both kernel settings (on: the Pallas kernels
staged behind ``lax.platform_dependent``, and the grouped-GEMM kernels in
Pallas interpret mode; off: ``fp8jax.kernels.use_pallas(False)``) it prints

* the jaxpr of the forward and of ``jax.vjp``'s backward, with memory
  addresses and source locations blanked (they move with any edit);
* a SHA-256 of the output's and of every gradient's bytes, computed on the
  CPU, so that the diff shows a change in a single bit.

A combination an op refuses prints the error's type and message instead.
It runs on the CPU only (it sets ``JAX_PLATFORMS=cpu``). Options:
``--only SUBSTRING`` keeps the cases whose name contains it, ``--hashes``
prints one SHA-256 per jaxpr in place of its text (shorter output).

The deviceless GEMM counts need no separate check: XLA compiles identical
jaxprs to identical HLO on the same JAX, so equal jaxprs imply equal counts.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import contextlib
import hashlib
import re

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax
import fp8jax.kernels
from fp8jax.ops import ragged_dot

RECIPES = {
    "current": fp8jax.CurrentScaling(),
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "rowwise": fp8jax.RowwiseScaling(),
    "block": fp8jax.BlockScaling(),
    "mxfp8": fp8jax.MXFP8Scaling(),
}
TOKENS, HIDDEN, FFN, OUT, GROUPS = 128, 256, 256, 128, 4


def _kernels(on: bool):
    stack = contextlib.ExitStack()
    stack.enter_context(fp8jax.kernels.use_pallas(on))
    if on:
        stack.enter_context(ragged_dot.interpret_kernels())
    return stack


def _inputs():
    keys = iter(jax.random.split(jax.random.key(58), 16))

    def normal(shape, dtype=jnp.float32, scale=1.0):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    return {
        "x": normal((2, TOKENS // 2, HIDDEN), jnp.bfloat16),
        "gamma": normal((HIDDEN,), scale=0.1) + 1.0,
        "beta": normal((HIDDEN,), scale=0.1),
        "kernel": normal((HIDDEN, OUT), scale=0.05),
        "bias": normal((OUT,), scale=0.1),
        "k1": normal((HIDDEN, 2, FFN), scale=0.05),
        "k2": normal((FFN, OUT), scale=0.05),
        "rows": normal((TOKENS, HIDDEN), jnp.bfloat16),
        "experts": normal((GROUPS, HIDDEN, OUT), scale=0.05),
        "sizes": jnp.array([40, 0, 56, 24], jnp.int32),  # 120 of 128 rows: rows past the sum
        # The same cotangent for every case, whichever cases --only keeps.
        "ct": lambda shape, dtype: jax.random.normal(jax.random.key(7), shape).astype(dtype),
    }


def _cases(inp, recipe, name):
    """(op name, function of differentiable args, args, state group or None) per op."""
    x, gamma, beta = inp["x"], inp["gamma"], inp["beta"]
    yield "dense", lambda x, k, b, s: fp8jax.dense(x, k, b, recipe=recipe, state=s), (
        x, inp["kernel"], inp["bias"]), fp8jax.DotScaleState  # fmt: skip
    dims = (((2,), (0,)), ((), ()))
    yield "dot_general", lambda x, k, s: fp8jax.dot_general(
        x, k, dims, recipe=recipe, state=s), (x, inp["kernel"]), fp8jax.DotScaleState  # fmt: skip
    yield "layernorm_dense", lambda x, g, b, k, bias, s: fp8jax.layernorm_dense(
        x, g, b, k, bias, recipe=recipe, state=s), (
        x, gamma, beta, inp["kernel"], inp["bias"]), fp8jax.DotScaleState  # fmt: skip
    yield "layernorm_mlp", lambda x, g, k1, k2, s: fp8jax.layernorm_mlp(
        x, g, None, k1, k2, activations=("silu", "linear"), norm_type="rmsnorm", recipe=recipe,
        state=s), (x, gamma, inp["k1"], inp["k2"]), fp8jax.MlpScaleState  # fmt: skip
    sizes = inp["sizes"]
    yield "ragged_dot", lambda a, w, s: fp8jax.ragged_dot(
        a, w, sizes, recipe=recipe, state=s), (inp["rows"], inp["experts"]), None  # fmt: skip


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_SOURCE = re.compile(r"[\w./<>-]+\.py:\d+(:\d+)?")


def _clean(text: str) -> str:
    return _SOURCE.sub("<src>", _ADDRESS.sub("", text))


def _digest(tree) -> list[str]:
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.asarray(leaf)
        h = hashlib.sha256(a.tobytes()).hexdigest()[:16]
        out.append(f"{jax.tree_util.keystr(path)} {a.dtype}{list(a.shape)} {h}")
    return out


def _show(label: str, text: str, hashes: bool) -> list[str]:
    text = _clean(text)
    if hashes:
        return [f"{label} {hashlib.sha256(text.encode()).hexdigest()[:16]}"]
    return [f"{label}:", text]


def snapshot_case(fn, args, state, ct_of, hashes: bool) -> list[str]:
    primal = (*args, state)

    def backward(primal, ct):
        _, vjp = jax.vjp(fn, *primal)
        return vjp(ct)

    lines = _show("forward jaxpr", str(jax.make_jaxpr(fn)(*primal)), hashes)
    y = jax.jit(fn)(*primal)
    ct = ct_of(y.shape, y.dtype)
    lines += _show("backward jaxpr", str(jax.make_jaxpr(backward)(primal, ct)), hashes)
    lines += ["output " + d for d in _digest(y)]
    lines += ["grad " + d for d in _digest(jax.jit(backward)(primal, ct))]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="keep cases whose name contains this")
    parser.add_argument("--hashes", action="store_true", help="hash each jaxpr's text")
    options = parser.parse_args(argv)
    inp = _inputs()
    for rname, recipe in RECIPES.items():
        for on in (True, False):
            for op, fn, args, group in _cases(inp, recipe, rname):
                name = f"{op} {rname} kernels={'on' if on else 'off'}"
                if options.only not in name:
                    continue
                print(f"=== {name}", flush=True)
                try:
                    with _kernels(on):
                        state = None if group is None else fp8jax.init_state(recipe, group)
                        lines = snapshot_case(fn, args, state, inp["ct"], options.hashes)
                except (TypeError, ValueError, NotImplementedError, AttributeError) as e:
                    lines = [f"refused: {type(e).__name__}: {_clean(str(e))}"]
                print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
