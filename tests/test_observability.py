"""Seeing a run: metrics.jsonl and TensorBoard files read back by TensorBoard's own reader,
the timeline of every task's phases, `mpips plot`, `ckpt list` with validation metrics, the
sync loss averaged over replicas, and plain progress lines when stderr is not a terminal."""

import json
import re
import time
from collections import defaultdict

import pytest
from conftest import run_py, run_train

from mpips.run.hooks import ProgressBar, Run, StepInfo

JOB = """
[data]
builtin = "digits"
[train]
mode = "{mode}"
steps = 300
eval_every = 100
[checkpoint]
dir = "runs/obs"
every_steps = 150
[summary]
every_steps = 10
all_workers = true
timeline = {timeline}
"""


def records(path):
    out = defaultdict(list)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert set(r) == {"time", "task", "step", "name", "value"}, r
        out[r["name"]].append((r["step"], r["value"]))
    return out


ASYNC_LINE = re.compile(
    r"\[/job:worker/task:(\d+)\] step (\d+) loss (\S+) epoch \d+ "
    r"\(update \d+ of this worker, pulled (\d+) steps earlier\)"
)
SYNC_LINE = re.compile(r"\[/job:worker/task:0\] step (\d+) loss (\S+) epoch \d+ \(mean over all")


def printed_updates(stdout):
    """Each async worker's updates as it logged them (--log-every 1): task -> [(global
    step, batch loss, delay)]."""
    out = defaultdict(list)
    for m in ASYNC_LINE.finditer(stdout):
        out[int(m[1])].append((int(m[2]), float(m[3]), int(m[4])))
    return out


def check_against_printed(got, updates, every, batch=32):
    """A worker's records against its logged updates: each at its first update at or past
    a multiple of ``every`` global steps (one per multiple), its loss and delay the means of
    the updates since its last record, its examples/s and global steps/s over the same
    interval. Returns the seconds its records cover."""
    steps = [t for t, _, _ in updates]
    assert [s for s, _ in got["loss"]] == [s for s, _ in got["staleness/delay"]]
    prev, covered = 0, 0.0
    delays = got["staleness/delay"]
    for j, ((at, loss), (_, delay)) in enumerate(zip(got["loss"], delays, strict=True)):
        multiple = at // every * every
        assert at in steps and prev < multiple <= at, (prev, at)
        assert not [t for t in steps if multiple <= t < at], at  # its first update past it
        since = [(x, d) for t, x, d in updates if prev < t <= at]
        assert loss == pytest.approx(sum(x for x, _ in since) / len(since), abs=1e-4), at
        assert delay == pytest.approx(sum(d for _, d in since) / len(since), abs=1e-9), at
        rate = got["examples_per_sec"][j]
        assert rate[0] == at and rate[1] > 0
        seconds = batch * len(since) / rate[1]
        if "global_steps_per_sec" in got:  # the chief: the same interval, in global steps
            steps_rate = got["global_steps_per_sec"][j]
            assert steps_rate[0] == at
            assert (at - prev) / steps_rate[1] == pytest.approx(seconds, rel=1e-6)
        covered += seconds
        prev = at
    return covered


