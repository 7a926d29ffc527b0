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


class Columns(torch.nn.Module):
    """Table f indexed only with column f of each row (DLRM's way: it keeps to its span),
    or (``every``) each table with all of a row's ids, reading zero rows for the others'."""

    def __init__(self, sizes, every=False, dim=3):
        super().__init__()
        self.every = every
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in sizes
        )
        self.out = torch.nn.Linear(dim * len(sizes), 1)

    def forward(self, x):
        if self.every:
            bags = [t(x.indices, x.offsets, per_sample_weights=x.weights) for t in self.tables]
        else:
            cols = x.indices.view(len(x), -1)
            bags = [t(cols[:, f : f + 1]) for f, t in enumerate(self.tables)]
        return self.out(torch.cat(bags, 1)).squeeze(1)


@pytest.mark.parametrize("strays_from", [None, 0, 3])
def test_span_tables_share_the_pulled_buffer_where_the_module_keeps_to_its_spans(
    strays_from, monkeypatch, capfd
):
    """Tables with offsets read the batch's rows from one buffer, as the store pulls them
    (each table's rows at its own ids' positions, other rows another table's): a module
    that indexes each table only with its ids is bound to that buffer but at the steps
    that check it on copies (the first, then every RECHECK-th), and reads zero rows past
    the batch's; one that indexes every table with every id (from the start, or from a
    later step: found at the next check, and said) runs on copies with zero rows for the
    others' ids. All give PyTorch's loss and gradients on the whole tables, step after
    step."""
    import scipy.sparse as sp

    import mpips.torch.spans
    from mpips.device.pages import page_aligned

    monkeypatch.setattr(mpips.torch.spans, "RECHECK", 3)

    def loss(z, y):
        return torch.nn.functional.binary_cross_entropy_with_logits(z, y.float())

    sizes, offsets = (5, 7, 4), (0, 5, 12)
    torch.manual_seed(0)
    net = Columns(sizes, strays_from == 0)
    names = [f"tables.{f}.weight" for f in range(3)]
    tables = {n: t.weight.detach().numpy().copy() for n, t in zip(names, net.tables, strict=True)}
    ref = Columns((16, 16, 16), net.every)  # each table over all ids: zero but its own
    ref.out.load_state_dict(net.out.state_dict())
    with torch.no_grad():
        for t, n, o in zip(ref.tables, names, offsets, strict=True):
            t.weight.zero_()[o : o + len(tables[n])] = torch.from_numpy(tables[n])
    model = mt.Model(net, loss, table_offsets=dict(zip(names, offsets, strict=True)))
    values = {n: v.copy() for n, v in model.initial_values(0).items()}
    rng = np.random.default_rng(1)
    rows_w, rows_g = page_aligned((64, 3), np.float32), page_aligned((64, 3), np.float32)
    for step in range(6):
        net.every = ref.every = strays_from is not None and step >= strays_from
        cols = np.stack([o + rng.integers(0, n, 6) for n, o in zip(sizes, offsets, strict=True)], 1)
        x = sp.csr_matrix((np.ones(18, np.float32), cols.ravel(), np.arange(0, 19, 3)), (6, 16))
        y = rng.integers(0, 2, 6)
        batch, ids = model.prepare(x)
        rows_w[: len(ids)] = 7.0  # (positions no table serves: never read where kept to)
        runs = []
        for n, o in zip(names, offsets, strict=True):
            a, b = np.searchsorted(ids, [o, o + len(tables[n])])
            rows_w[a:b] = tables[n][ids[a:b] - o]
            runs.append((a, b))
        k = len(ids)
        params = {**values, **{n: rows_w[:k] for n in names}}
        grads = {n: np.zeros_like(v) for n, v in values.items()}
        grads.update({n: rows_g[:k][a:b] for n, (a, b) in zip(names, runs, strict=True)})
        got = model.loss_and_grads(params, batch, y, grads)
        ref.zero_grad()
        want = loss(ref(whole(x)), torch.from_numpy(y))
        want.backward()
        assert got == pytest.approx(float(want.detach()), rel=1e-6)
        for n, (a, b), t in zip(names, runs, ref.tables, strict=True):
            dense = t.weight.grad.to_dense().numpy()
            np.testing.assert_allclose(grads[n], dense[ids[a:b]], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grads["out.weight"], ref.out.weight.grad.numpy(), rtol=1e-5)
        shared = net.tables[1].weight.data_ptr() == rows_w.ctypes.data
        kept = strays_from is None or step < strays_from
        assert model.table_set.spans.keeps_to_spans is kept
        assert shared is (kept and step % 3 != 0)
        if shared:  # (a dense read of the weight: the batch's rows, then zeros)
            assert not net.tables[1].weight[k:].any()
    said = capfd.readouterr()
    assert ("indexes a table with ids it does not serve" in said.out + said.err) is (
        strays_from == 3
    )


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


def test_span_tables_share_a_buffer_and_their_rows_move_in_one_datatype():
    """The store keeps the rows of tables with disjoint spans (one element type and width)
    in one buffer, and a step's rows of every table on a PS task move through one indexed
    datatype: displacements counted in elements from the first table's part; parts not a
    whole element apart, or another row width, get datatypes of their own."""
    from mpips.store.client import Routed, Table, _gather, _row_groups

    class Part:
        def __init__(self, offset):
            self.offset = offset

    f32 = np.dtype(np.float32)
    a = Table("a", [Part(0)], 5, 4, f32, "div", span=(0, 5))
    b = Table("b", [Part(80)], 7, 4, f32, "div", span=(5, 12))
    c = Table("c", [Part(192)], 4, 2, f32, "div", span=(12, 16))
    d = Table("d", [Part(256)], 6, 4, f32, "div", span=(3, 9))  # (overlaps a and b)
    e = Table("e", [Part(352)], 100, 4, f32, "div")  # (no span: every id is a row)
    assert _row_groups([a, b, c, d, e]) == {"a": "a", "d": "d", "b": "a", "c": "c"}
    one = _gather(
        [Routed(a, 0, slice(0, 2), np.array([1, 3])), Routed(b, 0, slice(2, 4), np.array([0, 6]))]
    )
    (g,) = one
    made = g.mpi_type.decode()[2]
    assert (made["blocklength"], list(made["displacements"])) == (4, [4, 12, 20, 44])
    assert (g.disp, g.rows) == (0, 4)
    g.free()
    b.parts = [Part(82)]  # (not a whole float32 after a's part)
    each = _gather(
        [
            Routed(a, 0, slice(0, 1), np.array([1])),
            Routed(b, 0, slice(1, 2), np.array([2])),
            Routed(c, 0, slice(2, 3), np.array([3])),
        ]
    )
    assert [(x.table.name, x.disp) for x in each] == [("a", 0), ("b", 82), ("c", 192)]
    for x in each:
        x.free()


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
