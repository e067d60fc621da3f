"""The next-item task of the training loop (``models.training.train``): what one epoch feeds the model, its loss, and
the leave-one-out judgement of a split (sampled and full ranking; the best state is the highest
``next_item.select_metric`` on valid, and with ``next_item.also_select_metric`` a second one is kept too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from features.splits import leave_one_out_split
from models.config import TrainRunConfig, resolve_user_model
from models.inference.bundle import ModelBundle, build_model
from models.sequential.data import ItemAttributes, SequenceSet, TrainPairs
from models.sequential.evaluate import catalog_mask, model_scorer, rank_split, sequence_negatives
from models.sequential.objective import next_item_loss, resolve_loss, resolve_loss_dtype
from models.training.data import TrainingSet
from models.training.dense import DenseSpec


class NextItemTask:
    higher_is_better, sparse_in_backward = (
        True,
        False,
    )  # embeddings train with AdamW (see models.training.train)

    def __init__(self, cfg: TrainRunConfig, path: Path):
        data = TrainingSet(path)
        if cfg.split_mode == "leave_one_out":
            data.examples["split"] = leave_one_out_split(data.examples)
        if cfg.model == "sasrec":
            mc, max_len, buckets, items = cfg.sasrec, cfg.sasrec.max_len, 0, None
        else:
            mc = resolve_user_model(cfg.user_model, leave_one_out=True)
            max_len, buckets = mc.max_history, mc.time_buckets
            items = (
                ItemAttributes.read(path, data.vocab["ad_id"], data.vocabularies.get("ad_id"))
                if mc.item_attributes == "all"
                else None
            )
            if mc.item_attributes == "all" and items is None:
                raise ValueError(f"{path}: user_model.item_attributes=all but the set has no items.parquet")
        self.cfg, self.data = cfg, data
        self.seqs = SequenceSet(data, max_len, buckets)
        model = build_model(cfg.model, mc, data.vocab, 0, items=items)
        self.bundle = ModelBundle(
            cfg.model, model, data.vocab, DenseSpec([], [], []), 0, "", "", items=items,
            vocabularies=data.vocabularies,
        )  # fmt: skip
        self.loss_kind = resolve_loss(cfg.next_item, model.num_items)
        self.loss_dtype = resolve_loss_dtype(cfg.next_item) if self.loss_kind == "full" else None
        self.negatives = sequence_negatives(self.seqs, cfg.next_item.eval_negatives, cfg.next_item.eval_seed)
        self.candidates = catalog_mask(self.seqs)
        self.select = f"valid_{cfg.next_item.select_metric}"
        self.also = f"valid_{cfg.next_item.also_select_metric}" if cfg.next_item.also_select_metric else ""
        self.num_train = self.seqs.num_users

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """Batches of ``optim.batch_size`` users. SASRec: users of similar train-prefix length together (shuffled
        within a length, the batches in random order), the way its reference code runs it fast: its padded
        encoder costs batch x longest x d, and most users are short (Toys median 6 of 50). The user model:
        shuffled users (its jagged encoder pads nothing; length-sorted batches cost it ~0.04 valid HR@10 on
        Toys at equal epochs, every batch weighing the same, so short users counted far more per target)."""
        rng = np.random.default_rng(self.cfg.optim.seed + epoch)
        size = self.cfg.optim.batch_size
        if self.cfg.model == "sasrec":
            users = np.lexsort(
                (rng.random(self.seqs.num_users), np.minimum(self.seqs.train_cut, self.seqs.max_len))
            )
            batches = [users[i : i + size] for i in range(0, len(users), size)]
            return [batches[i] for i in rng.permutation(len(batches))]
        users = rng.permutation(self.seqs.num_users)
        return [users[i : i + size] for i in range(0, len(users), size)]

    def loss(self, users: np.ndarray) -> torch.Tensor:
        batch: TrainPairs = self.seqs.train_batch(users)
        nic = self.cfg.next_item
        return next_item_loss(
            self.bundle.model, batch, self.loss_kind, nic.num_negatives, nic.shared_negatives, self.loss_dtype
        )

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, epoch: int | None = None) -> dict[str, float]:
        """The leave-one-out metrics of ``split``; during training (``epoch`` given) the full-catalog ranking
        only every ``next_item.full_ranking_every`` epochs (epoch 0, the untrained model, included), or at every
        epoch when the selection metric is a full-ranking one."""
        every = self.cfg.next_item.full_ranking_every
        selects_full = any(m.startswith("valid_full_") for m in (self.select, self.also))
        full = epoch is None or selects_full or (every > 0 and epoch % every == 0)
        was_training = model.training
        model.eval()
        out = rank_split(
            model_scorer(model, self.seqs), self.seqs, split, self.negatives, prefix=f"{split}_",
            candidates=self.candidates, full=full,
        )  # fmt: skip
        model.train(was_training)
        return out

    def plots(self, model: nn.Module, history: list[dict], run_dir: Path) -> list[Path]:
        from models.tracking.plots import ranking_curve_plot

        return [ranking_curve_plot(history, self.select, run_dir / "learning_curve.png")]
