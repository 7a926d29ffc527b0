"""Dynamic tables (tables.kind = "dynamic"): a PS task's rows (admission, eviction by age
and at capacity, restore), and under mpiexec: training equal to the dense one-process
computation where no id collides, checkpoints restored onto 1, 2 and 3 PS tasks, ids far
past any fixed table, the counts reported, export, and what is refused."""

import h5py
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import run_mpi, run_py
from test_ctr_mpi import FEATURES, JOB, reference, small_dataset

from mpips.checkpoint import Checkpoint
from mpips.data import sparse
from mpips.job import parse_job
from mpips.store.dynamic_rows import DynamicRows, Policy, owner_of
from mpips.store.id_map import IdMap
from mpips.store.row_cache import RowCache

DYNAMIC = '\n[tables]\nkind = "dynamic"\n'


def table(policy=None, slots=("accumulator",)):
    """Two tables of one map: "t" of 2-wide rows, each id's initial row (id, -id), and "u"
    of 1-wide rows (10 id); each accumulator 0.1."""

    def initial(ids):
        rows = {"t": np.stack([ids, -ids], axis=1), "u": 10 * ids[:, None]}
        return {
            n: {"": r.astype(np.float32), "accumulator": np.full(r.shape, 0.1, np.float32)}
            for n, r in rows.items()
        }

    return DynamicRows({"t": 2, "u": 1}, np.dtype(np.float32), slots, initial, policy or Policy())


def pulled(t, ids, step, train=True):
    """Table "t"'s rows of a pull (and "u"'s, checked to be the same ids')."""
    out = {"t": np.full((len(ids), 2), np.nan, np.float32), "u": np.full((len(ids), 1), np.nan)}
    t.lookup(np.asarray(ids, np.int64), out, step, train)
    np.testing.assert_array_equal(out["u"][:, 0] == 0, (out["t"] == 0).all(axis=1))  # (one map)
    return out["t"]


def push(t, ids, g, apply=None, lr=0.0):
    """A push of gradient rows ``g`` of table "t" (zero for "u")."""
    g = np.float32(g)
    u = np.zeros((len(g), 1), np.float32)
    t.update(np.asarray(ids, np.int64), {"t": g, "u": u}, apply, lr, 1)


def test_rows_are_made_once_for_ids_of_any_value_and_read_back():
    t = table()
    big = [0, 7, 2**40 + 3, 2**63 - 1]
    np.testing.assert_array_equal(pulled(t, big, 1)[:, 0], np.float32(big))
    assert t.counts.created == 4 and t.live == 4
    push(t, [7], [[1, 1]])  # SGD: deltas added
    assert pulled(t, [7, 9], 2).tolist() == [[8, -6], [9, -9]]
    assert t.counts.created == 5  # only 9 is new
    # an evaluation's pull makes no row and counts nothing
    assert pulled(t, [11], 3, train=False).tolist() == [[0, 0]] and t.live == 5


def test_ids_below_min_count_read_zero_and_are_not_trained():
    t = table(Policy(min_count=3))
    for step in (1, 2):
        assert pulled(t, [5], step).tolist() == [[0, 0]]
    push(t, [5], [[1, 1]])  # dropped
    assert t.counts.dropped == 1 and t.counts.not_admitted == 2 and t.live == 0
    assert pulled(t, [5], 3).tolist() == [[5, -5]]  # the third pull admits it, afresh


def test_rows_not_pulled_for_ttl_steps_are_evicted():
    t = table(Policy(ttl_steps=10))
    pulled(t, [1, 2], 0)
    pulled(t, [2], 8)
    t.expire(10)
    assert t.live == 2
    t.expire(11)  # 1 was last pulled at 0: 11 steps ago
    assert sorted(t.map.items()[0].tolist()) == [2] and t.counts.evicted_age == 1
    push(t, [1], [[1, 1]])
    assert t.counts.dropped == 1  # a gradient for an evicted row goes nowhere


def test_at_capacity_the_least_used_rows_go_never_those_of_the_pull():
    t = table(Policy(capacity=3))
    for step, ids in enumerate(([1, 2, 3], [1, 2], [1])):
        pulled(t, ids, step)
    pulled(t, [4], 3)  # 3 is the least used
    assert sorted(t.map.items()[0].tolist()) == [1, 2, 4] and t.counts.evicted_full == 1
    pulled(t, [5, 6], 4)  # 4 and then 2 go: 1 was used most
    assert sorted(t.map.items()[0].tolist()) == [1, 5, 6] and t.counts.evicted_full == 3
    assert len(t.ids) == 3  # never more rows than the capacity
    with pytest.raises(ValueError, match="tables.capacity"):
        pulled(t, [7, 8, 9, 10], 5)


