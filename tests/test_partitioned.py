"""Dense variables split by rows over the PS tasks (layout.partition, TensorFlow's
partitioned variables): the placement, the job's checks, and real runs that must equal
the unsplit ones (one async worker == one process; restore onto another PS count)."""

import numpy as np
import pytest
from conftest import run_mpi
from shared_runs import run_in_turn
from test_optimizers_mpi import assert_same_checkpoints, read_ckpt, reference, write_job

from mpips.errors import ConfigError
from mpips.job import parse_job
from mpips.models.variables import VariableSpec
from mpips.placement.table import imbalance, round_robin

SPECS = [
    VariableSpec("k0", (784, 256)),
    VariableSpec("b0", (256,)),
    VariableSpec("k1", (256, 10)),
    VariableSpec("b1", (10,)),
]


def placement_of(layout: str, num_ps: int, specs=SPECS):
    from mpips.placement.plan import job_placement

    return job_placement(parse_job(f"[train]\nsteps = 1\n[layout]\n{layout}\n"), specs, num_ps)


def test_a_split_variable_has_one_contiguous_block_per_ps_task():
    placement = placement_of('partition = ["k0"]', 3)
    blocks = placement.parts("k0")
    assert [b.ps_task for b in blocks] == [0, 1, 2]
    assert [b.rows for b in blocks] == [(0, 261, 1), (261, 522, 1), (522, 784, 1)]
    assert all(b.spec.shape == (b.rows[1] - b.rows[0], 256) and not b.table for b in blocks)
    # the other variables follow the rule as if k0 were not there; blocks come after them
    assert [(e.name, e.ps_task) for e in placement if e.whole is None] == [
        ("b0", 0),
        ("k1", 1),
        ("b1", 2),
    ]
    for p in range(3):
        whole_end = placement.whole_bytes(p)
        assert all(b.offset >= whole_end for b in placement.on_ps(p) if b.whole)
        assert placement.dense_bytes(p) == placement.ps_bytes(p)  # no tables: all dense
    held = [sum(e.spec.nbytes for e in placement.on_ps(p)) for p in range(3)]
    assert max(held) < 1.05 * min(held)  # k0 alone would put 0.8 MB on one task
    assert imbalance(placement, "round_robin") == ""


def test_partition_min_bytes_splits_by_size_and_one_ps_splits_nothing():
    placement = placement_of("partition_min_bytes = 10000", 2)
    assert {e.name for e in placement if e.whole} == {"k0", "k1"}
    assert all(e.whole is None for e in placement_of("partition_min_bytes = 10000", 1))
    digests = placement_of("", 2).entry_digests()
    assert digests != placement_of('partition = ["k1"]', 2).entry_digests()


@pytest.mark.parametrize(
    "layout, message",
    [
        ('partition = ["k9"]', "layout.partition: the model has no variable 'k9'"),
        ('partition = ["k0"]\npin = {k0 = 1}', "also pinned by layout.pin"),
        ('partition = ["b1"]', "'b1' has 10 rows, fewer than the 16 PS tasks"),
        ("partition = 'k0'", "layout.partition: expected a list of strings"),
        ("partition_min_bytes = -1", "layout.partition_min_bytes: must be >= 0"),
    ],
)
def test_bad_partition_settings_are_named(layout, message):
    with pytest.raises(ConfigError, match=message):
        placement_of(layout, 16)


def test_the_imbalance_warning_says_which_variable_to_split():
    said = imbalance(round_robin(SPECS, 2), "round_robin")
    assert 'layout.partition = ["k0"]' in said


def split_job(tmp_path, kind, steps, ckpt, ps, split="partition_min_bytes = 1"):
    """The optimizer test's job on 1 worker and ``ps`` PS tasks, every variable split."""
    job = write_job(tmp_path, kind, steps, ckpt)
    text = (tmp_path / "job.toml").read_text() + f"[layout]\nps = {ps}\n{split}\n"
    (tmp_path / "job.toml").write_text(text)
    return job


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """split_job with SGD and with Adam, 30 steps on 2 PS tasks, trained in turn in one
    launch (into runs/<kind>); the directory, each job and each case (run_in_turn)."""
    d = tmp_path_factory.mktemp("split")
    jobs = {}
    for kind in ("sgd", "adam"):
        jobs[kind] = split_job(d, kind, 30, f"runs/{kind}", ps=2)
        (d / "job.toml").rename(d / f"{kind}.toml")
    cases = run_in_turn(d, [*jobs], lambda todo: run_mpi(3, ["in_turn.py", *todo], cwd=d))
    return d, jobs, cases


@pytest.mark.launcher
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_async_worker_with_split_variables_equals_one_process(split_runs, kind):
    """SGD pushes blocks by Accumulate, Adam through the PS's inbox: both must land each
    block in its rows (a block in the wrong rows, or a missed one, changes the model)."""
    d, jobs, cases = split_runs
    cases[kind].result()  # this case's own run ended (else: its failure alone, by name)
    job = jobs[kind]
    variables, slots, _ = read_ckpt(d / f"runs/{kind}/ckpt-30.json")
    want, want_slots = reference(job, 30)
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for name, per_slot in want_slots.items():
        for slot, value in per_slot.items():
            np.testing.assert_allclose(slots[f"{name}/{slot}"], value, rtol=1e-5, atol=1e-6)


@pytest.mark.launcher
def test_split_blocks_restore_onto_another_ps_count(tmp_path):
    """20 steps on 2 PS tasks (split), resumed to 30 on 3 PS tasks (split again, other
    blocks), equal 30 steps on one PS bit for bit; the checkpoint keeps blocks by rows."""
    from mpips.checkpoint import Checkpoint

    split_job(tmp_path, "adam", 20, "runs/resumed", ps=2)
    assert run_mpi(3, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path).returncode == 0
    manifest = Checkpoint(tmp_path / "runs/resumed/ckpt-20.json")
    parts = manifest.variables["dense_0/kernel"].parts
    assert [(p.shard, p.rows) for p in parts] == [(0, (0, 32, 1)), (1, (32, 64, 1))]
    split_job(tmp_path, "adam", 30, "runs/resumed", ps=3)
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restored global_step 20" in r.stdout
    split_job(tmp_path, "adam", 30, "runs/straight", ps=1, split="")
    assert run_mpi(2, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path).returncode == 0
    assert_same_checkpoints(
        tmp_path / "runs/resumed/ckpt-30.json", tmp_path / "runs/straight/ckpt-30.json"
    )


@pytest.mark.launcher
def test_sync_replicas_with_split_variables_trains(tmp_path):
    """The PS aggregates a block like a whole variable: 2 workers, 2 PS tasks, all split."""
    from conftest import run_train

    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nmode = "sync_replicas"\nsteps = 60\n'
        '[checkpoint]\ndir = "runs/sr"\n[layout]\nps = 2\npartition_min_bytes = 1\n'
    )
    r = run_train(tmp_path, 4, "job.toml", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.result["global_step"] == 60 and r.result["test_accuracy"] > 0.8
