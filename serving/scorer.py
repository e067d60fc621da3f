"""Scoring one request: the user side once (``Ranker.user_side``: every block's K/V), candidates in batches.

``score_shared`` is the serving path. ``score_recompute`` is the same model called the training way with the
user side repeated for every candidate (B = N users of one candidate each): it recomputes the user's K/V per
candidate, and exists to prove equality (tests) and to measure what sharing saves (``bench/serve.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from models.architectures.ranker import CandidateQueries, Ranker
from models.training.batch import Batch, Candidates, Events, Profile


@dataclass
class UserInputs:
    recent: Events  # one user's recent events
    profile: Profile  # (1,) row
    user_tokens: torch.Tensor | None  # (1, K, d_user) or None (cold start)


def user_tokens(embedding: np.ndarray | None, ranker: Ranker) -> tuple[torch.Tensor | None, str | None]:
    """(1, K, d) tokens from a flat cached embedding, or None plus why it cannot be used."""
    if embedding is None:
        return None, "no_embedding"
    if ranker.user_proj is None:
        return None, "ranker_uses_no_embedding"
    k, width = ranker.cfg.num_user_tokens, ranker.user_proj.in_features
    if embedding.size != k * width:
        return None, f"embedding_width_{embedding.size}_expected_{k * width}"
    if not np.isfinite(embedding).all():
        return None, "embedding_not_finite"
    return torch.from_numpy(embedding.reshape(1, k, width).copy()), None


@torch.inference_mode()
def score_shared(
    ranker: Ranker,
    user: UserInputs,
    cands: Candidates | None,
    batch_size: int,
    check: Callable[[], None] | None = None,
    queries: CandidateQueries | None = None,
) -> np.ndarray:
    """(N, 2) probabilities p_click, p_conversion; the user's K/V computed once, shared by every batch.

    ``check`` is called before every batch: it raises to abandon a request whose deadline passed. ``queries``:
    the candidates' user-independent rows when the caller has them (``serving.candidate_cache``); ``cands`` may
    then be None (``Ranker.score`` needs nothing else of them)."""
    if cands is None and queries is None:
        raise ValueError("score_shared needs the candidates or their queries")
    mask = None if user.user_tokens is None else torch.ones(1, dtype=torch.bool)
    side = ranker.user_side(user.recent, user.profile, user.user_tokens, mask)
    n = queries.token.shape[0] if cands is None else cands.ad_id.numel()
    if 0 < n <= batch_size:  # one batch (the usual request): no slicing
        if check is not None:
            check()
        return torch.sigmoid(ranker.score(side, cands, queries)).numpy()
    out = []
    for start in range(0, n, batch_size):
        if check is not None:
            check()
        stop = min(n, start + batch_size)
        chunk = None if cands is None else Candidates(
            ad_id=cands.ad_id[start:stop],
            advertiser_id=cands.advertiser_id[start:stop],
            category_id=cands.category_id[start:stop],
            surface=cands.surface[start:stop],
            dense=cands.dense[start:stop],
            offsets=torch.tensor([0, stop - start]),
        )  # fmt: skip
        part = None if queries is None else queries.part(start, stop)
        out.append(torch.sigmoid(ranker.score(side, chunk, part)))
    return torch.cat(out).numpy() if out else np.zeros((0, 2), np.float32)


def repeat_user(user: UserInputs, n: int) -> tuple[Events, Profile, torch.Tensor | None]:
    """The one user's inputs repeated for n users (jagged: the events n times, offsets advanced)."""
    ev = user.recent
    length = int(ev.offsets[-1])
    rep = {
        f: getattr(ev, f).repeat(n)
        for f in ("ad_id", "action", "surface", "category_id", "advertiser_id", "ts", "gap_bucket")
    }
    events = Events(**rep, offsets=torch.arange(n + 1) * length)
    prof = Profile(
        *(
            getattr(user.profile, f).repeat(n, *([1] * (getattr(user.profile, f).dim() - 1)))
            for f in ("user_id", "gender", "country", "dense")
        )
    )
    tokens = None if user.user_tokens is None else user.user_tokens.expand(n, -1, -1).contiguous()
    return events, prof, tokens


@torch.inference_mode()
def score_recompute(ranker: Ranker, user: UserInputs, cands: Candidates) -> np.ndarray:
    """(N, 2) probabilities with the user side recomputed for every candidate (no K/V sharing)."""
    n = cands.ad_id.numel()
    events, prof, tokens = repeat_user(user, n)
    mask = None if tokens is None else torch.ones(n, dtype=torch.bool)
    batch = Batch(
        history=events,
        candidates=replace(cands, offsets=torch.arange(n + 1)),
        labels=torch.zeros(n, 2),
        profile=prof,
        user_tokens=tokens,
        user_token_mask=mask,
    )
    logits, _ = ranker(batch)
    return torch.sigmoid(logits).numpy()