def test_adagrad_on_rows_and_a_restore_keep_rows_and_slots():
    from mpips.job import OptimizerConfig
    from mpips.optim import build_optimizer

    opt = build_optimizer(OptimizerConfig(kind="adagrad", learning_rate=0.5))
    t = table()
    pulled(t, [3, 4], 1)
    push(t, [4, 3], [[1, 2], [3, 4]], opt.apply, 0.5)
    ids, rows, slots = t.live_arrays()
    assert ids.tolist() == [3, 4]
    want = np.float32([[3, -3], [4, -4]])
    acc = np.float32(0.1) + np.float32([[3, 4], [1, 2]]) ** 2
    want -= 0.5 * np.float32([[3, 4], [1, 2]]) / (np.sqrt(acc) + np.float32(1e-7))
    np.testing.assert_allclose(rows["t"], want, rtol=1e-6)
    np.testing.assert_allclose(slots["t"]["accumulator"], acc, rtol=1e-6)
    again = table()
    again.load(ids, {n: {"": rows[n], **slots[n]} for n in rows}, 1)
    assert pulled(again, [4], 2).tolist() == rows["t"][1:].tolist()
    np.testing.assert_array_equal(again.live_arrays()[2]["t"]["accumulator"], acc)


@pytest.mark.parametrize("storage", ["float32", "float16"])
@pytest.mark.parametrize("rowwise", [False, True])
def test_adagrad_full_and_rowwise_on_float32_and_float16_rows_follow_float64(rowwise, storage):
    """50 updates of random rows against the same rule in float64: float32 rows within
    float32 rounding, float16 rows within one unit of the rounding of one store a step
    (the update is computed in float32 from the stored row, then rounded); the
    accumulators (one a row, row-wise) as exact as float32 allows."""
    from mpips.optim.rules import apply_adagrad, apply_rowwise_adagrad

    rng, lr, eps, width = np.random.default_rng(1), 0.05, 1e-7, 8
    rule = apply_rowwise_adagrad if rowwise else apply_adagrad

    def initial(ids):
        rows = np.cos(ids[:, None] + np.arange(width)).astype(np.float32)
        acc = np.full((len(ids), 1 if rowwise else width), 0.1, np.float32)
        return {"t": {"": rows, "accumulator": acc}}

    t = DynamicRows(
        {"t": width},
        np.dtype(np.float32),
        ("accumulator",),
        initial,
        storage=np.dtype(storage),
        rowwise=rowwise,
    )

    def apply(var, grad, slots, lr, step):
        rule(var, grad, slots["accumulator"], lr, eps)

    ids = np.arange(6, dtype=np.int64)
    ref = initial(ids)["t"][""].astype(np.float16 if storage == "float16" else np.float32)
    ref, acc = ref.astype(np.float64), np.full((6, 1 if rowwise else width), 0.1)
    out = np.empty((6, width), np.float32)
    for step in range(50):
        t.lookup(ids, {"t": out}, step)
        # as stored, widened; a store's rounding may differ by one unit where the float32
        # update and the float64 one straddle a midpoint
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-3 if storage == "float16" else 1e-5)
        g = rng.normal(size=(6, width)).astype(np.float32)
        t.update(ids, {"t": g.copy()}, apply, lr, step + 1)
        rule(ref, g.astype(np.float64), acc, lr, eps)  # (float64: the rule's exact course)
        if storage == "float16":
            ref = ref.astype(np.float16).astype(np.float64)  # what one rounded store keeps
        else:
            ref = ref.astype(np.float32).astype(np.float64)
    _, rows, slots = t.live_arrays()
    assert rows["t"].dtype == np.dtype(storage) and slots["t"]["accumulator"].shape == acc.shape
    np.testing.assert_allclose(slots["t"]["accumulator"], acc, rtol=1e-5)
    assert t.rows["t"].nbytes == len(t.ids) * width * np.dtype(storage).itemsize


