"""DLRM (Naumov et al., 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems") as a plain PyTorch module: a bottom MLP over the 13 integer
features, one ``nn.EmbeddingBag(sparse=True)`` table per categorical feature (26, each of its
feature's cardinality), the pairwise dot products of the 27 resulting vectors (feature
interaction), and a top MLP over them and the bottom MLP's output. mpips keeps the 26 tables
on the PS tasks split by rows and moves only the rows a batch touches. Named from
jobs/torch_dlrm.toml as ``model.kind = "torch_dlrm:build"``.

Data: ``python -m mpips data criteo-synthetic`` (mpips/data/criteo_synthetic.py). Each row
holds its 39 features in order, in one id space: ids 0..12 are the integers (value
log(1 + x)), then categorical f's value c as the id ``13 + offset[f] + c`` (value 1). The
module reads them by position: row r's entries 0..12 give the bottom MLP's input (their
values), entry 13 + f indexes table f. ``build`` tells mpips which ids each table serves
(``table_offsets``: table f's row 0 is id 13 + offset[f]), so each table pulls only its own
feature's rows; mpips hands the module the batch's ids renumbered to the rows it pulled (one
numbering for all tables). In plain PyTorch, ``plain_batch`` gives each table its
feature's values as rows, as DLRM's reference code does.

``fused=True`` keeps the 26 tables' rows in one ``nn.EmbeddingBag`` (as TorchRec and
FBGEMM fuse a model's tables): the same function, one table pulled a step instead of 26
(DLRM in its reference form is the default).
"""

import torch
from torch import nn

import mpips.torch
from mpips.data.criteo_synthetic import CRITEO_KAGGLE_CARDINALITIES, cardinalities
from mpips.errors import DataError

INTEGERS, CATEGORIES = 13, 26


def _mlp(sizes, last_relu):
    """Linear layers through ``sizes`` with ReLU between (and after the last if asked),
    initialised as DLRM's reference: weights N(0, 2 / (fan_in + fan_out)), biases
    N(0, 1 / fan_out)."""
    layers = []
    for k, (m, n) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layer = nn.Linear(m, n)
        nn.init.normal_(layer.weight, 0.0, (2.0 / (m + n)) ** 0.5)
        nn.init.normal_(layer.bias, 0.0, (1.0 / n) ** 0.5)
        layers.append(layer)
        if last_relu or k < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _table(rows, dim):
    """A sparse sum-bag, uniform in +-sqrt(1 / rows) (DLRM's initialisation)."""
    table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
    bound = (1.0 / rows) ** 0.5
    nn.init.uniform_(table.weight, -bound, bound)
    return table


class DLRM(nn.Module):
    def __init__(self, sizes, embedding_dim=16, bottom=(512, 256, 64), top=(512, 256), fused=False):
        """``sizes``: the 26 tables' rows (their features' cardinalities)."""
        super().__init__()
        self.dim, self.fused, self.sizes = embedding_dim, fused, [int(n) for n in sizes]
        self.bottom = _mlp([INTEGERS, *bottom, embedding_dim], last_relu=True)
        if fused:
            self.embedding = _table(int(sum(sizes)), embedding_dim)
        else:
            self.embeddings = nn.ModuleList(_table(int(n), embedding_dim) for n in sizes)
        vectors = CATEGORIES + 1
        i, j = torch.tril_indices(vectors, vectors, offset=-1)
        self.register_buffer("pairs_i", i, persistent=False)
        self.register_buffer("pairs_j", j, persistent=False)
        self.top = _mlp([embedding_dim + len(i), *top, 1], last_relu=False)

    def _embed(self, cats):
        """rows x 26 x dim: feature f's ids looked up in its table."""
        rows = cats.shape[0]
        if self.fused:
            one = torch.arange(rows * CATEGORIES, device=cats.device)  # one id per bag
            return self.embedding(cats.reshape(-1), one).view(rows, CATEGORIES, self.dim)
        return torch.stack([t(cats[:, f : f + 1]) for f, t in enumerate(self.embeddings)], 1)

    def forward(self, batch):  # batch: mpips.torch.SparseInput (indices, offsets, weights)
        rows, width = len(batch), INTEGERS + CATEGORIES
        if batch.indices.numel() != rows * width:
            raise DataError(
                f"torch_dlrm: {batch.indices.numel()} ids for {rows} rows; every row must hold "
                f"the {INTEGERS} integer and {CATEGORIES} categorical features in order "
                "(python -m mpips data criteo-synthetic writes such files)"
            )
        dense = batch.weights.view(rows, width)[:, :INTEGERS]
        x = self.bottom(dense)
        z = torch.cat(
            [x.unsqueeze(1), self._embed(batch.indices.view(rows, width)[:, INTEGERS:])], 1
        )
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs_i, self.pairs_j]
        return self.top(torch.cat([x, dots], 1)).squeeze(1)


def loss(logits, y):
    return nn.functional.binary_cross_entropy_with_logits(logits, y.float())


def feature_sizes(num_ids):
    """The 26 tables' rows for a criteo-synthetic file of ``num_ids`` ids (13 + its capped
    cardinalities): the cap it was written with, found again."""
    low, high = 1, max(CRITEO_KAGGLE_CARDINALITIES)
    while low < high:  # the smallest cap that gives as many ids
        mid = (low + high) // 2
        low, high = (mid + 1, high) if INTEGERS + cardinalities(mid).sum() < num_ids else (low, mid)
    if INTEGERS + cardinalities(low).sum() != num_ids:
        raise DataError(
            f"torch_dlrm: the data has {num_ids} ids, which no criteo-synthetic file has (13 + "
            "the 26 Kaggle cardinalities, capped): write it with python -m mpips data "
            "criteo-synthetic"
        )
    return [int(n) for n in cardinalities(low)]


def first_ids(sizes, fused):
    """The data id of each table's row 0, by table: 13 + the sizes before it."""
    if fused:
        return {"embedding.weight": INTEGERS}
    starts = INTEGERS + torch.tensor([0, *sizes[:-1]]).cumsum(0)
    return {f"embeddings.{f}.weight": int(n) for f, n in enumerate(starts)}


def plain_batch(batch, sizes, fused):
    """A SparseInput of data ids as plain PyTorch takes it: each categorical's id as its
    table's row (the id less the table's first id)."""
    firsts = list(first_ids(sizes, fused).values())
    shift = torch.tensor([0] * INTEGERS + (firsts * CATEGORIES)[:CATEGORIES], dtype=torch.int64)
    ids = batch.indices.view(len(batch), INTEGERS + CATEGORIES) - shift
    return mpips.torch.SparseInput(ids.reshape(-1), batch.offsets, batch.weights, len(batch))


def build(data, embedding_dim=16, bottom=(512, 256, 64), top=(512, 256), fused=False):
    """On a criteo-synthetic file: a table per categorical feature of its cardinality (or
    one of all of them, ``fused``), each serving its feature's ids."""
    sizes = feature_sizes(data.num_inputs)
    net = DLRM(sizes, embedding_dim, tuple(bottom), tuple(top), fused)
    return mpips.torch.Model(net, loss, table_offsets=first_ids(sizes, fused))
