"""The smoke test: rank real candidates for a few users through the deployed server, check every answer."""

from __future__ import annotations

from serving.rollout.base import MODEL_NAME


def smoke_test(ws, url: str, expected_version: str, users: int = 3, candidates: int = 20) -> list[str]:
    """The problems found (empty = pass): HTTP errors, ads lost or unsorted, probabilities outside [0, 1], another
    version than the one deployed, embeddings of another user model than the ranker expects."""
    import numpy as np

    from features.feature_repo.offline import partition_days, read_partition
    from models.embeddings.versions import sample_users
    from serving.client import rank

    days = partition_days(ws, "offline", "ad_attributes")
    if not days:
        return [f"no ads to rank: {ws.offline('ad_attributes')} is empty"]
    ads = np.sort(read_partition(ws.offline("ad_attributes", days[-1]), ["ad_id"]).column(0).to_numpy())
    ads = [int(a) for a in ads[:candidates]]
    ids = [int(u) for u in sample_users(ws, users)] or [0]
    problems = []
    for user in ids:
        try:
            status, body = rank(url, MODEL_NAME, user, ads)
        except OSError as err:
            return [f"no server answering at {url}: {err}"]
        if status != 200:
            problems.append(f"user {user}: HTTP {status}: {body.get('error', body)}")
            continue
        p = np.asarray(body["p_click"], np.float64)
        if sorted(body["ad_ids"]) != sorted(ads):
            problems.append(f"user {user}: ranked {len(body['ad_ids'])} ads, sent {len(ads)}")
        if not (np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()):
            problems.append(f"user {user}: p_click outside [0, 1] or not finite")
        elif (np.diff(p) > 1e-9).any():
            problems.append(f"user {user}: ads not sorted by p_click")
        if expected_version and body.get("model_version") != expected_version:
            problems.append(f"user {user}: served {body.get('model_version')}, deployed {expected_version}")
        if body.get("fallback", {}).get("embedding_version_mismatch"):
            problems.append(
                f"user {user}: embedding {body.get('embedding_version')} is not from the user model the ranker "
                f"expects ({body.get('expected_user_model_version')})"
            )
    return problems
