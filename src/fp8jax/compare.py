"""``fp8jax compare``: loss curves of several ``fp8jax train`` runs in one PNG, and a table.

The first run is the reference: the table gives each run's final train and
validation loss, its throughput, and its relative gap to the first run
(``(loss - loss_first) / loss_first``; positive is worse). The plot has the
train loss (lines) and validation loss (markers) of every run against the
step, and each run's validation loss relative to the first run's at the steps
both evaluated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib

from fp8jax.training.run_dir import read_metrics


class CompareError(ValueError):
    """A run directory is missing or has no metrics."""


@dataclasses.dataclass(frozen=True)
class Run:
    """What ``compare`` reads from one run directory."""

    path: pathlib.Path
    label: str
    metrics: list[dict]
    summary: dict

    @property
    def train_curve(self) -> tuple[list[int], list[float]]:
        return [m["step"] for m in self.metrics], [m["loss"] for m in self.metrics]

    @property
    def val_curve(self) -> tuple[list[int], list[float]]:
        rows = [m for m in self.metrics if isinstance(m.get("val_loss"), int | float)]
        return [m["step"] for m in rows], [m["val_loss"] for m in rows]

    @property
    def final_train(self) -> float:
        return self.metrics[-1]["loss"]

    @property
    def final_val(self) -> float | None:
        values = self.val_curve[1]
        return values[-1] if values else None

    @property
    def tokens_per_s(self) -> float | None:
        if isinstance(self.summary.get("tokens_per_s"), int | float):
            return self.summary["tokens_per_s"]
        rates = [
            m["tokens_per_s"]
            for m in self.metrics
            if isinstance(m.get("tokens_per_s"), int | float)
        ]
        return sum(rates) / len(rates) if rates else None


def load_run(path: str | os.PathLike) -> Run:
    """Reads ``metrics.jsonl`` (required), ``config.json`` and ``summary.json`` of a run.

    Raises:
      CompareError: if the directory or its metrics are missing or empty.
    """
    path = pathlib.Path(path)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise CompareError(
            f"{path} is not an fp8jax train run: it has no metrics.jsonl. Pass the --out "
            "directories of fp8jax train."
        )
    metrics = [
        m
        for m in read_metrics(metrics_path)
        if isinstance(m, dict)
        and isinstance(m.get("step"), int)
        and isinstance(m.get("loss"), int | float)
    ]
    if not metrics:
        raise CompareError(f"{metrics_path} has no metrics lines yet; nothing to compare.")
    config, summary = {}, {}
    for name, target in (("config.json", config), ("summary.json", summary)):
        with contextlib.suppress(OSError, ValueError):  # optional: metrics are enough
            value = json.loads((path / name).read_text())
            target.update(value if isinstance(value, dict) else {})
    precision = config.get("precision", summary.get("precision"))
    recipe = config.get("recipe", summary.get("recipe"))
    detail = precision if not recipe else f"{precision} {recipe}"
    label = f"{path.name} ({detail})" if detail else path.name
    return Run(path=path, label=label, metrics=metrics, summary=summary)


def _gap(value: float | None, reference: float | None) -> str:
    if value is None or reference is None:
        return "-"
    return f"{(value - reference) / reference:+.2%}"


def table(runs: list[Run]) -> str:
    """The comparison table; gaps are relative to the first run."""
    headers = ("run", "steps", "train loss", "val loss", "tokens/s", "train gap", "val gap")
    first = runs[0]
    rows = [
        (
            r.label,
            str(r.metrics[-1]["step"]),
            f"{r.final_train:.4f}",
            "-" if r.final_val is None else f"{r.final_val:.4f}",
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            _gap(r.final_train, first.final_train),
            _gap(r.final_val, first.final_val),
        )
        for r in runs
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells):
        first_cell = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first_cell, *rest])

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def plot(runs: list[Run], out: str | os.PathLike, *, title: str | None = None) -> pathlib.Path:
    """Writes the loss-curve PNG to ``out`` and returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2))
    ref_steps, ref_vals = runs[0].val_curve
    reference = dict(zip(ref_steps, ref_vals, strict=True))
    for i, run in enumerate(runs):
        color = f"C{i}"
        curves.plot(*run.train_curve, color=color, lw=1.2, label=f"{run.label} train")
        steps, vals = run.val_curve
        if steps:
            curves.plot(steps, vals, "o--", color=color, ms=3, lw=0.8, label=f"{run.label} val")
        common = [(s, v) for s, v in zip(steps, vals, strict=True) if s in reference]
        if common:
            gaps.plot(
                [s for s, _ in common],
                [100 * (v - reference[s]) / reference[s] for s, v in common],
                "o-",
                color=color,
                ms=3,
                label=run.label,
            )
    curves.set(xlabel="step", ylabel="loss (nats/byte)", title=title or "loss")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    gaps.axhline(0, color="k", lw=0.5)
    gaps.set(
        xlabel="step",
        ylabel="%",
        title=f"validation loss vs {runs[0].path.name} (positive is worse)",
    )
    gaps.grid(alpha=0.3)
    if gaps.get_legend_handles_labels()[0]:  # runs without validation losses draw no gap
        gaps.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def compare(paths: list[str], out: str | os.PathLike | None = None, title: str | None = None):
    """Loads the runs, writes the plot, returns ``(table_text, png_path)``.

    ``out`` defaults to ``compare.png`` beside the first run.

    Raises:
      CompareError: if no run is given, or a run has no metrics.
    """
    if not paths:
        raise CompareError("fp8jax compare needs at least one run directory.")
    runs = [load_run(p) for p in paths]
    out = pathlib.Path(out or runs[0].path.parent / "compare.png")
    check_out(out)
    try:
        return table(runs), plot(runs, out, title=title)
    except OSError as e:
        raise CompareError(f"--out {str(out)!r} cannot be written: {e.strerror or e}.") from None


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_out(out: pathlib.Path) -> None:
    """Checks, before anything is written, that the plot can be written to ``out``.

    Raises:
      CompareError: for a suffix matplotlib is not asked to write, a directory,
        or a path below a file or without write permission.
    """
    if out.suffix.lower() not in PLOT_SUFFIXES:
        raise CompareError(
            f"--out {str(out)!r} must end in one of {PLOT_SUFFIXES} (the plot's format), got "
            f"{out.suffix or 'no suffix'!r}."
        )
    if out.is_dir():
        raise CompareError(f"--out {str(out)!r} is a directory; pass a file path.")
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CompareError(f"--out {str(out)!r} cannot be created: {str(existing)!r} is a file.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CompareError(f"--out {str(out)!r} cannot be written: no permission in {existing}.")
