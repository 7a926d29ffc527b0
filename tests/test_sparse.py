"""Sparse input, CTR models and row partitions, in one process."""

import numpy as np
import pytest
import scipy.sparse as sp

from mpips.data import ctr_convert, sparse
from mpips.data.batches import open_dataset
from mpips.errors import DataError
from mpips.models.ctr import EMBEDDING, WIDE, WideDeep
from mpips.models.metrics import auc
from mpips.models.variables import VariableSpec
from mpips.placement.table import owner_and_row, partition_rows, place_tables, round_robin


@pytest.mark.parametrize("rule", ["mod", "div"])
@pytest.mark.parametrize("num_rows,num_ps", [(10, 3), (7, 2), (5, 1), (2, 3)])
def test_ids_are_routed_to_the_partition_that_holds_them(rule, num_rows, num_ps):
    parts = partition_rows(num_rows, num_ps, rule)
    ids = np.arange(num_rows)
    owner, row = owner_and_row(ids, num_rows, num_ps, rule)
    for i in ids:
        held = list(range(*parts[owner[i]]))
        assert held[row[i]] == i  # the part's row `row` is the table's row `i`
    assert sorted(r for p in parts for r in range(*p)) == list(ids)  # each row exactly once


def test_tables_are_placed_after_the_whole_variables():
    dense = round_robin([VariableSpec("b", (1,))], 2)
    placement = place_tables(dense, [VariableSpec("emb", (5, 3))], "div")
    parts = placement.parts("emb")
    assert [(e.ps_task, e.rows, e.spec.shape) for e in parts] == [
        (0, (0, 3, 1), (3, 3)),
        (1, (3, 5, 1), (2, 3)),
    ]
    assert placement.dense_bytes(0) == 64 and parts[0].offset == 64
    assert {e.name for e in placement} == {"b", "emb"}


def random_batch(rng, rows, features, nnz):
    """A batch whose rows share ids (duplicates across rows and within the batch)."""
    ids = rng.integers(0, features, (rows, nnz))
    x = sp.csr_matrix(
        (
            rng.uniform(0.5, 1.5, rows * nnz).astype(np.float32),
            ids.ravel(),
            np.arange(0, rows * nnz + 1, nnz),
        ),
        shape=(rows, features),
    )
    x.sum_duplicates()
    return x, rng.integers(0, 2, rows).astype(np.float32)


@pytest.mark.parametrize("hidden", [None, [4]])
def test_row_gradients_equal_the_dense_gradient(hidden):
    """Duplicate ids in a batch: the gradient per unique id is the sum over every use, and
    equals the corresponding rows of the gradient of the full (dense) table."""
    rng = np.random.default_rng(0)
    features = 12
    model = WideDeep(features, hidden, embedding_dim=3)
    full = {t.name: model.initial_rows(t.name, (0, features, 1), 7) + 0.1 for t in model.tables()}
    dense = model.initial_values(3)
    x, y = random_batch(rng, 6, features, 4)
    assert len(np.unique(x.indices)) < x.nnz  # the batch does repeat ids

    want = {k: np.zeros_like(v) for k, v in {**dense, **full}.items()}
    want_loss = model.loss_and_grads({**dense, **full}, x, y, want)

    local, ids = model.prepare(x)
    rows = {name: table[ids] for name, table in full.items()}
    got = {
        **{k: np.zeros_like(v) for k, v in dense.items()},
        **{k: np.zeros_like(v) for k, v in rows.items()},
    }
    assert model.loss_and_grads({**dense, **rows}, local, y, got) == pytest.approx(want_loss)
    for name in full:
        np.testing.assert_allclose(got[name], want[name][ids], rtol=1e-5, atol=1e-7)
        untouched = np.setdiff1d(np.arange(features), ids)
        assert not want[name][untouched].any()  # only touched rows have a gradient
    for name in dense:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_initial_rows_do_not_depend_on_the_partition():
    model = WideDeep(10, [2], embedding_dim=4)
    whole = model.initial_rows(EMBEDDING, (0, 10, 1), 5)
    np.testing.assert_array_equal(model.initial_rows(EMBEDDING, (1, 10, 3), 5), whole[1::3])
    assert np.abs(whole).max() <= 0.05 and len(np.unique(whole)) == whole.size
    assert not model.initial_rows(WIDE, (0, 10, 1), 5).any()


def test_auc_matches_the_pair_count():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 200)
    s = rng.normal(size=200) + y
    s[:20] = 0.5  # ties count half
    pos, neg = s[y == 1], s[y == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auc(y, s) == pytest.approx(pairs)


def test_libsvm_and_libffm_converters(tmp_path):
    (tmp_path / "a.svm").write_text("1 3:0.5 7:1\n-1 1:2 # comment\n\n+1 7:1 7:2\n0 2:1\n")
    ctr_convert.convert_libsvm(tmp_path / "a.h5", tmp_path / "a.svm", test_src=tmp_path / "a.svm")
    info = open_dataset(str(tmp_path / "a.h5"))
    assert info.sparse and info.num_inputs == 8 and info.rows == {"train": 4, "test": 4}
    x, y = sparse.load_csr(info.path, "train", (0, 4), info.num_inputs)
    np.testing.assert_array_equal(y, [1, 0, 1, 0])
    np.testing.assert_allclose(x.toarray()[2], [0, 0, 0, 0, 0, 0, 0, 3])  # duplicates summed
    (tmp_path / "b.ffm").write_text("1 0:3:0.5 1:7:1\n0 2:1:2\n")
    ctr_convert.convert_libsvm(tmp_path / "b.h5", tmp_path / "b.ffm", test_fraction=0.5, ffm=True)
    assert open_dataset(str(tmp_path / "b.h5")).rows == {"train": 1, "test": 1}
    (tmp_path / "bad.svm").write_text("1 3:0.5\n1 3\n")
    with pytest.raises(DataError, match=r"bad.svm:2: not a libsvm line"):
        ctr_convert.convert_libsvm(tmp_path / "bad.h5", tmp_path / "bad.svm")
    assert not (tmp_path / "bad.h5").exists()


def test_bad_sparse_files(tmp_path):
    x = sp.csr_matrix(np.eye(4, dtype=np.float32))
    y = np.array([0, 1, 0, 1])
    sparse.write_csr(tmp_path / "ok.h5", (x, y), (x, y), 4)
    import h5py

    with h5py.File(tmp_path / "ok.h5", "a") as f:
        f.attrs["num_features"] = 3  # ids go up to 3
    info = open_dataset(str(tmp_path / "ok.h5"))
    with pytest.raises(DataError, match="feature id 3 outside 0..2"):
        sparse.load_csr(info.path, "train", (0, 4), info.num_inputs)
    with h5py.File(tmp_path / "ok.h5", "a") as f:
        del f["test/values"]
    with pytest.raises(DataError, match="'test/values' must be a 1-D float array"):
        open_dataset(str(tmp_path / "ok.h5"))


def test_zipf_ids_are_skewed_and_in_range(tmp_path):
    ctr_convert.make_zipf(tmp_path / "z.h5", rows=2000, num_features=1_000_000, nnz=8)
    info = open_dataset(str(tmp_path / "z.h5"))
    x, y = sparse.load_csr(info.path, "train", (0, 2000), info.num_inputs)
    counts = np.bincount(x.indices)
    assert x.indices.max() < 1_000_000 and 0.2 < y.mean() < 0.8
    assert counts.max() > 100 * np.median(counts[counts > 0])  # a few ids everywhere
