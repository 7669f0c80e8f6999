"""``fp8jax compare``: loss curves of ``fp8jax train`` runs in one PNG, a table, and its JSON.

Runs are grouped by their configuration (their ``config.json`` less the seed),
so several seeds of one configuration count as one group: a convergence claim
rests on seed means and spreads, not on one seed each. The first run's group
is the reference. For each group the table gives the number of runs and their
seeds, the mean, min and max final validation loss over the seeds, the mean
final train loss and tokens/s, the relative gap of its mean to the reference
mean (``(mean - reference) / reference``; positive is worse), and two verdicts:
whether its mean lies within the reference's seed range, and within
``tolerance`` of the reference mean. The same numbers go to a JSON file beside
the plot, to be kept as evidence.

When every group has one run (or ``per_run``), the table is the per-run table
of final losses and gaps to the first run.

The plot has each group's mean train loss (lines) and mean validation loss
(markers) against the step, shaded from the min to the max over its seeds, and
each group's mean validation loss relative to the reference mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import statistics

from fp8jax.training.run_dir import read_metrics

DEFAULT_TOLERANCE = 0.005
MAX_TOLERANCE = 0.1

# config.json keys that do not define a configuration: the seed is what varies
# inside a group, data.source is where the corpus was read (data.fingerprint
# says what it was), and checkpoint_every changes no loss.
NOT_CONFIGURATION = ("seed", "data.source", "checkpoint_every")

# Keys a group label shows as bare values ("fp8 current"); others show as key=value.
BARE_KEYS = ("name", "precision", "recipe")


class CompareError(ValueError):
    """A run directory is missing or has no metrics, or runs cannot be grouped."""


@dataclasses.dataclass(frozen=True)
class Run:
    """What ``compare`` reads from one run directory.

    ``config`` is None when the run has no usable ``config.json``: such a run
    cannot be matched to others, so it forms a group of its own.
    """

    path: pathlib.Path
    label: str
    metrics: list[dict]
    summary: dict
    config: dict | None = None

    @property
    def train_curve(self) -> tuple[list[int], list[float]]:
        return [m["step"] for m in self.metrics], [m["loss"] for m in self.metrics]

    @property
    def val_curve(self) -> tuple[list[int], list[float]]:
        rows = [m for m in self.metrics if isinstance(m.get("val_loss"), int | float)]
        return [m["step"] for m in rows], [m["val_loss"] for m in rows]

    @property
    def final_step(self) -> int:
        return self.metrics[-1]["step"]

    @property
    def final_val_step(self) -> int | None:
        steps = self.val_curve[0]
        return steps[-1] if steps else None

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

    @property
    def seed(self):
        return None if self.config is None else self.config.get("seed")

    @property
    def settings(self) -> dict | None:
        """The flattened configuration that groups runs: ``config.json`` less the seed."""
        if self.config is None:
            return None
        flat = _flatten(self.config)
        return {k: v for k, v in flat.items() if k not in NOT_CONFIGURATION}


def _flatten(config: dict, prefix: str = "") -> dict:
    """``{"model": {"hidden": 128}}`` as ``{"model.hidden": 128}``; None values dropped.

    Dropping None makes a run whose config.json predates a field group with
    runs that recorded it as None (``recipe`` of a BF16 run).
    """
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= _flatten(value, f"{name}.")
        elif value is not None:
            flat[name] = value
    return flat


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
    config, summary = _read_object(path / "config.json"), _read_object(path / "summary.json")
    precision = (config or {}).get("precision", (summary or {}).get("precision"))
    recipe = (config or {}).get("recipe", (summary or {}).get("recipe"))
    detail = precision if not recipe else f"{precision} {recipe}"
    label = f"{path.name} ({detail})" if detail else path.name
    return Run(path=path, label=label, metrics=metrics, summary=summary or {}, config=config)


def _read_object(path: pathlib.Path) -> dict | None:
    """The JSON object in ``path``; None if it is missing, unreadable, empty or not an object."""
    with contextlib.suppress(OSError, ValueError):  # optional: metrics are enough
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) and value else None
    return None


@dataclasses.dataclass(frozen=True)
class Group:
    """Runs of one configuration (several seeds), or one run compared on its own."""

    label: str
    runs: list[Run]

    @property
    def seeds(self) -> list:
        return [r.seed for r in self.runs]

    @property
    def final_vals(self) -> list[float]:
        return [r.final_val for r in self.runs if r.final_val is not None]

    @property
    def val_mean(self) -> float | None:
        return statistics.fmean(self.final_vals) if self.final_vals else None

    @property
    def val_min(self) -> float | None:
        return min(self.final_vals, default=None)

    @property
    def val_max(self) -> float | None:
        return max(self.final_vals, default=None)

    @property
    def train_mean(self) -> float:
        return statistics.fmean(r.final_train for r in self.runs)

    @property
    def tokens_per_s(self) -> float | None:
        rates = [r.tokens_per_s for r in self.runs if r.tokens_per_s is not None]
        return statistics.fmean(rates) if rates else None

    @property
    def train_band(self) -> Band:
        return Band.of([r.train_curve for r in self.runs])

    @property
    def val_band(self) -> Band:
        return Band.of([r.val_curve for r in self.runs])


@dataclasses.dataclass(frozen=True)
class Band:
    """The mean, min and max of several runs' curves at the steps all of them logged."""

    steps: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]

    @classmethod
    def of(cls, curves: list[tuple[list[int], list[float]]]) -> Band:
        by_step = [dict(zip(steps, values, strict=True)) for steps, values in curves]
        steps = sorted(set.intersection(*(set(d) for d in by_step)))
        columns = [[d[s] for d in by_step] for s in steps]
        return cls(
            steps=steps,
            mean=[statistics.fmean(c) for c in columns],
            low=[min(c) for c in columns],
            high=[max(c) for c in columns],
        )


