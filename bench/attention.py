"""FP8 attention against cuDNN in one process: speed against its BF16, errors against its FP8.

Two parts; every row is printed and appended to ``--out`` (JSON lines) as it
is measured.

* **Speed.** Per shape, the forward and the forward + backward (``jax.vjp``
  under a random output gradient) of ``fp8jax.dot_product_attention``
  (without and with ``hadamard=True``), cuDNN BF16
  (``jax.nn.dot_product_attention(implementation="cudnn")``), cuDNN FP8 and,
  as a diagnostic, JAX's own Mosaic GPU attention in F16 (``attention_mgpu``:
  fp8jax's framework without FP8), each timed by bench/harness.py's
  ``measure`` (first compile, synchronized median after a heating spell,
  pipelined mean, peak memory; a backward's dq, dk and dv checked not to be
  zeros before it is timed). ``vs_bf16``
  is cuDNN BF16's median over the row's (> 1: faster than cuDNN BF16),
  ``vs_bf16_pipelined`` the same of the pipelined means, ``tflops`` each
  row's useful FLOPs a second and ``mma_floor_ms`` its products' time at the
  tensor cores' dense peaks (:func:`tensor_rates`). Shapes:
  ``llama-3b``'s attention (8 x 4096, 24 query and 8 kv heads of 128,
  causal), the TE layer's (bench/layer.py's ``te``: 8 x 2048, 32 heads of
  128, causal) and issue 60's targets.
* **Errors.** On the same BF16 inputs (one ``llama-3b`` sequence, head_dim
  128, causal and not, Gaussian and with outlier channels in Q and K): the
  relative Frobenius error of the output and of dq, dk, dv against f32
  attention (XLA, f32 inputs holding the BF16 values), for fp8jax (without
  and with its Hadamard rotation), cuDNN FP8 and cuDNN BF16.

cuDNN FP8: ``jax.nn.dot_product_attention`` takes no FP8 scales (jax 0.10
and 0.11), so this calls JAX's private cuDNN entry,
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)``,
with BF16 in and out as a user calls it (the casts are inside the timed
function) and the scales TransformerEngine's recipe gives it: one current
scale per tensor for Q, K, V and dO; P at a fixed 2**8, fp8jax's; for the
output, dP, dQ, dK and dV, which cuDNN writes in E4M3, amax / 448 from a
first call on the same inputs (the best scales it could have). Where cuDNN
refuses (head_dim 64 with FP8, a missing entry) the row says why.

* **Forward builds** (``--builds``, issue 60's A/B): the forward kernel's
  other pipelines (:data:`FORWARD_BUILDS`, each a
  :class:`~fp8jax.kernels.attention.ForwardConfig`) timed beside the
  default in the same process as ``fp8jax@NAME``, each with a check row:
  its forward output against the default build's on the same inputs
  (bitwise equal but where P in registers lets the tensor cores sum a
  block in another order, PV in place leaves the sum across blocks to
  their accumulation, or ``fma_exp2``'s cubic moves a P across an E4M3
  rounding boundary), and error rows as the others' when errors are
  measured. ``--builds-only`` times only cuDNN BF16, the default and the
  builds; ``--parts fwd`` only the forwards (the builds share the backward).
  The backward kernels' builds (:data:`BACKWARD_BUILDS`, each a
  :class:`~fp8jax.kernels.attention_backward.BackwardConfig`) are timed
  forward and backward only, under the same ``--builds``.

Run on an H200 (speed and errors apart, each within ten minutes):
  PYTHONPATH=src python bench/attention.py --skip-errors --out bench/results/attention.jsonl
  PYTHONPATH=src python bench/attention.py --skip-speed --out bench/results/attention.jsonl
The forward builds' A/B (about a minute a shape):
  PYTHONPATH=src python bench/attention.py --skip-errors --builds all --builds-only \
    --parts fwd --only llama-3b_b8_s4096_causal_24q8kv,d128_s4096_causal_32q8kv,\
d64_s4096_causal_32q8kv --out bench/results/attention_builds.jsonl
The wiring on a CPU (tiny shapes, XLA BF16 standing in for cuDNN BF16, the
cuDNN rows skipped with the reason):
  JAX_PLATFORMS=cpu PYTHONPATH=src python bench/attention.py --dry-run --out /tmp/a.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json

import harness
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.kernels.attention import ForwardConfig
from fp8jax.kernels.attention_backward import BackwardConfig
from fp8jax.training import mfu

BF16, F32, F8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 256.0  # P in [0, 1] to E4M3, fp8jax's fixed scale (docs/design.md#fp8-attention)

# (name, batch, seq, q heads, kv heads, head_dim, causal)
SHAPES = [
    ("llama-3b_b8_s4096_causal_24q8kv", 8, 4096, 24, 8, 128, True),
    ("te_b8_s2048_causal_32q32kv", 8, 2048, 32, 32, 128, True),
    ("d128_s4096_causal_32q8kv", 2, 4096, 32, 8, 128, True),
    ("d64_s4096_causal_32q8kv", 2, 4096, 32, 8, 64, True),
    ("d128_s8192_causal_32q8kv", 1, 8192, 32, 8, 128, True),
    ("d128_s4096_full_32q8kv", 2, 4096, 32, 8, 128, False),
]
ERROR_SHAPE = (1, 4096, 24, 8, 128)  # (batch, seq, q heads, kv heads, head_dim): llama-3b's
DRY_SHAPES = [("dry_d128_s256_causal_4q2kv", 1, 256, 4, 2, 128, True)]
# The forward kernel's builds beside its default (issue 60). With a fresh PV
# tile the overlap spills registers at head_dim 128 (deviceless ptxas; 240
# registers spill least); with PV accumulated in place it does not.
FORWARD_BUILDS = {
    "p_registers": ForwardConfig(p_registers=True, row_scales=True),
    "in_place": ForwardConfig(pv_in_place=True),
    "stages3": ForwardConfig(stages=3),
    # Four key blocks in flight: a block's TMA has three steps to land, not one.
    "stages4": ForwardConfig(stages=4),
    # JAX's own Mosaic GPU attention's step: P from registers into PV accumulated in place.
    "registers_in_place": ForwardConfig(p_registers=True, pv_in_place=True, row_scales=True),
    "registers_in_place_stages4": ForwardConfig(
        p_registers=True, pv_in_place=True, row_scales=True, stages=4
    ),
    "overlap_in_place": ForwardConfig(overlap=True, pv_in_place=True),
    # FlashAttention-3's FP8 forward: all of them.
    "fa3": ForwardConfig(overlap=True, pv_in_place=True, p_registers=True),
    "fa3_stages4": ForwardConfig(overlap=True, pv_in_place=True, p_registers=True, stages=4),
    "fa3_stages3": ForwardConfig(overlap=True, pv_in_place=True, p_registers=True, stages=3),
    "fa3_no_pingpong": ForwardConfig(
        overlap=True, pv_in_place=True, p_registers=True, pingpong=False
    ),
    "overlap": ForwardConfig(overlap=True, row_scales=True, registers=240),
    "no_pingpong": ForwardConfig(pingpong=False),
    # A quarter, three eighths, half or three quarters of the scores' exponentials on
    # the FP32 pipes, off the MUFU (which may also run P's E4M3 conversions).
    "fma_exp2_32": ForwardConfig(fma_exp2=32),
    "fma_exp2_48": ForwardConfig(fma_exp2=48),
    "fma_exp2_64": ForwardConfig(fma_exp2=64),
    "fma_exp2_96": ForwardConfig(fma_exp2=96),
    "fma_exp2_64_no_pingpong": ForwardConfig(fma_exp2=64, pingpong=False),
    "fma_exp2_64_registers_in_place": ForwardConfig(
        fma_exp2=64, p_registers=True, pv_in_place=True, row_scales=True
    ),
    "fma_exp2_64_fa3": ForwardConfig(fma_exp2=64, overlap=True, pv_in_place=True, p_registers=True),
    "longest_first": ForwardConfig(longest_first=True),
    "fa3_longest_first": ForwardConfig(
        overlap=True, pv_in_place=True, p_registers=True, longest_first=True
    ),
}
# The backward kernels' builds: the same forward, so timed with their backward only.
BACKWARD_BUILDS = {
    # Three 64-row blocks of the streamed side in flight, not two.
    "bwd_stages3": BackwardConfig(stages=3),
    # The step's independent products issued together, waited for once.
    "bwd_paired": BackwardConfig(paired=True),
    "bwd_paired_stages3": BackwardConfig(paired=True, stages=3),
    # dQ's shares added by the dK/dV kernel (TMA reduce-add), no dQ kernel.
    "bwd_fused": BackwardConfig(fused=True),
}
PARTS = ("fwd", "fwd_bwd")
DRY_ERROR_SHAPE = (1, 128, 2, 1, 128)
CASES = ("gaussian", "outliers")
GRADIENTS = ("dq", "dk", "dv")


def inputs(batch, seq, heads, kv_heads, d, case="gaussian", seed=0):
    """BF16 q, k, v and an output gradient; ``outliers``: 4 channels of Q and K 10x the rest.

    Outlier channels are what trained models' queries and keys carry: they
    set a block's scale and leave the other channels few E4M3 steps. Q and K
    are then brought back to unit RMS, so that the logits' spread (about 4)
    stays that of a sharp trained head.
    """
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, d), F32)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, d), F32)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, d), F32)
    g = jax.random.normal(keys[3], (batch, seq, heads, d), F32)
    if case == "outliers":
        channels = jnp.ones((d,), F32).at[jnp.array([3, 17, 40, 61])].set(10.0)
        channels = channels / jnp.sqrt(jnp.mean(jnp.square(channels)))
        q, k = q * channels[None, None, None, :], k * channels[None, None, None, :]
    return tuple(x.astype(BF16) for x in (q, k, v, g))


def bf16_attention(implementation: str, causal: bool):
    def attend(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    return attend


def fp8jax_attention(causal: bool, hadamard: bool = False, build: ForwardConfig | None = None,
                     backward: BackwardConfig | None = None):  # fmt: skip
    return functools.partial(fp8jax.dot_product_attention, causal=causal, hadamard=hadamard,
                             forward_config=build, backward_config=backward)  # fmt: skip


def built(causal: bool, name: str):
    """fp8jax's attention as the build ``name`` of :data:`FORWARD_BUILDS` or
    :data:`BACKWARD_BUILDS`."""
    if name in FORWARD_BUILDS:
        return fp8jax_attention(causal, build=FORWARD_BUILDS[name])
    return fp8jax_attention(causal, backward=BACKWARD_BUILDS[name])


def reference(causal: bool):
    """f32 attention (XLA) on the inputs' values: the errors' reference."""

    def attend(q, k, v):
        f32 = [x.astype(F32) for x in (q, k, v)]
        with jax.default_matmul_precision("highest"):
            return jax.nn.dot_product_attention(*f32, is_causal=causal, implementation="xla")

    return attend


def with_backward(fn):
    def run(q, k, v, g):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(g.astype(out.dtype)))

    return run


# cuDNN FP8 ------------------------------------------------------------------

SCALED = ("o", "dP", "dQ", "dK", "dV")  # cuDNN's E4M3 results whose scales are calibrated


def _cudnn():
    """JAX's cuDNN attention module: private, as jax.nn's entry takes no FP8 scales."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def _amax(x):
    return jnp.max(jnp.abs(x.astype(F32)))


