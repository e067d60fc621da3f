"""The tensors a model reads: jagged ``Events``, ``Candidates``, the user ``Profile``, and the ``Batch`` of them.

Built from a training set by ``models.training.batch_builder`` and online by ``serving.inputs``; every field is
a flat tensor (jagged ones with ``offsets``), never padded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from models.architectures.transforms import lengths

EVENT_ID_FIELDS = ("ad_id", "action", "surface", "category_id", "advertiser_id")
CANDIDATE_ID_FIELDS = ("ad_id", "advertiser_id", "category_id", "surface")


@dataclass
class Events:
    """Jagged events of B sequences: one (total,) tensor per field, ``offsets`` (B + 1,)."""

    ad_id: torch.Tensor
    action: torch.Tensor
    surface: torch.Tensor
    category_id: torch.Tensor
    advertiser_id: torch.Tensor
    ts: torch.Tensor  # int64 seconds
    gap_bucket: torch.Tensor  # bucketed time gap (to the event before it, or to the request time)
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return lengths(self.offsets)

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1


@dataclass
class Candidates:
    """N candidate ads (ids + dense features), ``offsets`` (B + 1,) grouping them by user/request."""

    ad_id: torch.Tensor
    advertiser_id: torch.Tensor
    category_id: torch.Tensor
    surface: torch.Tensor
    dense: torch.Tensor  # (N, F) float32, already normalized
    offsets: torch.Tensor

    def select(self, idx: torch.Tensor) -> Candidates:
        """A subset of candidates as one group each (tests: compare one-by-one with many-at-once)."""
        kw = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "offsets"}
        return Candidates(**kw, offsets=torch.arange(idx.numel() + 1))


@dataclass
class Profile:
    """User-side context for the ranker, one row per user/request."""

    user_id: torch.Tensor
    gender: torch.Tensor
    country: torch.Tensor
    dense: torch.Tensor  # (B, P) float32 (age, normalized)


@dataclass
class Batch:
    history: Events  # user model: the long history; ranker: the recent fresh events
    candidates: Candidates
    labels: torch.Tensor  # (N, 2) float32: click, conversion
    profile: Profile
    user_tokens: torch.Tensor | None = None  # ranker: (B, K, d_user) cached user embedding
    user_token_mask: torch.Tensor | None = None  # (B,) bool: row has a cached embedding

    def to(self, device: torch.device) -> Batch:
        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if x is None:
                return None
            return replace(x, **{f.name: move(getattr(x, f.name)) for f in fields(x)})

        return move(self)
