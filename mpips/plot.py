"""``python -m mpips plot RUN_DIR``: PNG figures of a run from its summaries (metrics.jsonl of
each worker and PS task) and, if one was recorded, its timeline (merged into
RUN_DIR/timeline.json)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .errors import DataError
from .summaries import (
    DELAY,
    EXAMPLES_PER_SEC,
    LOSS,
    PS_APPLY_BUSY,
    PS_UPDATES_PER_SEC,
    UNREADABLE,
    VALIDATION,
)
from .timeline import merge

Series = dict[str, dict[str, list[tuple[float, float, float]]]]  # name -> task -> (t, step, v)


def read_metrics(run_dir: str | Path) -> tuple[Series, int]:
    """Every worker's and PS task's metrics.jsonl under ``run_dir``: (name -> task ->
    [(time, step, value)], the number of unreadable lines skipped: a run killed mid-write
    leaves half a line)."""
    files = sorted(Path(run_dir).glob("worker-*/metrics.jsonl"))
    files += sorted(Path(run_dir).glob("ps-*/metrics.jsonl"))
    if not files:
        raise DataError(
            f"{run_dir}: no worker-*/metrics.jsonl (summaries are written where "
            f"summary.dir says, by default the checkpoint directory)"
        )
    out: Series = defaultdict(lambda: defaultdict(list))
    skipped = 0
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            try:
                r = json.loads(line)
                out[r["name"]][r["task"]].append(
                    (float(r["time"]), float(r["step"]), float(r["value"]))
                )
            except UNREADABLE:
                skipped += 1
    if not out:
        raise DataError(f"{run_dir}: its metrics.jsonl files hold no readable records")
    return out, skipped


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, ax: Any, path: Path) -> Path:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the figures a run's files allow into ``out`` (default: the run directory);
    returns their paths."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DataError(
            'plot needs matplotlib: pip install "mpips[plot]" (or matplotlib)'
        ) from None
    series, skipped = read_metrics(run_dir)
    if skipped:
        print(f"skipped {skipped} unreadable line(s) (a run killed while writing?)")
    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = _figure("training loss (each worker's batches)", "global step", "loss")
    for task, points in sorted(series.get(LOSS, {}).items()):
        ax.plot([p[1] for p in points], [p[2] for p in points], label=task)
    written.append(_save(fig, ax, out / "loss.png"))
    validation = {k[len(VALIDATION) :]: v for k, v in series.items() if k.startswith(VALIDATION)}
    if validation:
        fig, ax = _figure("validation (chief)", "global step", "value")
        for name, by_task in sorted(validation.items()):
            for points in by_task.values():
                ax.plot([p[1] for p in points], [p[2] for p in points], "o-", label=name)
        written.append(_save(fig, ax, out / "validation.png"))
    fig, ax = _figure("throughput", "seconds since the first record", "examples/s")
    start = min(
        (p[0] for by_task in series.values() for ps in by_task.values() for p in ps), default=0.0
    )
    for task, points in sorted(series.get(EXAMPLES_PER_SEC, {}).items()):
        ax.plot([p[0] - start for p in points], [p[2] for p in points], label=task)
    written.append(_save(fig, ax, out / "throughput.png"))
    if DELAY in series:
        fig, ax = _figure(
            "staleness: global steps between pull and push (mean of each record)",
            "delay",
            "records",
        )
        for task, points in sorted(series[DELAY].items()):
            ax.hist([p[2] for p in points], bins=20, alpha=0.5, label=task)
        written.append(_save(fig, ax, out / "staleness.png"))
    if PS_UPDATES_PER_SEC in series:
        fig, ax = _figure("PS apply rate", "global step", "updates applied/s (solid)")
        busy_ax = ax.twinx()
        busy_ax.set_ylabel("% of the time applying (dashed)")
        for task, points in sorted(series[PS_UPDATES_PER_SEC].items()):
            (line,) = ax.plot([p[1] for p in points], [p[2] for p in points], label=task)
            busy = series.get(PS_APPLY_BUSY, {}).get(task, [])
            busy_ax.plot(
                [p[1] for p in busy], [100 * p[2] for p in busy], "--", color=line.get_color()
            )
        written.append(_save(fig, ax, out / "ps_apply.png"))
    timeline = merge(run_dir)
    if timeline is not None:
        written += [timeline, _plot_phases(timeline, out / "phases.png")]
    return written


def _plot_phases(path: Path, png: Path) -> Path:
    """Time per phase and task, from a Chrome trace of complete ("X") events."""
    try:
        events = json.loads(path.read_text())["traceEvents"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a timeline ({e})") from None
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    names = {}
    try:
        for ev in events:
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                names[ev["pid"]] = str(ev["args"]["name"])
            elif ev.get("ph") == "X":
                totals[ev["pid"]][str(ev["name"])] += float(ev["dur"]) / 1e6
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: not a timeline (a malformed event: {e})") from None
    fig, ax = _figure("time per phase", "task", "seconds")
    tasks = sorted(totals)
    phases = sorted({p for t in totals.values() for p in t})
    bottom = [0.0] * len(tasks)
    for phase in phases:
        heights = [totals[t].get(phase, 0.0) for t in tasks]
        ax.bar([names.get(t, str(t)) for t in tasks], heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    return _save(fig, ax, png)
