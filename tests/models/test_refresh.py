"""The embedding refresh against real Feast stores: offline partition, online push, point-in-time joins of later
training sets, version-mismatch detection, multi-process == single-process, and the registry champion."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from features.feature_repo.offline import day_end
from features.feature_repo.tables import CREATED_TS, EVENT_TS, USER_EMBEDDING
from features.store import open_store
from features.training_sets import TrainingSetConfig, build_training_set
from gemflow.cli import app
from gemflow.workspace import Workspace
from models.config import RankerConfig, UserModelConfig
from models.embeddings.batching import shard_by_tokens, token_budget_batches
from models.embeddings.refresh import (
    EMBEDDING_FILE,
    RefreshConfig,
    active_sequences,
    encode_sequences,
    load_champion,
    refresh_embeddings,
)
from models.embeddings.versions import check_versions, expected_versions, sample_users
from models.inference.bundle import ModelBundle, build_model, embed_examples, save_bundle
from models.tracking.registry.flat import to_training_set
from models.training.data import TrainingSet
from models.training.dense import DenseSpec
from tests.features.helpers import (
    DAY0,
    USERS,
    landed_days,
)
from tests.models.fixtures import record_training_run

DAYS = [DAY0 + dt.timedelta(days=k) for k in range(4)]
MODEL_CFG = UserModelConfig(d_model=16, num_layers=1, num_heads=2, num_user_tokens=2, max_history=24)


@pytest.fixture(scope="module")
def landed(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Four accepted days in a workspace (pristine copy per test) and two user models (v1, v2) over its vocab."""
    root = tmp_path_factory.mktemp("refresh")
    ws = Workspace(root / "ws")
    vocab = landed_days(ws, DAYS, events_per_day=50)
    models = {}
    for seed, name in ((1, "v1"), (2, "v2")):
        torch.manual_seed(seed)
        model = build_model("user", MODEL_CFG, vocab, 1)
        bundle = ModelBundle("user", model, vocab, DenseSpec(["quality"], [0.0], [1.0]), 0, name, "")
        save_bundle(root / name / "model.pt", bundle)
        models[name] = root / name / "model.pt"
    return ws.root, models


@pytest.fixture
def ws(landed, tmp_path) -> Workspace:
    shutil.copytree(landed[0], tmp_path / "ws")
    return Workspace(tmp_path / "ws")


def refresh(ws: Workspace, model: Path, day: dt.date, **kw) -> dict:
    return refresh_embeddings(ws, RefreshConfig(date=day.isoformat(), model_uri=str(model), **kw))


def online(ws: Workspace, users) -> dict:
    rows = [{"user_id": int(u)} for u in users]
    feats = ["user_embedding:user_embedding", "user_embedding:model_version"]
    return open_store(ws).get_online_features(features=feats, entity_rows=rows).to_dict()


# ----------------------------------------------------------------------------------------------- batching
def test_token_budget_batches_are_sorted_dense_and_within_budget():
    lengths = np.random.default_rng(0).integers(1, 300, 500)
    plan = token_budget_batches(lengths, token_budget=1000, max_users=64)
    assert sorted(np.concatenate(plan).tolist()) == list(range(500))
    flat = np.concatenate([lengths[b] for b in plan])
    assert (np.diff(flat) >= 0).all(), "users are not in ascending length order"
    for b in plan:
        assert len(b) <= 64
        assert lengths[b].sum() <= 1000 or len(b) == 1
    # a user longer than the budget still gets encoded, alone
    assert [len(b) for b in token_budget_batches(np.array([5, 5000]), 100, 8)] == [1, 1]
    with pytest.raises(ValueError, match="token_budget"):
        token_budget_batches(lengths, 0, 8)


def test_shards_balance_tokens():
    lengths = np.random.default_rng(1).integers(1, 1000, 301)
    shards = shard_by_tokens(lengths, 2)
    assert sorted(np.concatenate(shards).tolist()) == list(range(301))
    loads = [lengths[s].sum() for s in shards]
    assert max(loads) / min(loads) < 1.01


