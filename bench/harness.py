"""Shared GPU benchmark harness: timing, FP8 GEMM counts, memory, environment.

Timing is the median of ``iters`` individually synchronized calls after
``warmup`` calls and a heating spell (``--heat``), so one slow outlier (a
page fault) does not move the result. The heat runs the program back to
back until the GPU sits at its power cap, as in a training job (see
clocks.py); each row records the SM clock while it was timed. Speed is only
ever reported as a ratio against a baseline measured in the same process.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from breakdown import CLASSES, breakdown
from clocks import ClockSampler
from flax.linen import fp8_ops

import fp8jax
from fp8jax import compile_cache
from fp8jax.verify import fp8_relayouts, gemm_report

# The delayed-scaling recipe of every fp8jax "delayed" row.
DELAYED = fp8jax.DelayedScaling(amax_history_len=1024)


def standard_variants(flax_variant, fp8jax_variant) -> dict:
    """The five side-by-side rows of every benchmark (issue 8), by name.

    ``flax_variant(x, ..., dot_general_cls=)`` builds the plain Flax model
    (``None``: BF16); ``fp8jax_variant(x, ..., recipe=)`` the fp8jax one.
    """
    return {
        "bf16": functools.partial(flax_variant, dot_general_cls=None),
        "flax_fp8_direct": functools.partial(
            flax_variant, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp
        ),
        "flax_fp8_qdq": functools.partial(flax_variant, dot_general_cls=fp8_ops.Fp8DotGeneralOp),
        "fp8jax_current": functools.partial(fp8jax_variant, recipe=fp8jax.CurrentScaling()),
        "fp8jax_delayed": functools.partial(fp8jax_variant, recipe=DELAYED),
    }


# How a benchmark reduces its model's output to the loss it differentiates (--loss).
# "random", the default, is mean(y * r) with r a fixed random tensor of y's shape,
# passed in as an argument: the output gradient is then random, as a real loss's
# is. "mean" makes the output gradient a constant: XLA may then start the backward
# before the forward has finished and fuse work a real loss rules out, and the GPU
# draws less power (docs/design.md#the-benchmarks-loss-and-fp8-state). "square" (half the mean
# square) makes the gradient the output itself.
LOSSES = {
    "random": lambda y, r: jnp.mean(y.astype(jnp.float32) * r.astype(jnp.float32)),
    "mean": lambda y, r: y.astype(jnp.float32).mean(),
    "square": lambda y, r: 0.5 * jnp.mean(jnp.square(y.astype(jnp.float32))),
}
_loss = {"name": "random"}


def set_loss(name: str) -> None:
    """Chooses the loss of every benchmark built afterwards (a key of :data:`LOSSES`)."""
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {name!r}.")
    _loss["name"] = name


def add_loss_argument(parser) -> None:
    """``--loss``: a key of :data:`LOSSES`; pass the parsed value to :func:`set_loss`."""
    parser.add_argument(
        "--loss", default="random", choices=sorted(LOSSES),
        help="mean(y * r) with r fixed and random (default), the mean of the output "
        "(constant gradient) or half its mean square",
    )  # fmt: skip


def output_cotangent(shape) -> jax.Array:
    """The fixed random ``r`` of the "random" loss, for an output of ``shape``."""
    return jax.random.normal(jax.random.key(7), shape, jnp.float32).astype(jnp.bfloat16)


def output_loss(y, r):
    """The benchmark loss of the model output ``y`` and :func:`output_cotangent` ``r``."""
    return LOSSES[_loss["name"]](y, r)


# Seconds each row runs back to back before it is timed (--heat).
_heat = {"seconds": 3.0}


def add_heat_argument(parser) -> None:
    """``--heat SECONDS``: run each row back to back this long before timing it.

    Three seconds bring an H200 to its power-capped clock under any of the
    benchmarks' programs (docs/design.md#timing-at-the-power-cap); 0 times
    each row from wherever the previous one left the GPU.
    """
    parser.add_argument(
        "--heat", type=float, default=_heat["seconds"], metavar="SECONDS",
        help="run each row back to back this long before timing it (default: %(default)s)",
    )  # fmt: skip


def add_compile_cache_argument(parser) -> None:
    """``--compile-cache DIR``: JAX's persistent compilation cache, off by default here.

    The first FP8 compile on an H200 autotunes GEMMs for minutes
    (fp8jax.compile_cache); with a directory that a previous run filled, the
    same shapes compile in about a second. Off by default, so that a benchmark
    run depends on no state from an earlier one.
    """
    parser.add_argument(
        "--compile-cache", default=None, metavar="DIR",
        help="JAX's persistent compilation cache directory (default: none)",
    )  # fmt: skip


def use_compile_cache(args) -> None:
    """Turns the cache of :func:`add_compile_cache_argument` on, before anything compiles."""
    if args.compile_cache:
        print(f"compile cache: {compile_cache.enable(args.compile_cache)}", flush=True)


def start(args) -> dict:
    """Applies the options every script shares before anything compiles; the run's environment.

    ``--compile-cache`` (:func:`add_compile_cache_argument`) and, where the
    script has it, ``--loss`` (:func:`add_loss_argument`), which also goes into
    the environment record.
    """
    use_compile_cache(args)
    if getattr(args, "heat", None) is not None:
        if args.heat < 0:
            raise ValueError(f"--heat must be >= 0 seconds, got {args.heat}.")
        _heat["seconds"] = args.heat
    env = environment()
    env["heat_s"] = _heat["seconds"]
    if hasattr(args, "loss"):
        set_loss(args.loss)
        env["loss"] = args.loss
    return env


def bf16_matrices(variables):
    """Flax variables with every f32 matrix of ``params`` in bf16, as the activations.

    Other collections, fp8jax's delayed-scaling state among them, stay as they are.
    """
    params = jax.tree.map(
        lambda p: p.astype(jnp.bfloat16) if p.dtype == jnp.float32 and p.ndim > 1 else p,
        variables["params"],
    )
    return {**variables, "params": params}


def _call(fn, args: list, carry: bool):
    """``fn(*args)``, synchronized; with ``carry``, its first output becomes ``args[0]``."""
    out = jax.block_until_ready(fn(*args))
    if carry:
        args[0] = out[0]
    return out


def time_ms(fn, *args, warmup: int = 5, iters: int = 30, carry: bool = False) -> dict:
    """Median, 10th and 90th percentile wall time of ``fn(*args)`` in ms.

    ``carry``: feed each call's first output back as the next call's first
    argument, as a train loop does with its state; needed when ``fn`` donates it.
    """
    return _timed(fn, list(args), warmup, iters, carry)


def _timed(fn, args: list, warmup: int, iters: int, carry: bool) -> dict:
    """:func:`time_ms` on an argument list that, with ``carry``, ends holding the last state."""
    for _ in range(warmup):
        _call(fn, args, carry)
    _run_for(fn, args, _heat["seconds"], carry)
    samples = []
    with ClockSampler() as clocks:
        for _ in range(iters):
            start = time.perf_counter()
            _call(fn, args, carry)
            samples.append((time.perf_counter() - start) * 1e3)
        pipelined = _pipelined(fn, args, iters, carry)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p10_ms": samples[len(samples) // 10],
        "p90_ms": samples[(9 * len(samples)) // 10],
        "iters": iters,
        "pipelined_ms": pipelined,
        "clocks": clocks.summary(),
    }


def _run_for(fn, args: list, seconds: float, carry: bool) -> None:
    """Calls ``fn`` back to back, ten at a time, until ``seconds`` have passed."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(_pipelined_calls(fn, args, 10, carry))


