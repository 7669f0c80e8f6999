"""The MoE presets' train-step peak memory on one H200, computed without a GPU.

Compiles ``fp8jax train``'s step (:class:`fp8jax.training.program.TrainProgram`'s,
the state donated as the CLI donates it) deviceless for an H200 at each
batch size, BF16 and FP8, and prints the compiled peak per device
(``fp8jax.verify.memory_many``: arguments + outputs + temporaries - donated).
Nothing is allocated: the state is abstract.

A deviceless compile cannot see two kernels the GPU runs, so this script
traces the same memory without them:

* cuDNN's fused attention (``--attention auto`` on a GPU) needs cuDNN to
  compile. XLA's attention would hold the ``[batch, heads, seq, seq]``
  scores of every layer for the backward, gigabytes per layer at 4096 bytes,
  which cuDNN never does; so the attention core is a stand-in with cuDNN's
  footprint: it saves q, k, v, the output and f32 softmax statistics
  ``[batch, heads, seq]``, and its backward makes an f32 ``dq``;
* the BF16 experts' Mosaic GPU grouped GEMMs (``fp8jax.kernels.bf16_grouped``)
  are traced as on a GPU host (a CPU host takes ``lax.ragged_dot``, which
  XLA's GPU backend expands to a dense GEMM over all experts); their wgrad
  kernel reads the SM count of ``jax.devices()[0]`` when traced, given here
  as the H200's 132.

    PYTHONPATH=src:bench python bench/moe_memory.py --config mixtral --batch-sizes 4 6 8
    PYTHONPATH=src:bench python bench/moe_memory.py --config deepseek --layers 6 8 --batch-sizes 8
    PYTHONPATH=src:bench python bench/moe_memory.py --config llama-1b --batch-sizes 16

``llama-1b`` at 16 sequences was measured on an H200 (docs/train.md#llama-presets:
89.2 GiB BF16, 75.5 GiB FP8), which checks the method.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import time
import types
from unittest import mock

import jax
import jax.numpy as jnp

from fp8jax import verify, xla_options
from fp8jax.flax import _attention
from fp8jax.kernels import bf16_grouped
from fp8jax.training.config import TrainOptions, resolve
from fp8jax.training.program import TrainProgram

GIB = 2**30
H200_SMS = 132
# JAX preallocates 75% of the GPU's memory by default; the H200 reports 143,771 MiB.
DEFAULT_SHARE_GIB = 0.75 * 143_771 / 1024
VARIANTS = {"bf16": {"precision": "bf16"}, "fp8jax_current": {"precision": "fp8"}}


@jax.custom_vjp
def _flash_standin(q, k, v):
    return _flash_standin_fwd(q, k, v)[0]


def _expand(kv, heads):
    """``[b, s, kv_heads, d]`` repeated to ``heads`` (the GQA grouping)."""
    return jnp.repeat(kv, heads // kv.shape[2], axis=2)


def _flash_standin_fwd(q, k, v):
    # Elementwise only: no [seq, seq] buffer, as in a fused flash attention.
    o = (q.astype(jnp.float32) + _expand(v, q.shape[2]).astype(jnp.float32)).astype(q.dtype)
    stats = jnp.sum(q.astype(jnp.float32), axis=-1).transpose(0, 2, 1)  # [b, heads, s] f32
    return o, (q, k, v, o, stats)


def _flash_standin_bwd(residuals, g):
    q, k, v, o, stats = residuals
    scale = stats.transpose(0, 2, 1)[..., None]
    dq = g.astype(jnp.float32) * scale + o.astype(jnp.float32) + q.astype(jnp.float32)
    group = q.shape[2] // k.shape[2]
    dkv = dq.reshape(*dq.shape[:2], k.shape[2], group, dq.shape[-1]).sum(3)
    dk = (dkv + k.astype(jnp.float32)).astype(k.dtype)
    dv = (dkv + v.astype(jnp.float32)).astype(v.dtype)
    return dq.astype(q.dtype), dk, dv


_flash_standin.defvjp(_flash_standin_fwd, _flash_standin_bwd)


def _attention_core(q, k, v, mask, causal, implementation, hadamard=False):
    # _attention.attention_core's signature: attend() passes hadamard positionally.
    return _flash_standin(q, k, v)


def _h200_devices(*args, **kwargs):
    return [types.SimpleNamespace(core_count=H200_SMS, platform="gpu")]


@contextlib.contextmanager
def as_on_h200():
    """Traces the GPU's kernels' memory: the attention stand-in, the Mosaic GPU grouped GEMMs."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as wgrad

    fake_jax = types.SimpleNamespace(**{k: getattr(jax, k) for k in dir(jax) if k[0] != "_"})
    fake_jax.devices = _h200_devices
    with (
        mock.patch.object(_attention, "attention_core", _attention_core),
        mock.patch.object(bf16_grouped, "_gpu_host", lambda: True),
        mock.patch.object(wgrad, "jax", fake_jax),
    ):
        yield


