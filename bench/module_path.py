"""The modules one FP8 op's forward and backward pass through, and how often each is entered.

Traces ``jax.jit(jax.grad(loss)).lower(...)`` of a public op under
``sys.setprofile`` and counts, for every module of ``src/fp8jax``, its
*entries*: calls into a function of that module from a function of another
fp8jax module (JAX's own frames in between, such as a custom_vjp calling
its forward, are looked through; calls within a module do not count). A
module entered once is used through one call that returns everything the
caller needs (docs/design.md#the-path-of-one-fp8-dense-forward-and-backward).

    PYTHONPATH=src python bench/module_path.py            # dense, layernorm_dense, layernorm_mlp
    PYTHONPATH=src python bench/module_path.py --op dense

It prints the path (each module at its first entry, in order) and the
counts. It runs on the CPU (``JAX_PLATFORMS=cpu``); tracing stages the
Pallas kernels behind ``lax.platform_dependent``, so the path is the GPU's.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

import fp8jax

_ROOT = str(Path(fp8jax.__file__).parent)
TOKENS, HIDDEN, FFN = 128, 256, 256


def _module(code) -> str | None:
    """``code``'s module as a path under src/fp8jax, or None outside fp8jax."""
    filename = code.co_filename
    if not filename.startswith(_ROOT):
        return None
    return os.path.relpath(filename, _ROOT)


class Entry(NamedTuple):
    """A call into ``module``'s ``function`` from ``caller`` (None: from outside fp8jax)."""

    module: str
    function: str
    caller: str | None
    # The module was not already on the call stack: a call back into it (a
    # Pallas index map, a shard_map body) is an entry, but not a fresh one.
    fresh: bool


def trace_entries(fn, args: tuple) -> list[Entry]:
    """Every module entry while ``jax.jit(fn).lower(*args)`` traces."""
    entries = []
    modules = {}  # id(frame's code) -> module, memoised: the profiler sees every call

    def module_of(code):
        key = id(code)
        if key not in modules:
            modules[key] = _module(code)
        return modules[key]

    def profile(frame, event, _arg):
        if event != "call":
            return
        module = module_of(frame.f_code)
        if module is None:
            return
        caller = frame.f_back
        while caller is not None and module_of(caller.f_code) is None:
            caller = caller.f_back
        caller_module = None if caller is None else module_of(caller.f_code)
        if caller_module == module:
            return
        fresh, outer = True, caller
        while outer is not None and fresh:
            fresh = module_of(outer.f_code) != module
            outer = outer.f_back
        entries.append(Entry(module, frame.f_code.co_name, caller_module, fresh))

    jitted = jax.jit(fn)
    sys.setprofile(profile)
    try:
        jitted.lower(*args)
    finally:
        sys.setprofile(None)
    return entries


def path_and_counts(entries: list[Entry], fresh_only: bool = False):
    """The modules in the order first entered, and each one's number of (fresh) entries."""
    counts = collections.Counter(e.module for e in entries if e.fresh or not fresh_only)
    return list(dict.fromkeys(e.module for e in entries)), dict(counts)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (TOKENS, HIDDEN), jnp.bfloat16)
    w1 = jax.random.normal(keys[1], (HIDDEN, FFN), jnp.float32) * 0.05
    w2 = jax.random.normal(keys[2], (FFN, HIDDEN), jnp.float32) * 0.05
    return x, w1, w2


def dense_grad():
    """``grad`` of a loss through ``fp8jax.dense(x, kernel, bias)``, and its arguments."""
    x, w, _ = _inputs()

    def loss(x, w, b):
        return jnp.sum(fp8jax.dense(x, w, b).astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2)), (x, w, jnp.zeros((FFN,), jnp.float32))


def layernorm_dense_grad():
    """``grad`` through ``fp8jax.layernorm_dense``, and its arguments."""
    x, w, _ = _inputs()
    gamma, beta = jnp.ones((HIDDEN,)), jnp.zeros((HIDDEN,))

    def loss(x, gamma, beta, w):
        y = fp8jax.layernorm_dense(x, gamma, beta, w)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2, 3)), (x, gamma, beta, w)


def layernorm_mlp_grad():
    """``grad`` through ``fp8jax.layernorm_mlp`` (GeGLU), and its arguments."""
    x, w1, w2 = _inputs()
    gamma, beta = jnp.ones((HIDDEN,)), jnp.zeros((HIDDEN,))
    w1 = jnp.stack([w1, w1], axis=1)  # (hidden, 2, ffn): the gate's two branches

    def loss(x, gamma, beta, w1, w2):
        y = fp8jax.layernorm_mlp(x, gamma, beta, w1, w2)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (x, gamma, beta, w1, w2)


OPS = {"dense": dense_grad, "layernorm_dense": layernorm_dense_grad,
       "layernorm_mlp": layernorm_mlp_grad}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(OPS), action="append")
    parser.add_argument("--functions", action="store_true", help="print every entry")
    args = parser.parse_args()
    for name in args.op or list(OPS):
        entries = trace_entries(*OPS[name]())
        path, counts = path_and_counts(entries)
        _, fresh = path_and_counts(entries, fresh_only=True)
        print(f"== {name}: {len(path)} modules, {len(entries)} entries")
        print("path: " + " -> ".join(path))
        print("entries  fresh  module")
        for module in path:
            print(f"  {counts[module]:5d}  {fresh.get(module, 0):5d}  {module}")
        if args.functions:
            for e in entries:
                print(f"    {e.caller} -> {e.module}:{e.function}{'' if e.fresh else '  (back)'}")


if __name__ == "__main__":
    main()