def _pipelined(fn, args: list, iters: int, carry: bool) -> float:
    """Mean ms per call of ``iters`` calls dispatched back to back, synchronized once.

    What a train loop sees: the host queues the next step while the GPU runs
    this one, so per-call dispatch and synchronization, which the median of
    synchronized calls includes, are hidden
    (docs/design.md#timing-at-the-power-cap).
    """
    start = time.perf_counter()
    jax.block_until_ready(_pipelined_calls(fn, args, iters, carry))
    return (time.perf_counter() - start) * 1e3 / iters


def _pipelined_calls(fn, args: list, calls: int, carry: bool):
    """``calls`` calls of ``fn`` dispatched back to back; the last one's output."""
    out = None
    for _ in range(calls):
        out = fn(*args)
        if carry:
            args[0] = out[0]
    return out


def compiled_facts(compiled, hlo: str) -> dict:
    """GEMM backends, untiled FP8 transposes and peak memory of a compile whose text is ``hlo``."""
    report = gemm_report(hlo)
    untiled = [r for r in fp8_relayouts(hlo) if r.untiled_transpose]
    backends: dict[str, int] = {}
    for g in report.gemms:
        backends[g.backend] = backends.get(g.backend, 0) + 1
    memory = compiled.memory_analysis()
    peak = None
    if memory is not None:
        peak = (
            memory.temp_size_in_bytes
            + memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
        )
    return {
        "gemms": len(report.gemms),
        "fp8_gemms": len(report.fp8_gemms),
        "backends": backends,
        "attention": len(report.attention),
        # The slow untiled FP8 transposes, [dtype, shape] each
        # (docs/design.md#the-forward-kernel-transposed-in-the-program).
        "untiled_fp8_transposes": [[r.dtype, list(r.shape)] for r in untiled],
        "peak_memory_gib": None if peak is None else peak / 2**30,
        "report": report,
    }


