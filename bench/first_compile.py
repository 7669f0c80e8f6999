"""The first compile with a plain ``jax.jit``, FP8 against BF16, each in a fresh process (issue 59).

A user jits fp8jax's layer or train step without ``compiler_options``; this
times what they wait for: trace, lower and compile of ``value_and_grad``
(layers) or the train step, in a fresh Python process per row, so no
in-memory cache, no persistent compilation cache and no autotune result of
an earlier row is reused. Rows:

- ``layer-te`` and ``layer-llama3-8b``: one TransformerLayer forward+backward
  at bench/layer.py's presets. ``bf16`` is that script's Flax layer,
  ``fp8`` fp8jax's TransformerLayer (current scaling), both under a plain
  ``jax.jit``; ``fp8_options`` the fp8jax layer jitted with
  ``fp8jax.compiler_options()``, for comparison.
- ``train-<preset>``: ``fp8jax train``'s step (bench/gpt.py builds it) for a
  Gpt preset (``--train-presets``), its ``raw_step`` under a plain ``jax.jit``
  with the state donated, as a user would jit it.

Each child prints one JSON line; the parent logs it as it comes and ends with
a table of seconds and the FP8/BF16 ratio per row.

    PYTHONPATH=src:bench python bench/first_compile.py [--rows ...] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LAYER_ROWS = ("layer-te", "layer-llama3-8b")
VARIANTS = ("bf16", "fp8", "fp8_options")


def _layer_step(preset: str, variant: str, attention: str):
    import jax
    import jax.numpy as jnp
    import layer
    from harness import bf16_matrices, output_cotangent, output_loss

    import fp8jax
    from fp8jax.flax import linen as fnn

    shape = layer.PRESETS[preset]
    x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq, shape.hidden))
    x = x.astype(jnp.bfloat16)
    r = output_cotangent(x.shape)
    if variant == "bf16":
        model = layer.FlaxLayer(shape, attention)
        variables = bf16_matrices(jax.jit(model.init)(jax.random.key(0), x))

        def loss(variables, x, r):
            return output_loss(model.apply(variables, x), r)

        return jax.value_and_grad(loss, argnums=(0, 1)), (variables, x, r), {}
    s = shape
    model = fnn.TransformerLayer(
        num_heads=s.heads, num_kv_heads=s.kv_heads, intermediate_dim=s.ffn,
        activations=("silu", "linear") if s.gated else ("gelu_tanh",),
        norm_type="rmsnorm" if s.gated else "layernorm", use_bias=not s.gated, causal=True,
        attention_implementation=attention, dtype=jnp.bfloat16, recipe=fp8jax.CurrentScaling(),
    )  # fmt: skip
    params = bf16_matrices(jax.jit(model.init)(jax.random.key(0), x))["params"]

    def fp8_loss(params, x, r):
        return output_loss(model.apply({"params": params}, x), r)

    options = {"compiler_options": fp8jax.compiler_options()} if variant == "fp8_options" else {}
    return jax.value_and_grad(fp8_loss, argnums=(0, 1)), (params, x, r), options


def _train_step(preset: str, variant: str, attention: str):
    import gpt

    import fp8jax

    name = "bf16" if variant == "bf16" else "fp8jax_current"
    program, _, args, _, _ = gpt.step_and_args(preset, name, attention=attention)
    options = {"compiler_options": fp8jax.compiler_options()} if variant == "fp8_options" else {}
    return program.raw_step, args, options | {"donate_argnums": 0}


def child(row: str, variant: str, attention: str) -> dict:
    """Builds the row's program, then times its first trace, lower and compile."""
    import jax

    if row.startswith("layer-"):
        fn, args, jit_kw = _layer_step(row.removeprefix("layer-"), variant, attention)
    else:
        fn, args, jit_kw = _train_step(row.removeprefix("train-"), variant, attention)
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    # optax's schedules mix int32 and f32, as in fp8jax train.
    with jax.numpy_dtype_promotion("standard"):
        lowered = jax.jit(fn, **jit_kw).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo = compiled.as_text()
    return {
        "row": row,
        "variant": variant,
        "trace_lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        "first_compile_s": round(t2 - t0, 2),
        "cublaslt_fp8_calls": hlo.count('custom_call_target="__cublas$lt$matmul$f8"'),
        "triton_gemm_fusions": hlo.count('"kind":"__triton_gemm"')
        + hlo.count('"kind":"__triton_nested_gemm_fusion"'),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }


def _run_child(row: str, variant: str, attention: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row, variant, attention]
    # A fresh process without the persistent compilation cache: what a new user gets.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"row": row, "variant": variant, "error": f"no result after {timeout:.0f} s"}
    wall = round(time.perf_counter() - start, 2)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"row": row, "variant": variant, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1]) | {"process_wall_s": wall}


def _table(results: list[dict]) -> str:
    by = {(r["row"], r["variant"]): r for r in results}
    out = [f"{'row':<22}{'variant':<13}{'first compile s':>16}{'x BF16':>9}{'cuBLASLt f8':>13}"
           f"{'Triton GEMMs':>14}"]  # fmt: skip
    for r in results:
        if "error" in r:
            out.append(f"{r['row']:<22}{r['variant']:<13}  {r['error'].splitlines()[0]}")
            continue
        base = by.get((r["row"], "bf16"), {}).get("first_compile_s")
        ratio = f"{r['first_compile_s'] / base:.2f}" if base else "-"
        out.append(
            f"{r['row']:<22}{r['variant']:<13}{r['first_compile_s']:>16.2f}{ratio:>9}"
            f"{r['cublaslt_fp8_calls']:>13}{r['triton_gemm_fusions']:>14}"
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", nargs="*", default=None, help="default: both layers and trains")
    parser.add_argument("--train-presets", nargs="*", default=["llama-1b"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--attention", default="cudnn", help="cudnn on the GPU, xla elsewhere")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return 0
    rows = args.rows or [*LAYER_ROWS, *(f"train-{p}" for p in args.train_presets)]
    results = []
    for row in rows:
        for variant in args.variants:
            result = _run_child(row, variant, args.attention, args.timeout)
            print(json.dumps(result), flush=True)
            results.append(result)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=2)
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
