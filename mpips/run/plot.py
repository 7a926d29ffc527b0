"""``python -m mpips plot RUN_DIR``: PNG figures of a run from its summaries (metrics.jsonl of
each worker and PS task) and, if one was recorded, its timeline (merged into
RUN_DIR/timeline.json)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import DataError
from .summaries import (
    DELAY,
    EXAMPLES_PER_SEC,
    LOSS,
    PS_APPLY_BUSY,
    PS_UPDATES_PER_SEC,
    STEPS_PER_SEC,
    UNREADABLE,
    VALIDATION,
)
from .timeline import merge

Point = tuple[float, float, float]  # a record: (unix time, global step, value)
Series = dict[str, dict[str, list[Point]]]  # name -> task -> records, in the order written


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


def _save(fig: Any, path: Path) -> Path:
    """``fig`` (its legend, if it has labels) as the PNG ``path``, then closed."""
    ax = fig.axes[0]
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the figures a run's files allow into ``out`` (default: the run directory);
    returns their paths. Every line breaks where the run was resumed (see restarts)."""
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
    cuts = restarts(series)
    written = []
    for name, draw in FIGURES:
        fig = draw(series, cuts)
        if fig is not None:
            written.append(_save(fig, out / name))
    timeline = merge(run_dir)
    if timeline is not None:
        written += [timeline, _plot_phases(timeline, out / "phases.png")]
    return written


# -- restarts: a resumed run appends to the same metrics.jsonl files ---------------------------

CHIEF = "/job:worker/task:0"  # the one task that records global_steps_per_sec
RESTART_SECONDS = 0.5  # more time between two of the chief's records than its rate explains
Cut = tuple[float, float]  # (last record before a restart, first one after it): unix seconds


def restarts(series: Series) -> list[Cut]:
    """Where the run stopped and was resumed, as the chief's records show it: each record
    of global_steps_per_sec is the global steps since its previous one over the seconds
    since then, so within one run the time between two records is the steps between them
    over the later one's rate; a resumed run adds the time the job was down (at least its
    start-up), or starts from an older checkpoint (its steps go back). Each such pair of
    records is narrowed to the longest time in it with no record of any task (the other
    tasks record a little before or after the chief): the gap between the two runs."""
    chief = series.get(STEPS_PER_SEC, {}).get(CHIEF) or series.get(LOSS, {}).get(CHIEF, [])
    rated = bool(series.get(STEPS_PER_SEC, {}).get(CHIEF))
    times = sorted({p[0] for by_task in series.values() for ps in by_task.values() for p in ps})
    return [
        _quietest(times, a[0], b[0])
        for a, b in zip(chief, chief[1:], strict=False)
        if _resumed(a, b, rated)
    ]


def _resumed(a: Point, b: Point, rated: bool) -> bool:
    """Whether the chief's record ``b`` is the first of a resumed run (``a``: its record
    before; ``rated``: their values are global steps per second)."""
    if b[1] <= a[1]:
        return True
    if not rated or not (math.isfinite(b[2]) and b[2] > 0):
        return False
    explained = (b[1] - a[1]) / b[2]  # seconds: the steps between them at b's rate
    return b[0] - a[0] > explained * 1.01 + RESTART_SECONDS


def _quietest(times: list[float], lo: float, hi: float) -> Cut:
    """The longest interval between consecutive ``times`` within [lo, hi]."""
    inside = [lo] + [t for t in times if lo < t < hi] + [hi]
    return max(zip(inside, inside[1:], strict=False), key=lambda g: g[1] - g[0])


def _run_of(t: float, cuts: list[Cut]) -> int:
    """Which run a record made at ``t`` belongs to: the number of restarts before it."""
    return sum(t >= cut[1] for cut in cuts)


def broken(
    points: list[Point], x: int, cuts: list[Cut], origin: float = 0.0
) -> tuple[list[float], list[float]]:
    """A series' (x, y) to plot: x is the records' step (``x`` 1) or their time (``x`` 0:
    seconds of training since ``origin``, the time between runs left out), y their value,
    with a NaN between two records of different runs, where matplotlib breaks the line."""
    xs: list[float] = []
    ys: list[float] = []
    for i, p in enumerate(points):
        if i and _run_of(p[0], cuts) != _run_of(points[i - 1][0], cuts):
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(training_seconds(p[0], cuts, origin) if x == 0 else p[x])
        ys.append(p[2])
    return xs, ys


def training_seconds(t: float, cuts: list[Cut], origin: float) -> float:
    """Seconds from ``origin`` to ``t``, less the time between runs (a resumed run may start
    hours after the one before it stopped)."""
    return t - origin - sum(cut[1] - cut[0] for cut in cuts if t >= cut[1])


# -- the figures ---------------------------------------------------------------------------


