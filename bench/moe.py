"""Grouped expert GEMMs and MoE blocks: fp8jax's FP8 ragged_dot vs BF16 and dense FP8.

Part ``gemm``: one grouped GEMM (forward), balanced routing, in TFLOP/s on
the useful FLOPs (``2 * rows * k * n``):

- ``fp8jax_grouped``: fp8jax's grouped-GEMM path on pre-quantized FP8
  operands (layout, padding gather, Pallas kernel, un-padding);
- ``fp8_dense``: one dense FP8 GEMM of the same total rows (cuBLASLt);
- ``bf16_ragged_dot``: ``lax.ragged_dot`` in BF16;
- ``bf16_capacity``: the rows as ``[g, rows / g, k]`` (a capacity-padded
  batch with no padding needed), a batched BF16 ``dot_general``;
- ``bf16_mgpu``: JAX's Mosaic GPU ``ragged_dot_mgpu``, where importable;
- ``fp8jax_op_fwd_bwd`` / ``bf16_ragged_dot_fwd_bwd``: ``fp8jax.ragged_dot``
  (quantization included) and ``lax.ragged_dot``, forward and backward.

Part ``tiles``: the grouped GEMM alone under each of :data:`TILINGS`; the
fastest is then used by that shape's other parts.

Part ``backward``: the forward, dgrad and wgrad grouped GEMMs alone and the op's
fwd+bwd, under each wgrad tiling of :data:`WGRAD_TILINGS`.

Part ``block``: the MoE block forward and backward (router and permutation
included) with fp8jax's FP8 experts against three BF16 blocks from the same
parameters: the library's BF16 block with its experts on ``lax.ragged_dot``
(the kernels switched off), the same block on JAX's Mosaic GPU grouped GEMMs
(:func:`grouped_moe`; the library's BF16 block runs these by default), and
:func:`capacity_moe` (capacity-factor buffers and batched einsums, the way
a Flax user writes an MoE without grouped GEMMs; it drops slots past
1.25x a balanced share, so it may do less work than the others).

``--recipe current,block`` runs the block part's FP8 block once per recipe
(``fp8jax`` per-tensor current scaling, ``fp8jax_block`` BlockScaling's
1x128 tiles and 128x128 expert blocks) and prints each FP8 block's speed
against the fastest BF16 block of the same process.

Part ``blockgemm``: BlockScaling's grouped GEMM (``fp8jax.ragged_dot``,
quantization included) against the dense block-scaled GEMM
(``fp8jax.dense``) of the same rows, forward and forward+backward, with
the BF16 dense GEMM of those rows as the baseline.

    cd bench && PYTHONPATH=../src python moe.py [--part tiles,gemm,backward,block,blockgemm]
        [--shape deepseek,mixtral] [--recipe current,block] [--iters N] [--out F] [--trace DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
import traceback

import jax
import jax.numpy as jnp
from breakdown import breakdown
from flax import linen as nn
from harness import (
    add_compile_cache_argument,
    add_heat_argument,
    check_gradients,
    compiled_facts,
    dump,
    start,
    time_ms,
)
from jax import lax

import fp8jax
from fp8jax.kernels import bf16_grouped
from fp8jax.kernels import grouped_gemm as gg
from fp8jax.ops import moe as moe_ops
from fp8jax.ops import ragged_dot as rd

BF16, F32 = jnp.bfloat16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    shared: int


SHAPES = {
    "mixtral": Shape(16384, 4096, 14336, 8, 2, 0),
    "deepseek": Shape(16384, 2048, 1408, 64, 6, 2),
}


ITERS = {"n": 20}
TRACE = {"dir": None}  # --trace: the block part's rows are profiled and broken down here

TOP_KERNELS = 12  # the slowest kernels printed per traced row


def _trace(name: str, compiled, args, hlo: str) -> dict:
    """Three profiled calls of ``compiled``, broken down by kernel class (bench/breakdown.py)."""
    where, steps = os.path.join(TRACE["dir"], name), 3
    with jax.profiler.trace(where):
        for _ in range(steps):
            jax.block_until_ready(compiled(*args))
    b = breakdown(where, hlo, steps)
    shares = ", ".join(f"{k} {v:.1%}" for k, v in b["share"].items())
    print(f"    kernels {b['kernel_ms']:.3f} ms/call: {shares}", flush=True)
    for kernel, k in list(b["kernels_ms"].items())[:TOP_KERNELS]:
        print(f"      {k['ms']:7.3f} ms  {k['class']:<10} {kernel[:48]:<48} {k['what'][:70]}",
              flush=True)  # fmt: skip
    return b


def _row(name, fn, args, flops, iters=None, trace=False, backward=False):
    """One row: ``fn`` compiled, timed and counted; ``backward``: ``fn`` returns only gradients,
    which are checked not to be zeros (harness.check_gradients) before timing."""
    iters = iters or ITERS["n"]
    start = time.perf_counter()
    # fp8jax's variants compile with its XLA options, the baselines with XLA's defaults.
    options = fp8jax.compiler_options() if name.startswith("fp8") else None
    try:
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
        compile_s = time.perf_counter() - start
        checked = check_gradients(name, compiled(*args)) if backward else None
        t = time_ms(compiled, *args, warmup=3, iters=iters)
    except Exception as e:  # a baseline that does not run here is reported, not fatal
        traceback.print_exc()
        print(f"  {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    t.pop("clocks", None)
    hlo = compiled.as_text()
    facts = compiled_facts(compiled, hlo)
    facts.pop("report")
    row = {"name": name, "compile_s": compile_s, **t, **facts,
           "tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
           "gradient_leaves_checked": checked}  # fmt: skip
    print(f"  {name}: {t['median_ms']:.3f} ms ({t['pipelined_ms']:.3f} pipelined), "
          f"{row['tflops']:.0f} TFLOP/s (useful), "
          f"{facts['fp8_gemms']}/{facts['gemms']} FP8 GEMMs {facts['backends']}, "
          f"peak {facts['peak_memory_gib']:.2f} GiB, first compile {compile_s:.1f} s",
          flush=True)  # fmt: skip
    if trace and TRACE["dir"]:
        row["breakdown"] = _trace(name, compiled, args, hlo)
    return row


TILINGS = (
    gg.Tiles(),
    gg.Tiles(m=64, n=128, k=128, warps=4, stages=4),
    gg.Tiles(m=64, n=256, k=128, warps=4, stages=3),
    gg.Tiles(m=128, n=128, k=64, warps=4, stages=4),
    gg.Tiles(m=128, n=128, k=128, warps=8, stages=3),
    gg.Tiles(m=128, n=256, k=64, warps=8, stages=3),
    gg.Tiles(m=128, n=256, k=128, warps=8, stages=3),
)


def _gemm_operands(shape: Shape):
    rows, k, n, g = shape.tokens * shape.top_k, shape.hidden, 2 * shape.ffn, shape.experts
    x = jax.random.normal(jax.random.key(0), (rows, k), BF16).astype(fp8jax.E4M3.dtype)
    w_t = jax.random.normal(jax.random.key(1), (g, n, k), BF16).astype(fp8jax.E4M3.dtype)
    return x, w_t, jnp.full((g,), rows // g, jnp.int32), 2 * rows * k * n


def tile_rows(shape: Shape) -> tuple[list[dict], gg.Tiles]:
    """The grouped GEMM under each tiling; the rows and the fastest tiling."""
    x8, w8_t, sizes, flops = _gemm_operands(shape)
    one, scales = jnp.float32(1.0), jnp.ones((shape.experts,), F32)
    print(f"\ntilings, {shape}", flush=True)
    out, best = [], (float("inf"), gg.current_tiles())
    for tiles in TILINGS:
        with gg.use_tiles(tiles):
            row = _row(f"fp8jax_grouped {tiles}",
                       lambda a, b, s: rd._grouped(a, b, s, one, scales, BF16),
                       (x8, w8_t, sizes), flops)  # fmt: skip
        out.append(row)
        if row.get("median_ms", float("inf")) < best[0]:
            best = (row["median_ms"], tiles)
    return out, best[1]


def gemm_rows(shape: Shape) -> list[dict]:
    rows, k, n, g = shape.tokens * shape.top_k, shape.hidden, 2 * shape.ffn, shape.experts
    print(f"\ngrouped GEMM: rows {rows}, k {k}, n {n} (gate+up), {g} experts", flush=True)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, k), BF16)
    w = (jax.random.normal(keys[1], (g, k, n), F32) * k**-0.5).astype(BF16)
    sizes = jnp.full((g,), rows // g, jnp.int32)
    flops = 2 * rows * k * n
    e4 = fp8jax.E4M3.dtype
    x8, w8_t = x.astype(e4), jnp.swapaxes(w, 1, 2).astype(e4)
    one = jnp.float32(1.0)
    scales = jnp.ones((g,), F32)
    out = []
    out.append(_row("fp8jax_grouped",
                    lambda a, b, s: rd._grouped(a, b, s, one, scales, BF16),
                    (x8, w8_t, sizes), flops))  # fmt: skip
    w8_dense_t = w8_t[0]  # [n, k]
    out.append(_row("fp8_dense",
                    lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=BF16),
                    (x8, w8_dense_t), flops))  # fmt: skip
    out.append(_row("bf16_dense",
                    lambda a, b: a @ b, (x, w[0]), flops))  # fmt: skip
    out.append(_row("bf16_ragged_dot", lambda a, b, s: lax.ragged_dot(a, b, s),
                    (x, w, sizes), flops))  # fmt: skip
    out.append(_row("bf16_capacity",
                    lambda a, b: jnp.einsum("gck,gkn->gcn", a.reshape(g, -1, k), b),
                    (x, w), flops))  # fmt: skip
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        mgpu = functools.partial(ragged_dot_mgpu.ragged_dot, block_m=128, block_n=128,
                                 block_k=64, max_concurrent_steps=4, grid_block_n=1)  # fmt: skip
        out.append(_row("bf16_mgpu", lambda a, b, s: mgpu(a, b, group_sizes=s),
                        (x, w, sizes), flops))  # fmt: skip
    except ImportError as e:
        out.append({"name": "bf16_mgpu", "error": f"not importable: {e}"})
    gy = jax.random.normal(keys[2], (rows, n), BF16)

    def fwd_bwd(f):
        def step(a, b, s, gy):
            _, vjp = jax.vjp(lambda a, b: f(a, b, s), a, b)
            return vjp(gy)

        return step

    out.append(_row("fp8jax_op_fwd_bwd", fwd_bwd(fp8jax.ragged_dot), (x, w, sizes, gy),
                    3 * flops, backward=True))  # fmt: skip
    out.append(_row("bf16_ragged_dot_fwd_bwd", fwd_bwd(lax.ragged_dot), (x, w, sizes, gy),
                    3 * flops, backward=True))  # fmt: skip
    return out


WGRAD_TILINGS = (  # (wgrad_k, wgrad_n, wgrad_warps)
    (128, 128, 8),
    (128, 256, 8),
    (256, 128, 8),
    (64, 256, 4),
)


def gate_up_operands(shape: Shape, title: str):
    """The gate+up grouped GEMM's random BF16 operands under balanced routing: ``(rows, k, n,
    groups, x, w, output gradient, group sizes)``; prints ``title`` with the sizes."""
    rows, k, n, g = shape.tokens * shape.top_k, shape.hidden, 2 * shape.ffn, shape.experts
    print(f"\n{title}: rows {rows}, k {k}, n {n}, {g} experts", flush=True)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, k), BF16)
    w = (jax.random.normal(keys[1], (g, k, n), F32) * k**-0.5).astype(BF16)
    gy = jax.random.normal(keys[2], (rows, n), BF16)
    return rows, k, n, g, x, w, gy, jnp.full((g,), rows // g, jnp.int32)


def backward_rows(shape: Shape) -> tuple[list[dict], gg.Tiles]:
    """Where ``fp8jax.ragged_dot``'s fwd+bwd goes: the forward, dgrad and wgrad grouped GEMMs
    alone on FP8 operands (layout, padding and, for wgrad, the transposes included), and the
    op's fwd+bwd, under each wgrad tiling of :data:`WGRAD_TILINGS` (the other kernels keep
    :func:`gg.current_tiles`'s). Also returns the tiling whose fwd+bwd was fastest."""
    rows, k, n, g, x, w, gy, sizes = gate_up_operands(shape, "backward")
    e4, e5 = fp8jax.E4M3.dtype, fp8jax.E5M2.dtype
    x8, w8, g8 = x.astype(e5), w.astype(e5), gy.astype(e5)
    one, scales = jnp.float32(1.0), jnp.ones((g,), F32)
    flops = 2 * rows * k * n
    out = [
        _row("fp8jax_forward_gemm",
             lambda a, b, s: rd._grouped(a, b, s, one, scales, BF16),
             (x.astype(e4), jnp.swapaxes(w, 1, 2).astype(e4), sizes), flops),
        _row("fp8jax_dgrad_gemm",
             lambda a, b, s: rd._grouped(a, b, s, one, scales, BF16), (g8, w8, sizes), flops),
    ]  # fmt: skip

    base, best = gg.current_tiles(), (float("inf"), gg.current_tiles())
    for tk, tn, warps in WGRAD_TILINGS:
        tiles = dataclasses.replace(base, wgrad_k=tk, wgrad_n=tn, wgrad_warps=warps)
        label = f"wgrad {tk}x{tn} w{warps}"

        # A new function for each tiling: JAX caches a function's trace, and the
        # tiling is read when the kernels are traced.
        def fwd_bwd(a, b, s, gy):
            _, vjp = jax.vjp(lambda a, b: fp8jax.ragged_dot(a, b, s), a, b)
            return vjp(gy)

        with gg.use_tiles(tiles):
            out.append(_row(f"fp8jax_wgrad_gemm {label}",
                            lambda a, b, s: rd._grouped_wgrad(a, b, s, one, g, BF16),
                            (x8, g8, sizes), flops))  # fmt: skip
            row = _row(f"fp8jax_op_fwd_bwd {label}", fwd_bwd, (x, w, sizes, gy), 3 * flops,
                       backward=True)  # fmt: skip
        out.append(row)
        if "median_ms" in row and row["median_ms"] < best[0]:
            best = (row["median_ms"], tiles)
    return out, best[1]