def test_the_id_map_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    rng, ref, m = np.random.default_rng(3), {}, IdMap()
    for _ in range(300):
        new = np.setdiff1d(rng.integers(0, 1 << 62, 200), list(ref))
        rows = rng.integers(0, 1 << 30, len(new))
        m.insert(new, rows)
        ref.update(zip(new.tolist(), rows.tolist(), strict=True))
        gone = rng.choice(list(ref), 120, replace=False)
        m.remove(np.concatenate([gone, [7, 11]]))  # (7, 11: never in it)
        for i in gone.tolist():
            del ref[i]
        ask = np.concatenate([rng.choice(list(ref), 50), gone[:20], rng.integers(0, 9, 5)])
        np.testing.assert_array_equal(m.find(ask), [ref.get(i, -1) for i in ask.tolist()])
    assert len(m) == len(ref) and sorted(m.items()[0].tolist()) == sorted(ref)
    # the marks of empty and removed slots are never an id's: -1 and -2 find nothing
    assert m.find(np.array([-1, -2], np.int64)).tolist() == [-1, -1]
    assert len(m.keys) <= 3 * 2 * len(ref)  # never more than 6 slots a live id


def test_the_row_cache_keeps_the_most_pulled_ids_fresh_for_max_age_steps():
    out = {"t": np.zeros((4, 2), np.float32)}
    cache = RowCache(["t"], [2], np.dtype(np.float32), capacity=2, max_age=2)

    def pull(ids, rows):
        """A pull: the positions read from the cache; the others as the PS answers."""
        ids = np.asarray(ids, np.int64)
        hit, slots = cache.split(ids)
        miss = np.setdiff1d(np.arange(len(ids)), hit)
        out["t"][: len(ids)] = -1
        out["t"][miss] = np.float32(rows)[miss]
        cache.read(slots, hit, out)
        cache.store(ids, miss, out)
        return hit.tolist(), out["t"][: len(ids)].tolist()

    assert pull([1, 2, 3], [[1, 1], [2, 2], [3, 3]]) == ([], [[1, 1], [2, 2], [3, 3]])
    assert pull([1, 2], [[9, 9], [9, 9]]) == ([0, 1], [[1, 1], [2, 2]])  # cached: 1 and 2
    cache.refresh(np.array([2, 5], np.int64), {"t": np.float32([[7, 7], [5, 5]])}, np.ones(2, bool))
    assert pull([2], [[9, 9]]) == ([0], [[7, 7]])  # its own push's row
    assert pull([1], [[8, 8]]) == ([], [[8, 8]])  # 1 was read 3 steps ago: asked again
    assert pull([1], [[9, 9]]) == ([0], [[8, 8]])  # ... and cached anew
    for _ in range(3):
        pull([3], [[3, 3]])  # 3 is now pulled more often than 2 (4 times to 3)
    assert sorted(cache.map.items()[0].tolist()) == [1, 3]
    assert cache.hits == 4 and cache.looked == 11
    # a push answered "no row" for 3 (evicted on its PS task): it leaves the cache
    cache.refresh(np.array([3], np.int64), {"t": np.zeros((1, 2), np.float32)}, np.zeros(1, bool))
    assert cache.map.items()[0].tolist() == [1] and pull([3], [[4, 4]]) == ([], [[4, 4]])


def test_ids_outside_0_to_2_63_are_refused_before_anything_moves():
    from types import SimpleNamespace

    from mpips.errors import DataError
    from mpips.store.lookups import DynamicClient

    lookups = SimpleNamespace(boxes=[(None, None)], cache=(0, 0), tables=[], win=None)
    client = DynamicClient(lookups, 0)
    for bad in (np.array([3, -1]), np.array([2**63], np.uint64)):
        with pytest.raises(DataError, match=r"integers in \[0, 2\^63\)"):
            client.ask(bad, train=True)


def test_owners_are_a_hash_of_the_id_spread_over_the_tasks():
    ids = np.arange(0, 3000 * 1024, 1024, dtype=np.int64)  # low bits all alike
    owner = owner_of(ids, 3)
    assert set(np.bincount(owner).tolist()) <= set(range(900, 1100))
    np.testing.assert_array_equal(owner, owner_of(ids.copy(), 3))  # the same everywhere


# under mpiexec: the small CTR data of test_ctr_mpi (40 ids), one worker throughout