def measure(
    name: str,
    jitted,
    *args,
    iters: int = 30,
    trace_dir: str | None = None,
    devices: int = 1,
    carry: bool = False,
    state_arg: int | None = None,
    flax_fp8_state: bool = False,
    gradients=None,
) -> dict:
    """One benchmark row: compiled once, then timed, counted and (optionally) traced.

    ``jitted`` is a ``jax.jit`` function, or an executable compiled already.

    The executable that is timed is the one whose HLO is reported, so the FP8
    GEMM count and the timing always describe the same program. With
    ``trace_dir``, three more calls are profiled and broken down by kernel
    class (bench/breakdown.py), per step and per GPU over ``devices`` GPUs,
    and the optimized HLO is written next to the trace (``compiled.hlo.txt``):
    a live compile can differ from a deviceless one (autotuned GEMMs, layouts).
    ``carry`` is :func:`time_ms`'s, for steps that donate their state; such a
    step is run :data:`CALIBRATION_STEPS` times on its state before its
    gradients are checked, which calibrates the FP8 state it carries.

    ``flax_fp8_state``: the first argument is a Flax variables dict whose FP8
    collection the step's gradient updates (``value_and_grad(loss,
    argnums=(0, ...))``); it is calibrated likewise (:func:`calibrate_flax_state`).

    ``state_arg``: the index of an argument that holds fp8jax's delayed-scaling
    state (or None), for a step ``value_and_grad(loss, argnums=(..., state_arg,
    ...))`` whose gradient returns the updated state. The state is calibrated
    (:func:`calibrate_state`) before the step is timed, as in a training run:
    a fresh state's scale of 1 would quantize the benchmark loss's tiny output
    gradients to zeros, and GEMMs on zeros run cooler and faster
    (docs/design.md#the-benchmarks-loss-and-fp8-state).

    ``gradients(step, args)``: the gradients of one training step on ``args``
    (:func:`grad_part` for a step that returns them), taken after
    calibration and before timing; the row is refused if any of them is all
    zeros (:func:`check_gradients`). Rows without a backward leave it None.
    """
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile() if hasattr(jitted, "lower") else jitted
    compile_s = time.perf_counter() - start
    hlo = compiled.as_text()
    facts = compiled_facts(compiled, hlo)
    args = list(args)
    if state_arg is not None and args[state_arg] is not None:
        args[state_arg] = calibrate_state(compiled, args, state_arg)
    if flax_fp8_state:
        args[0] = calibrate_flax_state(compiled, args)
    if carry:  # a train step whose state (FP8 state included) it feeds forward
        for _ in range(CALIBRATION_STEPS):
            _call(compiled, args, carry)
    checked = None if gradients is None else check_gradients(name, gradients(compiled, args))
    row = {"name": name, "compile_s": compile_s, **_timed(compiled, args, 5, iters, carry), **facts}
    row["gradient_leaves_checked"] = checked
    if trace_dir:
        where = os.path.join(trace_dir, name)
        steps = 3
        with jax.profiler.trace(where):
            for _ in range(steps):
                _call(compiled, args, carry)
        with open(os.path.join(where, "compiled.hlo.txt"), "w") as f:
            f.write(hlo)
        row["breakdown"] = breakdown(where, hlo, steps, devices)
    print(
        f"  {name}: {row['median_ms']:.3f} ms ({row['pipelined_ms']:.3f} pipelined), "
        f"first compile {compile_s:.1f} s, "
        f"{facts['fp8_gemms']}/{facts['gemms']} FP8 GEMMs "
        f"{facts['backends']}, peak {facts['peak_memory_gib'] or 0:.2f} GiB, "
        f"{len(facts['untiled_fp8_transposes'])} untiled FP8 transposes"
        f"{'' if checked is None else f', {checked} gradients not zeros'}{_clock_note(row)}",
        flush=True,
    )
    if "breakdown" in row:
        b = row["breakdown"]
        print(f"    kernels {b['kernel_ms']:.3f} ms/step: {breakdown_text(b)}", flush=True)
        idle = ", ".join(f"{k} {v:.3f}" for k, v in b["idle_ms"].items())
        print(f"    GPU idle between kernels, ms/step by gap length: {idle}", flush=True)
    return row


