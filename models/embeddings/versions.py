"""Does the serving ranker read embeddings written by the user model it was trained against?

The ranker champion records the user-model version of the cached tokens it was trained on (registry tag
``gemflow.user_model_version``, also ``bundle.user_model_version``); every online embedding row carries the
``model_version`` that wrote it. After a new user-model champion is refreshed, the online rows change version
while the ranker still expects the old one: serving then flags each request (``embedding_version_mismatch``).
``check_versions`` finds that before traffic does, from a sample of users.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from features.feature_repo.offline import partition_days, read_partition
from gemflow.workspace import Workspace
from models.embeddings.refresh import EMBEDDING_TABLE, MODEL_URI, load_local
from models.tracking.mlflow_store import connect

RANKER_CHAMPION_URI = "models:/gem-ranker@champion"
VERSION_TAG = "gemflow.user_model_version"


@dataclass
class VersionReport:
    ranker: str  # the ranker version checked ("gem-ranker/4")
    expected: list[str]  # user-model version(s) its cached tokens came from; empty = it reads none
    sampled: int  # users asked for
    found: int  # of them with an embedding online
    versions: dict[str, int] = field(default_factory=dict)  # online model_version -> users
    mismatched_users: list[int] = field(default_factory=list)  # a few examples

    @property
    def status(self) -> str:
        if not self.expected:
            return "no_expectation"  # an online-only ranker: nothing to compare
        if self.found == 0:
            return "no_embeddings"
        return "mismatch" if self.mismatched_users else "ok"

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "no_expectation")

    def message(self) -> str:
        seen = ", ".join(f"{v} x{n}" for v, n in sorted(self.versions.items())) or "none"
        head = f"{self.ranker} expects user model {', '.join(self.expected) or '(none)'}"
        tail = f"online ({self.found}/{self.sampled} sampled users have one): {seen}"
        if self.status == "mismatch":
            return f"MISMATCH: {head}; {tail}; e.g. users {self.mismatched_users[:5]}"
        if self.status == "no_embeddings":
            return f"NO EMBEDDINGS: {head}; none of {self.sampled} sampled users has one online"
        return f"{self.status.upper()}: {head}; {tail}"

    def to_dict(self) -> dict:
        return {**asdict(self), "status": self.status}


def expected_versions(
    ranker_uri: str, tracking_uri: str = "", ws: Workspace | None = None
) -> tuple[str, list[str]]:
    """(the ranker version checked, the user-model versions it expects) for a registry URI or a model.pt."""
    if not ranker_uri.startswith("models:/"):
        bundle = load_local(Path(ranker_uri))
        if bundle.kind != "ranker":
            raise ValueError(f"{ranker_uri} is a {bundle.kind} model, not a ranker")
        return f"local/{bundle.version or Path(ranker_uri).name}", _split(bundle.user_model_version)
    match = MODEL_URI.match(ranker_uri)
    if not match:
        raise ValueError(
            f"model URI {ranker_uri!r} must look like models:/NAME@ALIAS or models:/NAME/VERSION"
        )
    from mlflow.exceptions import MlflowException

    client = connect(ws, tracking_uri)
    name = match["name"]
    try:
        mv = (
            client.get_model_version_by_alias(name, match["alias"])
            if match["alias"]
            else client.get_model_version(name, match["version"])
        )
    except MlflowException as err:
        raise LookupError(f"cannot resolve {ranker_uri} at {client.tracking_uri}: {err.message}") from err
    label = f"{name}/{mv.version}"
    if VERSION_TAG in mv.tags:
        return label, _split(mv.tags[VERSION_TAG])
    from models.tracking.registry import (
        load_registered,  # no tag: an online-only ranker, or registered by hand
    )

    return label, _split(load_registered(f"models:/{name}/{mv.version}").user_model_version)


def _split(versions: str | None) -> list[str]:
    return [v for v in (versions or "").split(",") if v]


def sample_users(ws: Workspace, sample: int, seed: int = 0) -> np.ndarray:
    """Up to ``sample`` users of the latest refresh (the users whose embeddings should be online)."""
    days = partition_days(ws, "offline", EMBEDDING_TABLE)
    if not days:
        return np.zeros(0, np.int64)
    users = read_partition(ws.offline(EMBEDDING_TABLE, days[-1]), ["user_id"]).column(0).to_numpy()
    if len(users) > sample:
        users = np.random.default_rng(seed).choice(users, sample, replace=False)
    return np.sort(users.astype(np.int64))


def online_versions(store, user_ids: np.ndarray) -> list[str | None]:
    """The ``model_version`` online for each user (None where the user has no embedding)."""
    if len(user_ids) == 0:
        return []
    from feast.errors import FeastObjectNotFoundException

    rows = [{"user_id": int(u)} for u in user_ids]
    try:
        out = store.get_online_features(
            features=[f"{EMBEDDING_TABLE}:model_version"], entity_rows=rows
        ).to_dict()
    except FeastObjectNotFoundException as err:
        raise LookupError(
            f"the feature store at {store.repo_path} has no {EMBEDDING_TABLE} view yet "
            "(run `gemflow ingest` and `gemflow refresh-embeddings` first)"
        ) from err
    return list(out["model_version"])


def check_versions(store, ranker: str, expected: list[str], user_ids: np.ndarray) -> VersionReport:
    found = online_versions(store, user_ids)
    versions: dict[str, int] = {}
    mismatched = []
    for user, version in zip(user_ids.tolist(), found, strict=True):
        if version is None:
            continue
        versions[version] = versions.get(version, 0) + 1
        if expected and version not in expected:
            mismatched.append(int(user))
    present = sum(versions.values())
    return VersionReport(ranker, expected, len(user_ids), present, versions, mismatched)
