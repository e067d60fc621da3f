"""Ranking metrics: normalized entropy (NE), AUC, calibration; HR@K / NDCG@K / MRR for leave-one-out.

NE = (weighted mean log loss of the predictions) / (entropy of the weighted background rate): 1.0 is no better
than always predicting the average rate, lower is better. It matches ``torchrec.metrics.ne.NEMetric``.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-12  # torchrec's eta: predictions and the background rate are clamped to [EPS, 1 - EPS]


def _arrays(labels, preds, weights, probabilities: bool = True):
    y = np.asarray(labels, np.float64).ravel()
    p = np.asarray(preds, np.float64).ravel()
    w = np.ones_like(y) if weights is None else np.asarray(weights, np.float64).ravel()
    if not (len(y) == len(p) == len(w)):
        raise ValueError(f"labels ({len(y)}), predictions ({len(p)}) and weights ({len(w)}) differ in length")
    if np.isnan(p).any():
        raise ValueError("predictions contain NaN")
    if probabilities and len(y) and (np.nanmin(p) < 0 or np.nanmax(p) > 1 or np.isnan(p).any()):
        raise ValueError("predictions must be probabilities in [0, 1] (pass sigmoid(logits), not logits)")
    return y, p, w


def log_loss_sum(labels, preds, weights=None) -> float:
    y, p, w = _arrays(labels, preds, weights)
    p = np.clip(p, EPS, 1 - EPS)
    return float(-(w * (y * np.log2(p) + (1 - y) * np.log2(1 - p))).sum())


def normalized_entropy(labels, preds, weights=None) -> float:
    y, p, w = _arrays(labels, preds, weights)
    pos, neg = float((w * y).sum()), float((w * (1 - y)).sum())
    rate = np.clip(pos / max(float(w.sum()), EPS), EPS, 1 - EPS)
    background = -(pos * np.log2(rate) + neg * np.log2(1 - rate))
    return float(log_loss_sum(y, p, w) / background) if background > 0 else float("nan")


def auc(labels, preds) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count one half) of any scores; NaN when one class is absent."""
    y, p, _ = _arrays(labels, preds, None, probabilities=False)
    n_pos, n_neg = int((y > 0.5).sum()), int((y <= 0.5).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    sorted_p = p[order]
    ranks = np.empty(len(p))
    # average rank of each tie group
    _, first, counts = np.unique(sorted_p, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y > 0.5].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def calibration(labels, preds, weights=None) -> float:
    """Mean prediction / observed rate (1.0 = calibrated)."""
    y, p, w = _arrays(labels, preds, weights)
    observed = float((w * y).sum())
    return float((w * p).sum()) / observed if observed > 0 else float("nan")


def binary_metrics(labels, preds, prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}ne": normalized_entropy(labels, preds),
        f"{prefix}auc": auc(labels, preds),
        f"{prefix}calibration": calibration(labels, preds),
        f"{prefix}log_loss": log_loss_sum(labels, preds) / max(len(np.ravel(labels)), 1),
    }


RANK_KS = (1, 5, 10)


def ranks_to_metrics(rank, ks: tuple[int, ...] = RANK_KS, prefix: str = "") -> dict[str, float]:
    """The metrics of leave-one-out ranks (``rank`` = how many competitors scored >= the positive; 0 = top):
    the means over users of ``per_user_metric``. NaN when there are no users."""
    rank = np.asarray(rank, np.float64).ravel()
    names = ["mrr", *(f"{m}@{k}" for k in ks for m in ("hr", "ndcg"))]
    if not len(rank):
        return {f"{prefix}{name}": float("nan") for name in names}
    return {f"{prefix}{name}": float(per_user_metric(rank, name).mean()) for name in names}


def per_user_metric(rank, metric: str) -> np.ndarray:
    """Each user's ``metric`` from their rank: HR@K = 1 if rank < K; NDCG@K = 1/log2(rank + 2) if rank < K, else 0
    (one relevant item, so no ideal-DCG division); MRR = 1/(rank + 1)."""
    rank = np.asarray(rank, np.float64)
    if metric == "mrr":
        return 1.0 / (rank + 1)
    kind, k = metric.split("@")
    hit = rank < int(k)
    return hit.astype(np.float64) if kind == "hr" else np.where(hit, 1.0 / np.log2(rank + 2), 0.0)


def rank_metrics(pos_scores, neg_scores, ks: tuple[int, ...] = (10,)) -> dict[str, float]:
    """Leave-one-out ranking of 1 positive among its sampled negatives (one row per user): the metrics of
    rank = number of negatives scored >= the positive (ties count against the model)."""
    pos = np.asarray(pos_scores, np.float64).ravel()
    neg = np.asarray(neg_scores, np.float64)
    if neg.ndim != 2 or neg.shape[0] != len(pos):
        raise ValueError(f"neg_scores must be (users, negatives) with {len(pos)} rows, got {neg.shape}")
    return ranks_to_metrics(sampled_ranks(pos, neg), ks) | {"users": float(len(pos))}


def sampled_ranks(pos, neg):
    """(U,) how many of each row's negatives score >= its positive: ties count against the model, so a
    constant scorer ranks last (numpy arrays or torch tensors)."""
    return (neg >= pos[:, None]).sum(1)
