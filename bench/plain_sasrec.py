"""A plain PyTorch SASRec, the speed yardstick of ``bench/sequential.py``'s SASRec (issue 36): the same shape
(``configs/sequential.yaml``'s ``sasrec``: d 50, 2 blocks, 1 head, max length 50, dropout 0.5), the paper's BCE
loss with one sampled negative per position, on the same training sequences (each user's history up to the valid
item), trained the way the public re-implementations do it: dense left-padded (B, T) tensors, a causal mask only
(padding inputs are zeroed, as in the reference code), batches of users of similar length (length buckets), Adam.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plain_sasrec.py --workspace /tmp/toys --training-set toys \
        --epochs 2 --threads 1

Prints seconds per epoch (and the same for the gemflow SASRec through the training loop's task, ``--ours``,
the two alternating epoch by epoch, each first every other epoch, so both see the same load);
it judges speed only (no evaluation): the quality of SASRec is bench/sequential.py's table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import add_record_flag, record  # noqa: E402


class PlainSASRec(nn.Module):
    def __init__(self, num_items: int, d: int = 64, blocks: int = 2, heads: int = 1, max_len: int = 50,
                 dropout: float = 0.5):  # fmt: skip
        super().__init__()
        self.items = nn.Embedding(num_items + 1, d, padding_idx=0)  # id 0 = padding, items are 1..num_items
        self.positions = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        self.attn_norms = nn.ModuleList(nn.LayerNorm(d, eps=1e-8) for _ in range(blocks))
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(d, heads, dropout, batch_first=True) for _ in range(blocks)
        )
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(d, eps=1e-8) for _ in range(blocks))
        self.ffns = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d, d), nn.Dropout(dropout), nn.ReLU(), nn.Linear(d, d), nn.Dropout(dropout)
            )
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(d, eps=1e-8)
        self.max_len = max_len

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        t = seq.shape[1]
        x = self.items(seq) * self.items.embedding_dim**0.5 + self.positions.weight[self.max_len - t :]
        keep = (seq > 0)[..., None]
        x = self.drop(x) * keep
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        for attn_norm, attn, ffn_norm, ffn in zip(
            self.attn_norms, self.attns, self.ffn_norms, self.ffns, strict=True
        ):
            q = attn_norm(x)
            x = q + attn(q, x, x, attn_mask=causal, need_weights=False)[0]
            y = ffn_norm(x)
            x = (y + ffn(y)) * keep
        return self.norm(x)


def train_sequences(path: Path, max_len: int) -> tuple[list[np.ndarray], int]:
    """Each user's history up to the valid item, the last ``max_len + 1`` items (ids shifted by 1: 0 pads)."""
    from models.sequential.data import SequenceSet
    from models.training.data import TrainingSet

    seqs = SequenceSet(TrainingSet(path), max_len, 0)
    d = seqs.data
    starts = d.seq_offsets[seqs.user_rows]
    out = [
        d.seq_values["ad_id"][s + max(0, c - max_len - 1) : s + c] + 1
        for s, c in zip(starts, seqs.train_cut, strict=True)
    ]
    return out, int(d.vocab["ad_id"])


def bucketed_batches(lengths: np.ndarray, batch_size: int, rng) -> list[np.ndarray]:
    order = np.lexsort((rng.random(len(lengths)), lengths))  # by length, shuffled within a length
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def plain_epoch(model, opt, sequences, num_items: int, batch_size: int, rng) -> float:
    lengths = np.array([len(s) for s in sequences])
    start = time.perf_counter()
    for users in bucketed_batches(lengths, batch_size, rng):
        t = int(lengths[users].max())
        padded = np.zeros((len(users), t), np.int64)
        for row, u in enumerate(users):
            padded[row, t - lengths[u] :] = sequences[u]
        padded = torch.from_numpy(padded)
        seq, pos = padded[:, :-1], padded[:, 1:]
        neg = torch.randint(1, num_items + 1, pos.shape)
        states = model(seq)
        mask = pos > 0
        pos_logit = (states * model.items(pos)).sum(-1)[mask]
        neg_logit = (states * model.items(neg)).sum(-1)[mask]
        loss = F.softplus(-pos_logit).mean() + F.softplus(neg_logit).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def ours_epoch(task, model, opt, epoch: int) -> float:
    start = time.perf_counter()
    for users in task.epoch_batches(epoch):
        loss = task.loss(users)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace", required=True)
    p.add_argument("--training-set", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--ours", action="store_true", help="also time the gemflow SASRec (sasrec, paper loss)")
    add_record_flag(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from gemflow.config import load_config
    from gemflow.workspace import Workspace
    from models.config import TrainRunConfig
    from models.training.prepare import resolve_training_set

    ws = Workspace(Path(args.workspace).resolve())
    path = resolve_training_set(args.training_set, ws)
    cfg = load_config(TrainRunConfig, str(Path(__file__).resolve().parents[1] / "configs" / "sequential.yaml"),
                      {"model": "sasrec", "next_item.loss": "bce", "training_set": str(path),
                       "optim.batch_size": str(args.batch_size)})  # fmt: skip
    shape = cfg.sasrec  # both models get the configured SASRec's shape
    torch.manual_seed(0)
    sequences, num_items = train_sequences(path, shape.max_len)
    model = PlainSASRec(
        num_items, shape.d_model, shape.num_blocks, shape.num_heads, shape.max_len, shape.dropout
    )
    opt = torch.optim.Adam(model.train().parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    epochs = {"plain": lambda epoch: plain_epoch(model, opt, sequences, num_items, args.batch_size, rng)}
    print(f"SASRec shape: d {shape.d_model}, {shape.num_blocks} blocks, {shape.num_heads} head(s), max length "
          f"{shape.max_len}, dropout {shape.dropout}", flush=True)  # fmt: skip
    if args.ours:
        from models.sequential.task import NextItemTask

        task = NextItemTask(cfg, path)
        ours = task.bundle.model.train()
        ours_opt = torch.optim.Adam(ours.parameters(), lr=1e-3)
        epochs["gemflow"] = lambda epoch: ours_epoch(task, ours, ours_opt, epoch + 1)
    load = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {name: [] for name in epochs}
    for epoch in range(args.epochs):  # alternating, each first every other epoch: both see the same load
        for name in list(epochs)[:: 1 if epoch % 2 == 0 else -1]:
            seconds[name].append(epochs[name](epoch))
            print(f"{name:<8} epoch {epoch}: {seconds[name][-1]:.1f} s", flush=True)
    loads = f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    print(f"threads {args.threads}, batch {args.batch_size}, {len(sequences)} users, {loads}")
    if args.record:
        rows = [
            (f"{name} SASRec, s/epoch ({args.training_set}, {args.threads} thread(s), median of {len(v)}; {loads})",
             f"{float(np.median(v)):.1f}")
            for name, v in seconds.items() if v
        ]  # fmt: skip
        record(f"sasrec-epoch.{Path(args.training_set).name}", "SASRec training speed per epoch", rows)


if __name__ == "__main__":
    main()
