"""mpips.torch's sparse tables: an nn.EmbeddingBag(sparse=True) is a table on the PS tasks,
a step pulls and pushes only the rows its batch touches (their gradients are PyTorch's),
one hybrid worker equals PyTorch's own loop, and the shipped wide-and-deep matches the
built-in wide_deep on the CTR data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import ROOT, need, run_mpi, run_py
from test_ctr_mpi import FEATURES, clothing, small_dataset  # noqa: F401 (a fixture)

from mpips.checkpoint import Checkpoint
from mpips.data.batches import batches, load_split, open_dataset

torch = need("torch")
mt = pytest.importorskip("mpips.torch")

NET = """
import torch
from torch import nn
import mpips.torch


class WideDeep(nn.Module):
    def __init__(self, features, dim=3, hidden=4):
        super().__init__()
        self.wide = nn.EmbeddingBag(features, 1, mode="sum", sparse=True)
        self.bias = nn.Parameter(torch.zeros(1))
        self.embedding = nn.EmbeddingBag(features, dim, mode="sum", sparse=True)
        self.deep = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, b):
        w = self.wide(b.indices, b.offsets, per_sample_weights=b.weights)
        d = self.deep(self.embedding(b.indices, b.offsets, per_sample_weights=b.weights))
        return (w + d).squeeze(1) + self.bias


def loss(z, y):
    return nn.functional.binary_cross_entropy_with_logits(z, y.float())


def build(data):
    return mpips.torch.Model(WideDeep(data.num_inputs), loss)
