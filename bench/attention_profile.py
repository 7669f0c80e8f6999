"""Where FP8 attention's kernels spend their time, by Mosaic GPU's on-device profiler.

The forward kernel (``fp8jax.kernels.attention.mosaic_forward(profile_dir=...)``)
opens named regions in each warpgroup: the compute warpgroups' ``wait_k`` and
``wait_v`` (K's and Vᵀ's blocks to land), ``qk`` (QKᵀ issued, the turn passed
to the other warpgroup, waited for), ``turn_wait`` (the tensor cores'
ping-pong), ``softmax``, ``p_operand`` (P to E4M3 and into shared memory),
``pv`` (PV issued, waited for, added to the accumulator) and ``epilogue``; the
memory warpgroup's ``wait_free`` (a slot's blocks consumed) and ``load``
(TMA issued). With ``--part bwd`` the backward's two kernels
(``fp8jax.kernels.attention_backward.mosaic_backward(profile_dir=...)``): a
step's ``wait``, ``scores`` (S or Sᵀ and P), ``dp`` (dP and dS) and ``dv_dk``
or ``dq`` (the gradient products), then ``epilogue``; their profiler buffer
shares shared memory with them, which holds a CTA's regions up to sequences
of about 2048. Mosaic GPU writes each call's regions as a Chrome trace, start
and end read off the SM's cycle counter (``%clock``: the trace's "us" are
thousands of cycles, each warpgroup's counted from its first event); this
script profiles one call at a shape and prints, per warpgroup kind, each
region's mean cycles a CTA (its own: nested regions are subtracted from
their parents), a key block, its share of the CTA, and what no region
covers.

The profiler itself costs a few cycles a region, so the kernel's total is
not the unprofiled kernel's time (bench/attention.py times that).

    PYTHONPATH=src:bench python bench/attention_profile.py \
        --shape llama-3b_b8_s4096_causal_24q8kv --batch 1 [--build fa3] --out DIR
    PYTHONPATH=src:bench python bench/attention_profile.py --part bwd \
        --shape te_b8_s2048_causal_32q32kv --batch 1 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp

from fp8jax.kernels import attention as kernel
from fp8jax.kernels import attention_backward as backward_kernels
from fp8jax.ops.attention import backward_operands, kernel_operands

WARPGROUPS = ("compute", "compute", "memory")  # the kernel's thread index order
# An SM's dense tensor-core rate a cycle: 989 TFLOP/s BF16 on 132 SMs at 1830 MHz (H100 and
# H200 SXM) is 4096 FLOPs; FP8 twice that.
BF16_FLOPS_A_CYCLE = 4096


def mma_cycles_a_step(kernel_name: str, d: int) -> float:
    """A CTA's products of one loop step at the tensor cores' peak, in cycles: the forward's
    key block (QKᵀ, PV in FP8, both warpgroups' 64 rows by 128 keys); the backward's 64-row
    step (S in FP8; dP, dV, dK or dP, dQ in BF16; both warpgroups' 64 rows by 64)."""
    if kernel_name == "fwd":
        return 2 * 2 * (2 * 64 * 128 * d) / (2 * BF16_FLOPS_A_CYCLE)
    bf16_products = 3 if kernel_name == "dkv" else 2
    product = 2 * 64 * 64 * d
    return 2 * product * (1 / (2 * BF16_FLOPS_A_CYCLE) + bf16_products / BF16_FLOPS_A_CYCLE)


def region_times(trace: dict) -> dict:
    """``{kind: {"ctas": n, "span_cycles": mean, "regions": {name: (cycles, count)}}}``,
    means over a kind's warpgroups (one a CTA).

    ``trace``: a Mosaic GPU profiler trace (Chrome format: ``B``/``E`` events,
    ``ts`` in thousands of SM cycles, ``tid`` one a warpgroup of a CTA,
    numbered from 1 in the kernel's warpgroup order). A region's time is its
    own: the time of regions nested in it is its children's. ``(untracked)`` is
    the span from a warpgroup's first event to its last that no region covers.
    """
    by_tid = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        by_tid[event["tid"]].append(event)
    totals = {kind: collections.defaultdict(lambda: [0.0, 0]) for kind in set(WARPGROUPS)}
    spans = collections.defaultdict(list)
    for tid, events in by_tid.items():
        kind = WARPGROUPS[(tid - 1) % len(WARPGROUPS)]
        stack, covered = [], 0.0  # open regions: [name, start, children's time]
        for event in events:
            if event["ph"] == "B":
                stack.append([event["name"], event["ts"], 0.0])
                continue
            name, start, children = stack.pop()
            if name != event["name"]:
                raise ValueError(f"region {event['name']!r} ends inside {name!r} (tid {tid})")
            took = 1e3 * (event["ts"] - start)
            totals[kind][name][0] += took - children
            totals[kind][name][1] += 1
            if stack:
                stack[-1][2] += took
            else:
                covered += took
        if stack:
            raise ValueError(f"regions {[s[0] for s in stack]} never end (tid {tid})")
        span = 1e3 * (events[-1]["ts"] - events[0]["ts"])
        totals[kind]["(untracked)"][0] += span - covered
        spans[kind].append(span)
    out = {}
    for kind, regions in totals.items():
        n = len(spans[kind])
        if n:
            out[kind] = {
                "ctas": n,
                "span_cycles": statistics.fmean(spans[kind]),
                "regions": {name: (t / n, c / n) for name, (t, c) in regions.items()},
            }
    return out


def profile(shape, batch: int, build, trace_dir: str, part: str = "fwd") -> list[dict]:
    """One profiled call of the forward kernel (``part="fwd"``) or of the backward's two
    (``"bwd"``) at ``shape`` (bench/attention.py's tuple): a result a kernel."""
    name, _, seq, heads, kv_heads, d, causal = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, d), jnp.bfloat16)
    g = jax.random.normal(keys[3], (batch, seq, heads, d), jnp.bfloat16)
    scale = d**-0.5

    @jax.jit
    def run(q, k, v, g):
        operands, quantized = kernel_operands(q, k, v, scale)
        profiled = {"profile_dir": trace_dir}
        if part == "fwd":
            return kernel.mosaic_forward(*operands, causal=causal, config=build, **profiled)
        out, lse2 = kernel.mosaic_forward(*operands, causal=causal, config=build)
        operands = backward_operands(quantized, out, lse2, g, scale)
        return backward_kernels.mosaic_backward(*operands, causal=causal, scale=scale,
                                                **profiled)  # fmt: skip

    before = set(glob.glob(os.path.join(trace_dir, "*-trace.json")))
    # One call: a trace's file is named when its kernel is lowered, and a later call of
    # the same compile finds it written and writes none (Mosaic GPU warns).
    jax.block_until_ready(run(q, k, v, g))
    jax.effects_barrier()  # the profiler's host callbacks have written their files
    results = []
    for path in sorted(set(glob.glob(os.path.join(trace_dir, "*-trace.json"))) - before):
        with open(path) as f:
            times = region_times(json.load(f))
        regions = times.get("compute", {}).get("regions", {})
        kernel_name = "dkv" if "dv_dk" in regions else "dq" if "dq" in regions else "fwd"
        results.append({"shape": name, "batch": batch, "kernel": kernel_name, "trace": path,
                        "mma_cycles_a_step": mma_cycles_a_step(kernel_name, d),
                        "warpgroups": times})  # fmt: skip
    return results


