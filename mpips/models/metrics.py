"""Evaluation metrics computed on the host."""

from __future__ import annotations

import numpy as np


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((np.asarray(logits).argmax(axis=1) == labels).mean())


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the chance a random positive scores above a random
    negative (ties count half), from the ranks (Mann-Whitney U)."""
    from scipy.stats import rankdata

    labels = np.asarray(labels) > 0.5
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if not positives or not negatives:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))
