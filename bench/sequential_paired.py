"""A paired comparison of two next-item models over the same test users (``bench/sequential.py --collect``).

"Ahead in every seed" compares means: on a small set (MovieLens-100K: 943 test users, a binomial std of ~0.011
on one seed's HR@10) it flips on a handful of users. The paired test reads each user's rank under both models
(``models.sequential.evaluate.split_ranks``), averages each user's difference over the seeds, and bootstraps
the mean difference over users: a 95% interval that excludes 0 says the gap is larger than which users happen
to be in the test set; what it cannot say is anything about users outside it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.training.metrics import per_user_metric

RANKS_FILE = "test_ranks.npz"  # per run folder: each test user's rank per protocol, written once
OWN = "sampled_own"  # the sampled ranks of the state a run kept on a sampled valid metric (its ``model-also.pt``)
METRICS = ("hr@10", "ndcg@10")


def kept_on_sampled(row: dict) -> bool:
    """Whether a table row's run kept a second state on a sampled valid metric (``next_item.also_select_metric``)."""
    also = row.get("also_select_metric", "")
    return bool(also) and not also.startswith("full_")


def paired_bootstrap(
    ours: list[np.ndarray], theirs: list[np.ndarray], metric: str, *, samples: int = 2000, seed: int = 0
) -> dict[str, float]:
    """Mean over users of (ours - theirs) ``metric``, each user's difference averaged over the seeds (the lists
    pair seed by seed, each array one rank per user in the same user order), with a percentile bootstrap 95%
    interval over users and the share of resamples where ours is not ahead (a one-sided p-value)."""
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
        raise ValueError("paired_bootstrap needs the same seeds and the same users for both models")
    diff = np.mean(
        [per_user_metric(a, metric) - per_user_metric(b, metric) for a, b in zip(ours, theirs, strict=True)],
        0,
    )
    rng = np.random.default_rng(seed)
    n = len(diff)
    means = np.empty(samples)
    chunk = max(1, 2_000_000 // max(n, 1))  # resamples per draw: bounded memory on large sets
    for start in range(0, samples, chunk):
        stop = min(samples, start + chunk)
        means[start:stop] = diff[rng.integers(0, n, (stop - start, n))].mean(1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {
        "diff": float(diff.mean()),
        "low": float(low),
        "high": float(high),
        "p_not_ahead": float((means <= 0).mean()),
        "users": n,
    }


def compare(ranks: dict[str, list[dict[str, np.ndarray]]], ours: str = "gemflow") -> dict[str, dict]:
    """``ranks``: model -> per seed (in the same seed order) protocol -> per-user ranks. For every other model,
    per protocol and metric, ``paired_bootstrap`` of ``ours`` against it."""
    out = {}
    for name, theirs in ranks.items():
        if name == ours:
            continue
        out[name] = {
            f"{protocol}_{metric}": paired_bootstrap(
                [r[protocol] for r in ranks[ours]], [r[protocol] for r in theirs], metric
            )
            for protocol in ranks[ours][0]
            if protocol in theirs[0]
            for metric in METRICS
        }
    return out


def markdown(paired: dict[str, dict], seeds: list[int], ours: str = "gemflow") -> list[str]:
    """The paired table's lines (sampled and masked protocols)."""
    if not paired:
        return []
    users = next(iter(next(iter(paired.values())).values()))["users"]
    lines = [
        f"**Paired over the {users:,} test users** ({ours} − model, each user's difference averaged over seeds "
        f"{seeds}; 95% bootstrap interval over users, 2,000 resamples; p = share of resamples where {ours} is "
        "not ahead; `bench/sequential_paired.py`)",
        "",
    ]
    keys = ["sampled_hr@10", "sampled_ndcg@10", "masked_hr@10", "masked_ndcg@10"]
    if any(f"{OWN}_hr@10" in cells for cells in paired.values()):
        keys += [f"{OWN}_hr@10", f"{OWN}_ndcg@10"]
    header = [
        f"{protocol.replace(OWN, 'sampled (own selection)')} {metric.upper()}"
        for protocol, metric in (k.rsplit("_", 1) for k in keys)
    ]
    lines += [f"| model | {' | '.join(header)} |", "|---|" + "---|" * len(keys)]
    for name, cells in paired.items():
        row = []
        for key in keys:
            c = cells.get(key)
            row.append(
                f"{c['diff']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] p {c['p_not_ahead']:.3f}" if c else "–"
            )
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return [*lines, ""]


def user_ranks(cfg, ws, row: dict) -> dict[str, np.ndarray]:
    """Each test user's rank per protocol under a table row's model: its run's best state (ranked once, then
    read from ``test_ranks.npz`` in its folder), or popularity (no run folder; seconds)."""
    from models.inference.bundle import load_bundle
    from models.sequential.data import SequenceSet
    from models.sequential.evaluate import next_item_ranks, popularity_scorer, sequence_negatives, split_ranks
    from models.training.data import TrainingSet
    from models.training.prepare import resolve_training_set
    from models.training.train import ALSO_MODEL

    nic = cfg.next_item
    data = TrainingSet(resolve_training_set(cfg.training_set, ws))
    if "run_dir" not in row:
        seqs = SequenceSet(data, 1, 0)
        negatives = sequence_negatives(seqs, nic.eval_negatives, nic.eval_seed)
        ranks = split_ranks(popularity_scorer(seqs), seqs, "test", negatives)
        return {**ranks, OWN: ranks["sampled"]}  # never selected: one ranking serves both
    path = Path(row["run_dir"]) / RANKS_FILE
    own = kept_on_sampled(row)
    if path.exists():
        with np.load(path) as saved:
            ranks = {k: saved[k] for k in saved.files}
        if OWN in ranks or not own:
            return ranks
    else:
        ranks = next_item_ranks(load_bundle(path.parent), data, "test", nic.eval_negatives, nic.eval_seed)
    if own:  # the sampled ranks of the state kept on the sampled valid metric (``model-also.pt``)
        also = load_bundle(path.parent / ALSO_MODEL)
        ranks[OWN] = next_item_ranks(also, data, "test", nic.eval_negatives, nic.eval_seed)["sampled"]
    np.savez_compressed(path, **ranks)
    return ranks