def train_step(preset: str, variant: str, batch_size: int, remat: str = "none",
               seq_len: int | None = None, **model):  # fmt: skip
    """``(step, (abstract state, batch))``: ``fp8jax train``'s step, before jit.

    ``model`` replaces fields of the preset's ``GptConfig`` (``layers``, to keep
    a compile short). Trace it inside :func:`as_on_h200`.
    """
    options = TrainOptions(out="unused", config=preset, batch_size=batch_size, remat=remat,
                           seq_len=seq_len, **VARIANTS[variant])  # fmt: skip
    config = resolve(options)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, **model))
    with jax.numpy_dtype_promotion("standard"):
        program = TrainProgram(config, None, "xla", materialize=False)
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    return program.raw_step, (program.initial_state, batch)


def step_memory(preset: str, variant: str, batch_size: int, remat: str = "none",
                target: str = "h200", **overrides):  # fmt: skip
    """The compiled train step's :class:`fp8jax.verify.Memory` on one GPU of ``target``,
    its state donated as ``fp8jax train`` donates it."""
    with jax.numpy_dtype_promotion("standard"), as_on_h200():
        step, args = train_step(preset, variant, batch_size, remat, **overrides)
        [memory] = verify.memory_many(
            [(step, args)],
            target=target,
            xla_flags=xla_options.as_xla_flags(),
            donate_argnums=(0,),
        )
    return memory


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", nargs="+", default=["mixtral", "deepseek"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="default: the preset's")  # fmt: skip
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="the model's layers (default: the preset's)")  # fmt: skip
    parser.add_argument("--remat", nargs="+", default=["none"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--target", default="h200")
    parser.add_argument("--budget-gib", type=float, default=DEFAULT_SHARE_GIB,
                        help="fits: peak below this (default: JAX's 75%% of an H200)")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON, rewritten after every row")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, deviceless {args.target}, budget {args.budget_gib:.1f} GiB",
          flush=True)  # fmt: skip
    print(f"{'config':>10} {'variant':>15} {'remat':>5} {'layers':>6} {'batch':>5} {'args GiB':>8} "
          f"{'temp GiB':>8} {'peak GiB':>8} {'fits':>4} {'compile s':>9}", flush=True)  # fmt: skip
    rows = []
    for preset in args.config:
        from fp8jax.training.config import PRESETS

        for remat, layers, batch_size, variant in itertools.product(
            args.remat,
            args.layers or [PRESETS[preset].model.layers],
            args.batch_sizes or [PRESETS[preset].batch_size],
            args.variants,
        ):
            start = time.perf_counter()
            memory = step_memory(preset, variant, batch_size, remat, args.target,
                                 layers=layers)  # fmt: skip
            seconds = time.perf_counter() - start
            row = {"config": preset, "variant": variant, "remat": remat, "layers": layers,
                   "batch_size": batch_size, **memory._asdict(),
                   "peak_gib": memory.peak / GIB,
                   "fits": memory.peak / GIB <= args.budget_gib}  # fmt: skip
            rows.append(row)
            print(f"{preset:>10} {variant:>15} {remat:>5} {layers:>6} {batch_size:>5} "
                  f"{memory.argument / GIB:>8.2f} {memory.temp / GIB:>8.2f} "
                  f"{row['peak_gib']:>8.2f} {'yes' if row['fits'] else 'no':>4} "
                  f"{seconds:>9.1f}", flush=True)  # fmt: skip
            if args.out:
                payload = {"jax": jax.__version__, "target": args.target,
                           "budget_gib": args.budget_gib, "rows": rows}  # fmt: skip
                with open(args.out, "w") as f:
                    json.dump(payload, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