def group_runs(runs: list[Run], *, per_run: bool = False) -> list[Group]:
    """Groups runs by configuration, in the order of their first run.

    A run without a usable ``config.json``, or every run under ``per_run``,
    forms a group of its own.

    Raises:
      CompareError: if a directory is given twice, two runs of a group share a
        seed, or the runs of a group end at different steps.
    """
    _check_distinct_directories(runs)
    members: dict[object, list[Run]] = {}
    for index, run in enumerate(runs):
        settings = run.settings
        key = index if per_run or settings is None else _configuration_key(settings)
        members.setdefault(key, []).append(run)
    groups = [Group(label=label, runs=rs) for label, rs in _labelled(list(members.values()))]
    for group in groups:
        _check_distinct_seeds(group)
        _check_same_final_steps(group)
    return groups


def _configuration_key(settings: dict) -> str:
    """``settings`` as a dict key: runs whose keys are equal are seeds of one configuration."""
    return json.dumps(settings, sort_keys=True)


def _check_distinct_directories(runs: list[Run]) -> None:
    seen: dict[pathlib.Path, Run] = {}
    for run in runs:
        where = run.path.resolve()
        if where in seen:
            raise CompareError(
                f"RUN {str(run.path)!r} is given twice (as {str(seen[where].path)!r} too); each "
                "run directory counts once in its group's mean."
            )
        seen[where] = run


def _check_distinct_seeds(group: Group) -> None:
    by_seed: dict[str, Run] = {}
    for run in group.runs:
        other = by_seed.setdefault(json.dumps(run.seed), run)
        if other is not run:
            raise CompareError(
                f"RUN {str(other.path)!r} and {str(run.path)!r} have the same configuration and "
                f"seed {run.seed!r}, so they are not seeds of group {group.label!r}. Pass "
                "--per-run to compare them run by run (e.g. before and after a code change)."
            )


def _check_same_final_steps(group: Group) -> None:
    ends = {(r.final_step, r.final_val_step) for r in group.runs}
    if len(ends) > 1:
        found = "; ".join(
            f"{r.path}: step {r.final_step}, validation at {r.final_val_step}" for r in group.runs
        )
        raise CompareError(
            f"the runs of group {group.label!r} end at different steps ({found}), so their "
            "final losses come from different points of training. Expected the same last "
            "step and last validation step in every seed: pass finished runs, or --per-run."
        )


