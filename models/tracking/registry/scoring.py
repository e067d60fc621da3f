"""Scoring a trained bundle on a training set exactly as training evaluates it (shared by the gate and MLflow)."""

from __future__ import annotations

import numpy as np

from models.inference.bundle import ModelBundle
from models.training.batch_builder import BatchBuilder
from models.training.data import TrainingSet


def batch_builder(bundle: ModelBundle, data: TrainingSet) -> BatchBuilder:
    cfg = bundle.cfg
    data = data.as_seen_by(bundle.vocabularies)
    if bundle.kind == "user":
        return BatchBuilder(
            data, bundle.dense, history_len=cfg.max_history, time_buckets=cfg.time_buckets, gap_to="previous"
        )
    emb, present = None, None
    if cfg.use_user_tokens and bundle.user_token_dim:
        emb, present, _ = data.user_embeddings()
        if emb is None:  # no cached embedding in this data: every row takes the cold-start path
            present = np.zeros(len(data.examples), bool)
            emb = np.zeros((len(data.examples), bundle.user_token_dim * cfg.num_user_tokens), np.float32)
    return BatchBuilder(
        data, bundle.dense, history_len=cfg.recent_events, time_buckets=cfg.time_buckets, gap_to="request",
        user_embeddings=emb, user_present=present, num_user_tokens=cfg.num_user_tokens,
        fresh_delay_s=cfg.fresh_delay_s,
    )  # fmt: skip