def _descale(amax):
    """The per-tensor factor that maps ``amax`` to E4M3's largest value (x ≈ x8 * descale)."""
    return jnp.maximum(amax, 2.0**-60) / E4M3_MAX


def _to_e4m3(x, descale):
    return (x.astype(F32) / descale).astype(F8)


def _fp8_params(descale_q, descale_k, descale_v, descale_do, descales: dict) -> dict:
    """cuDNN's seventeen FP8 parameters: descale_X multiplies E4M3 X back, scale_X divides."""

    def one(x):
        return jnp.reshape(jnp.asarray(x, F32), (1, 1, 1, 1))

    params = {name: one(0.0) for name in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")}
    params |= {
        "descale_q": one(descale_q), "descale_k": one(descale_k),
        "descale_v": one(descale_v), "descale_dO": one(descale_do),
        "descale_s": one(1.0 / P_SCALE), "scale_s": one(P_SCALE),
        "descale_o": one(descales["o"]), "scale_o": one(1.0 / descales["o"]),
        "descale_dP": one(descales["dP"]), "scale_dP": one(1.0 / descales["dP"]),
        "scale_dQ": one(1.0 / descales["dQ"]), "scale_dK": one(1.0 / descales["dK"]),
        "scale_dV": one(1.0 / descales["dV"]),
    }  # fmt: skip
    return params


def cudnn_fp8(causal: bool, scale: float):
    """``(forward, fwd_bwd)``: cuDNN FP8 attention with BF16 inputs and results.

    ``forward(q, k, v, descales)`` -> out; ``fwd_bwd(q, k, v, g, descales)`` ->
    ``((out, dq, dk, dv), amaxes)``, ``descales`` and ``amaxes`` keyed by
    :data:`SCALED`.
    """
    module = _cudnn()
    mask = module.MaskType.CAUSAL if causal else module.MaskType.NO_MASK

    def attend(q8, k8, v8, params):
        return module.dot_product_attention(
            q8, k8, v8, fp8_params=params, scale=scale, mask_type=mask, use_fp8=True
        )

    def quantized(q, k, v, g, descales):
        per_tensor = [_descale(_amax(x)) for x in (q, k, v, g)]
        e4m3 = [_to_e4m3(x, s) for x, s in zip((q, k, v, g), per_tensor, strict=True)]
        return e4m3, _fp8_params(*per_tensor, descales)

    def forward(q, k, v, descales):
        (q8, k8, v8, _), params = quantized(q, k, v, q, descales)
        out8, _, _ = attend(q8, k8, v8, params)
        return (out8.astype(F32) * descales["o"]).astype(BF16)

    def fwd_bwd(q, k, v, g, descales):
        (q8, k8, v8, g8), params = quantized(q, k, v, g, descales)
        (out8, _, amax_o), vjp = jax.vjp(attend, q8, k8, v8, params)
        unit = jnp.ones((1, 1, 1, 1), F32)  # the amax outputs' cotangents: unused
        dq8, dk8, dv8, dparams = vjp((g8, unit, unit))
        results = [
            (x.astype(F32) * descales[name]).astype(BF16)
            for x, name in zip((out8, dq8, dk8, dv8), ("o", "dQ", "dK", "dV"), strict=True)
        ]
        amaxes = {"o": amax_o} | {n: dparams[f"amax_{n}"] for n in ("dP", "dQ", "dK", "dV")}
        return tuple(results), {n: jnp.reshape(a, ()) for n, a in amaxes.items()}

    return forward, fwd_bwd


def calibrated_descales(fwd_bwd, q, k, v, g) -> dict:
    """Per-tensor descales of cuDNN's E4M3 results, from a first call with unit scales."""
    unit = {name: jnp.float32(1.0) for name in SCALED}
    _, amaxes = jax.jit(fwd_bwd)(q, k, v, g, unit)
    return {name: _descale(amaxes[name]) for name in SCALED}


# Rows -------------------------------------------------------------------------


def relative(x, ref) -> float:
    x, ref = x.astype(F32), ref.astype(F32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _refused(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def speed_rows(shape, args, baseline: str, cudnn_ok: bool, log) -> dict:
    """Times every implementation on one shape; the summary row, with the ratios."""
    name, batch, seq, heads, kv_heads, d, causal = shape
    q, k, v, g = inputs(batch, seq, heads, kv_heads, d)
    scale = d**-0.5
    fns = {
        baseline: bf16_attention(baseline.removesuffix("_bf16"), causal),
        "fp8jax": fp8jax_attention(causal),
    }
    if not args.builds_only:
        fns["fp8jax_hadamard"] = fp8jax_attention(causal, hadamard=True)
    builds = {f"fp8jax@{b}": FORWARD_BUILDS[b] for b in args.builds if b in FORWARD_BUILDS}
    backward_builds = [f"fp8jax@{b}" for b in args.builds if b in BACKWARD_BUILDS]
    fns |= {f"fp8jax@{b}": built(causal, b) for b in args.builds}
    times = {}
    for impl, fn in fns.items():
        for part, jitted, call in (
            ("fwd", jax.jit(fn), (q, k, v)),
            ("fwd_bwd", jax.jit(with_backward(fn)), (q, k, v, g)),
        ):
            if part in args.parts and not (part == "fwd" and impl in backward_builds):
                grads = _grads_after(1) if part == "fwd_bwd" else None  # (out, dq, dk, dv)
                times[(impl, part)] = _measure(f"{impl} {part}", jitted, call, args.iters, grads)
                log({"shape": name, "impl": impl, "part": part, **times[(impl, part)]})
    if builds:
        log_build_checks(name, fns, builds, (q, k, v), log)
    if not args.builds_only:
        cudnn_fp8_rows(name, (q, k, v, g), causal, scale, args, cudnn_ok, times, log)
    mosaic_f16_rows(name, (q, k, v, g), causal, args, cudnn_ok, times, log)
    summary = {"shape": name, "baseline": baseline, "vs_bf16": {}, "vs_bf16_pipelined": {}}
    for (impl, part), t in times.items():
        if impl != baseline:
            base = times[(baseline, part)]
            summary["vs_bf16"][f"{impl}_{part}"] = base["median_ms"] / t["median_ms"]
            summary["vs_bf16_pipelined"][f"{impl}_{part}"] = (
                base["pipelined_ms"] / t["pipelined_ms"]
            )
    summary |= tensor_rates(shape, times)
    if args.builds:  # > 1: the build is faster than the default
        summary["vs_default"] = {
            f"{impl}_{part}": times[("fp8jax", part)]["median_ms"] / t["median_ms"]
            for (impl, part), t in times.items() if impl in builds or impl in backward_builds
        }  # fmt: skip
    log(summary)
    pipelined = summary["vs_bf16_pipelined"]
    print(f"{name}: " + ", ".join(f"{k} {r:.3f}x ({pipelined[k]:.3f}x pipelined)"
                                  for k, r in summary["vs_bf16"].items())
          + f" {baseline}", flush=True)  # fmt: skip
    floors = summary["mma_floor_ms"] or {}
    print(f"{name} TFLOP/s: " + ", ".join(
        f"{k} {r:.0f}" + (f" (floor {floors[k]:.3f} ms)" if k in floors else "")
        for k, r in summary["tflops"].items()), flush=True)  # fmt: skip
    return summary


def tensor_rates(shape, times: dict) -> dict:
    """Each timed row's TFLOP/s and its floor: its products at the tensor cores' dense peaks.

    A product is one T x T x d GEMM a head (halved under causality); the
    forward has two (QKᵀ, PV), the backward five (S again, dP, dV, dK, dQ),
    FlashAttention's count. The floor runs each at the peak of the precision
    the implementation takes it in: fp8jax's forward and S in FP8 (twice BF16's
    peak on Hopper), its other four in BF16; cuDNN FP8 all in FP8; the BF16
    and F16 kernels all at BF16's. None where the device's peak is unknown.
    """
    _, batch, seq, heads, _, d, causal = shape
    gemm = 2 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
    bf16 = mfu.BF16_PEAK_FLOPS.get(jax.devices()[0].device_kind)
    rates, floors = {}, {}
    for (impl, part), t in times.items():
        products = 2 if part == "fwd" else 7
        rates[f"{impl}_{part}"] = products * gemm / (t["median_ms"] * 1e-3) / 1e12
        if bf16 is None:
            continue
        if impl.startswith("fp8jax"):
            fp8_products = 2 if part == "fwd" else 3  # the forward's two and S again
        else:
            fp8_products = products if impl == "cudnn_fp8" else 0
        seconds = gemm * (fp8_products / (2 * bf16) + (products - fp8_products) / bf16)
        floors[f"{impl}_{part}"] = seconds * 1e3
    return {"tflops": rates, "mma_floor_ms": floors or None}


def _grads_after(index: int, results: int | None = None):
    """harness.measure's ``gradients``: a call's results from ``index`` on (dq, dk, dv), taken
    from its output's element ``results`` where the results are one element of it."""

    def gradients(step, args):
        out = step(*args)
        return (out if results is None else out[results])[index:]

    return gradients


def _measure(label: str, jitted, call, iters: int, gradients) -> dict:
    """One timed row by harness.measure: its first compile, the synchronized median and the
    pipelined mean, peak memory, the live compile's GEMM and attention counts, and, for a
    backward, its gradients checked not to be zeros before it is timed."""
    row = harness.measure(label, jitted, *call, iters=iters, gradients=gradients)
    row.pop("report")
    del row["name"]  # the log names the shape, the implementation and the part
    return row


def cudnn_fp8_rows(name, call, causal, scale, args, cudnn_ok, times, log) -> None:
    """cuDNN FP8's times into ``times``, or the row that says why there are none."""
    if not cudnn_ok:
        log({"shape": name, "impl": "cudnn_fp8", "skipped": "cuDNN needs an NVIDIA GPU"})
        return
    q, k, v, g = call
    try:
        forward, fwd_bwd = cudnn_fp8(causal, scale)
        descales = calibrated_descales(fwd_bwd, q, k, v, g)
        for part, jitted, args_, grads in (
            ("fwd", jax.jit(forward), (q, k, v, descales), None),
            # ((out, dq, dk, dv), amaxes)
            ("fwd_bwd", jax.jit(fwd_bwd), (q, k, v, g, descales), _grads_after(1, results=0)),
        ):
            if part in args.parts:
                times[("cudnn_fp8", part)] = _measure(f"cudnn_fp8 {part}", jitted, args_,
                                                      args.iters, grads)  # fmt: skip
                log({"shape": name, "impl": "cudnn_fp8", "part": part,
                     **times[("cudnn_fp8", part)]})  # fmt: skip
    except Exception as error:  # cuDNN's refusal is the row's result
        log({"shape": name, "impl": "cudnn_fp8", "refused": _refused(error)})


def mosaic_f16(causal: bool):
    """JAX's own Mosaic GPU attention (``attention_mgpu``), blocks of 64 queries by 128 keys as
    fp8jax's. F16 in and out: its kernels stage operands in F16 shared memory whatever the
    input (BF16 fails to trace, jax 0.10), and F16 runs the tensor cores at BF16's rate. Its
    softmax takes no 1/sqrt(d) scale, which no time depends on; its backward is unmasked only
    (jax 0.10), so a causal shape's fwd_bwd row says it refused."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,  # its backward's
    )  # fmt: skip

    def attend(q, k, v):
        return attention_mgpu.attention(q, k, v, config)

    return attend


def mosaic_f16_rows(name, call, causal, args, on_gpu, times, log) -> None:
    """:func:`mosaic_f16`'s times into ``times`` (on the inputs cast to F16 before timing), or
    the row that says why there are none: a diagnostic, not the baseline. It shares fp8jax's
    framework without FP8, so it tells the kernel's structure from its FP8 work."""
    if not on_gpu:
        log({"shape": name, "impl": "mosaic_f16", "skipped": "Mosaic GPU needs an NVIDIA GPU"})
        return
    q, k, v, g = (x.astype(jnp.float16) for x in call)
    try:
        attend = mosaic_f16(causal)
        for part, jitted, args_, grads in (
            ("fwd", jax.jit(attend), (q, k, v), None),
            ("fwd_bwd", jax.jit(with_backward(attend)), (q, k, v, g), _grads_after(1)),
        ):
            if part in args.parts:
                times[("mosaic_f16", part)] = _measure(f"mosaic_f16 {part}", jitted, args_,
                                                       args.iters, grads)  # fmt: skip
                log({"shape": name, "impl": "mosaic_f16", "part": part,
                     **times[("mosaic_f16", part)]})  # fmt: skip
    except Exception as error:  # a refusal (a CUDA version, a shape) is the row's result
        log({"shape": name, "impl": "mosaic_f16", "refused": _refused(error)})


def log_build_checks(name, fns, builds, call, log) -> None:
    """Each build's forward output against the default build's on the same inputs."""
    want = jax.jit(fns["fp8jax"])(*call).astype(F32)
    for impl in builds:
        got = jax.jit(fns[impl])(*call).astype(F32)
        log({"shape": name, "impl": impl, "check_vs_default": {
            "max_abs_diff": float(jnp.max(jnp.abs(got - want))),
            "frac_differing": float(jnp.mean(got != want)),
            "max_abs_default": float(jnp.max(jnp.abs(want))),
        }})  # fmt: skip


def _names(text: str, known, flag: str) -> tuple[str, ...]:
    """A comma-separated list of ``known`` names ("all": every one), or a clear error."""
    names = tuple(known) if text == "all" else tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; expected names from {list(known)} or 'all'.")
    return names


def error_rows(error_shape, causal: bool, case: str, baseline: str, cudnn_ok: bool, log,
               builds=()):  # fmt: skip
    """Relative errors against f32 of every implementation (and forward build) on one input."""
    batch, seq, heads, kv_heads, d = error_shape
    q, k, v, g = inputs(batch, seq, heads, kv_heads, d, case=case, seed=1)
    want = jax.jit(with_backward(reference(causal)))(q, k, v, g)
    runs = {f"fp8jax@{b}": jax.jit(with_backward(built(causal, b))) for b in builds}
    runs |= {
        "fp8jax": jax.jit(with_backward(fp8jax_attention(causal))),
        "fp8jax_hadamard": jax.jit(with_backward(fp8jax_attention(causal, hadamard=True))),
        baseline: jax.jit(with_backward(bf16_attention(baseline.removesuffix("_bf16"), causal))),
    }
    label = {"case": case, "causal": causal, "shape": list(error_shape)}
    errors = {}
    for impl, run in runs.items():
        got = run(q, k, v, g)
        errors[impl] = dict(zip(("out", *GRADIENTS), map(relative, got, want), strict=True))
        log({"errors_vs_f32": impl, **label, **errors[impl]})
    if not cudnn_ok:
        log({"errors_vs_f32": "cudnn_fp8", **label, "skipped": "cuDNN needs an NVIDIA GPU"})
    else:
        try:
            _, fwd_bwd = cudnn_fp8(causal, d**-0.5)
            descales = calibrated_descales(fwd_bwd, q, k, v, g)
            got, _ = jax.jit(fwd_bwd)(q, k, v, g, descales)
            errors["cudnn_fp8"] = dict(zip(("out", *GRADIENTS), map(relative, got, want),
                                           strict=True))  # fmt: skip
            log({"errors_vs_f32": "cudnn_fp8", **label, **errors["cudnn_fp8"]})
        except Exception as error:  # cuDNN's refusal is the row's result
            log({"errors_vs_f32": "cudnn_fp8", **label, "refused": _refused(error)})
    if "cudnn_fp8" in errors:
        for impl in ("fp8jax", "fp8jax_hadamard"):
            ratios = {p: errors[impl][p] / errors["cudnn_fp8"][p] for p in errors[impl]}
            log({f"{impl}_error_over_cudnn_fp8": ratios, **label})
    print(f"errors {case} causal={causal}: " + "; ".join(
        f"{impl} " + " ".join(f"{p} {e:.2e}" for p, e in errs.items())
        for impl, errs in errors.items()), flush=True)  # fmt: skip
    return errors


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="attention.jsonl", help="JSON lines, one per row")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument(
        "--only", default=None, help="time only the shapes of these names (comma-separated)"
    )
    parser.add_argument(
        "--builds",
        default="",
        help="builds to time beside the default, comma-separated, or 'all': forward "
        f"{', '.join(FORWARD_BUILDS)}; backward {', '.join(BACKWARD_BUILDS)}",
    )
    parser.add_argument(
        "--builds-only",
        action="store_true",
        help="time only the BF16 baseline, the default and --builds",
    )
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"parts to time, comma-separated: {', '.join(PARTS)}")  # fmt: skip
    parser.add_argument("--skip-errors", action="store_true", help="time only")
    parser.add_argument("--skip-speed", action="store_true", help="measure the errors only")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes, XLA's BF16 baseline: a CPU check"
    )
    harness.add_heat_argument(parser)
    harness.add_compile_cache_argument(parser)
    args = parser.parse_args(argv)
    args.builds = _names(args.builds, FORWARD_BUILDS | BACKWARD_BUILDS, "--builds")
    args.parts = _names(args.parts, PARTS, "--parts")
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    only = _names(args.only, [s[0] for s in shapes], "--only") if args.only else None
    env = harness.start(args)
    cudnn_ok = jax.default_backend() == "gpu"
    if not cudnn_ok and not args.dry_run:
        parser.error(f"cuDNN needs an NVIDIA GPU, the backend is {jax.default_backend()}; "
                     "pass --dry-run to check the wiring on it.")  # fmt: skip
    baseline = "xla_bf16" if args.dry_run else "cudnn_bf16"
    rows = []

    def log(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    log({"environment": env, "baseline": baseline})
    for shape in shapes:
        if not args.skip_speed and (only is None or shape[0] in only):
            speed_rows(shape, args, baseline, cudnn_ok, log)
    if not args.skip_errors:
        for causal in (True, False):
            for case in CASES:
                error_shape = DRY_ERROR_SHAPE if args.dry_run else ERROR_SHAPE
                error_rows(error_shape, causal, case, baseline, cudnn_ok, log, args.builds)
    return rows


if __name__ == "__main__":
    main()
