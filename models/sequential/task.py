"""The next-item task of the training loop (``models.train``): what one epoch feeds the model, its loss, and
the leave-one-out judgement of a split (sampled and full ranking; the best state is the highest
``next_item.select_metric`` on valid)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from features.splits import leave_one_out_split
from models.config import TrainRunConfig, resolve_user_model
from models.data import DenseSpec, TrainingSet
from models.inference import ModelBundle, build_model
from models.sequential.data import ItemAttributes, SequenceSet, TrainPairs
from models.sequential.evaluate import model_scorer, negative_lists, rank_split
from models.sequential.objective import next_item_loss, resolve_loss

BUCKET_BATCHES = 32  # length-sorted chunks of this many batches: little padding, still a shuffled order


class NextItemTask:
    higher_is_better, sparse_in_backward = True, False  # embeddings train with AdamW (see models.train)

    def __init__(self, cfg: TrainRunConfig, path: Path):
        data = TrainingSet(path)
        if cfg.split_mode == "leave_one_out":
            data.examples["split"] = leave_one_out_split(data.examples)
        if cfg.model == "sasrec":
            mc, max_len, buckets, items = cfg.sasrec, cfg.sasrec.max_len, 0, None
        else:
            mc = resolve_user_model(cfg.user_model, leave_one_out=True)
            max_len, buckets = mc.max_history, mc.time_buckets
            items = ItemAttributes.read(path, data.vocab["ad_id"]) if mc.item_attributes == "all" else None
            if mc.item_attributes == "all" and items is None:
                raise ValueError(f"{path}: user_model.item_attributes=all but the set has no items.parquet")
        self.cfg, self.data = cfg, data
        self.seqs = SequenceSet(data, max_len, buckets)
        model = build_model(cfg.model, mc, data.vocab, 0, items=items)
        self.bundle = ModelBundle(cfg.model, model, data.vocab, DenseSpec([], [], []), 0, "", "", items=items)
        self.loss_kind = resolve_loss(cfg.next_item, model.num_items)
        self.negatives = negative_lists(self.seqs, cfg.next_item.eval_negatives, cfg.next_item.eval_seed)
        self.select = f"valid_{cfg.next_item.select_metric}"
        self.num_train = self.seqs.num_users

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """Users in batches of ``optim.batch_size``: shuffled, then sorted by length within chunks of
        ``BUCKET_BATCHES`` batches (a batch's sequences have similar lengths), batches shuffled again."""
        rng = np.random.default_rng(self.cfg.optim.seed + epoch)
        size = self.cfg.optim.batch_size
        users = rng.permutation(self.seqs.num_users)
        lengths = np.minimum(self.seqs.train_cut[users], self.seqs.max_len)
        chunk = size * BUCKET_BATCHES
        out = []
        for start in range(0, len(users), chunk):
            part = users[start : start + chunk]
            part = part[np.argsort(lengths[start : start + chunk], kind="stable")]
            out += [part[i : i + size] for i in range(0, len(part), size)]
        return [out[i] for i in rng.permutation(len(out))]

    def loss(self, users: np.ndarray) -> torch.Tensor:
        batch: TrainPairs = self.seqs.train_batch(users)
        return next_item_loss(self.bundle.model, batch, self.loss_kind, self.cfg.next_item.num_negatives)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        was_training = model.training
        model.eval()
        out = rank_split(model_scorer(model, self.seqs), self.seqs, split, self.negatives, prefix=f"{split}_")
        model.train(was_training)
        return out

    def plots(self, model: nn.Module, history: list[dict], run_dir: Path) -> list[Path]:
        from models.plots import ranking_curve_plot

        return [ranking_curve_plot(history, self.select, run_dir / "learning_curve.png")]