def print_table(result: dict) -> None:
    """Each warpgroup kind's regions, most cycles first. A loop step (the forward's key
    block, the backward's 64 rows) is a ``wait_k`` or ``wait`` (compute) or a ``load``
    (memory): one a step in every build."""
    for kind, t in result["warpgroups"].items():
        block_region = (
            "load" if kind == "memory" else "wait" if result["kernel"] != "fwd" else "wait_k"
        )
        blocks = t["regions"].get(block_region, (0.0, 0.0))[1] or 1.0
        print(f"{result['kernel']} {result['shape']} (batch {result['batch']}, build "
              f"{result['build']}), {kind} warpgroups: {t['ctas']}, "
              f"{t['span_cycles']:,.0f} cycles a CTA, {blocks:.1f} steps a CTA, "
              f"{t['span_cycles'] / blocks:,.0f} a step against "
              f"{result['mma_cycles_a_step']:,.0f} of products at peak")  # fmt: skip
        print(f"  {'region':<14}{'cycles/CTA':>12}{'cycles/step':>14}{'share':>8}{'count':>8}")
        for name, (cycles, count) in sorted(t["regions"].items(), key=lambda r: -r[1][0]):
            print(f"  {name:<14}{cycles:>12,.0f}{cycles / blocks:>14,.0f}"
                  f"{cycles / t['span_cycles']:>8.1%}{count:>8.1f}")  # fmt: skip


def main(argv=None) -> dict:
    from attention import FORWARD_BUILDS, SHAPES

    parser = argparse.ArgumentParser(description=__doc__)
    shapes = {s[0]: s for s in SHAPES}
    parser.add_argument("--shape", default=SHAPES[0][0], choices=sorted(shapes))
    parser.add_argument(
        "--batch", type=int, default=1,
        help="the shape's batch (the trace holds a region per block and CTA)",
    )  # fmt: skip
    parser.add_argument(
        "--build", default=None, choices=sorted(FORWARD_BUILDS),
        help="a bench/attention.py forward build (default: the library's)",
    )  # fmt: skip
    parser.add_argument(
        "--part", default="fwd", choices=("fwd", "bwd"),
        help="the forward kernel, or the backward's two (dK and dV, then dQ)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="the traces and a JSON summary go here")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error(f"the profiler runs on an NVIDIA GPU, the backend is {jax.default_backend()}")
    build = kernel.DEFAULT_CONFIG if args.build is None else FORWARD_BUILDS[args.build]
    trace_dir = args.out or tempfile.mkdtemp(prefix="attention_profile_")
    os.makedirs(trace_dir, exist_ok=True)
    results = profile(shapes[args.shape], args.batch, build, trace_dir, args.part)
    for result in results:
        result["build"] = args.build or "default"
        print_table(result)
    with open(os.path.join(trace_dir, f"summary_{args.part}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
