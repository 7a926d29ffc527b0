"""Incremental table shards: after a base, a PS writes only the table rows (and slot rows)
changed since its previous checkpoint, on top of it. Read back, every checkpoint of the chain
is bit for bit what was written, on the writer's layout and on any other; pruning keeps what
a kept checkpoint overlays; a base gone or not committed is one clear error."""

import json

import h5py
import numpy as np
import pytest

from mpips import checkpoint
from mpips.checkpoint import Checkpoint, Increments, SparseTables
from mpips.checkpoint.increments import row_digests
from mpips.errors import CheckpointError
from mpips.models.initial import InitialValues
from mpips.models.variables import VariableSpec

ROWS, WIDTH, SEED = 20_000, 8, 3  # a 640 KB table: large enough to be stored sparsely
TABLE, SLOT = "emb", "emb/accumulator"


def initial_rows(table, rows, seed):
    """The table's initial rows: distinct, from the row number and ``seed``; Adagrad's 0.1."""
    r = np.arange(*rows, dtype=np.float32)[:, None]
    values = r * 0.001 + np.arange(WIDTH, dtype=np.float32) + seed
    return {"": values, "accumulator": np.full_like(values, 0.1)}


INITIAL = InitialValues(initial_rows)


class Writer:
    """Two PS tasks holding the table split mod 2, each with its own Increments."""

    def __init__(self, d, every):
        self.d = d
        self.table = INITIAL.compute(TABLE, (0, ROWS, 1), SEED)
        self.full = {TABLE: self.table[""].copy(), SLOT: self.table["accumulator"].copy()}
        self.increments = [Increments(every, 0), Increments(every, 0)]

    def train(self, rng, rows):
        """Change ``rows`` random rows of the table and of its slot."""
        touched = rng.choice(ROWS, rows, replace=False)
        self.full[TABLE][touched] += rng.standard_normal((rows, WIDTH)).astype(np.float32)
        self.full[SLOT][touched] += 1.0

    def save(self, step, commit=True):
        for k in (0, 1):
            part = (k, ROWS, 2)
            tables = SparseTables({TABLE: part}, SEED, INITIAL)
            checkpoint.write_shard(
                self.d,
                step,
                k,
                2,
                {TABLE: self.full[TABLE][k::2]},
                {SLOT: self.full[SLOT][k::2]},
                tables,
                increments=self.increments[k],
            )
        if commit:
            self.commit(step)
        return {k: v.copy() for k, v in self.full.items()}

    def commit(self, step):
        parts = (checkpoint.Part(0, (0, ROWS, 2)), checkpoint.Part(1, (1, ROWS, 2)))
        entry = checkpoint.Entry((ROWS, WIDTH), "float32", parts)
        checkpoint.commit(self.d, step, 2, {TABLE: entry}, {SLOT: entry}, {}, max_to_keep=2)


def read(path, rows=None):
    spec = VariableSpec(TABLE, (ROWS, WIDTH), "float32")
    slot = VariableSpec(SLOT, (ROWS, WIDTH), "float32")
    want = {TABLE: rows, SLOT: rows} if rows else None
    return Checkpoint(path).read([spec], [slot], rows=want, initial=INITIAL)


def test_every_checkpoint_of_a_chain_reads_back_bit_for_bit_on_any_layout(tmp_path):
    w, rng = Writer(tmp_path, every=3), np.random.default_rng(0)
    saved, bases = {}, {}
    for step in range(10, 80, 10):
        w.train(rng, 50)
        saved[step] = w.save(step)
        bases[step] = json.loads((tmp_path / f"ckpt-{step}.json").read_text()).get("bases")
        if step == 30:
            with h5py.File(tmp_path / "ckpt-30.shard-1-of-2.h5") as f:
                assert f[f"variables/{TABLE}"].attrs["base"] == b"checkpoint"
                stored = f[f"variables/{TABLE}/index"].shape[0]
    # a base, three increments, a base, two increments
    assert bases == {10: None, 20: [10], 30: [20], 40: [30], 50: None, 60: [50], 70: [60]}
    assert 0 < stored <= 50  # only the rows changed since step 20 that this shard holds
    # kept: the newest 2 and what they overlay (50); 10 to 40 pruned
    assert sorted(s for s, _ in checkpoint.list_checkpoints(tmp_path)) == [50, 60, 70]
    for step in (50, 60, 70):
        for rows in (None, (0, ROWS, 1), (1, ROWS, 3), (100, 9000, 1)):
            got = read(tmp_path / f"ckpt-{step}.json", rows)
            r = slice(*rows) if rows else slice(None)
            for name in (TABLE, SLOT):
                assert got[name].tobytes() == saved[step][name][r].tobytes(), (step, rows, name)