"""

JOB = """
[model]
kind = "net:build"
partition = "mod"
init_seed = 4
[data]
path = "s.h5"
[optimizer]
learning_rate = 0.5
[train]
mode = "hybrid"
steps = 30
batch_size = 8
seed = 5
log_every = 0
progress = false
[checkpoint]
dir = "runs/s"
"""


def namespace():
    scope: dict = {}
    exec(compile(NET, "net.py", "exec"), scope)  # (the test's own source text)
    return scope


def whole(x) -> object:
    """A CSR batch over the tables' own ids, as PyTorch's loop feeds its module."""
    return mt.SparseInput(
        torch.from_numpy(x.indices.astype(np.int64)),
        torch.from_numpy(x.indptr[:-1].astype(np.int64)),
        torch.from_numpy(x.data.astype(np.float32)),
        x.shape[0],
    )


def pytorchs_loop(tmp_path, ref, forward, loss, steps=30):
    """PyTorch's own loop: SGD (lr 0.5, the JOB's) on ``ref`` over the job's batches of
    s.h5 (batch 8, seed 5, one worker's), ``forward(x)`` giving the outputs."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = load_split(open_dataset(str(tmp_path / "s.h5")), "train")
    stream = batches(x, y, 8, 5, 0, per_epoch=len(y) // 8)
    for _ in range(steps):
        _, bx, by = next(stream)
        opt.zero_grad()
        loss(forward(bx), torch.from_numpy(by)).backward()
        opt.step()


def test_a_step_moves_only_the_touched_rows_and_their_gradients_are_pytorchs(tmp_path):
    small_dataset(tmp_path / "s.h5")
    x, y = load_split(open_dataset(str(tmp_path / "s.h5")), "train")
    x, y = x[:8], y[:8]
    net = namespace()
    torch.manual_seed(0)
    model = mt.Model(net["WideDeep"](FEATURES), net["loss"])
    assert [t.name for t in model.tables()] == ["wide.weight", "embedding.weight"]
    assert "wide.weight" not in [v.name for v in model.variables()]
    batch, ids = model.prepare(x)
    assert list(ids) == sorted(set(x.indices)) and len(ids) < FEATURES
    params = model.initial_values(0)
    for t in model.tables():  # the pulled rows: only the batch's ids
        params[t.name] = model.initial_rows(t.name, (0, FEATURES, 1), 0)[ids]
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    model.loss_and_grads(params, batch, y, grads)
    for t in model.tables():
        assert grads[t.name].shape[0] == len(ids)  # one gradient row a touched id, no more
    torch.manual_seed(0)
    ref = net["WideDeep"](FEATURES)
    net["loss"](ref(whole(x)), torch.from_numpy(y)).backward()
    for name, p in ref.named_parameters():
        g = p.grad.to_dense().numpy() if p.grad.is_sparse else p.grad.numpy()
        if name in ("wide.weight", "embedding.weight"):
            np.testing.assert_allclose(grads[name], g[ids], rtol=1e-5, atol=1e-7)
            untouched = np.setdiff1d(np.arange(FEATURES), ids)
            assert not g[untouched].any()  # (what is not pulled has no gradient)
        else:
            np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-7, err_msg=name)
    assert model.traffic.copied_bytes == 0


def test_sparse_tables_need_sparse_or_integer_data():
    from mpips.errors import DataError

    model = mt.Model(namespace()["WideDeep"](FEATURES), namespace()["loss"])
    with pytest.raises(DataError, match=r"sparse embeddings \(sparse=True\) takes sparse"):
        model.prepare(np.ones((2, 3), np.float32))


@pytest.mark.launcher
def test_one_hybrid_worker_equals_pytorchs_loop(tmp_path):
    """Tables on 2 PS tasks (rows pulled and pushed), the dense part the worker's replica:
    after 30 SGD steps, PyTorch's loop with whole tables on the same batches."""
    small_dataset(tmp_path / "s.h5")
    (tmp_path / "net.py").write_text(NET)
    (tmp_path / "job.toml").write_text(JOB)
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--ps", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    variables, _ = Checkpoint(tmp_path / "runs/s/ckpt-30.json").read_all()
    net = namespace()
    torch.manual_seed(4)  # model.init_seed: the factory is called after it
    ref = net["WideDeep"](FEATURES)
    pytorchs_loop(tmp_path, ref, lambda x: ref(whole(x)), net["loss"])
    assert sorted(variables) == sorted(n for n, _ in ref.named_parameters())
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(variables[name], p.detach().numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.launcher
def test_the_shipped_pytorch_wide_deep_matches_the_built_in_one(clothing):  # noqa: F811
    """jobs/torch_ctr_wide_deep.toml (nn.EmbeddingBag tables, hybrid) against the built-in
    wide_deep in the same mode, steps and data: test AUC within 0.01."""
    for name in ("torch_ctr_wide_deep.toml", "torch_wide_deep.py", "ctr_wide_deep.toml"):
        shutil.copy(ROOT / "jobs" / name, clothing / name)
    text = (clothing / "ctr_wide_deep.toml").read_text()
    text = text.replace("[train]\n", '[train]\nmode = "hybrid"\n')
    (clothing / "builtin.toml").write_text(text)
    auc = {}
    for job in ("torch_ctr_wide_deep.toml", "builtin.toml"):
        args = [
            "--steps",
            "250",
            "--no-progress",
            "--result",
            "r.json",
            "--ckpt-dir",
            f"runs/{job}",
        ]
        r = run_mpi(4, ["-m", "mpips", "train", job, *args], cwd=clothing, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        auc[job] = json.loads((clothing / "r.json").read_text())["test_auc"]
    assert auc["builtin.toml"] > 0.85, auc
    assert abs(auc["torch_ctr_wide_deep.toml"] - auc["builtin.toml"]) <= 0.01, auc


SPLIT = """
import torch
from torch import nn
import mpips.torch


class Split(nn.Module):
    # two tables over one id space: a serves ids [0, half), b serves [half, features)
    def __init__(self, features, half, dim=3):
        super().__init__()
        self.a = nn.EmbeddingBag(half, dim, mode="sum", sparse=True)
        self.b = nn.EmbeddingBag(features - half, dim, mode="sum", sparse=True)
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        bag = lambda t: t(x.indices, x.offsets, per_sample_weights=x.weights)  # noqa: E731
        return self.out(bag(self.a) + bag(self.b)).squeeze(1)


def loss(z, y):
    return nn.functional.binary_cross_entropy_with_logits(z, y.float())


def build(data):
    half = data.num_inputs // 2
    net = Split(data.num_inputs, half)
    return mpips.torch.Model(net, loss, table_offsets={"a.weight": 0, "b.weight": half})
"""


@pytest.mark.launcher
def test_tables_that_serve_parts_of_the_id_space_train_as_pytorchs_loop(tmp_path):
    """table_offsets: two tables of half the id space each (each pulls only its own ids'
    rows; the other ids read zero rows there), on 2 PS tasks, hybrid, 30 SGD steps: the same
    values as PyTorch's loop feeding each table only its own ids as rows."""
    small_dataset(tmp_path / "s.h5")
    (tmp_path / "net.py").write_text(SPLIT)
    (tmp_path / "job.toml").write_text(JOB)
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--ps", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    variables, _ = Checkpoint(tmp_path / "runs/s/ckpt-30.json").read_all()
    scope: dict = {}
    exec(compile(SPLIT, "net.py", "exec"), scope)
    half = FEATURES // 2
    assert variables["a.weight"].shape[0] == half and variables["b.weight"].shape[0] == half
    torch.manual_seed(4)  # model.init_seed: the factory is called after it
    ref = scope["Split"](FEATURES, half)

    def forward(x):  # each table its own ids, as rows (the others weighted 0)
        b = whole(x)
        mine = b.indices < half
        a = ref.a(torch.where(mine, b.indices, 0), b.offsets, per_sample_weights=b.weights * mine)
        rows_b = torch.where(mine, 0, b.indices - half)
        o = ref.b(rows_b, b.offsets, per_sample_weights=b.weights * ~mine)
        return ref.out(a + o).squeeze(1)

    pytorchs_loop(tmp_path, ref, forward, scope["loss"])
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(variables[name], p.detach().numpy(), rtol=1e-4, atol=1e-6)
    torch.manual_seed(4)
    fresh = scope["Split"](FEATURES, half)
    for t in ("a.weight", "b.weight"):  # both trained
        assert not np.allclose(variables[t], dict(fresh.named_parameters())[t].detach().numpy())


def test_table_offsets_name_tables_and_ids():
    from mpips.errors import ConfigError

    scope: dict = {}
    exec(compile(SPLIT, "net.py", "exec"), scope)
    net, loss = scope["Split"](10, 5), scope["loss"]
    with pytest.raises(ConfigError, match="names 'c.weight', not a sparse table"):
        mt.Model(net, loss, table_offsets={"c.weight": 0})
    with pytest.raises(ConfigError, match=r"table_offsets\['a.weight'\] is -1"):
        mt.Model(net, loss, table_offsets={"a.weight": -1})
    model = mt.Model(net, loss, table_offsets={"a.weight": 0, "b.weight": 5})
    assert model.table_offsets() == {"a.weight": 0, "b.weight": 5}
    import scipy.sparse as sp

    from mpips.errors import DataError

    past = sp.csr_matrix((np.ones(2, np.float32), ([0, 0], [3, 10])), shape=(1, 11))
    with pytest.raises(DataError, match="no table serves an id past 9"):
        model.prepare(past)  # (id 10: wrong offsets, or another file)
    model.prepare(past[:, :10])


def test_a_table_with_a_span_routes_only_its_ids():
    """The store's routing: a table serving ids [100, 150) gets only those of a step's
    sorted ids, as rows id - 100, at their positions (a slice on one PS task; split by the
    rule over two)."""
    from mpips.store.client import Table

    ids = np.array([3, 99, 100, 101, 120, 149, 150, 400])
    one = Table("t", [None], 50, 4, np.dtype(np.float32), "div", span=(100, 150))
    for ascending in (False, True):
        ((p, at, rows),) = one.route(ids, ascending)
        assert p == 0 and at == slice(2, 6) and rows.tolist() == [0, 1, 20, 49]
    shuffled = np.array([120, 3, 100, 400, 149])  # (any order: by a mask)
    ((_, at, rows),) = one.route(shuffled)
    assert list(at) == [0, 2, 4] and rows.tolist() == [20, 0, 49]
    two = Table("t", [None, None], 50, 4, np.dtype(np.float32), "mod", span=(100, 150))
    got = {p: (list(np.asarray(at)), rows.tolist()) for p, at, rows in two.route(ids)}
    assert got == {0: ([2, 4], [0, 10]), 1: ([3, 5], [0, 24])}
    assert one.route(np.array([1, 2, 500])) == []
    plain = Table("t", [None], 500, 4, np.dtype(np.float32), "div")
    ((_, at, rows),) = plain.route(ids)
    assert at == slice(None) and rows is ids


@pytest.mark.launcher
def test_a_module_with_dynamic_tables_trains_on_ids_past_2_40_and_exports(tmp_path):
    """tables.kind = "dynamic": the module is built with 64 rows a table, the data's ids
    are past 2^40; hybrid on 2 PS tasks trains, and the .pt export holds each table's live
    rows, with their ids beside it, loading strictly into a module of that many rows."""
    from test_dynamic_tables import big_id_dataset

    big_id_dataset(tmp_path / "b.h5")
    (tmp_path / "net.py").write_text(NET.replace("WideDeep(data.num_inputs)", "WideDeep(64)"))
    job = JOB.replace('"s.h5"', '"b.h5"') + '[tables]\nkind = "dynamic"\n'
    (tmp_path / "job.toml").write_text(job)
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml", "--ps", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    made = sum(
        int(s.split("made")[0].split(",")[-1])
        for s in r.stdout.splitlines()
        if "dynamic tables (wide.weight, embedding.weight)" in s
    )
    assert made > 0
    out = run_py(["-m", "mpips", "ckpt", "export", "runs/s", "m.pt"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    state, ids = torch.load(tmp_path / "m.pt"), torch.load(tmp_path / "m.ids.pt")
    assert sorted(ids) == ["embedding.weight", "wide.weight"]
    assert len(ids["embedding.weight"]) == made and ids["embedding.weight"].min() >= 1 << 40
    module = namespace()["WideDeep"](made)
    module.wide = torch.nn.EmbeddingBag(len(ids["wide.weight"]), 1, mode="sum", sparse=True)
    module.load_state_dict(state, strict=True)