def _labelled(members: list[list[Run]]) -> list[tuple[str, list[Run]]]:
    """Each group's runs with a label that names what differs between the groups.

    When every group has one run the label is the run's own (its directory,
    precision and recipe), as the per-run table shows it.
    """
    if all(len(runs) == 1 for runs in members):
        labels = [runs[0].label for runs in members]
    else:
        settings = [runs[0].settings for runs in members]
        differing = _differing_keys([s for s in settings if s is not None])
        labels = [
            runs[0].path.name if s is None else _describe(s, differing) or runs[0].path.name
            for runs, s in zip(members, settings, strict=True)
        ]
    repeated = {label for label in labels if labels.count(label) > 1}
    labels = [
        f"{label} ({runs[0].path.name})" if label in repeated else label
        for label, runs in zip(labels, members, strict=True)
    ]
    return list(zip(labels, members, strict=True))


def _named_by_differences(runs: list[Run]) -> list[Run]:
    """The runs, each label also naming the settings beyond precision and recipe that differ.

    A table of ``fp8 (fp8 current)`` against ``fp8-2 (fp8 current)`` says
    nothing of the accumulation or remat that set them apart.
    """
    settings = [r.settings for r in runs if r.settings is not None]
    extra = [k for k in _differing_keys(settings) if k not in BARE_KEYS]
    named = []
    for run in runs:
        more = "" if run.settings is None else _describe(run.settings, extra)
        if more:
            label = (
                f"{run.label[:-1]} {more})" if run.label.endswith(")") else f"{run.label} ({more})"
            )
            run = dataclasses.replace(run, label=label)
        named.append(run)
    return named


def _different_ends(runs: list[Run]) -> str:
    """A warning line when the runs' last steps differ, or nothing."""
    if len({r.final_step for r in runs}) <= 1:
        return ""
    ends = ", ".join(f"{r.path.name}: {r.final_step}" for r in runs)
    return (
        f"\nwarning: the runs end at different steps ({ends}), so their final losses come "
        "from different points of training; compare runs of the same --steps."
    )


def _differing_keys(settings: list[dict]) -> list[str]:
    """The keys to label groups by: precision and recipe, then those not alike in every group."""
    keys = sorted({k for s in settings for k in s})
    differing = [k for k in keys if len({json.dumps(s.get(k)) for s in settings}) > 1]
    leading = ["name"] if "name" in differing else []
    rest = [k for k in differing if k not in BARE_KEYS]
    return [*leading, "precision", "recipe", *rest]


def _describe(settings: dict, keys: list[str]) -> str:
    """``"fp8 current"``, ``"bf16 learning_rate=0.001"``: the values of ``keys`` in ``settings``."""
    parts = []
    for key in keys:
        if key not in settings:
            continue
        value = settings[key]
        if key == "data.fingerprint":
            value = str(value)[:8]
        parts.append(str(value) if key in BARE_KEYS else f"{key}={value}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How a group's mean final losses stand against the reference group's.

    ``within_range``: the mean validation loss lies in the reference's
    [min, max] over seeds; ``within_tolerance``: it is within ``tolerance``
    (a fraction) of the reference mean. None where a validation loss is
    missing, and for the reference itself.
    """

    val_gap: float | None
    train_gap: float
    within_range: bool | None
    within_tolerance: bool | None


def judge(group: Group, reference: Group, tolerance: float) -> Verdict:
    """``group``'s gaps to ``reference`` and the two verdicts of a convergence claim."""
    val_gap = _relative(group.val_mean, reference.val_mean)
    train_gap = _relative(group.train_mean, reference.train_mean)
    if group is reference or val_gap is None:
        return Verdict(val_gap, train_gap, None, None)
    within_range = reference.val_min <= group.val_mean <= reference.val_max
    return Verdict(val_gap, train_gap, within_range, abs(val_gap) <= tolerance)


def _relative(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return (value - reference) / reference


def _percent(gap: float | None) -> str:
    return "-" if gap is None else f"{gap:+.2%}"


def _gap(value: float | None, reference: float | None) -> str:
    return _percent(_relative(value, reference))


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _yes_no(value: bool | None, reference: bool) -> str:
    if reference:
        return "ref"
    return "-" if value is None else ("yes" if value else "no")


def _render(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells):
        first_cell = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first_cell, *rest])

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def table(runs: list[Run]) -> str:
    """The per-run table; gaps are relative to the first run."""
    headers = ("run", "steps", "train loss", "val loss", "tokens/s", "train gap", "val gap")
    first = runs[0]
    rows = [
        (
            r.label,
            str(r.final_step),
            f"{r.final_train:.4f}",
            _loss(r.final_val),
            _rate(r.tokens_per_s),
            _gap(r.final_train, first.final_train),
            _gap(r.final_val, first.final_val),
        )
        for r in runs
    ]
    return _render(headers, rows)