@pytest.mark.launcher
def test_dynamic_tables_train_as_the_dense_computation_over_1_2_and_3_ps_tasks(tmp_path):
    """10 + 10 + 10 steps on 2, 1 and 3 PS tasks, each restoring the one before it, equal
    30 steps of one process with whole tables (no id collides; untouched rows have no row).
    The last 10 with the worker caching 8 hot rows: its pushes refresh them, and it is the
    only worker, so a cached row is the PS's row (a cache that missed a refresh would
    train on stale rows)."""
    small_dataset(tmp_path / "s.h5")
    live = 0  # the rows held at the end of the run before, over every PS task
    for steps, ranks, ps in ((10, 3, "2"), (20, 2, "1"), (30, 4, "3")):
        text = JOB.format(model="wide_deep", rule="mod", opt="adagrad", lr=0.3, steps=steps)
        cache = "cache_rows = 8\ncache_steps = 100\n" if steps == 30 else ""
        (tmp_path / "job.toml").write_text(text + DYNAMIC + cache)
        r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml", "--ps", ps], cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        if steps > 10:
            assert f"restored global_step {steps - 10}" in r.stdout
            restored = sum(
                int(line.split("restored ")[1].split()[0])
                for line in r.stdout.splitlines()
                if "rows of dynamic tables" in line
            )
            assert restored == live  # each id's rows, on the task owning it
        live = sum(
            int(line.split("deep/embedding): ")[1].split()[0])
            for line in r.stdout.splitlines()
            if "dynamic tables (wide/weights, deep/embedding): " in line
        )
    hits = float(r.stdout.split("row cache: ")[1].split("%")[0])
    assert hits > 10  # (the cache is used: 8 hot ids of the 40)
    ckpt = Checkpoint(tmp_path / "runs/s/ckpt-30.json")
    assert len(ckpt.variables["deep/embedding"].parts) == 3  # a part a PS task
    text = JOB.format(model="wide_deep", rule="mod", opt="adagrad", lr=0.3, steps=30)
    job = parse_job(text.replace('"s.h5"', f'"{tmp_path / "s.h5"}"'))
    want, want_slots = reference(job, 30)
    variables, slots = ckpt.read_all()
    for name in ("wide/weights", "deep/embedding"):
        ids = variables[name + ":ids"]
        assert len(np.unique(ids)) == len(ids) and ids.max() < FEATURES
        np.testing.assert_allclose(variables[name], want[name][ids], rtol=1e-4, atol=1e-6)
        acc = slots[f"{name}/accumulator"]
        np.testing.assert_allclose(acc, want_slots[name]["accumulator"][ids], rtol=1e-4)
        untouched = np.setdiff1d(np.arange(FEATURES), ids)  # never pulled: as initialised
        np.testing.assert_allclose(want_slots[name]["accumulator"][untouched], 0.1)
    for name in ("wide/bias", "deep/dense_0/kernel"):
        np.testing.assert_allclose(variables[name], want[name], rtol=1e-4, atol=1e-6)
    final = r.stdout.split("test_auc ")[-1].split()[0]
    ev = run_py(["-m", "mpips", "eval", "job.toml"], cwd=tmp_path)  # rows by id, one process
    (tmp_path / "fixed.toml").write_text(text.replace("steps = 30", "steps = 40"))
    assert ev.returncode == 0 and f"test_auc {final}" in ev.stdout, ev.stdout + ev.stderr
    fixed = run_mpi(2, ["-m", "mpips", "train", "fixed.toml"], cwd=tmp_path)  # (see below)
    out = run_py(["-m", "mpips", "ckpt", "export", "runs/s", "out.h5"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # the checkpoint resumed with fixed tables: one line (fixed.toml, written above)
    said = 'written as a dynamic table: restore it with tables.kind = "dynamic"'
    assert fixed.returncode != 0 and said in fixed.stderr, fixed.stderr
    with h5py.File(tmp_path / "out.h5") as f:
        np.testing.assert_array_equal(f["deep/embedding:ids"][()], variables["deep/embedding:ids"])


def big_id_dataset(path, rows=400, seed=0):
    """Ids far past any table one could allocate (2^40 + k * 2^32): 60 distinct ones, a
    few of them frequent, labels from a planted weight per id."""
    rng = np.random.default_rng(seed)
    distinct = (1 << 40) + (np.arange(60, dtype=np.int64) << 32)
    ids = distinct[np.minimum(rng.zipf(1.3, (rows, 4)) - 1, 59)]
    weight = np.sin(np.arange(60))
    x = sp.csr_matrix(
        (np.ones(rows * 4, np.float32), ids.ravel(), np.arange(0, rows * 4 + 1, 4)),
        shape=(rows, int(distinct[-1]) + 1),
    )
    x.sum_duplicates()
    score = [
        weight[np.searchsorted(distinct, x.indices[a:b])].sum()
        for a, b in zip(x.indptr[:-1], x.indptr[1:], strict=True)
    ]
    y = (np.array(score) > 0).astype(np.int8)
    sparse.write_csr(path, (x[:300], y[:300]), (x[300:], y[300:]), int(distinct[-1]) + 1)


@pytest.mark.launcher
def test_admission_and_eviction_at_scale_of_ids_are_counted_and_kept_in_bounds(tmp_path):
    big_id_dataset(tmp_path / "b.h5")
    text = JOB.format(model="logreg", rule="mod", opt="ftrl", lr=0.3, steps=60)
    text = text.replace('"s.h5"', '"b.h5"') + DYNAMIC
    text += "capacity = 16\nmin_count = 3\nttl_steps = 20\ncache_rows = 4\ncache_steps = 5\n"
    (tmp_path / "job.toml").write_text(text.replace("batch_size = 8", "batch_size = 4"))
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--ps", "1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [s for s in r.stdout.splitlines() if "dynamic tables (wide/weights)" in s]
    assert len(lines) == 1  # (one PS task: 16 rows for the 60 ids)
    said = [
        [int(w) for w in s.split(": ")[1].replace(",", "").split() if w.isdigit()] for s in lines
    ]
    live, made, by_age, at_capacity, not_admitted, _ = np.sum(said, axis=0)
    assert all(s[0] <= 16 for s in said)  # never more than the capacity
    assert not_admitted > 0 and made > live and by_age + at_capacity == made - live
    ckpt = Checkpoint(tmp_path / "runs/s/ckpt-60.json")
    ids = ckpt.read_all()[0]["wide/weights:ids"]
    assert ids.min() >= 1 << 40 and len(ids) == live
    # the hottest id is admitted and kept, though the workers cache it (a cache that kept
    # the zero row of an id not yet admitted would never ask for it again)
    assert 1 << 40 in ids.tolist()
    # resumed with room for fewer rows than the checkpoint gives the PS task (batches of
    # 2 x 4 ids: 8 rows are enough for one): one line, nothing lost
    text = (tmp_path / "job.toml").read_text().replace("capacity = 16", "capacity = 8")
    text = text.replace("steps = 60", "steps = 70").replace("batch_size = 4", "batch_size = 2")
    (tmp_path / "again.toml").write_text(text)
    r = run_mpi(3, ["-m", "mpips", "train", "again.toml", "--ps", "1"], cwd=tmp_path)
    said = "more than tables.capacity = 8: raise the capacity, or restore onto more PS tasks"
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert Checkpoint(tmp_path / "runs/s/ckpt-60.json").step == 60  # (still the latest)


def test_what_dynamic_tables_rule_out_is_said_in_one_line():
    from mpips.errors import ConfigError
    from mpips.job import parse_job
    from mpips.models.ctr import WideDeep
    from mpips.modes.tables import check

    def job(extra, section="[tables]"):
        text = JOB.format(model="logreg", rule="mod", opt="sgd", lr=0.3, steps=5) + DYNAMIC
        return parse_job(text.replace(section + "\n", f"{section}\n{extra}\n"))

    model, nnz = WideDeep(40), 5
    check(job(""), model, nnz)  # (batch 8 x 5 ids: no capacity needed)
    for extra, section, said in (
        ("capacity = 39", "[tables]", "capacity = 39: below the 40 ids one batch may touch"),
        ('optimizer = "rowwise_adagrad"', "[tables]", 'with optimizer.kind = "adagrad"'),
        ("zero_copy = true", "[train]", "not with train.zero_copy"),
    ):
        with pytest.raises(ConfigError, match=said):
            check(job(extra, section), model, nnz)
    fixed = parse_job(
        JOB.format(model="logreg", rule="mod", opt="sgd", lr=0.3, steps=5)
        + '[tables]\ndtype = "float16"\n'
    )
    with pytest.raises(ConfigError, match='for tables.kind = "dynamic"'):
        check(fixed, model, nnz)


@pytest.mark.launcher
def test_a_refusal_under_mpiexec_is_one_line_and_no_traceback(tmp_path):
    small_dataset(tmp_path / "s.h5")
    text = JOB.format(model="logreg", rule="mod", opt="sgd", lr=0.3, steps=5) + DYNAMIC
    (tmp_path / "job.toml").write_text(text.replace("[train]\n", "[train]\nzero_copy = true\n"))
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path)
    assert r.returncode != 0 and "not with train.zero_copy" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("not with train.zero_copy") == 1