def grad_part(index: int):
    """``measure``'s ``gradients`` for a step whose output ``index`` holds its gradients.

    The step is called once more on ``args`` (a train step that donates its
    state is not called this way: it checks its gradients another way).
    """

    def gradients(step, args):
        return step(*args)[index]

    return gradients


def check_gradients(name: str, tree) -> int:
    """Refuses gradients of which any floating leaf is all zeros; the number of leaves checked.

    A gradient that quantized to zeros (an FP8 scale never calibrated, an
    output gradient that vanished) makes GEMMs on zeros, which run cooler and
    faster than a training step's (docs/design.md#the-benchmarks-loss-and-fp8-state);
    such a row is not timed. Every leaf counts, not the tree's total, as one
    layer's weight gradient can be lost while the others are not.
    """
    leaves = [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    if not leaves:
        raise ValueError(f"{name}: no floating gradients to check.")
    nonzero = jax.jit(lambda xs: [jnp.any(x != 0) for x in xs])([leaf for _, leaf in leaves])
    zero = [path for (path, _), any_ in zip(leaves, nonzero, strict=True) if not bool(any_)]
    if zero:
        raise ValueError(
            f"{name}: {len(zero)} of {len(leaves)} gradients are all zeros, e.g. {zero[:5]}; "
            "the row would time GEMMs on zeros."
        )
    return len(leaves)


# Steps a delayed-scaling state is run for before it is timed: each swaps in the
# amaxes the step recorded, so after one the scales come from the data.
CALIBRATION_STEPS = 3


def calibrate_state(step, args: list, state_arg: int, steps: int = CALIBRATION_STEPS):
    """The delayed-scaling state ``args[state_arg]`` after ``steps`` calls of ``step``.

    ``step(*args)`` returns ``(loss, grads)`` with ``grads[state_arg]`` the
    state's gradient, which carries the updated state (fp8jax.take_new_state).
    """
    state = args[state_arg]
    for _ in range(steps):
        _, grads = step(*args[:state_arg], state, *args[state_arg + 1 :])
        state = jax.block_until_ready(fp8jax.take_new_state(state, grads[state_arg]))
    return state


def calibrate_flax_state(step, args: list, steps: int = CALIBRATION_STEPS) -> dict:
    """Flax's variables ``args[0]`` with their FP8 collection after ``steps`` training steps.

    Flax's FP8 ops keep their amax histories and scales in the
    ``_overwrite_with_gradient`` collection, whose "gradient" is its new
    value; a Flax training loop swaps it in every step. Fresh, its scales
    are 1, and a benchmark gradient quantizes to zeros, as fp8jax's own
    delayed state does (:func:`calibrate_state`).
    """
    variables = args[0]
    for _ in range(steps):
        _, grads = step(variables, *args[1:])
        new = grads[0][fp8_ops.OVERWRITE_WITH_GRADIENT]
        variables = jax.block_until_ready({**variables, fp8_ops.OVERWRITE_WITH_GRADIENT: new})
    return variables


def _clock_note(row: dict) -> str:
    c = row.get("clocks")
    if not c:
        return ""
    return (
        f", SM {c['sm_mhz_mean']:.0f} MHz (min {c['sm_mhz_min']:.0f}), "
        f"{c['power_w_mean']:.0f} W, clock held down {c['clock_held_share']:.0%}"
    )


def environment() -> dict:
    """Versions, device and date, for BENCHMARKS.md."""
    import flax
    import jaxlib

    return {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "device": str(jax.devices()[0].device_kind),
        "device_count": jax.device_count(),
    }


def breakdown_text(b: dict) -> str:
    """The classes of a breakdown in their published order: ms and share of kernel time."""
    order = [k for k in CLASSES if k in b["ms"]] + sorted(set(b["ms"]) - set(CLASSES))
    return ", ".join(f"{k} {b['ms'][k]:.2f} ms ({b['share'][k]:.1%})" for k in order)


def quantize_share(row: dict) -> str:
    """The share of kernel time in quantize fusions, where the row was profiled."""
    if "breakdown" not in row:
        return "-"
    return f"{row['breakdown']['share'].get('quantize', 0.0):.1%}"


def print_table(title: str, rows: list[dict], baseline: str) -> None:
    """Ratios against ``baseline`` first, synchronized and pipelined; milliseconds as context."""
    base_row = next(r for r in rows if r["name"] == baseline)
    base, base_pipelined = base_row["median_ms"], base_row.get("pipelined_ms")
    print(f"\n{title}")
    print(
        f"{'variant':<28} {'vs ' + baseline:>10} {'median ms':>10} {'pipelined':>10} "
        f"{'FP8 GEMMs':>10} {'GEMMs':>6} {'peak GiB':>9} {'compile s':>10} {'quantize':>9}  "
        "backends"
    )
    for r in rows:
        pipelined = f"{base_pipelined / r['pipelined_ms']:.3f}x" if "pipelined_ms" in r else "-"
        print(
            f"{r['name']:<28} {base / r['median_ms']:>9.3f}x {r['median_ms']:>10.3f} "
            f"{pipelined:>10} "
            f"{r['fp8_gemms']:>10} {r['gemms']:>6} {r['peak_memory_gib'] or 0:>9.2f} "
            f"{r.get('compile_s', float('nan')):>10.1f} {quantize_share(r):>9}  {r['backends']}"
        )


def dump(path: str, payload: dict) -> None:
    """Writes ``payload`` (minus report objects) as JSON."""

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k != "report"}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    with open(path, "w") as f:
        json.dump(clean(payload), f, indent=2)