def test_an_increment_writes_only_what_changed(tmp_path):
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(1)
    w.train(rng, 5000)
    w.save(10)
    base = Checkpoint(tmp_path / "ckpt-10.json")
    w.train(rng, 20)
    w.save(20)
    inc = Checkpoint(tmp_path / "ckpt-20.json")
    for name, is_slot in ((TABLE, False), (SLOT, True)):
        assert sum(n for _, n in base.layouts(name, is_slot)) == 5000  # changed from initial
        assert sum(n for _, n in inc.layouts(name, is_slot)) == 20  # changed since step 10
    size = lambda c: sum(c.shard_path(k).stat().st_size for k in range(2))  # noqa: E731
    assert size(inc) < size(base) / 10  # (an HDF5 file's own overhead: ~10 KB)


def test_no_increment_on_a_checkpoint_that_is_not_committed(tmp_path):
    """A PS writes a base when its last shard never committed; a commit refuses a shard
    that overlays an uncommitted checkpoint."""
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(2)
    w.train(rng, 10)
    w.save(10, commit=False)  # (another PS failed: no manifest)
    w.train(rng, 10)
    saved = w.save(20)
    assert "bases" not in json.loads((tmp_path / "ckpt-20.json").read_text())
    got = read(tmp_path / "ckpt-20.json")
    assert got[TABLE].tobytes() == saved[TABLE].tobytes()
    # a shard that overlays step 25, never committed, is refused at the commit
    w.train(rng, 10)
    w.increments[0].step = w.increments[1].step = 25
    (tmp_path / "ckpt-25.json").write_text("{}")  # there while the shards are written
    w.save(30, commit=False)
    (tmp_path / "ckpt-25.json").unlink()  # and gone at the commit
    with pytest.raises(CheckpointError, match="global_step 25, which is not committed"):
        w.commit(30)
    assert not (tmp_path / "ckpt-30.json").exists()


def test_an_increment_whose_base_is_gone_is_one_clear_error(tmp_path):
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(3)
    for step in (10, 20):
        w.train(rng, 10)
        w.save(step)
    (tmp_path / "ckpt-10.json").unlink()
    with pytest.raises(CheckpointError, match="global_step 10, and that one is gone"):
        read(tmp_path / "ckpt-20.json")


def test_digests_tell_rows_apart_bit_for_bit():
    a = np.zeros((4, 3), np.float32)
    a[1, 0] = -0.0  # another bit pattern
    a[2, 2] = 1e-45
    a[3] = [0, 0, 0]
    d = row_digests(a)
    assert d[0] == d[3] and len({d[0], d[1], d[2]}) == 3
    b = np.arange(12, dtype=np.float64).reshape(4, 3)
    swapped = b[:, ::-1].copy()  # the same words in another order differ
    assert not (row_digests(b) == row_digests(swapped)).any()


