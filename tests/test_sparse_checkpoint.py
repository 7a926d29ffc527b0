"""Sparse checkpoints of table partitions: a PS writes only the rows of its tables (and of
their slots) that differ from their initial values, and every reader computes the others
again. A checkpoint written so restores bit for bit on the same and on another PS count and
the run goes on exactly as one that never stopped; its shards are a small fraction of a
dense checkpoint's bytes; `ckpt export` and `ckpt inspect` read it whole; a corrupted sparse
part is one clear error."""

import json
import re
import shutil

import h5py
import numpy as np
import pytest
from conftest import run_mpi, run_py
from test_ctr_mpi import small_dataset

from mpips import checkpoint
from mpips.checkpoint import Checkpoint
from mpips.data.hdf5 import plain_attrs
from mpips.errors import CheckpointError
from mpips.job import OptimizerConfig, load_job
from mpips.models import initial
from mpips.models.ctr import EMBEDDING, WIDE, WideDeep
from mpips.models.variables import VariableSpec
from mpips.optim import build_optimizer

FEATURES = 100_000  # a table of 100k rows, of which a run touches under 1%
JOB = """
[model]
kind = "wide_deep"
hidden = [4]
embedding_dim = 4
partition = "mod"
init_seed = 2
[data]
path = "{data}"
[optimizer]
kind = "adagrad"
learning_rate = 0.3
[train]
steps = {steps}
batch_size = 8
seed = 5
log_every = 0
progress = false
[checkpoint]
dir = "{ckpt}"
"""
TABLES = [EMBEDDING, WIDE, f"{EMBEDDING}/accumulator", f"{WIDE}/accumulator"]


def sparse_dataset(path):
    """160 rows of 5 ids out of FEATURES: a run touches a few hundred table rows."""
    small_dataset(path, rows=160, features=FEATURES, train=128)


