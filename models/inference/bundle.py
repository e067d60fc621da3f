"""Saving, loading and running trained models: predictions over example rows, user embeddings per example.

A trained model is one file, ``model.pt``, holding its kind, config, vocabulary, dense-feature normalization
and weights (plain tensors and Python values, loadable with ``weights_only=True``). A user model trained with
mixture-of-experts blocks (``gemflow train --nproc``, DeepSpeed MoE) also records ``moe`` (experts, top-k): its
blocks load as the plain-PyTorch ``models.architectures.layers.MixtureOfExperts``, so no DeepSpeed is needed to use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from features.vocabulary import Vocabulary
from gemflow.config import load_config, to_dict
from models.architectures.layers import use_moe_ffn
from models.architectures.ranker import Ranker
from models.architectures.user_model import UserModel
from models.config import RankerConfig, SASRecConfig, UserModelConfig
from models.sequential.data import ItemAttributes
from models.sequential.sasrec import SASRec
from models.training.batch_builder import BatchBuilder
from models.training.data import TrainingSet
from models.training.dense import DenseSpec

CONFIGS = {"user": UserModelConfig, "ranker": RankerConfig, "sasrec": SASRecConfig}

MODEL_FILE = "model.pt"


@dataclass
class ModelBundle:
    kind: str  # "user" | "ranker" | "sasrec"
    model: UserModel | Ranker | SASRec
    vocab: dict[str, int]
    dense: DenseSpec
    user_token_dim: int
    version: str  # the run that trained it (cached embeddings carry it)
    user_model_version: str  # ranker: the user-model version its cached tokens came from
    moe: dict | None = None  # {"num_experts", "top_k"} when the blocks named "moe" in cfg.ffn are MoE
    items: ItemAttributes | None = (
        None  # user models that read item attributes: the table they were trained on
    )
    # raw user_id / ad_id -> rows of its tables (``features.vocabulary``); {} when its ids are the rows
    vocabularies: dict[str, Vocabulary] = field(default_factory=dict)

    @property
    def cfg(self):
        return self.model.cfg


def build_model(
    kind: str, cfg, vocab: dict[str, int], num_dense: int, user_token_dim: int = 0, moe: dict | None = None,
    items: ItemAttributes | None = None, torchrec: bool = True,
):  # fmt: skip
    """A fresh model of ``kind``; ``torchrec=False`` for one that is loaded to be read, never trained."""
    if kind == "sasrec":
        return SASRec(cfg, vocab)
    if kind == "user":
        model = UserModel(cfg, vocab, num_dense, items, torchrec)
        if moe and "moe" in cfg.ffn:
            use_moe_ffn(model.blocks, cfg.ffn, moe["num_experts"], moe["top_k"])
        return model
    return Ranker(cfg, vocab, num_dense, user_token_dim, torchrec)


def save_bundle(path: Path, bundle: ModelBundle, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    payload = {
        "kind": bundle.kind,
        "config": to_dict(bundle.cfg),
        "vocab": dict(bundle.vocab),
        "dense": {"columns": bundle.dense.columns, "mean": bundle.dense.mean, "std": bundle.dense.std},
        "user_token_dim": bundle.user_token_dim,
        "version": bundle.version,
        "user_model_version": bundle.user_model_version,
        "state_dict": state_dict if state_dict is not None else bundle.model.state_dict(),
    }
    if bundle.items is not None:
        payload["item_attributes"] = bundle.items.to_payload()
    if bundle.vocabularies:  # plain tensors: the file still loads with weights_only=True
        payload["vocabularies"] = {
            name: {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in voc.to_payload().items()
            }
            for name, voc in bundle.vocabularies.items()
        }
    if bundle.moe:
        payload["moe"] = {"num_experts": int(bundle.moe["num_experts"]), "top_k": int(bundle.moe["top_k"])}
    atomic_save(payload, path)


def load_bundle(path: str | Path) -> ModelBundle:
    """The trained model at ``path`` (a run folder or its model file), in eval mode, to be read: its embedding
    tables are plain modules (``models.architectures.tokenizer.PlainTables``), not torchrec's."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"no trained model at {path} (train one with `gemflow train`)")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    cfg = load_config(CONFIGS[payload["kind"]], None, payload["config"])
    dense = DenseSpec(**payload["dense"])
    moe = payload.get("moe")
    items = ItemAttributes(**payload["item_attributes"]) if "item_attributes" in payload else None
    model = build_model(  # to be read (evaluated, served, embedded with): tables without torchrec
        payload["kind"], cfg, payload["vocab"], len(dense.columns), payload["user_token_dim"], moe, items,
        torchrec=False,
    )  # fmt: skip
    model.load_state_dict(payload["state_dict"])
    model.eval()
    vocabularies = {
        name: Vocabulary.from_payload({k: v.numpy() if torch.is_tensor(v) else v for k, v in p.items()})
        for name, p in payload.get("vocabularies", {}).items()
    }
    return ModelBundle(
        payload["kind"], model, payload["vocab"], dense, payload["user_token_dim"], payload["version"],
        payload["user_model_version"], moe, items, vocabularies,
    )  # fmt: skip


def atomic_save(obj, path: Path) -> None:
    """Write to a temp file in the same folder, then rename: a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def batches(rows: np.ndarray, size: int, desc: str | None = None):
    starts = range(0, len(rows), size)
    for start in tqdm(starts, desc=desc, leave=False, disable=desc is None):
        yield rows[start : start + size]


@torch.no_grad()
def predict(
    model, builder: BatchBuilder, rows: np.ndarray, batch_size: int, desc: str | None = None
) -> np.ndarray:
    """(len(rows), 2) probabilities: p_click, p_conversion."""
    was_training = model.training
    model.eval()
    out = [torch.sigmoid(model(builder(chunk))[0]) for chunk in batches(rows, batch_size, desc)]
    model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros((0, 2), np.float32)


@torch.no_grad()
def embed_examples(bundle: ModelBundle, data: TrainingSet, batch_size: int = 512) -> np.ndarray:
    """(examples, K * d) the user model's tokens for every example, from its history as of the example's cut
    (what a cache refreshed at that moment would hold: no event at or after the example enters)."""
    if bundle.kind != "user":
        raise ValueError("cached user embeddings come from a user model, got a ranker")
    model, cfg = bundle.model, bundle.cfg
    data = data.as_seen_by(bundle.vocabularies)
    builder = BatchBuilder(
        data, bundle.dense, history_len=cfg.max_history, time_buckets=cfg.time_buckets, gap_to="previous"
    )
    rows = np.arange(len(data.examples))
    out = []
    for chunk in batches(rows, batch_size, "embed users"):
        b = builder(chunk)
        out.append(model.encode_user(b.history, b.profile.user_id).flatten(1))
    return torch.cat(out).numpy().astype(np.float32)
