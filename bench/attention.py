"""FP8 attention (fp8jax.dot_product_attention) against cuDNN's BF16 attention, one process.

For each shape, four timed rows (bench/harness.py: synchronized median after
a heating spell) and the errors of both against an f32 reference:

* ``cudnn_fwd`` / ``fp8_fwd``: the forward alone;
* ``cudnn_fwd_bwd`` / ``fp8_fwd_bwd``: forward and backward under a random
  output gradient (``jax.vjp``, the gradients of q, k and v).

Speed is printed as cuDNN's time over fp8jax's (> 1: FP8 faster). Errors
are relative Frobenius norms against ``jax.nn.dot_product_attention`` in f32
(XLA) on the first batch element, for the output and dq, dk, dv. Each row
is printed and appended to ``--out`` (JSON lines) as it is measured.

Run on an H200:
  PYTHONPATH=src python bench/attention.py --out bench/results/attention.jsonl
"""

from __future__ import annotations

import argparse
import json

import harness
import jax
import jax.numpy as jnp

import fp8jax

# (name, batch, seq, q heads, kv heads, head_dim, causal)
SHAPES = [
    ("d128_s4096_causal_32q8kv", 2, 4096, 32, 8, 128, True),
    ("d64_s4096_causal_32q8kv", 2, 4096, 32, 8, 64, True),
    ("d128_s2048_causal_32q8kv", 4, 2048, 32, 8, 128, True),
    ("d128_s8192_causal_32q8kv", 1, 8192, 32, 8, 128, True),
    ("d128_s4096_full_32q8kv", 2, 4096, 32, 8, 128, False),
]


def attention_fns(causal: bool):
    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def fp8(q, k, v):
        return fp8jax.dot_product_attention(q, k, v, causal=causal)

    def reference(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return jax.nn.dot_product_attention(*f32, is_causal=causal, implementation="xla")

    return {"cudnn": cudnn, "fp8": fp8, "reference": reference}


def with_backward(fn):
    def run(q, k, v, g):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(g.astype(out.dtype)))

    return run


def relative(x, ref) -> float:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def errors(fns, q, k, v, g) -> dict:
    """Relative errors of cuDNN and fp8jax against f32 on batch element 0."""
    one = [x[:1] for x in (q, k, v, g)]
    want = jax.jit(with_backward(fns["reference"]))(*one)
    out = {}
    for name in ("cudnn", "fp8"):
        got = jax.jit(with_backward(fns[name]))(*one)
        out[name] = {
            part: relative(a, b)
            for part, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="attention.jsonl", help="JSON lines, one per row")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--only", default=None, help="run only the shape of this name")
    harness.add_heat_argument(parser)
    harness.add_compile_cache_argument(parser)
    args = parser.parse_args()
    env = harness.start(args)
    print(json.dumps(env), flush=True)

    def log(row):
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    log({"environment": env})
    for name, batch, seq, heads, kv_heads, d, causal in SHAPES:
        if args.only and name != args.only:
            continue
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (batch, seq, heads, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, seq, kv_heads, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, seq, kv_heads, d), jnp.bfloat16)
        g = jax.random.normal(keys[3], (batch, seq, heads, d), jnp.bfloat16)
        fns = attention_fns(causal)
        times = {}
        for impl in ("cudnn", "fp8"):
            fwd = jax.jit(fns[impl])
            both = jax.jit(with_backward(fns[impl]))
            times[f"{impl}_fwd"] = harness.time_ms(fwd, q, k, v, iters=args.iters)
            log({"shape": name, "row": f"{impl}_fwd", **times[f"{impl}_fwd"]})
            times[f"{impl}_fwd_bwd"] = harness.time_ms(both, q, k, v, g, iters=args.iters)
            log({"shape": name, "row": f"{impl}_fwd_bwd", **times[f"{impl}_fwd_bwd"]})
        summary = {
            "shape": name,
            "fwd_speedup_vs_cudnn": times["cudnn_fwd"]["median_ms"] / times["fp8_fwd"]["median_ms"],
            "fwd_bwd_speedup_vs_cudnn": (
                times["cudnn_fwd_bwd"]["median_ms"] / times["fp8_fwd_bwd"]["median_ms"]
            ),
            "errors_vs_f32": errors(fns, q, k, v, g),
        }
        log(summary)
        print(
            f"{name}: forward {summary['fwd_speedup_vs_cudnn']:.3f}x cuDNN BF16, "
            f"forward+backward {summary['fwd_bwd_speedup_vs_cudnn']:.3f}x; errors "
            f"{summary['errors_vs_f32']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