# ----------------------------------------------------------------------------------------------- refresh
def test_refresh_writes_offline_and_online_with_the_model_version(ws, landed):
    day = DAYS[1]
    summary = refresh(ws, landed[1]["v1"], day)
    assert summary["model_version"] == "local/v1" and summary["online"] == "pushed"
    assert summary["users"] == len(USERS)

    table = pq.read_table(ws.offline("user_embedding", day) / EMBEDDING_FILE)
    assert table.schema.equals(USER_EMBEDDING.remove_metadata(), check_metadata=False)
    frame = table.to_pandas()
    assert (frame[EVENT_TS] == day_end(day)).all() and (frame[CREATED_TS] == day_end(day)).all()
    assert set(frame["model_version"]) == {"local/v1"}

    got = online(ws, [USERS[0], 999])  # 999: never seen, no embedding
    assert got["model_version"] == ["local/v1", None]
    expected = frame.set_index("user_id").loc[USERS[0], "user_embedding"]
    np.testing.assert_allclose(got["user_embedding"][0], expected, rtol=1e-6)
    assert got["user_embedding"][1] is None

    report = ws.reports(day) / "user_embedding"
    assert (report / "refresh_summary.json").exists() and (report / "refresh_config.yaml").exists()


def test_rerun_overwrites_and_embeddings_match_the_training_path(ws, landed):
    day = DAYS[2]
    refresh(ws, landed[1]["v2"], day, token_budget=40, max_users_per_batch=2)
    first = pq.read_table(ws.offline("user_embedding", day)).to_pandas()
    refresh(ws, landed[1]["v2"], day)  # other batches, same rows: overwritten, not appended
    again = pq.read_table(ws.offline("user_embedding", day)).to_pandas()
    assert len(again) == len(first) == len(USERS)
    np.testing.assert_allclose(np.stack(again.user_embedding), np.stack(first.user_embedding), atol=1e-5)

    # Same user tokens as the training/eval code path (embed_examples over a training set whose examples sit
    # after each user's last event up to the end of the day).
    champion = load_champion(str(landed[1]["v2"]))
    seqs = active_sequences(ws, day, RefreshConfig(), champion.bundle.cfg.max_history)
    hist = {}
    for f in ("ad_id", "action", "surface", "category_id", "advertiser_id", "ts"):
        hist[f"hist_{f}"] = [
            seqs.values[f][a:b].tolist() for a, b in zip(seqs.offsets[:-1], seqs.offsets[1:], strict=True)
        ]
    rows = pd.DataFrame({"user_id": seqs.user_ids, "ad_id": 10, "advertiser_id": 100, "category_id": 1,
                         "quality": 0.5, "surface": 0, "ts": 0, **hist})  # fmt: skip
    data = to_training_set(rows, ws.root / "flat")
    want = embed_examples(champion.bundle, data)
    got = np.stack(again.set_index("user_id").loc[seqs.user_ids, "user_embedding"])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert seqs.lengths.max() == MODEL_CFG.max_history  # the cut to the most recent events was exercised


def test_training_sets_join_the_embedding_live_at_each_example(ws, landed):
    refresh(ws, landed[1]["v1"], DAYS[1])
    refresh(ws, landed[1]["v2"], DAYS[2])
    written = {
        d: pq.read_table(ws.offline("user_embedding", d)).to_pandas().set_index("user_id") for d in DAYS[1:3]
    }
    build_training_set(
        ws, TrainingSetConfig(name="joined", start=DAYS[0].isoformat(), end=DAYS[3].isoformat())
    )
    ranker = pq.read_table(ws.training("joined") / "ranker.parquet").to_pandas()
    day = pd.to_datetime(ranker["ts"], unit="s", utc=True).dt.date
    assert ranker.loc[day <= DAYS[1], "model_version"].isna().all(), "an embedding leaked before it existed"
    for example_day, refreshed, version in ((DAYS[2], DAYS[1], "local/v1"), (DAYS[3], DAYS[2], "local/v2")):
        rows = ranker[day == example_day]
        assert len(rows) and (rows["model_version"] == version).all()
        for r in rows.itertuples():
            np.testing.assert_allclose(r.user_embedding, written[refreshed].loc[r.user_id, "user_embedding"])
    ts = TrainingSet(ws.training("joined"))
    assert ts.user_embeddings()[2] == ["local/v1", "local/v2"]