@pytest.mark.launcher
def test_a_run_checkpoints_increments_and_resumes_from_one_on_another_ps_count(tmp_path):
    """The CTR job with a checkpoint every 4 steps: after the first, each PS writes only the
    rows changed since its last one. Resumed from an increment onto 3 PS tasks, it ends
    where a run that wrote every checkpoint whole ends, bit for bit; `ckpt inspect` says
    what it overlays."""
    from conftest import run_mpi, run_py
    from test_sparse_checkpoint import JOB, TABLES, model_initial, sparse_dataset

    sparse_dataset(tmp_path / "s.h5")

    def train(steps, ckpt, ps, increments):
        text = JOB.format(data=tmp_path / "s.h5", steps=steps, ckpt=ckpt)
        text = text.replace("embedding_dim = 4", "embedding_dim = 8")  # (32-byte rows)
        text += f"every_steps = 4\nincrements = {increments}\nmax_to_keep = 1\n"
        text += "increments_min_mb = 0\n"  # (its tables are small: increments all the same)
        (tmp_path / "job.toml").write_text(text)
        args = ["-m", "mpips", "train", "job.toml", "--ps", str(ps)]
        r = run_mpi(ps + 1, args, tmp_path, 120)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    train(18, "runs/inc", 2, 8)
    kept = sorted(s for s, _ in checkpoint.list_checkpoints(tmp_path / "runs/inc"))
    # max_to_keep 1, and the chain it overlays (a periodic checkpoint asked for while the
    # one before is still being written is skipped: which ones were taken varies)
    assert kept[0] == 4 and kept[-1] == 18, kept
    for before, step in zip(kept, kept[1:], strict=False):
        manifest = json.loads((tmp_path / f"runs/inc/ckpt-{step}.json").read_text())
        assert manifest["bases"] == [before]
    r = run_py(["-m", "mpips", "ckpt", "inspect", "runs/inc", "--job", "job.toml"], tmp_path)
    said = f"changed since global_step {kept[-2]}"
    assert r.returncode == 0 and said in r.stdout, r.stdout + r.stderr
    resumed = train(30, "runs/inc", 3, 8).stdout
    assert "restored global_step 18" in resumed
    train(30, "runs/whole", 2, 0)
    assert "bases" not in json.loads((tmp_path / "runs/whole/ckpt-30.json").read_text())
    values = model_initial(tmp_path)
    got = Checkpoint(tmp_path / "runs/inc/ckpt-30.json").read_all(values)
    want = Checkpoint(tmp_path / "runs/whole/ckpt-30.json").read_all(values)
    assert set(TABLES) <= set(got[0]) | set(got[1])
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in w:
            assert g[name].tobytes() == w[name].tobytes(), name


def test_an_array_under_the_size_for_increments_is_written_as_a_base_each_time(tmp_path):
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(4)
    w.increments = [Increments(8, 1 << 20), Increments(8, 1 << 20)]  # a part: 320 KB
    for step in (10, 20):
        w.train(rng, 10)
        saved = w.save(step)
    assert "bases" not in json.loads((tmp_path / "ckpt-20.json").read_text())
    assert read(tmp_path / "ckpt-20.json")[TABLE].tobytes() == saved[TABLE].tobytes()


def test_a_second_save_at_the_same_step_is_a_base(tmp_path):
    """The end of a run may save again at the step of its last periodic checkpoint: that
    shard is a base, not an increment on itself (which would replace the rows it needs)."""
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(5)
    for step in (10, 20):
        w.train(rng, 10)
        w.save(step)
    w.train(rng, 10)
    saved = w.save(20)  # again, after more training
    assert "bases" not in json.loads((tmp_path / "ckpt-20.json").read_text())
    got = read(tmp_path / "ckpt-20.json")
    assert got[TABLE].tobytes() == saved[TABLE].tobytes()


def test_an_increment_of_most_rows_is_written_as_a_base(tmp_path):
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(6)
    w.train(rng, 10)
    w.save(10)
    w.train(rng, int(0.8 * ROWS))  # most rows changed: an increment would be no smaller
    saved = w.save(20)
    assert "bases" not in json.loads((tmp_path / "ckpt-20.json").read_text())
    assert read(tmp_path / "ckpt-20.json")[SLOT].tobytes() == saved[SLOT].tobytes()


def test_narrow_rows_are_not_written_as_increments():
    """A digest is 8 bytes a row: a table of width-1 float32 rows would hold twice its
    memory in them, so it is written as a base each time."""
    inc = Increments(8, 0)
    assert not inc.takes(np.zeros((1000, 1), np.float32))
    assert inc.takes(np.zeros((1000, 8), np.float32))
    assert not Increments(0, 0).takes(np.zeros((1000, 8), np.float32))


def test_a_commit_refuses_a_shard_whose_bases_are_not_earlier_steps(tmp_path):
    w, rng = Writer(tmp_path, every=8), np.random.default_rng(7)
    w.train(rng, 10)
    w.save(10)
    w.save(20, commit=False)
    with h5py.File(tmp_path / "ckpt-20.shard-0-of-2.h5", "r+") as f:
        f.attrs["bases"] = np.array([20])  # itself: crafted, or a bug
    with pytest.raises(CheckpointError, match="are not steps before 20; not committed"):
        w.commit(20)
    with h5py.File(tmp_path / "ckpt-20.shard-0-of-2.h5", "r+") as f:
        f.attrs["bases"] = "ten"
    with pytest.raises(CheckpointError, match="are not steps before 20"):
        w.commit(20)