def _seeds(group: Group) -> str:
    return ",".join("?" if s is None else str(s) for s in group.seeds)


def group_table(groups: list[Group], tolerance: float) -> str:
    """The per-group table: seed means and spreads, gaps and verdicts against the first group."""
    headers = (
        "group", "runs", "seeds", "val mean", "val min", "val max", "train mean", "tokens/s",
        "val gap", "in ref range", f"within {100 * tolerance:g}%",
    )  # fmt: skip
    reference = groups[0]
    rows = []
    for group in groups:
        verdict = judge(group, reference, tolerance)
        is_reference = group is reference
        rows.append(
            (
                group.label,
                str(len(group.runs)),
                _seeds(group),
                _loss(group.val_mean),
                _loss(group.val_min),
                _loss(group.val_max),
                _loss(group.train_mean),
                _rate(group.tokens_per_s),
                _percent(verdict.val_gap),
                _yes_no(verdict.within_range, is_reference),
                _yes_no(verdict.within_tolerance, is_reference),
            )
        )
    return _render(headers, rows)


def record(groups: list[Group], tolerance: float) -> dict:
    """The group table's numbers as a JSON-ready dict, with each run's own final losses."""
    reference = groups[0]
    return {
        "reference": reference.label,
        "tolerance": tolerance,
        "groups": [_group_record(g, judge(g, reference, tolerance)) for g in groups],
    }


def _group_record(group: Group, verdict: Verdict) -> dict:
    settings = group.runs[0].settings
    return {
        "label": group.label,
        "settings": settings,
        "runs": [
            {
                "path": str(r.path),
                "seed": r.seed,
                "step": r.final_step,
                "val_step": r.final_val_step,
                "final_val_loss": r.final_val,
                "final_train_loss": r.final_train,
                "tokens_per_s": r.tokens_per_s,
            }
            for r in group.runs
        ],
        "val_loss_mean": group.val_mean,
        "val_loss_min": group.val_min,
        "val_loss_max": group.val_max,
        "train_loss_mean": group.train_mean,
        "tokens_per_s_mean": group.tokens_per_s,
        "val_gap": verdict.val_gap,
        "train_gap": verdict.train_gap,
        "mean_within_reference_range": verdict.within_range,
        "mean_within_tolerance": verdict.within_tolerance,
    }