def test_backfill_does_not_overwrite_newer_online_embeddings(ws, landed):
    refresh(ws, landed[1]["v2"], DAYS[2])
    summary = refresh(ws, landed[1]["v1"], DAYS[1])
    assert summary["online"].startswith("skipped") and summary["online_rows"] == 0
    assert (ws.offline("user_embedding", DAYS[1]) / EMBEDDING_FILE).exists()
    assert online(ws, USERS)["model_version"] == ["local/v2"] * len(USERS)


def test_bad_inputs_name_the_problem(ws, landed, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a models:/ URI"):
        refresh(ws, tmp_path / "missing.pt", DAYS[1])
    with pytest.raises(FileNotFoundError, match="no accepted events on or before"):
        refresh(ws, landed[1]["v1"], DAY0 - dt.timedelta(days=3))
    with pytest.raises(ValueError, match="not a date"):
        refresh_embeddings(ws, RefreshConfig(date="yesterday", model_uri=str(landed[1]["v1"])))
    with pytest.raises(ValueError, match="must look like models:/NAME"):
        load_champion("models:/gem-user-model")
    with pytest.raises(FileNotFoundError, match="run `gemflow ingest"):
        refresh_embeddings(Workspace(tmp_path / "empty"), RefreshConfig(model_uri=str(landed[1]["v1"])))
    result = CliRunner().invoke(app, ["refresh-embeddings", "-w", str(ws.root), "--model-uri", "nope.pt"])
    assert result.exit_code == 2 and "neither a models:/ URI" in result.output


# ----------------------------------------------------------------------------------------------- versions
def _ranker(path: Path, user_model_version: str) -> Path:
    cfg = RankerConfig(d_model=16, num_layers=1, num_heads=2, num_user_tokens=2)
    vocab = {"ad_id": 20, "advertiser_id": 110, "category_id": 5, "action": 8, "surface": 4, "gender": 3,
             "country": 8, "user_id": 8}  # fmt: skip
    model = build_model("ranker", cfg, vocab, 1, 16)
    save_bundle(path, ModelBundle("ranker", model, vocab, DenseSpec(["quality"], [0.0], [1.0]), 16, "r1",
                                  user_model_version))  # fmt: skip
    return path


def test_version_mismatch_is_detected(ws, landed, tmp_path):
    refresh(ws, landed[1]["v1"], DAYS[1])
    users = sample_users(ws, 100)
    assert users.tolist() == sorted(USERS)
    store = open_store(ws)
    ok = check_versions(store, "gem-ranker/1", ["local/v1"], np.append(users, 999))
    assert ok.status == "ok" and ok.found == len(USERS) and ok.sampled == len(USERS) + 1

    refresh(ws, landed[1]["v2"], DAYS[2])  # a new user-model champion went live; the ranker still expects v1
    bad = check_versions(store, "gem-ranker/1", ["local/v1"], users)
    assert bad.status == "mismatch" and bad.versions == {"local/v2": len(USERS)}
    assert bad.mismatched_users == sorted(USERS) and "MISMATCH" in bad.message()
    assert check_versions(store, "gem-ranker/1", [], users).status == "no_expectation"
    assert check_versions(store, "gem-ranker/1", ["local/v2"], np.array([999])).status == "no_embeddings"

    ranker = _ranker(tmp_path / "ranker" / "model.pt", "local/v1")
    assert expected_versions(str(ranker)) == ("local/r1", ["local/v1"])
    cli = ["check-versions", "-w", str(ws.root), "--ranker-uri", str(ranker)]
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 1 and "MISMATCH" in result.output, result.output
    _ranker(ranker, "local/v2")
    result = CliRunner().invoke(app, [*cli, "--users", ",".join(map(str, USERS))])
    assert result.exit_code == 0 and result.output.startswith("OK"), result.output


# ----------------------------------------------------------------------------------------------- processes
@pytest.mark.integration
def test_multi_process_refresh_equals_single_process(ws, landed):
    champion = load_champion(str(landed[1]["v1"]))
    seqs = active_sequences(ws, DAYS[3], RefreshConfig(), champion.bundle.cfg.max_history)
    single = encode_sequences(champion.bundle, seqs, RefreshConfig(), desc=None)
    summary = refresh(ws, landed[1]["v1"], DAYS[3], nproc=2, threads=1)
    assert summary["nproc"] == 2
    multi = pq.read_table(ws.offline("user_embedding", DAYS[3])).to_pandas().set_index("user_id")
    np.testing.assert_allclose(np.stack(multi.loc[seqs.user_ids, "user_embedding"]), single, atol=1e-5)


# ----------------------------------------------------------------------------------------------- registry
@pytest.fixture
def mlflow_server(tmp_path):
    import mlflow

    from models.tracking.registry.server import start_server
    from tests.ports import free_port

    port = free_port()
    proc = start_server(tmp_path / "mlflow", port=port)
    previous = os.environ.get("MLFLOW_TRACKING_URI")  # not get_tracking_uri(): unset, it names ./mlflow.db
    url = f"http://127.0.0.1:{port}"
    mlflow.set_tracking_uri(url)
    yield url
    mlflow.set_tracking_uri(previous)  # None unsets it: no store leaks into later tests
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.integration
def test_refresh_from_the_registry_champion_records_its_version(ws, landed, mlflow_server):
    from mlflow import MlflowClient

    from models.tracking.registry import register_bundle

    client = MlflowClient()
    data = ws.training("vocab")
    for run in ("v1", "v2"):  # bundles written without training: give each the run training would record
        record_training_run(landed[1][run].parent, ws, mlflow_server)
    cli = ["register-run", "-w", str(ws.root), "--tracking-uri", mlflow_server, "--training-set", "vocab",
           "--run-dir", str(landed[1]["v1"].parent), "--calibration-low", "0.01", "--calibration-high", "100"]  # fmt: skip
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0 and "PROMOTED" in result.output, result.output
    first = client.get_model_version_by_alias("gem-user-model", "champion")
    # the same run again (a retried task) reuses its version: the same decision, no second version
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0 and f"v{first.version} from" in result.output, result.output
    assert client.get_model_version_by_alias("gem-user-model", "champion").version == first.version
    assert len(client.search_model_versions("name='gem-user-model'")) == 1
    second = register_bundle(landed[1]["v2"].parent, data)
    cfg = {"tracking_uri": mlflow_server}
    assert refresh(ws, Path("models:/gem-user-model@champion"), DAYS[1], **cfg)["model_version"] == (
        f"gem-user-model/{first.version}"
    )
    client.set_registered_model_alias(second.name, "champion", second.version)
    summary = refresh(ws, Path("models:/gem-user-model@champion"), DAYS[2], **cfg)
    assert summary["model_version"] == f"gem-user-model/{second.version}"
    assert summary["resolved_uri"] == f"models:/gem-user-model/{second.version}"
    assert online(ws, USERS)["model_version"] == [f"gem-user-model/{second.version}"] * len(USERS)

    # the ranker champion's expectation comes from its registry tag
    client.create_registered_model("gem-ranker")
    mv = client.create_model_version("gem-ranker", source=second.uri)
    client.set_model_version_tag(
        "gem-ranker", mv.version, "gemflow.user_model_version", summary["model_version"]
    )
    client.set_registered_model_alias("gem-ranker", "champion", mv.version)
    ranker, expected = expected_versions("models:/gem-ranker@champion", mlflow_server)
    assert (ranker, expected) == (f"gem-ranker/{mv.version}", [summary["model_version"]])
    assert check_versions(open_store(ws), ranker, expected, np.array(USERS)).status == "ok"
    with pytest.raises(LookupError, match="cannot load models:/gem-user-model@nope"):
        load_champion("models:/gem-user-model@nope", mlflow_server)
