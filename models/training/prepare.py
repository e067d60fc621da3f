"""What a training run trains on (``gemflow train``, both strategies): the training set and its splits, the
dense normalization fitted on the train rows, the batch builder (the user model's histories or the ranker's
recent events and cached user tokens) and the initial model, seeded from ``optim.seed`` (``prepare``)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gemflow.workspace import Workspace
from models.config import TrainRunConfig, resolve_user_model, validate
from models.inference.bundle import (
    ModelBundle,
    batches,
    build_model,
    embed_examples,
    load_bundle,
)
from models.training.batch_builder import BatchBuilder
from models.training.data import SNAPSHOTS, USER_VOCAB_ROW, TrainingSet, leave_one_out_split
from models.training.dense import DenseSpec


def resolve_training_set(name_or_path: str, ws: Workspace) -> Path:
    path = Path(name_or_path)
    return path if path.is_dir() else ws.training(name_or_path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Setup:
    data: TrainingSet
    builder: BatchBuilder
    bundle: ModelBundle
    train_rows: np.ndarray
    valid_rows: np.ndarray
    test_rows: np.ndarray


def prepare(cfg: TrainRunConfig, ws: Workspace, user_embeddings: np.ndarray | None = None) -> Setup:
    """Load the training set, fit the dense normalization on train rows, build batches and the model.

    ``user_embeddings`` (ranker only): (examples, K * d) cached user tokens to use instead of the training
    set's ``user_embedding`` column (the ablation bench passes what it just embedded).
    """
    validate(cfg)
    seed_everything(cfg.optim.seed)
    path = resolve_training_set(cfg.training_set, ws)
    if cfg.model == "user":
        if resolve_objective(cfg, path) != "click":
            raise ValueError(
                f"{path}: the next-item objective trains in one process (`gemflow train` without --nproc)"
            )
        cfg = replace(cfg, user_model=resolve_user_model(cfg.user_model, leave_one_out=False))
    data = TrainingSet(path, require_ranker=cfg.model == "ranker")
    if cfg.split_mode == "leave_one_out":
        data.examples["split"] = leave_one_out_split(data.examples)
    train_rows, valid_rows, test_rows = (data.split_rows(s) for s in ("train", "valid", "test"))
    if len(train_rows) == 0 or len(valid_rows) == 0:
        raise ValueError(
            f"{data.path}: need train and valid examples, got {len(train_rows)} train / {len(valid_rows)} valid"
        )
    if cfg.optim.max_train_examples and len(train_rows) > cfg.optim.max_train_examples:
        keep = np.random.default_rng(cfg.optim.seed).choice(
            len(train_rows), cfg.optim.max_train_examples, replace=False
        )
        train_rows = np.sort(train_rows[keep])
    frame = data.dense_frame()
    dense = DenseSpec.fit(frame.iloc[train_rows], data.dense_columns())

    user_model_version, token_dim = "", 0
    if cfg.model == "user":
        mc = cfg.user_model
        builder = BatchBuilder(
            data, dense, history_len=mc.max_history, time_buckets=mc.time_buckets, gap_to="previous",
            snapshot=mc.snapshot,
        )  # fmt: skip
    else:
        mc = cfg.ranker
        present = None
        if mc.use_user_tokens:
            user_embeddings, present, user_model_version = _cached_user_tokens(cfg, data, user_embeddings)
        if user_embeddings is not None:
            token_dim = user_embeddings.shape[1] // mc.num_user_tokens
        builder = BatchBuilder(
            data, dense, history_len=mc.recent_events, time_buckets=mc.time_buckets, gap_to="request",
            user_embeddings=user_embeddings if mc.use_user_tokens else None, user_present=present,
            num_user_tokens=mc.num_user_tokens, fresh_delay_s=mc.fresh_delay_s,
        )  # fmt: skip
    model = build_model(cfg.model, mc, data.vocab, len(dense.columns), token_dim)
    init_output_bias(model, data.labels(train_rows).numpy().mean(0))
    bundle = ModelBundle(
        cfg.model, model, data.vocab, dense, token_dim, "", user_model_version, vocabularies=data.vocabularies
    )
    return Setup(data, builder, bundle, train_rows, valid_rows, test_rows)


def resolve_objective(cfg: TrainRunConfig, path: Path) -> str:
    """The user model's objective: as configured, or for "auto" next_item on a set split leave-one-out (by
    build-training-set, or re-split here by ``split_mode: leave_one_out``)."""
    if cfg.user_model.objective != "auto":
        return cfg.user_model.objective
    if cfg.split_mode == "leave_one_out":
        return "next_item"
    manifest = path / "manifest.json"
    split = json.loads(manifest.read_text()).get("split", "time") if manifest.exists() else "time"
    return "next_item" if split == "leave-one-out" else "click"


def init_output_bias(model: nn.Module, rates: np.ndarray) -> None:
    """Start the click/conversion logits at the train base rates: the untrained model then predicts the
    background rate (NE 1.0) and training only has to learn what depends on the inputs."""
    rates = np.clip(rates, 1e-4, 1 - 1e-4)
    with torch.no_grad():
        model.head[-1].bias.copy_(torch.from_numpy(np.log(rates / (1 - rates))).float())
        model.head[-1].weight.mul_(0.1)


def _cached_user_tokens(cfg: TrainRunConfig, data: TrainingSet, given: np.ndarray | None):
    if given is not None:
        return given, np.ones(len(given), bool), "given"
    if cfg.ranker.user_model:
        user_bundle = load_bundle(cfg.ranker.user_model)
        emb = user_tokens_per_example(user_bundle, data)
        return emb, np.ones(len(emb), bool), user_bundle.version
    emb, present, versions = data.user_embeddings()
    if emb is None:
        raise ValueError(
            f"{data.path}: ranker.use_user_tokens=true but the training set has no user_embedding values; "
            "set ranker.user_model=<user-model run dir> or ranker.use_user_tokens=false (online-only)"
        )
    return emb, present, ",".join(versions)


def user_tokens_per_example(bundle: ModelBundle, data: TrainingSet, batch_size: int = 256) -> np.ndarray:
    """(examples, K * d) cached user tokens of every example, cut the way the user model was trained:
    as of the example itself (``snapshot="example"``), or as of its day's start (``"day"``: one encode per user-day,
    the daily refresh). Either way no event at or after the example's own cut enters its tokens."""
    every = SNAPSHOTS[getattr(bundle.cfg, "snapshot", "example")]
    data = data.as_seen_by(bundle.vocabularies)  # the user model's own rows, whatever set feeds the ranker
    if not every:
        return embed_examples(bundle, data)
    rows = np.arange(len(data.examples))
    group, cuts = data.snapshot_groups(rows, every)
    head = np.unique(group, return_index=True)[1]  # one example row per user-day
    model, cfg = bundle.model, bundle.cfg
    out = []
    with torch.no_grad():
        for chunk in batches(np.arange(len(head)), batch_size, "embed user-days"):
            h = data.history(
                head[chunk], cfg.max_history, cfg.time_buckets, gap_to="previous", cuts=cuts[head[chunk]]
            )
            user_id = torch.from_numpy(data.examples[USER_VOCAB_ROW].to_numpy(np.int64)[head[chunk]])
            out.append(model.encode_user(h, user_id).flatten(1))
    per_group = torch.cat(out).numpy().astype(np.float32)
    return per_group[group]