def loss_figure(series: Series, cuts: list[Cut]) -> Any:
    """Each writing worker's loss against the global step."""
    fig, ax = _figure("training loss (each worker's batches)", "global step", "loss")
    for task, points in sorted(series.get(LOSS, {}).items()):
        ax.plot(*broken(points, 1, cuts), label=task)
    return fig


def validation_figure(series: Series, cuts: list[Cut]) -> Any:
    """The chief's validation metrics (train.eval_every) against the global step."""
    validation = {k[len(VALIDATION) :]: v for k, v in series.items() if k.startswith(VALIDATION)}
    if not validation:
        return None
    fig, ax = _figure("validation (chief)", "global step", "value")
    for name, by_task in sorted(validation.items()):
        for points in by_task.values():
            ax.plot(*broken(points, 1, cuts), "o-", label=name)
    return fig


ALL_WORKERS = "all workers (sum of each one's latest rate)"
GLOBAL_RATE = "global steps/s, all workers (right axis)"
RESUMED = "run resumed"


def throughput_figure(series: Series, cuts: list[Cut]) -> Any:
    """Examples/s of each writing worker (and their sum, with several) against time, the
    chief's global steps/s of all workers on a right axis, a dotted line where the run was
    resumed (every line breaks there)."""
    rates = series.get(EXAMPLES_PER_SEC, {})
    title = "throughput" + ("" if len(rates) > 1 else " (only the chief records its own rate)")
    fig, ax = _figure(title, "seconds of training (the time between runs left out)", "examples/s")
    origin = _first_time(series)
    for task, points in sorted(rates.items()):
        label = f"{task} (chief)" if task == CHIEF else task
        ax.plot(*broken(points, 0, cuts, origin), label=label)
    if len(rates) > 1:
        total = summed(rates, cuts)
        ax.plot(*broken(total, 0, cuts, origin), "k-", linewidth=2, label=ALL_WORKERS)
    steps = series.get(STEPS_PER_SEC, {}).get(CHIEF)
    if steps:
        right = ax.twinx()
        right.set_ylabel("global steps/s (dashed)")
        xs, ys = broken(steps, 0, cuts, origin)
        right.plot(xs, ys, "--", color="gray", label=GLOBAL_RATE)
        ax.plot([], [], "--", color="gray", label=GLOBAL_RATE)  # (in the legend of ax)
    for k, cut in enumerate(cuts):
        at = training_seconds(cut[1], cuts, origin)
        ax.axvline(at, linestyle=":", color="red", label=None if k else RESUMED)
    return fig


def summed(rates: dict[str, list[Point]], cuts: list[Cut]) -> list[Point]:
    """The workers' rates added up: at each record of any worker, the sum of every worker's
    latest record of the same run, once each worker recording in that run has one."""
    merged = sorted((p[0], task, p) for task, points in rates.items() for p in points)
    out: list[Point] = []
    for run in sorted({_run_of(t, cuts) for t, _, _ in merged}):
        mine = [(task, p) for t, task, p in merged if _run_of(t, cuts) == run]
        tasks = {task for task, _ in mine}
        latest: dict[str, float] = {}
        for task, p in mine:
            latest[task] = p[2]
            if len(latest) == len(tasks):
                out.append((p[0], p[1], sum(latest.values())))
    return out


def staleness_figure(series: Series, cuts: list[Cut]) -> Any:
    """A histogram of each worker's recorded delays (async)."""
    if DELAY not in series:
        return None
    fig, ax = _figure(
        "staleness: global steps between pull and push (mean of each record)", "delay", "records"
    )
    for task, points in sorted(series[DELAY].items()):
        ax.hist([p[2] for p in points], bins=20, alpha=0.5, label=task)
    return fig


def ps_apply_figure(series: Series, cuts: list[Cut]) -> Any:
    """Each PS task's updates applied per second and share of time applying."""
    if PS_UPDATES_PER_SEC not in series:
        return None
    fig, ax = _figure("PS apply rate", "global step", "updates applied/s (solid)")
    busy_ax = ax.twinx()
    busy_ax.set_ylabel("% of the time applying (dashed)")
    for task, points in sorted(series[PS_UPDATES_PER_SEC].items()):
        (line,) = ax.plot(*broken(points, 1, cuts), label=task)
        busy = [(t, s, 100 * v) for t, s, v in series.get(PS_APPLY_BUSY, {}).get(task, [])]
        busy_ax.plot(*broken(busy, 1, cuts), "--", color=line.get_color())
    return fig


FIGURES = [  # file name, what draws it (None: nothing to draw)
    ("loss.png", loss_figure),
    ("validation.png", validation_figure),
    ("throughput.png", throughput_figure),
    ("staleness.png", staleness_figure),
    ("ps_apply.png", ps_apply_figure),
]


def _first_time(series: Series) -> float:
    return min(
        (p[0] for by_task in series.values() for ps in by_task.values() for p in ps), default=0.0
    )


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
    return _save(fig, png)