CAPACITY_FACTOR = 1.25  # the BF16 capacity baseline's expert buffers: 1.25x a balanced share


def capacity_moe(params, x, *, top_k: int, capacity_factor: float = CAPACITY_FACTOR):
    """A BF16 MoE block as a Flax user writes one without grouped GEMMs: capacity buffers.

    The same parameters and router as ``MoEBlock`` (softmax gating, SwiGLU);
    each expert takes at most ``capacity`` token slots, in token order, into
    an ``[experts, capacity, hidden]`` buffer (slots past it are dropped, as
    in capacity-factor MoE layers), and the experts are two batched einsums.
    """
    p = nn.unbox(params)["params"]  # MoEBlock's parameters carry their logical axes
    t, hidden = x.shape
    e = p["router"].shape[-1]
    gates, experts, _ = moe_ops.route(x.astype(F32) @ p["router"].astype(F32), top_k, "softmax")
    capacity = -(-int(t * top_k * capacity_factor) // e)
    flat = experts.reshape(-1)
    onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    keep = slot < capacity
    dest = jnp.where(keep, flat * capacity + slot, e * capacity)
    rows = jnp.repeat(x, top_k, axis=0)
    buf = jnp.zeros((e * capacity + 1, hidden), x.dtype).at[dest].set(rows)
    xe = buf[:-1].reshape(e, capacity, hidden)
    h = jnp.einsum("ech,ehgf->ecgf", xe, p["wi"].astype(x.dtype))
    a = (jax.nn.silu(h[:, :, 0].astype(F32)) * h[:, :, 1].astype(F32)).astype(x.dtype)
    ye = jnp.einsum("ecf,efh->ech", a, p["wo"].astype(x.dtype)).reshape(-1, hidden)
    ys = jnp.concatenate([ye, jnp.zeros((1, hidden), ye.dtype)])[dest]
    weights = jnp.where(keep.reshape(t, top_k), gates, 0.0)
    y = jnp.einsum("tkh,tk->th", ys.reshape(t, top_k, hidden).astype(F32), weights)
    return (y + _shared_experts(p, x)).astype(x.dtype)


def _shared_experts(p, x):
    """The BF16 blocks' shared experts (one SwiGLU MLP ``shared_wi``, ``shared_wo``), in f32; 0
    without them."""
    if "shared_wi" not in p:
        return 0.0
    hs = jnp.einsum("th,hgf->tgf", x, p["shared_wi"].astype(x.dtype))
    a_s = (jax.nn.silu(hs[:, 0].astype(F32)) * hs[:, 1].astype(F32)).astype(x.dtype)
    return (a_s @ p["shared_wo"].astype(x.dtype)).astype(F32)


def mgpu_ragged_dot():
    """``lax.ragged_dot``'s BF16 forward and backward on JAX's Mosaic GPU kernels: the library's
    :func:`fp8jax.kernels.bf16_grouped.ragged_dot`, which the BF16 MoE blocks call."""
    return bf16_grouped.ragged_dot


def grouped_moe(params, x, *, top_k: int, gemm):
    """The library's BF16 block (same router, permutations, SwiGLU, shared experts) with its
    expert GEMMs on ``gemm`` (``lax.ragged_dot``'s signature): on the GPU JAX's Mosaic GPU
    kernels (:func:`mgpu_ragged_dot`)."""
    p = nn.unbox(params)["params"]
    gates, experts, _ = moe_ops.route(x.astype(F32) @ p["router"].astype(F32), top_k, "softmax")
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = rd.inverse_permutation(order)
    sizes = jnp.zeros((p["router"].shape[-1],), jnp.int32).at[flat].add(1)
    e, hidden, _, ffn = p["wi"].shape
    xs = moe_ops.dispatch(x, order, inverse, top_k)
    h = gemm(xs, p["wi"].reshape(e, hidden, 2 * ffn).astype(x.dtype), sizes).reshape(-1, 2, ffn)
    a = (jax.nn.silu(h[:, 0].astype(F32)) * h[:, 1].astype(F32)).astype(x.dtype)
    ys = moe_ops.combine(gemm(a, p["wo"].astype(x.dtype), sizes), order, inverse)
    y = jnp.einsum("tkh,tk->th", ys.reshape(-1, top_k, hidden).astype(F32), gates)
    return (y + _shared_experts(p, x)).astype(x.dtype)


def _kernels_off(f):
    """``f`` traced with fp8jax's kernels off: the library's BF16 block on ``lax.ragged_dot``."""

    def off(*args):
        with fp8jax.kernels.use_pallas(False):
            return f(*args)

    return off


RECIPES = {"current": ("fp8jax", None), "block": ("fp8jax_block", fp8jax.BlockScaling())}


def _ratios(rows: list[dict], what: str) -> None:
    """Each FP8 row's speed against the fastest BF16 row: ``bf16 ms / fp8 ms``, synchronized
    medians, with the pipelined means' ratio beside it."""
    bf16 = [r for r in rows if r["name"].startswith("bf16") and "median_ms" in r]
    if not bf16:
        print(f"  no BF16 {what} ran: no ratios", flush=True)
        return
    fastest = min(bf16, key=lambda r: r["median_ms"])
    for r in rows:
        if r["name"].startswith("fp8") and "median_ms" in r:
            r["vs_fastest_bf16"] = fastest["median_ms"] / r["median_ms"]
            r["vs_fastest_bf16_pipelined"] = fastest["pipelined_ms"] / r["pipelined_ms"]
            print(f"  {r['name']}: {r['vs_fastest_bf16']:.3f}x "
                  f"({r['vs_fastest_bf16_pipelined']:.3f}x pipelined) the fastest BF16 {what} "
                  f"({fastest['name']}, {fastest['median_ms']:.3f} ms)", flush=True)  # fmt: skip


def block_rows(shape: Shape, recipes=("current",)) -> list[dict]:
    """fwd+bwd of the block: fp8jax's MoEBlock under each of ``recipes`` (:data:`RECIPES`), the
    same block in BF16 (``lax.ragged_dot`` experts, the kernels off) and :func:`capacity_moe`,
    all from the same BF16 parameters."""
    from fp8jax.flax.linen import moe as lmoe

    print(f"\nMoE block fwd+bwd: {shape}", flush=True)
    x = jax.random.normal(jax.random.key(0), (shape.tokens, shape.hidden), BF16)
    gy = jax.random.normal(jax.random.key(1), x.shape, BF16)
    experts = 2 * shape.tokens * shape.top_k * shape.hidden * shape.ffn * 3
    shared = 2 * shape.tokens * shape.hidden * shape.ffn * shape.shared * 3
    useful = 3 * (experts + shared)

    def make(fp8, recipe=None):
        block = lmoe.MoEBlock(num_experts=shape.experts, top_k=shape.top_k, ffn=shape.ffn,
                              shared_experts=shape.shared, fp8=fp8, dtype=BF16,
                              recipe=recipe)  # fmt: skip

        def apply(params, x):
            y, _ = block.apply(params, x, mutable=["intermediates"])
            return y

        return block, apply

    block, _ = make(True)
    # The parameters alone: the routing statistics init sows are not differentiated. Jitted:
    # eagerly, init's forward compiled each of its steps on its own.
    variables = {"params": jax.jit(block.init)(jax.random.key(2), x)["params"]}
    params = jax.tree.map(lambda p: p.astype(BF16) if p.ndim > 1 else p, variables)
    variants = (
        *((RECIPES[r][0], make(True, RECIPES[r][1])[1]) for r in recipes),
        ("bf16_capacity", functools.partial(capacity_moe, top_k=shape.top_k)),
        # mgpu_ragged_dot imports Mosaic GPU when traced, inside the row's error handling
        ("bf16_mgpu", lambda p, x: grouped_moe(p, x, top_k=shape.top_k, gemm=mgpu_ragged_dot())),
        ("bf16_ragged_dot", _kernels_off(make(False)[1])),
    )
    out = []
    for name, f in variants:

        def step(params, x, gy, f=f):
            _, vjp = jax.vjp(f, params, x)
            return vjp(gy)

        try:
            out.append(_row(name, step, (params, x, gy), useful,
                            iters=max(1, ITERS["n"] // 2), trace=True, backward=True))  # fmt: skip
        except Exception as e:  # a baseline that does not run here is reported, not fatal
            traceback.print_exc()
            out.append({"name": name, "error": f"{type(e).__name__}: {e}"[:500]})
    _ratios(out, "block")
    return out


def block_gemm_rows(shape: Shape) -> list[dict]:
    """BlockScaling's grouped GEMM (gate+up, balanced routing) against the dense block-scaled
    GEMM of the same rows and the BF16 dense GEMM, forward and forward+backward."""
    rows, k, n, _, x, w, gy, sizes = gate_up_operands(shape, "block-scaled grouped GEMM")
    block = fp8jax.BlockScaling()
    flops = 2 * rows * k * n
    variants = {
        "fp8jax_block_grouped": (lambda a, b, s: fp8jax.ragged_dot(a, b, s, recipe=block),
                                 (x, w, sizes)),
        "fp8jax_block_dense": (lambda a, b: fp8jax.dense(a, b, recipe=block), (x, w[0])),
        "bf16_dense": (lambda a, b: a @ b, (x, w[0])),
    }  # fmt: skip
    out = []
    for name, (f, args) in variants.items():
        out.append(_row(f"{name}_fwd", f, args, flops))

        def step(*args, f=f):
            _, vjp = jax.vjp(lambda a, b: f(a, b, *args[2:-1]), *args[:2])
            return vjp(args[-1])

        out.append(_row(f"{name}_fwd_bwd", step, (*args, gy), 3 * flops, backward=True))
    by_name = {r["name"]: r for r in out if "median_ms" in r}
    for part in ("fwd", "fwd_bwd"):
        grouped, dense = (by_name.get(f"fp8jax_block_{v}_{part}") for v in ("grouped", "dense"))
        if grouped and dense:
            print(f"  {part}: grouped {dense['median_ms'] / grouped['median_ms']:.3f}x the dense "
                  "block-scaled GEMM of the same rows", flush=True)  # fmt: skip
    for part in ("fwd", "fwd_bwd"):
        _ratios([r for r in out if r["name"].endswith(f"_{part}")], f"dense GEMM ({part})")
    return out


PARTS = ("tiles", "gemm", "backward", "block", "blockgemm")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--part", default="all", help=f"all, or a comma-separated list of {', '.join(PARTS)}"
    )
    parser.add_argument("--shape", default="mixtral,deepseek",
                        help=f"comma-separated, in order, of {tuple(SHAPES)}")  # fmt: skip
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--recipe", default="current", help=f"the block part's FP8 recipes, of {tuple(RECIPES)}"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per row")
    parser.add_argument(
        "--trace", default=None, help="profile block rows here; print the slowest kernels"
    )
    add_compile_cache_argument(parser)
    add_heat_argument(parser)
    args = parser.parse_args()
    recipes = tuple(args.recipe.split(","))
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipe must be a comma-separated list of {tuple(RECIPES)}, got {unknown}")
    ITERS["n"], TRACE["dir"] = args.iters, args.trace
    payload = {"environment": start(args), "fp8_compiler_options": fp8jax.compiler_options(),
               "results": {}}  # fmt: skip
    parts = set(PARTS) if args.part == "all" else set(args.part.split(","))
    for name in args.shape.split(","):
        shape = SHAPES[name]
        if "tiles" in parts:
            payload["results"][f"{name}/tiles"], best = tile_rows(shape)
            payload["results"][f"{name}/best_tiles"] = dataclasses.asdict(best)
            gg.set_tiles(best)  # for this shape's other parts
        if "gemm" in parts:
            payload["results"][f"{name}/gemm"] = gemm_rows(shape)
        if "backward" in parts:
            payload["results"][f"{name}/backward"], best = backward_rows(shape)
            payload["results"][f"{name}/best_backward_tiles"] = dataclasses.asdict(best)
            gg.set_tiles(best)  # for this shape's block
        if "block" in parts:
            payload["results"][f"{name}/block"] = block_rows(shape, recipes)
        if "blockgemm" in parts:
            payload["results"][f"{name}/blockgemm"] = block_gemm_rows(shape)
        if args.out:  # after each shape: a run cut short keeps what it measured
            dump(args.out, payload)


if __name__ == "__main__":
    main()
