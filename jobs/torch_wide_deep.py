"""Wide and deep in PyTorch on sparse (id, value) features, as the built-in ``wide_deep``:
logit = sum of x_i * w[i] + b (wide) + MLP(sum of x_i * E[i]) (deep). Both
``nn.EmbeddingBag`` tables are made with ``sparse=True``, so mpips keeps them on the PS tasks
split by rows and moves only the rows a batch touches. Named from
jobs/torch_ctr_wide_deep.toml as ``model.kind = "torch_wide_deep:build"``."""

import torch
from torch import nn

import mpips.torch


class WideDeep(nn.Module):
    def __init__(self, num_features, embedding_dim=8, hidden=32):
        super().__init__()
        self.wide = nn.EmbeddingBag(num_features, 1, mode="sum", sparse=True)
        self.bias = nn.Parameter(torch.zeros(1))
        self.embedding = nn.EmbeddingBag(num_features, embedding_dim, mode="sum", sparse=True)
        self.deep = nn.Sequential(nn.Linear(embedding_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.wide.weight)
        nn.init.uniform_(self.embedding.weight, -0.05, 0.05)

    def forward(self, batch):  # batch: mpips.torch.SparseInput (indices, offsets, weights)
        bag = (batch.indices, batch.offsets)
        wide = self.wide(*bag, per_sample_weights=batch.weights)
        deep = self.deep(self.embedding(*bag, per_sample_weights=batch.weights))
        return (wide + deep).squeeze(1) + self.bias


def loss(logits, y):
    return nn.functional.binary_cross_entropy_with_logits(logits, y.float())


def build(data, embedding_dim=8, hidden=32):
    """On the data's id space (data.num_inputs rows in each table)."""
    return mpips.torch.Model(WideDeep(data.num_inputs, embedding_dim, hidden), loss)