def plot(
    groups: list[Group],
    out: str | os.PathLike,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    title: str | None = None,
) -> pathlib.Path:
    """Writes the loss-curve plot to ``out`` and returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2))
    reference = groups[0]
    for i, group in enumerate(groups):
        _plot_curves(curves, group, f"C{i}")
        _plot_gap(gaps, group, reference.val_band, f"C{i}")
    _plot_reference_spread(gaps, reference.val_band)
    curves.set(xlabel="step", ylabel="loss (nats/byte)", title=title or "loss")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    gaps.axhline(0, color="k", lw=0.5)
    for sign in (-1, 1):
        gaps.axhline(sign * 100 * tolerance, color="grey", ls=":", lw=0.8)
    gaps.set(
        xlabel="step",
        ylabel="%",
        title=f"validation loss vs {reference.label} (positive is worse; dotted: "
        f"±{100 * tolerance:g}%)",
    )
    gaps.title.set_fontsize(9)
    gaps.grid(alpha=0.3)
    if gaps.get_legend_handles_labels()[0]:  # runs without validation losses draw no gap
        gaps.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _legend_name(group: Group) -> str:
    return group.label if len(group.runs) == 1 else f"{group.label} ({len(group.runs)} seeds)"


def _plot_curves(axes, group: Group, color: str) -> None:
    """The group's mean train and validation curves, shaded over its seeds' min..max."""
    name = _legend_name(group)
    train, val = group.train_band, group.val_band
    axes.plot(train.steps, train.mean, color=color, lw=1.2, label=f"{name} train")
    if val.steps:
        axes.plot(val.steps, val.mean, "o--", color=color, ms=3, lw=0.8, label=f"{name} val")
    if len(group.runs) > 1:
        axes.fill_between(train.steps, train.low, train.high, color=color, alpha=0.15, lw=0)
        if val.steps:
            axes.fill_between(val.steps, val.low, val.high, color=color, alpha=0.25, lw=0)


def _plot_gap(axes, group: Group, reference: Band, color: str) -> None:
    """The group's mean validation loss relative to the reference mean, in percent."""
    at = dict(zip(reference.steps, reference.mean, strict=True))
    val = group.val_band
    common = [(s, v) for s, v in zip(val.steps, val.mean, strict=True) if s in at]
    if common:
        axes.plot(
            [s for s, _ in common],
            [100 * (v - at[s]) / at[s] for s, v in common],
            "o-",
            color=color,
            ms=3,
            label=_legend_name(group),
        )


def _plot_reference_spread(axes, reference: Band) -> None:
    """The reference's seed range around its mean: where a group's mean passes the range check."""
    if reference.low == reference.high:  # one seed: no spread to show
        return
    axes.fill_between(
        reference.steps,
        [100 * (lo - m) / m for lo, m in zip(reference.low, reference.mean, strict=True)],
        [100 * (hi - m) / m for hi, m in zip(reference.high, reference.mean, strict=True)],
        color="C0",
        alpha=0.15,
        lw=0,
        label="reference seed range",
    )


def check_tolerance(tolerance: float) -> float:
    """Checks ``--tolerance``: a fraction, so that 0.5 meant as 0.5% is refused.

    Raises:
      CompareError: if it is not a number in [0, MAX_TOLERANCE].
    """
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not 0 <= tolerance <= MAX_TOLERANCE
    ):
        raise CompareError(
            f"--tolerance is a fraction of the reference mean (0.005 is 0.5%) in "
            f"[0, {MAX_TOLERANCE}], got {tolerance!r}."
        )
    return float(tolerance)


def compare(
    paths: list[str],
    out: str | os.PathLike | None = None,
    title: str | None = None,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    per_run: bool = False,
) -> tuple[str, pathlib.Path, pathlib.Path]:
    """Loads and groups the runs, writes the plot and its JSON; returns ``(table, plot, json)``.

    ``out`` defaults to ``compare.png`` beside the first run; the JSON goes
    beside the plot, with its name and a ``.json`` suffix.

    Raises:
      CompareError: if no run is given, a run has no metrics, the runs cannot
        be grouped (see :func:`group_runs`), or ``tolerance`` or ``out`` is bad.
    """
    tolerance = check_tolerance(tolerance)
    if not paths:
        raise CompareError("fp8jax compare needs at least one run directory.")
    runs = _named_by_differences([load_run(p) for p in paths])
    groups = group_runs(runs, per_run=per_run)
    out = pathlib.Path(out or runs[0].path.parent / "compare.png")
    check_out(out)
    numbers = out.with_suffix(".json")
    one_run_each = all(len(g.runs) == 1 for g in groups)
    text = table(runs) if one_run_each else group_table(groups, tolerance)
    text += _different_ends(runs)
    try:
        png = plot(groups, out, tolerance=tolerance, title=title)
        numbers.write_text(json.dumps(record(groups, tolerance), indent=2) + "\n")
    except OSError as e:
        raise CompareError(f"--out {str(out)!r} cannot be written: {e.strerror or e}.") from None
    return text, png, numbers


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