@pytest.mark.launcher
def test_summaries_timeline_and_plots_of_an_async_run(tmp_path):
    # (bounded staleness: the chief alone could make all 300 tiny steps, ~0.1 s, before the
    # other worker has seen the ready flag, leaving it no records)
    text = JOB.format(mode="async", timeline="true")
    (tmp_path / "job.toml").write_text(text.replace("[train]\n", "[train]\nmax_staleness = 30\n"))
    r = run_train(tmp_path, 3, "job.toml", "--log-every", "1", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs/obs"
    assert "summaries in runs/obs/worker-*/" in r.stdout
    chief, other = (
        records(run_dir / "worker-0/metrics.jsonl"),
        records(run_dir / "worker-1/metrics.jsonl"),
    )
    # the values: what each worker logged of its updates, and the chief's own report
    updates = printed_updates(r.stdout)
    assert sum(len(u) for u in updates.values()) == r.result["global_step"] == 300
    covered = check_against_printed(chief, updates[0], 10)
    check_against_printed(other, updates[1], 10)
    assert 0.5 * r.result["seconds"] < covered <= r.result["seconds"] * 1.01, covered
    # it learns: the run's first record well above its last, and each worker's loss falls
    # (a worker starved under load may log its first record late, when the loss is down)
    first, last = min(chief["loss"][0], other["loss"][0]), max(chief["loss"][-1], other["loss"][-1])
    assert first[1] > 2 * last[1], (first, last)
    for task, got in enumerate((chief, other)):
        assert got["loss"][0][1] > got["loss"][-1][1], task
        worst = r.result["staleness"][task]
        assert all(0 <= v <= worst["lead"]["max"] for _, v in got["staleness/lead"])
        assert all(0 <= v <= worst["delay"]["max"] for _, v in got["staleness/delay"])
    assert [(s, round(v, 6)) for s, v in chief["validation/accuracy"]] == [
        (v["global_step"], round(v["accuracy"], 6)) for v in r.result["validation"]
    ]
    assert [(s, round(v, 6)) for s, v in chief["validation/loss"]] == [
        (v["global_step"], round(v["loss"], 6)) for v in r.result["validation"]
    ]
    for got in (chief, other):
        for name in (
            "loss",
            "learning_rate",
            "examples_per_sec",
            "staleness/lead",
            "staleness/delay",
        ):
            steps = [s for s, _ in got[name]]
            assert steps and steps == sorted(steps) and len(set(steps)) == len(steps), name
        assert all(v == 0.1 for _, v in got["learning_rate"])  # the default job's lr
    assert "global_steps_per_sec" in chief and "global_steps_per_sec" not in other
    at = [s for s, _ in chief["validation/accuracy"]]  # async: the chief's first step >= N
    assert len(at) >= 2 and all(100 * k <= s < 100 * (k + 1) for k, s in enumerate(at, 1)), at
    assert all(0.5 < v <= 1 for _, v in chief["validation/accuracy"])
    assert chief["checkpoint/pause_ms"]
    # TensorBoard's own reader sees the same scalars at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "worker-0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss",
        "learning_rate",
        "examples_per_sec",
        "staleness/delay",
        "validation/accuracy",
        "global_steps_per_sec",
    } <= tags, tags
    assert [e.step for e in events.Scalars("loss")] == [s for s, _ in chief["loss"]]
    assert [round(e.value, 4) for e in events.Scalars("validation/accuracy")] == [
        round(v, 4) for _, v in chief["validation/accuracy"]
    ]
    assert not (run_dir / "ps-0").exists()  # plain SGD: the PS applies nothing itself
    # the timeline: each task's phases, merged by `mpips plot` into one Chrome trace
    parts = sorted(p.name for p in (run_dir / "timeline").glob("*.json"))
    assert parts == ["ps-0.json", "worker-0.json", "worker-1.json"]
    p = run_py(["-m", "mpips", "plot", "runs/obs"], cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    for name in ("loss", "validation", "throughput", "staleness", "phases"):
        png = run_dir / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    phases = defaultdict(set)
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    for e in trace:
        if e["ph"] == "X":
            assert e["dur"] >= 0
            phases[names[e["pid"]]].add(e["name"])
    for worker in ("/job:worker/task:0", "/job:worker/task:1"):
        assert {"ticket and staleness wait", "pull", "compute", "push and ack"} <= phases[worker], (
            phases
        )
    assert "checkpoint write" in phases["/job:ps/task:0"]
    pulls = sum(1 for e in trace if e["ph"] == "X" and e["name"] == "pull")
    assert pulls == r.result["global_step"]  # one per update of either worker
    # ckpt list: when each was written, and the validation metrics at its step
    c = run_py(["-m", "mpips", "ckpt", "list", "runs/obs"], cwd=tmp_path, timeout=60)
    assert c.returncode == 0, c.stderr
    last = [ln for ln in c.stdout.splitlines() if "ckpt-300.json" in ln]
    assert last and re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", last[0])
    assert "validation accuracy" in last[0]
    assert "tensorboard --logdir" not in c.stdout  # (train says where the summaries are)


@pytest.mark.launcher
def test_ps_tasks_that_apply_updates_record_their_apply_rate(tmp_path):
    """Adam: each PS applies every update; ps-K/ holds its rate, read back by TensorBoard,
    and `mpips plot` draws it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[optimizer]\nkind = "adam"\nlearning_rate = 0.005\n'
        '[train]\nsteps = 200\n[summary]\ndir = "runs/ps"\nevery_steps = 25\n'
        "[layout]\nps = 2\npartition_min_bytes = 1\n"
    )
    r = run_train(tmp_path, 4, "job.toml", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for task in (0, 1):
        got = records(tmp_path / f"runs/ps/ps-{task}/metrics.jsonl")
        # every PS task applies all 200 updates (every variable is split over both)
        assert [s for s, _ in got["ps/updates_per_sec"]] == list(range(25, 201, 25))
        assert all(v > 0 for _, v in got["ps/updates_per_sec"])
        assert all(0 < v < 1 for _, v in got["ps/apply_busy"])
        events = EventAccumulator(str(tmp_path / f"runs/ps/ps-{task}"))
        events.Reload()
        assert {"ps/updates_per_sec", "ps/apply_busy"} <= set(events.Tags()["scalars"])
        assert [e.step for e in events.Scalars("ps/apply_busy")] == list(range(25, 201, 25))
    p = run_py(["-m", "mpips", "plot", "runs/ps"], cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "runs/ps/ps_apply.png").stat().st_size > 5000


@pytest.mark.launcher
def test_the_sync_loss_is_the_mean_over_replicas(tmp_path):
    """Every replica records the same loss (the mean of all replicas' batch losses, carried
    in the last gradient bucket), though each trains on its own batch; no timeline is
    written unless asked for."""
    (tmp_path / "job.toml").write_text(JOB.format(mode="sync", timeline="false"))
    r = run_train(tmp_path, 3, "job.toml", "--log-every", "1", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs/obs"
    losses = [records(run_dir / f"worker-{k}/metrics.jsonl")["loss"] for k in range(3)]
    assert len(losses[0]) == 30 and losses[0] == losses[1] == losses[2]
    logged = {int(m[1]): float(m[2]) for m in SYNC_LINE.finditer(r.stdout)}
    assert sorted(logged) == list(range(1, 301))
    for at, loss in losses[0]:  # every 10 steps, the mean of the 10 steps' logged losses
        mean = sum(logged[t] for t in range(at - 9, at + 1)) / 10
        assert at % 10 == 0 and loss == pytest.approx(mean, abs=1e-4), at
    assert losses[0][0][1] > 2 * losses[0][-1][1]
    assert "mean over all replicas' batches" in r.stdout
    assert not (run_dir / "timeline").exists()


class _Role:
    is_chief, task = True, 0

    def __str__(self):
        return "/job:worker/task:0"


def _chief_run(start_step, target_steps, global_step):
    """A Run as the chief's hooks see it, without a job or a store behind it."""
    return Run(
        job=None,
        role=_Role(),
        start_step=start_step,
        target_steps=target_steps,
        global_step=lambda: global_step,
        start_save=None,
    )


def test_progress_is_plain_lines_with_an_eta_when_not_on_a_terminal(capsys):
    bar = ProgressBar(every_secs=0, terminal=False)
    run = _chief_run(0, 400, 400)
    bar.begin(run)
    for step in (100, 200):
        bar.after_step(run, StepInfo(step, 0.5, 0, step))
    bar.end(run)
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 3 and "\r" not in out.out + out.err, out
    assert lines[0].endswith("progress: from global_step 0 of 400, a line every 0 s")
    assert re.fullmatch(
        r"\[/job:worker/task:0\] progress: global_step 200/400 \(50%\), "
        r"[0-9.]+ steps/s, ETA \d+ s",
        lines[2],
    ), lines


def test_a_torn_metrics_line_is_skipped_by_plot_and_not_glued_to_the_next(tmp_path):
    """A run killed mid-write leaves half a line; the resumed run starts on a new line, and
    `mpips plot` skips the torn one and says so."""
    from mpips.run.plot import read_metrics
    from mpips.run.summaries import Summaries

    folder = tmp_path / "worker-0"
    folder.mkdir()
    good = '{"time": 1, "task": "/job:worker/task:0", "step": 20, "name": "loss", "value": 1.5}'
    (folder / "metrics.jsonl").write_text(good + "\n" + good[:30])
    hook = Summaries(tmp_path, every=1, tensorboard=False)
    run = _chief_run(20, 0, 20)
    hook.begin(run)
    before = time.time()
    hook.record(40, {"loss": 0.5})
    after = time.time()
    hook.end(run)
    series, skipped = read_metrics(tmp_path)
    (old, new) = series["loss"]["/job:worker/task:0"]
    assert skipped == 1 and old == (1.0, 20.0, 1.5) and new[1:] == (40.0, 0.5)
    assert before - 0.001 <= new[0] <= after + 0.001  # stamped when recorded (ms)


@pytest.mark.launcher
def test_a_summary_dir_that_cannot_be_written_is_found_before_training(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 50\n[summary]\ndir = "afile/s"\n'
    )
    r = run_train(tmp_path, 3, "job.toml", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("summary.dir afile/s: cannot write summaries there") == 1, r.stderr
    assert "train rows [" not in r.stdout  # nothing trained
