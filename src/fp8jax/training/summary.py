"""The words a run prints: its header, metrics lines, stop messages and final summary."""

from __future__ import annotations

import jax

from fp8jax.data import Corpus
from fp8jax.training import mfu
from fp8jax.training.config import RunConfig


def header(config: RunConfig, corpus: Corpus, mesh, counts: dict, attention: str,
           layers: str) -> str:  # fmt: skip
    """What is about to run, and how many of its train step's GEMMs are FP8."""
    recipe = f" ({config.recipe} scaling)" if config.recipe else ""
    where = "1 device" if mesh is None else ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        f"fp8jax train: {config.name} GPT, {config.model.num_params() / 1e6:.2f}M params, "
        f"{config.precision}{recipe}, batch {config.batch_size} x {config.seq_len} bytes"
        f"{_micro(config)}, remat {config.remat}, "
        f"{jax.default_backend()} {where}, {attention} attention, layers {layers}\n"
        f"  data: {corpus.describe()}\n"
        f"  train step: {counts['fp8']} of {counts['total']} dot_generals are FP8 "
        f"(jaxpr; the scanned layer body counts once{_recomputed(config)})"
    )


def _recomputed(config: RunConfig) -> str:
    if config.remat == "none":
        return ""
    what = "attention core" if config.remat == "dots" else "attention core, QKV, out and fc1"
    return f"; --remat {config.remat} recomputes the {what} GEMMs in the backward, counted again"


def _micro(config: RunConfig) -> str:
    n = config.accumulation_steps
    return "" if n == 1 else f" in {n} micro-batches of {config.batch_size // n}"


def deviceless_text(d: dict) -> str:
    if "skipped" in d:
        return f"{d['target']} compile: skipped ({d['skipped']})"
    return (
        f"{d['target']} compile: {d['fp8']} of {d['total']} GEMMs FP8, "
        f"{d['attention']} attention calls ({d['seconds']} s, "
        f"{'on this GPU' if d['target'] == 'live' else 'deviceless'})"
    )


def metrics_line(record: dict) -> str:
    parts = [f"step {record['step']}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        parts.append(f"{record['step_time_s'] * 1e3:.0f} ms/step")
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    return ", ".join(parts)


def diverged_message(what: str, step: int, last_saved: int | None, out, first_ckpt: int) -> str:
    """Why training stopped (``what``: "the loss is nan", say) and which checkpoint is kept."""
    kept = (
        f"The last good checkpoint, step {last_saved}, is kept in {out}/checkpoints; continue "
        "from it with --resume (a lower --lr may help)."
        if last_saved
        else f"No checkpoint was written yet (the first is due at step {first_ckpt})."
    )
    return f"training diverged: {what} at step {step}, so training stopped. {kept}"


TOKENS_PER_S_EXCLUDES = (
    "the session's first step (mostly compile), validation, checkpoints and metrics logging"
)


def build(config: RunConfig, *, status: str, step: int, train_loss, val_loss, tokens_per_s,
          timed_steps: tuple[int, int] | None, compile_s, train_s, counts: dict,
          checkpoint: int | None, mesh, attention: str, layers: str, flops_per_token: float,
          peak_flops: float | None, device_kind: str, devices: int) -> dict:  # fmt: skip
    """The ``summary.json`` record.

    ``mfu`` is the model's training FLOPs per second (``flops_per_token``
    times tokens/s) over ``peak_flops``, the devices' dense BF16 peak; None
    where that peak is unknown (a CPU) or nothing was timed.
    """
    value = mfu.mfu(tokens_per_s, flops_per_token, peak_flops)
    return {
        "status": status,
        "config": config.name,
        "precision": config.precision,
        "recipe": config.recipe,
        "step": step,
        "steps": config.steps,
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "tokens_per_s": tokens_per_s,
        # What tokens_per_s averages: these steps' device time, end to end.
        "tokens_per_s_steps": None if timed_steps is None else list(timed_steps),
        "tokens_per_s_excludes": TOKENS_PER_S_EXCLUDES,
        "model_flops_per_token": flops_per_token,
        "mfu": value,
        "mfu_peak_flops": peak_flops,
        "mfu_text": mfu.describe(peak_flops, device_kind, devices, value),
        "compile_s": compile_s,
        "train_s": train_s,
        "params": config.model.num_params(),
        "backend": jax.default_backend(),
        "mesh": None if mesh is None else dict(mesh.shape),
        "attention": attention,
        "layers": layers,
        "remat": config.remat,
        "accumulation_steps": config.accumulation_steps,
        "fp8_gemms": counts,
        "checkpoint_step": checkpoint,
    }


def _timed(summary: dict) -> str:
    steps = summary.get("tokens_per_s_steps")
    return "" if not steps else f" (steps {steps[0]}-{steps[1]})"


def _mfu_text(summary: dict) -> str:
    if summary["mfu"] is None and summary["mfu_peak_flops"] is not None:
        return f"{summary['mfu_text']}: n/a (no step was timed)"
    return summary["mfu_text"]


def text(summary: dict, out) -> str:
    """The summary a finished or interrupted run prints."""

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    jaxpr = summary["fp8_gemms"]["jaxpr"]
    lines = [
        f"{summary['status']} at step {summary['step']}/{summary['steps']}: "
        f"train loss {fmt(summary['final_train_loss'], '.4f')}, "
        f"validation loss {fmt(summary['final_val_loss'], '.4f')}",
        f"  {fmt(summary['tokens_per_s'], ',.0f')} tokens/s{_timed(summary)}, "
        f"compile {fmt(summary['compile_s'], '.1f')} s, train {fmt(summary['train_s'], '.1f')} s",
        f"  {_mfu_text(summary)}",
        f"  FP8 GEMMs in the train step: {jaxpr['fp8']} of {jaxpr['total']} dot_generals (jaxpr)",
    ]
    if "deviceless" in summary["fp8_gemms"]:
        lines.append(f"  {deviceless_text(summary['fp8_gemms']['deviceless'])}")
    if summary["checkpoint_step"] is not None:
        lines.append(f"  checkpoint: step {summary['checkpoint_step']} in {out}/checkpoints")
    if summary["status"] == "interrupted":
        lines.append("  continue with the same command plus --resume")
    lines.append(f"  metrics: {out}/metrics.jsonl; compare runs with: fp8jax compare {out} ...")
    return "\n".join(lines)
