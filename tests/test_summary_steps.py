"""summary.every_steps counts global steps (TensorFlow's habit): a default-like async job of
S steps gives the chief about S / N records, not S / N / workers, so `mpips plot` draws a
loss curve and a staleness histogram worth looking at."""

import pytest
from conftest import run_py, run_train

from mpips.run.plot import read_metrics

# the default job (digits, 3 workers here), with a staleness bound: on a loaded 2-core
# machine an unbounded chief can be starved to a handful of updates, and a chief that makes
# no update past a multiple of N cannot record there
JOB = """
[data]
builtin = "digits"
[train]
steps = 600
max_staleness = 2
[checkpoint]
dir = "runs/default"
"""


@pytest.mark.launcher
def test_a_default_like_job_records_about_steps_over_n_points(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    r = run_train(tmp_path, 4, "job.toml", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    series, skipped = read_metrics(tmp_path / "runs/default")
    assert skipped == 0
    for name in ("loss", "staleness/delay", "examples_per_sec"):
        steps = [int(p[1]) for p in series[name]["/job:worker/task:0"]]
        # one record per multiple of 20 the chief stepped past (every_steps = 20, default)
        assert 0.8 * 600 / 20 <= len(steps) <= 600 / 20, (name, steps)
        multiples = [s // 20 for s in steps]
        assert multiples == sorted(set(multiples)) and multiples[0] >= 1, (name, steps)
    assert r.result["updates"] < 0.5 * 600  # the chief made only its share of them
    p = run_py(["-m", "mpips", "plot", "runs/default"], cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    for png in ("loss.png", "staleness.png"):
        assert (tmp_path / "runs/default" / png).stat().st_size > 5000
