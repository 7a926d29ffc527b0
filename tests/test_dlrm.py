"""DLRM from PyTorch (jobs/torch_dlrm.py) on synthetic Criteo data (``data
criteo-synthetic``): the converter's layout, determinism, cardinality cap and bad arguments
in-process; the module's fused and per-feature tables agree; and the shipped job trains to
a stated AUC in hybrid mode, 1 PS + 2 workers."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
from conftest import ROOT, need, run_py, run_train

from mpips.cli import main
from mpips.data.batches import load_split, open_dataset
from mpips.data.criteo_synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    cardinalities,
    id_offsets,
    make_criteo_synthetic,
)


def _arrays(path) -> list[np.ndarray]:
    info = open_dataset(str(path))
    out = []
    for split in ("train", "test"):
        x, y = load_split(info, split)
        out += [x.indptr, x.indices, x.data, y]
    return out


def test_criteo_synthetic_layout(tmp_path):
    """Rows of 39 features in feature order: ids 0..12 valued log(1 + x) with x >= 1, then
    categorical f's id in [offset f, offset f + cardinality f), valued 1; rows // 10 test
    rows; the id space 13 + the capped cardinalities."""
    make_criteo_synthetic(tmp_path / "c.h5", rows=200, max_cardinality=50)
    info = open_dataset(str(tmp_path / "c.h5"))
    assert info.rows == {"train": 200, "test": 20} and info.max_nnz == 39
    assert info.num_inputs == 13 + int(cardinalities(50).sum())
    x, y = load_split(info, "train")
    ids, values = x.indices.reshape(200, 39), x.data.reshape(200, 39)
    assert (ids[:, :13] == np.arange(13)).all() and (values[:, :13] >= np.log(2) - 1e-6).all()
    low, card = id_offsets(50), cardinalities(50)
    assert ((ids[:, 13:] >= low) & (ids[:, 13:] < low + card)).all()
    assert (values[:, 13:] == 1).all() and set(np.unique(y)) == {0, 1}


def test_criteo_synthetic_is_deterministic(tmp_path):
    """The same seed writes the same file; another seed, other rows."""
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        make_criteo_synthetic(tmp_path / f"{name}.h5", rows=100, max_cardinality=1000, seed=seed)
    a, b, c = (_arrays(tmp_path / f"{n}.h5") for n in "abc")
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert not np.array_equal(a[1], c[1])


def test_criteo_synthetic_caps_cardinalities(tmp_path):
    """--max-cardinality caps each feature (those below it keep the published count); the
    Zipf draws reach past a small cap, so every capped feature's ids fill their range."""
    assert cardinalities(10**9).tolist() == list(CRITEO_KAGGLE_CARDINALITIES)
    assert sum(CRITEO_KAGGLE_CARDINALITIES) == 33_762_577
    card = cardinalities(5)
    assert card.tolist() == [min(c, 5) for c in CRITEO_KAGGLE_CARDINALITIES]
    make_criteo_synthetic(tmp_path / "c.h5", rows=2000, max_cardinality=5)
    info = open_dataset(str(tmp_path / "c.h5"))
    assert info.num_inputs == 13 + int(card.sum())
    cats = load_split(info, "train")[0].indices.reshape(-1, 39)[:, 13:] - id_offsets(5)
    assert [len(np.unique(cats[:, f])) for f in range(26)] == card.tolist()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--rows", "9"], "--rows 9: criteo-synthetic needs at least 10 train rows"),
        (["--rows", "0"], "--rows 0: criteo-synthetic needs at least 10 train rows"),
        (["--max-cardinality", "0"], "--max-cardinality 0: must be at least 1"),
        (["--seed", "-1"], "--seed -1: must be 0 or more"),
        (["--rows", str(10**12)], "TiB, more than the"),  # (refused before writing)
    ],
)
def test_criteo_synthetic_bad_arguments(tmp_path, capsys, args, says):
    """One line, exit code 2, nothing written."""
    out = tmp_path / "c.h5"
    assert main(["data", "criteo-synthetic", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mpips: error: {err.split('error: ', 1)[1]}" and says in err, err
    assert "\n" not in err and not out.exists()


def _dlrm_module():
    spec = importlib.util.spec_from_file_location("torch_dlrm", ROOT / "jobs" / "torch_dlrm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dlrm_fused_tables_equal_per_feature_tables(tmp_path):
    """fused=True (one table of every feature's rows) computes what the 26 tables of their
    features' cardinalities do; a file of another layout is refused in a line."""
    torch = need("torch")
    from mpips.errors import DataError
    from mpips.torch import SparseInput

    dlrm = _dlrm_module()
    make_criteo_synthetic(tmp_path / "c.h5", rows=64, max_cardinality=20)
    info = open_dataset(str(tmp_path / "c.h5"))
    x, _ = load_split(info, "train")
    sizes = dlrm.feature_sizes(info.num_inputs)
    assert sizes == cardinalities(20).tolist()
    torch.manual_seed(0)
    tables = dlrm.DLRM(sizes, 4, (8,), (8,), fused=False)
    fused = dlrm.DLRM(sizes, 4, (8,), (8,), fused=True)
    fused.load_state_dict(tables.state_dict(), strict=False)
    low = id_offsets(20) - 13  # (the fused table's rows: the categorical ids)
    with torch.no_grad():
        for f, table in enumerate(tables.embeddings):
            fused.embedding.weight[int(low[f]) : int(low[f]) + sizes[f]] = table.weight
    as_tensor = lambda a, t: torch.from_numpy(np.asarray(a, t))  # noqa: E731
    batch = SparseInput(
        as_tensor(x.indices, np.int64),
        as_tensor(x.indptr[:-1], np.int64),
        as_tensor(x.data, np.float32),
        64,
    )
    out = tables(dlrm.plain_batch(batch, sizes, False))
    torch.testing.assert_close(out, fused(dlrm.plain_batch(batch, sizes, True)))
    short = SparseInput(batch.indices[:-1], batch.offsets, batch.weights[:-1], 64)
    with pytest.raises(DataError, match="every row must hold the 13 integer and 26 categorical"):
        tables(short)
    with pytest.raises(DataError, match="which no criteo-synthetic file has"):
        dlrm.feature_sizes(info.num_inputs + 1)


@pytest.mark.launcher
def test_dlrm_trains_to_a_stated_auc_in_hybrid_mode(tmp_path):
    """jobs/torch_dlrm.toml (its module, SGD 0.5; a smaller model: 8-wide embeddings, bottom
    13-16-8, top 359-32-1) on 40000 synthetic rows with cardinalities capped at 300, hybrid,
    1 PS + 2 workers, 300 global steps of 2 x 128 rows: test AUC 0.7184 in each of 3 runs,
    5.8 to 11 s each on 2 shared cores (the planted model's own AUC is 0.90; a model that
    learns nothing, 0.5; async mode at the same examples, 0.66). Bar: 0.68."""
    need("torch")
    shutil.copy(ROOT / "jobs" / "torch_dlrm.py", tmp_path / "torch_dlrm.py")
    job = (ROOT / "jobs" / "torch_dlrm.toml").read_text()
    for line, small in (
        ("embedding_dim = 16", "embedding_dim = 8"),
        ("bottom = [64, 32]", "bottom = [16]"),
        ("top = [64, 32]", "top = [32]"),
        ('path = "data/criteo_synthetic.h5"', 'path = "c.h5"'),
        ("epochs = 1", "epochs = 10"),
    ):
        assert line in job, line
        job = job.replace(line, small)
    (tmp_path / "dlrm.toml").write_text(job)
    make_criteo_synthetic(tmp_path / "c.h5", rows=40_000, max_cardinality=300)
    r = run_train(tmp_path, 3, "dlrm.toml", "--steps", "300", "--ckpt-dir", "runs", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.result["global_step"] == 300 and r.result["test_auc"] > 0.68, r.result
    # eval reads each table's own rows as the run did (table_offsets): the same AUC
    e = run_py(["-m", "mpips", "eval", "dlrm.toml", "--ckpt", "runs"], tmp_path)
    assert e.returncode == 0 and f"test_auc {r.result['test_auc']:.4f}" in e.stdout, e