def train(d, steps, ckpt, ps, **env):
    """The job to ``steps`` (one worker, so updates are deterministic) on ``ps`` PS tasks."""
    (d / "job.toml").write_text(JOB.format(data=d / "s.h5", steps=steps, ckpt=ckpt))
    r = run_mpi(ps + 1, ["-m", "mpips", "train", "job.toml", "--ps", str(ps)], d, 120, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def shard_bytes(manifest):
    ckpt = Checkpoint(manifest)
    return sum(ckpt.shard_path(k).stat().st_size for k in range(ckpt.num_shards))


def model_initial(d):
    """The initial values of the job's tables and slots, from its model and optimizer."""
    from mpips.data.batches import open_data
    from mpips.models.mlp import build_model

    job = load_job(d / "job.toml")
    model = build_model(job.model, open_data(job.data))
    return initial.from_model(model, build_optimizer(job.optimizer))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Resumed: 10 steps on 2 PS tasks, to 20 on 2, to 30 on 3, sparse checkpoints; straight:
    30 steps on 2 PS tasks with dense checkpoints (MPIPS_SPARSE_CHECKPOINTS=0)."""
    d = tmp_path_factory.mktemp("sparse_ckpt")
    sparse_dataset(d / "s.h5")
    logs = {}
    for steps, ps in ((10, 2), (20, 2), (30, 3)):
        logs[steps] = train(d, steps, "runs/resumed", ps).stdout
    train(d, 30, "runs/straight", 2, MPIPS_SPARSE_CHECKPOINTS="0")
    return d, logs


@pytest.mark.launcher
def test_a_sparse_checkpoint_resumes_bit_for_bit_on_the_same_and_another_ps_count(runs):
    """10 + 10 steps on 2 PS tasks + 10 on 3, through sparse checkpoints, end where 30
    straight steps with dense checkpoints end: tables, slots and dense variables, bit for
    bit (as test_partitioned's split blocks do)."""
    d, logs = runs
    assert "restored global_step 10" in logs[20] and "resuming at batch 10" in logs[20]
    assert "restored global_step 20" in logs[30] and "resuming at batch 20" in logs[30]
    assert "untouched table rows computed again" in logs[20]  # restored from sparse parts
    for step, shards in ((10, 2), (20, 2), (30, 3)):
        ckpt = Checkpoint(d / f"runs/resumed/ckpt-{step}.json")
        for name in TABLES:  # every table partition and slot is sparse, a few rows stored
            layouts = ckpt.layouts(name, name.endswith("accumulator"))
            assert len(layouts) == shards
            assert all(0 < stored < 0.05 * FEATURES / shards for _, stored in layouts), layouts
    straight = Checkpoint(d / "runs/straight/ckpt-30.json")
    assert all(stored is None for _, stored in straight.layouts(EMBEDDING))
    values = model_initial(d)
    got = Checkpoint(d / "runs/resumed/ckpt-30.json").read_all(values)
    want = straight.read_all(values)
    assert set(TABLES) <= set(got[0]) | set(got[1])
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in w:  # tables, slots and the dense variables: the same bits
            assert g[name].tobytes() == w[name].tobytes(), name
    assert not np.array_equal(got[0][EMBEDDING], model_initial_table(d))  # it did train


def model_initial_table(d):
    return model_initial(d).compute(EMBEDDING, (0, FEATURES, 1), 2)[""]


@pytest.mark.launcher
def test_the_shards_of_a_run_that_touched_few_rows_are_a_fraction_of_dense_ones(runs):
    """The bytes written: under 1% of the rows touched, sparse shards are < 1/20 of dense."""
    d, _ = runs
    dense = shard_bytes(d / "runs/straight/ckpt-30.json")
    sparse_3 = shard_bytes(d / "runs/resumed/ckpt-30.json")
    sparse_2 = shard_bytes(d / "runs/resumed/ckpt-20.json")
    tables = FEATURES * (4 + 1) * 4 * 2  # embedding and wide weights, each with a slot
    assert dense > tables, (dense, tables)
    assert sparse_2 < dense / 20 and sparse_3 < dense / 20, (sparse_2, sparse_3, dense)


@pytest.mark.launcher
def test_ckpt_export_and_inspect_read_sparse_parts_whole(runs, tmp_path):
    """`ckpt export` writes full arrays (the model of the job given with --job computes the
    untouched rows; never one the manifest names); `ckpt inspect` says which parts are
    sparse."""
    d, _ = runs
    r = run_py(
        ["-m", "mpips", "ckpt", "export", "runs/resumed", "out.h5", "--slots", "--job", "job.toml"],
        d,
    )
    assert r.returncode == 0, r.stderr
    want_vars, want_slots = Checkpoint(d / "runs/straight/ckpt-30.json").read_all(model_initial(d))
    with h5py.File(d / "out.h5", "r") as f:
        for name, value in want_vars.items():
            assert f[name][()].tobytes() == value.tobytes(), name
        for name, value in want_slots.items():
            assert f[checkpoint.h5_path(name, True)][()].tobytes() == value.tobytes(), name
    r = run_py(["-m", "mpips", "ckpt", "inspect", "runs/resumed", "--job", "job.toml"], d)
    assert r.returncode == 0, r.stderr
    assert f"{EMBEDDING}" in r.stdout and "(sparse:" in r.stdout and "rows stored)" in r.stdout
    assert "note:" not in r.stdout and " ? " not in r.stdout, r.stdout
    # without --job: the job the manifest names is not loaded; one message says what to pass
    r = run_py(["-m", "mpips", "ckpt", "export", str(d / "runs/resumed"), "o.h5"], tmp_path)
    assert r.returncode == 2 and "pass the job file that trained it (--job JOB)" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    job = str(d / "job.toml")
    r = run_py(
        ["-m", "mpips", "ckpt", "export", str(d / "runs/resumed"), "o.h5", "--job", job], tmp_path
    )
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert f[EMBEDDING][()].tobytes() == want_vars[EMBEDDING].tobytes()


@pytest.mark.launcher
def test_eval_of_a_sparse_ctr_checkpoint_matches_what_training_reported(runs, tmp_path):
    """`mpips eval` of the CTR job's sparse checkpoint (table rows gathered for the test
    ids, untouched rows computed by the job's model) gives the test metrics the run itself
    reported at its end."""
    d, logs = runs
    final = next(line for line in logs[30].splitlines() if "final: " in line)
    reported = {k: float(v) for k, v in re.findall(r"test_(\w+) ([0-9.]+)", final)}
    assert {"auc", "loss"} <= reported.keys(), logs[30][-2000:]
    r = run_py(
        [
            "-m",
            "mpips",
            "eval",
            "job.toml",
            "--ckpt",
            "runs/resumed",
            "--result",
            str(tmp_path / "e.json"),
        ],
        d,
    )
    assert r.returncode == 0, r.stderr
    said = json.loads((tmp_path / "e.json").read_text())
    assert said["global_step"] == 30
    for name in ("auc", "loss"):
        value = said[f"test_{name}"]
        assert isinstance(value, float) and np.isfinite(value), said
        assert value == pytest.approx(reported[name], abs=1.5e-4), (name, said, reported)
    assert 0.0 < said["test_loss"] and 0.0 <= said["test_auc"] <= 1.0


def corrupt(path, name, how):
    """Damage the sparse part ``name`` (at its path in the shard) in one way."""
    with h5py.File(path, "r+") as f:
        g = f[name]
        index = g["index"][()]
        if how == "index out of range":
            g["index"][len(index) - 1] = g.attrs["rows"] + 5
        elif how == "index not ascending":
            g["index"][0], g["index"][1] = index[1], index[0]
        elif how == "values one row short":
            values = g["values"][()]
            del g["values"]
            g.create_dataset("values", data=values[:-1])
        elif how == "values of another dtype":
            values = g["values"][()]
            del g["values"]
            g.create_dataset("values", data=values.astype(np.float64))
        elif how == "rows that are not the part's":
            g.attrs["rows"] = 3
        elif how == "an unknown base":
            g.attrs["base"] = "pickle"
        elif how == "an index of floats":
            del g["index"]
            g.create_dataset("index", data=index.astype(np.float32))


CORRUPTIONS = {
    "index out of range": "its row index holds positions outside 0..",
    "index not ascending": "its row index is not strictly ascending",
    "values one row short": "(one row per index entry)",
    "values of another dtype": "its values are float64",
    "rows that are not the part's": "it says it has 3 rows, the manifest",
    "an unknown base": "what its other rows hold is 'pickle'",
    "an index of floats": "its row index is not a 1-D array of integers",
}


@pytest.mark.launcher
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupted_sparse_part_is_one_clear_error(runs, tmp_path, how):
    """Each kind of damage is one CheckpointError line naming the shard, the variable and
    what is wrong; from the command line, that line and exit code 2, no file written."""
    d, _ = runs
    shutil.copytree(d / "runs/resumed", tmp_path / "ck")
    manifest = tmp_path / "ck/ckpt-30.json"
    corrupt(Checkpoint(manifest).shard_path(1), checkpoint.h5_path(EMBEDDING, False), how)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(manifest).read_all(model_initial(d))
    message = str(e.value)
    assert CORRUPTIONS[how] in message and "\n" not in message, message
    assert f"shard ckpt-30.shard-1-of-3.h5 holds '{EMBEDDING}' sparsely" in message, message
    # and from the command line: that one line, exit code 2
    job = str(d / "job.toml")
    r = run_py(["-m", "mpips", "ckpt", "export", str(manifest), "o.h5", "--job", job], tmp_path)
    assert r.returncode == 2 and CORRUPTIONS[how] in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.launcher
def test_a_run_restoring_a_corrupted_sparse_part_stops_with_one_message(runs, tmp_path):
    """A PS restoring a damaged sparse slot stops the job: exit 2, said once."""
    d, _ = runs
    for name in ("s.h5", "job.toml"):
        shutil.copy(d / name, tmp_path / name)
    shutil.copytree(d / "runs/resumed", tmp_path / "runs/resumed")
    shard = Checkpoint(tmp_path / "runs/resumed/ckpt-30.json").shard_path(0)
    corrupt(shard, checkpoint.h5_path(f"{WIDE}/accumulator", True), "index out of range")
    before = shard.read_bytes()
    (tmp_path / "job.toml").write_text(JOB.format(data=d / "s.h5", steps=40, ckpt="runs/resumed"))
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml", "--ps", "3"], tmp_path, 120)
    message = "its row index holds positions outside 0.."
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count(message) == 1 and "Traceback" not in r.stderr, r.stderr
    assert shard.read_bytes() == before  # nothing written over it


# -- in one process: the writer's choices and the reader's arithmetic ----------------------


def partition(model, opt, rows, seed=3):
    """A fresh partition of the embedding (rows ``rows``) and its Adagrad slot."""
    table = model.initial_rows(EMBEDDING, rows, seed)
    return table, opt.init_slots(table)["accumulator"]


def write(d, step, model, opt, parts, seed=3, values=None):
    """Shards of ``parts`` (shard -> (rows, table, slot)) and their manifest."""
    values = values or initial.from_model(model, opt, 1 << 12)  # small chunks: many of them
    for k, (rows, table, slot) in parts.items():
        tables = checkpoint.SparseTables({EMBEDDING: rows}, seed, values)
        checkpoint.write_shard(
            d, step, k, len(parts), {EMBEDDING: table}, {f"{EMBEDDING}/accumulator": slot}, tables
        )

    table = checkpoint.Entry(
        (model.num_features, model.dim),
        "float32",
        tuple(checkpoint.Part(k, rows) for k, (rows, _, _) in parts.items()),
    )
    checkpoint.commit(
        d, step, len(parts), {EMBEDDING: table}, {f"{EMBEDDING}/accumulator": table}, {}
    )
    return Checkpoint(d / f"ckpt-{step}.json")


def test_touched_rows_are_stored_and_the_rest_computed_again_bit_for_bit(tmp_path):
    """Exactly the changed rows are stored (-0.0 for +0.0 counts as a change); read whole
    and re-sliced onto other partitions, table and slot come back bit for bit."""
    model = WideDeep(30_000, [2], embedding_dim=4)
    opt = build_optimizer(OptimizerConfig(kind="adagrad"))
    values = initial.from_model(model, opt, 1 << 12)
    want, want_slot = partition(model, opt, (0, 30_000, 1))
    rng = np.random.default_rng(1)
    touched = np.unique(rng.integers(0, 30_000, 300))
    want[touched] *= 0.5
    want_slot[touched] += 1
    want[touched[0], 0] = -0.0  # the bits, not the value, decide: -0.0 is not +0.0
    want[touched[1], 0] = 0.0
    parts = {k: ((k, 30_000, 2), want[k::2], want_slot[k::2]) for k in range(2)}
    ckpt = write(tmp_path, 1, model, opt, parts)
    stored = [n for _, n in ckpt.layouts(EMBEDDING)]
    assert sum(stored) == len(touched), stored
    got, got_slots = ckpt.read_all(values)
    assert got[EMBEDDING].tobytes() == want.tobytes()
    assert got_slots[f"{EMBEDDING}/accumulator"].tobytes() == want_slot.tobytes()
    assert ckpt.stored_bytes < 0.05 * ckpt.regenerated_bytes
    # re-sliced onto 1, 3 and 4 PS tasks ("mod") and onto contiguous blocks ("div")
    specs = [VariableSpec(EMBEDDING, want.shape)]
    slot_specs = [VariableSpec(f"{EMBEDDING}/accumulator", want.shape)]
    for rows in [(0, 30_000, 1), (2, 30_000, 3), (1, 30_000, 4), (7_500, 15_000, 1)]:
        wanted = {EMBEDDING: rows, f"{EMBEDDING}/accumulator": rows}
        part = ckpt.read(specs, slot_specs, rows=wanted, initial=values)
        assert part[EMBEDDING].tobytes() == want[range(*rows)].tobytes(), rows
        got_slot = part[f"{EMBEDDING}/accumulator"]
        assert got_slot.tobytes() == want_slot[range(*rows)].tobytes(), rows


def test_a_partition_most_of_whose_rows_changed_is_written_whole(tmp_path):
    """Half the rows changed: sparse would not pay, the table is written whole; its slot,
    with 100 rows changed, sparsely."""
    model = WideDeep(30_000, [2], embedding_dim=4)
    opt = build_optimizer(OptimizerConfig(kind="adagrad"))
    table, slot = partition(model, opt, (0, 30_000, 1))
    table[::2] += 1  # half the rows: sparse would write more than half the bytes
    slot[:100] += 1  # a hundred rows: sparse
    ckpt = write(tmp_path, 1, model, opt, {0: ((0, 30_000, 1), table, slot)})
    assert ckpt.layouts(EMBEDDING) == [(0, None)]
    assert ckpt.layouts(f"{EMBEDDING}/accumulator", True) == [(0, 100)]
    got, got_slots = ckpt.read_all(initial.from_model(model, opt))
    assert got[EMBEDDING].tobytes() == table.tobytes()
    assert got_slots[f"{EMBEDDING}/accumulator"].tobytes() == slot.tobytes()


def test_a_small_partition_is_written_whole_and_a_constant_needs_no_model(tmp_path):
    """Under SPARSE_MIN_BYTES: whole. A slot whose untouched rows are one constant reads
    back without any model; rows that are the model's initial values need one."""
    model = WideDeep(1_000, [2], embedding_dim=4)  # 16 KB: too small to bother
    opt = build_optimizer(OptimizerConfig(kind="adagrad"))
    table, slot = partition(model, opt, (0, 1_000, 1))
    ckpt = write(tmp_path, 1, model, opt, {0: ((0, 1_000, 1), table, slot)})
    assert ckpt.layouts(EMBEDDING) == [(0, None)]
    big = WideDeep(40_000, [2], embedding_dim=4)
    table, slot = partition(big, opt, (0, 40_000, 1))
    slot[5] = 2
    ckpt = write(tmp_path / "big", 1, big, opt, {0: ((0, 40_000, 1), table + 1, slot)})
    assert ckpt.layouts(EMBEDDING) == [(0, None)]  # every row changed
    assert ckpt.layouts(f"{EMBEDDING}/accumulator", True) == [(0, 1)]
    with h5py.File(ckpt.shard_path(0), "r") as f:
        g = f[checkpoint.h5_path(f"{EMBEDDING}/accumulator", True)]
        assert plain_attrs(g)["base"] == "constant" and g.attrs["value"] == np.float32(0.1)
    # the slot's untouched rows are one constant: no model needed to read it
    got = ckpt.read([], [VariableSpec(f"{EMBEDDING}/accumulator", slot.shape)])
    assert got[f"{EMBEDDING}/accumulator"].tobytes() == slot.tobytes()
    with pytest.raises(checkpoint.NeedsModel, match=r"pass the job file that trained it"):
        write(tmp_path / "t", 1, big, opt, {0: ((0, 40_000, 1), table, slot)}).read_all()


def test_initial_rows_of_another_model_are_refused(tmp_path):
    """Initial rows of the wrong shape (another model) are an error, not a silent mix."""
    model = WideDeep(30_000, [2], embedding_dim=4)
    opt = build_optimizer(OptimizerConfig(kind="adagrad"))
    table, slot = partition(model, opt, (0, 30_000, 1))
    table[3] += 1
    ckpt = write(tmp_path, 1, model, opt, {0: ((0, 30_000, 1), table, slot)})
    other = initial.from_model(WideDeep(30_000, [2], embedding_dim=8), opt)
    with pytest.raises(CheckpointError, match="not the model that wrote the checkpoint"):
        ckpt.read_all(other)
