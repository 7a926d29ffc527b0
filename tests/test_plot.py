"""`mpips plot` across a restart and for every worker: a resumed run appends to the same
metrics.jsonl files, and every line breaks where it was resumed (the time between the runs
left out); the throughput figure shows each worker's examples/s, their sum, and the chief's
global steps/s of all workers. Checked on the figures' own data (Line2D), drawn with
matplotlib's Agg backend from the files a real run wrote."""

import json
import math
import shutil

import pytest
from conftest import run_train

pytest.importorskip("matplotlib")

from mpips.run import plot  # noqa: E402
from mpips.run.summaries import EXAMPLES_PER_SEC, LOSS, STEPS_PER_SEC  # noqa: E402

JOB = """
[model]
kind = "mlp"
hidden = [16]
[data]
builtin = "digits"
[train]
steps = 200
batch_size = 16
[checkpoint]
dir = "run"
every_steps = 100
[summary]
every_steps = 20
all_workers = {all_workers}
tensorboard = false
"""

CHIEF = "/job:worker/task:0"


def lines(run_dir, after=None):
    """Every record of a run's metrics.jsonl files; with ``after`` (an earlier copy of the
    run directory), only those appended since."""
    out = []
    for path in sorted(run_dir.glob("*/metrics.jsonl")):
        text = path.read_text().splitlines()
        skip = len((after / path.parent.name / path.name).read_text().splitlines()) if after else 0
        out += [json.loads(line) for line in text[skip:]]
    return out


def pieces(values):
    """A plotted sequence cut at its NaNs (where the line breaks)."""
    out, piece = [], []
    for v in values:
        if isinstance(v, float) and math.isnan(v):
            out.append(piece)
            piece = []
        else:
            piece.append(float(v))
    return [*out, piece]


def by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def values(records, name, task):
    return [r["value"] for r in records if r["name"] == name and r["task"] == task]


@pytest.mark.launcher
def test_a_resumed_run_breaks_every_line_and_shows_every_workers_rate(tmp_path):
    (tmp_path / "job.toml").write_text(JOB.format(all_workers="true"))
    r = run_train(tmp_path, 3, "job.toml", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(tmp_path / "run", tmp_path / "first")
    r = run_train(tmp_path, 3, "job.toml", "--steps", "400", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restored global_step 200" in r.stdout, r.stdout[-2000:]
    before, after = lines(tmp_path / "first"), lines(tmp_path / "run", tmp_path / "first")
    assert before and after

    # one run: no break anywhere
    series, _ = plot.read_metrics(tmp_path / "first")
    assert plot.restarts(series) == []
    fig = plot.throughput_figure(series, [])
    assert all(not pieces(line.get_ydata())[1:] for line in fig.axes[0].get_lines())

    # resumed: one cut, between the last record of the first run and the first of the second
    series, _ = plot.read_metrics(tmp_path / "run")
    cuts = plot.restarts(series)
    assert cuts == [(max(r["time"] for r in before), min(r["time"] for r in after))]
    fig = plot.throughput_figure(series, cuts)
    ax, right = fig.axes
    got = by_label(ax)
    tasks = {CHIEF: f"{CHIEF} (chief)", "/job:worker/task:1": "/job:worker/task:1"}
    for task, label in tasks.items():  # each worker's rate, in two pieces: one per run
        want = [values(before, EXAMPLES_PER_SEC, task), values(after, EXAMPLES_PER_SEC, task)]
        assert pieces(got[label].get_ydata()) == want, label
        start = pieces(got[label].get_xdata())
        assert start[1][0] >= start[0][-1]  # the time between the runs is left out
    total = pieces(got[plot.ALL_WORKERS].get_ydata())
    assert len(total) == 2  # the sum breaks too; at the end: both workers' last rates
    last = sum(values(after, EXAMPLES_PER_SEC, task)[-1] for task in tasks)
    assert total[1][-1] == pytest.approx(last)
    (steps,) = right.get_lines()  # the chief's global steps/s of all workers
    want = [values(before, STEPS_PER_SEC, CHIEF), values(after, STEPS_PER_SEC, CHIEF)]
    assert pieces(steps.get_ydata()) == want
    assert plot.GLOBAL_RATE in got
    resumed = got[plot.RESUMED].get_xdata()
    x = pieces(got[tasks[CHIEF]].get_xdata())
    assert x[0][-1] <= resumed[0] <= x[1][0]
    # the loss against the global step breaks as well
    loss = by_label(plot.loss_figure(series, cuts).axes[0])[CHIEF]
    want = [values(before, LOSS, CHIEF), values(after, LOSS, CHIEF)]
    assert pieces(loss.get_ydata()) == want
    written = plot.plot_run(tmp_path / "run", tmp_path / "png")
    assert tmp_path / "png/throughput.png" in written
    assert (tmp_path / "png/throughput.png").stat().st_size > 5000


def record(t, step, name, value, task=CHIEF):
    return json.dumps({"time": t, "task": task, "step": step, "name": name, "value": value})


def chief_records(run_dir, rows):
    """The chief's metrics.jsonl: (time, step, global steps/s) rows, each with the loss
    and examples/s that come with it."""
    folder = run_dir / "worker-0"
    folder.mkdir(parents=True)
    text = ""
    for t, step, rate in rows:
        text += record(t, step, LOSS, 1.0 / step) + "\n"
        text += record(t, step, EXAMPLES_PER_SEC, 32 * rate) + "\n"
        text += record(t, step, STEPS_PER_SEC, rate) + "\n"
    (folder / "metrics.jsonl").write_text(text)


def test_a_restart_from_an_older_checkpoint_or_after_a_pause_is_found(tmp_path):
    """Within a run the time between two of the chief's records is the steps between them
    at its rate; a restart is more time than that (the job was down), or steps that go
    back (resumed from an older checkpoint). A slow but running chief is no restart."""
    rows = [(100.0, 20, 20.0), (101.0, 40, 20.0), (111.0, 60, 2.0)]  # slow, not stopped
    rows += [(3700.0, 40, 20.0), (3701.0, 60, 20.0)]  # an hour later, from step 20
    rows += [(3800.0, 80, 20.0), (3801.0, 100, 20.0)]  # 99 s later, from step 60
    chief_records(tmp_path, rows)
    series, _ = plot.read_metrics(tmp_path)
    cuts = plot.restarts(series)
    assert cuts == [(111.0, 3700.0), (3701.0, 3800.0)]
    fig = plot.throughput_figure(series, cuts)
    assert fig.axes[0].get_title() == "throughput (only the chief records its own rate)"
    got = by_label(fig.axes[0])
    assert plot.ALL_WORKERS not in got  # one worker: no sum
    x = pieces(got[f"{CHIEF} (chief)"].get_xdata())
    assert x == [[0.0, 1.0, 11.0], [11.0, 12.0], [12.0, 13.0]]  # downtime left out
    loss = by_label(plot.loss_figure(series, cuts).axes[0])[CHIEF]
    assert pieces(loss.get_xdata()) == [[20, 40, 60], [40, 60], [80, 100]]
