"""Summaries that cannot be written: a full disk (a real tmpfs), a stuck file system (a
FIFO nobody reads) and a writer that falls behind switch the task's summaries off with one
warning naming the folder and the cause; training goes on, and neither the end of a run nor
a stop (SIGTERM) waits long for the disk: the checkpoint is still written."""

import contextlib
import os
import re
import signal
import threading
import time

import pytest
from conftest import BackgroundJob, small_tmpfs

from mpips.run import summaries
from mpips.run.summaries import MetricsWriter

WORKER = "/job:worker/task:0"


def _within(seconds, fn):
    """``fn()`` in a thread; fails (rather than hangs) if it takes over ``seconds``."""
    t = threading.Thread(target=fn, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for over {seconds} s"
    return time.monotonic() - t0


def _warnings(text, folder):
    return text.count(f"warning: cannot write summaries in {folder} (")


def test_a_full_disk_switches_summaries_off_with_one_warning(tmp_path, capsys):
    """/dev/full answers every write with ENOSPC, like a full disk."""
    folder = tmp_path / "worker-0"
    folder.mkdir()
    (folder / "metrics.jsonl").symlink_to("/dev/full")
    out = MetricsWriter(folder, WORKER, tensorboard=False)
    for step in range(1, 50):
        out.record(step, {"loss": 1.0 / step})
        time.sleep(0.002)
    out.close()
    said = capsys.readouterr().out
    assert _warnings(said, folder) == 1, said
    assert "No space left on device (errno 28)): they are switched off, training goes on" in said


def test_numpy_scalars_are_written_as_numbers(tmp_path, capsys):
    """A model's loss as np.float32 (what a numpy mean gives): written, not "not JSON
    serializable" and summaries switched off."""
    import json

    import numpy as np

    out = MetricsWriter(tmp_path, WORKER, tensorboard=True)
    out.record(1, {"loss": np.float32(0.5), "accuracy": np.float64(0.25)})
    out.close()
    said = capsys.readouterr().out
    assert "cannot write summaries" not in said, said
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["name"], r["value"]) for r in lines] == [("loss", 0.5), ("accuracy", 0.25)]


@pytest.fixture
def stuck_fifo(tmp_path):
    """A worker folder whose metrics.jsonl is a FIFO nobody reads: opening it blocks, as a
    hung file system does. Afterwards a reader and writer is opened, so the thread ends."""
    folder = tmp_path / "worker-0"
    folder.mkdir()
    os.mkfifo(folder / "metrics.jsonl")
    writers = []
    yield folder, writers
    fd = os.open(folder / "metrics.jsonl", os.O_RDWR | os.O_NONBLOCK)  # unblocks the opens
    try:
        for w in writers:
            with contextlib.suppress(Exception):
                w.queue.put(summaries._CLOSE, timeout=5)
            w.thread.join(5)
            assert not w.thread.is_alive()
    finally:
        os.close(fd)


def test_closing_a_stuck_writer_has_a_deadline(stuck_fifo, capsys, monkeypatch):
    folder, writers = stuck_fifo
    monkeypatch.setattr(summaries, "CLOSE_SECONDS", 0.5)
    out = MetricsWriter(folder, WORKER, tensorboard=False)
    writers.append(out)

    def use():
        for step in range(3):
            out.record(step, {"loss": 1.0})
        out.close()

    assert _within(10, use) < 3
    said = capsys.readouterr().out
    assert _warnings(said, folder) == 1, said
    assert "its last records were not written within 0.5 s (a hung file system?)" in said


def test_a_writer_that_falls_behind_is_switched_off_without_blocking(
    stuck_fifo, capsys, monkeypatch
):
    folder, writers = stuck_fifo
    monkeypatch.setattr(summaries, "QUEUE_RECORDS", 5)
    out = MetricsWriter(folder, WORKER, tensorboard=False)
    writers.append(out)

    def use():
        for step in range(20):
            out.record(step, {"loss": 1.0})
        out.close()  # switched off: nothing to wait for

    assert _within(10, use) < 1
    said = capsys.readouterr().out
    assert _warnings(said, folder) == 1, said
    assert "5 records wait to be written, none was for a while (a hung file system?)" in said


FULL_DISK_JOB = """
[data]
builtin = "digits"
[train]
steps = 1000000000
[checkpoint]
dir = "runs/ckpt"
every_steps = 100
[summary]
dir = "{small}"
every_steps = 1
all_workers = true
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs at tmp_path/small."""
    with small_tmpfs(tmp_path / "small", "64k") as small:
        yield small


@pytest.mark.launcher
def test_a_full_summary_disk_lets_training_go_on_and_a_sigterm_checkpoint(tmp_path, small_disk):
    """The summary disk fills mid-run: each writing worker warns once and trains on; SIGTERM
    then stops the job within seconds with its checkpoint (exit 3)."""
    (tmp_path / "job.toml").write_text(FULL_DISK_JOB.format(small=small_disk))
    job = BackgroundJob(tmp_path, 3, "job.toml")
    # the chief warned, then trained on and saved a checkpoint
    job.wait_for(r"(?s)task:0\] warning: cannot write summaries in .*saved checkpoint")
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)  # mpiexec passes it to every rank
    code = job.end(timeout=60)
    took = time.monotonic() - t0
    text = job.text()
    assert code == 3, text[-3000:]
    assert took < 20, (took, text[-3000:])
    m = re.search(r"stopped early by SIGTERM: checkpoint at global_step (\d+)", text)
    assert m and (tmp_path / f"runs/ckpt/ckpt-{m.group(1)}.json").exists(), text[-3000:]
    for task in (0, 1):
        folder = small_disk / f"worker-{task}"
        assert _warnings(text, folder) == 1, text[-3000:]
        assert f"in {folder} (No space left on device (errno 28))" in text
    assert "Traceback" not in text and "mpips: error" not in text, text[-3000:]


def test_a_timeline_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    """The timeline is a trace: a run's end does not fail on it."""
    from mpips.run.timeline import Timeline

    (tmp_path / "afile").write_text("not a directory")
    timeline = Timeline(tmp_path / "afile", "worker", 0)
    timeline.span("pull", timeline.now())
    assert timeline.write() is None
    said = capsys.readouterr().out
    assert said.startswith(f"[{WORKER}] warning: cannot write the timeline {tmp_path}/afile/")
