"""Sweep points: one training run each, keyed by a hash of everything that shapes its result.

A point is a user-model (or ranker) shape, the history action types it reads and, for a ranker, the
user-model point whose embeddings it consumes. Two axes that meet at the base shape share one point (same
key), so it is trained once. The key hashes the resolved training config (minus where outputs and tracking
go) and the training set's fingerprint: change anything that matters and the point is new.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from gemflow.config import to_dict
from models.config import TrainRunConfig
from models.scaling.config import ALL_ACTIONS, AXIS_KEYS, ScalingConfig, Shape

# TrainRunConfig keys that say where outputs go or how they are tracked, never what is learned.
NOT_KEYED = ("output_dir", "tracking", "resume", "distributed", "training_set")


@dataclass
class SweepPoint:
    model: str  # "user" | "ranker"
    shape: (
        Shape  # user model: (num_layers, d_model, max_history); ranker: (num_layers, d_model, recent_events)
    )
    actions: str = ALL_ACTIONS  # history action types kept (composition / diversity)
    user_point: SweepPoint | None = None  # ranker: the user-model point whose cached tokens it reads
    groups: set[str] = field(default_factory=set)  # "axis:width", "synergy:balanced-1", ...
    lr: float = 0.0  # dense lr of this point (the width rule, ``ScalingConfig.lr_base_width``); 0 = base's

    @property
    def name(self) -> str:
        s = self.shape
        prefix = "user" if self.model == "user" else "ranker"
        tag = f"{prefix}-L{s.depth}-d{s.width}-h{s.seq_len}"
        if self.actions != ALL_ACTIONS:
            tag += "-" + self.actions.replace("+", "_")
        if self.user_point is not None:
            tag += f"-on-{self.user_point.name}"
        return tag

    def overrides(self) -> dict[str, object]:
        s = self.shape
        lr = {"optim.lr": self.lr} if self.lr > 0 else {}
        if self.model == "user":
            return {**lr, "model": "user", "user_model.num_layers": s.depth, "user_model.d_model": s.width,
                    "user_model.max_history": s.seq_len}  # fmt: skip
        return {**lr, "model": "ranker", "ranker.num_layers": s.depth, "ranker.d_model": s.width,
                "ranker.recent_events": s.seq_len, "ranker.use_user_tokens": True}  # fmt: skip


def train_config(base: TrainRunConfig, point: SweepPoint, extra: dict | None = None) -> TrainRunConfig:
    """A copy of ``base`` with the point's shape (and ``extra`` dotted keys) applied."""
    cfg = copy.deepcopy(base)
    for dotted, value in {**point.overrides(), **(extra or {})}.items():
        *parents, leaf = dotted.split(".")
        target = cfg
        for name in parents:
            target = getattr(target, name)
        if not hasattr(target, leaf):
            raise ValueError(f"unknown training config key {dotted!r}")
        setattr(target, leaf, value)
    return cfg


def point_key(base: TrainRunConfig, point: SweepPoint, set_fingerprint: str) -> str:
    cfg = to_dict(train_config(base, point))
    for name in NOT_KEYED:
        cfg.pop(name, None)
    cfg["ranker"]["user_model"] = ""
    if point.model == "user":
        cfg.pop("ranker")
    else:
        cfg.pop("user_model")
    payload = {"config": cfg, "actions": point.actions, "set": set_fingerprint,
               "user_point": point_key(base, point.user_point, set_fingerprint) if point.user_point else ""}  # fmt: skip
    return hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


class Grid:
    """The points of one sweep, deduplicated by key, each remembering the groups it belongs to."""

    def __init__(self, cfg: ScalingConfig, set_fingerprint: str):
        self.cfg, self.fingerprint = cfg, set_fingerprint
        self.points: dict[str, SweepPoint] = {}

    def key(self, point: SweepPoint) -> str:
        return point_key(self.cfg.base, self.tuned(point), self.fingerprint)

    def tuned(self, point: SweepPoint) -> SweepPoint:
        """The point with its dense lr from the width rule: a user model wider than ``lr_base_width`` gets
        ``base lr x lr_base_width / width`` (muP-style: Adam's per-weight update must shrink as fan-in grows
        for a wider model to train as stably as the base width, where the lr was tuned). Narrower models
        keep the base lr. Rankers keep the base lr."""
        base_width = self.cfg.lr_base_width
        if point.model != "user" or base_width <= 0 or point.shape.width <= base_width or point.lr > 0:
            return point
        lr = self.cfg.base.optim.lr * base_width / point.shape.width
        return dataclasses.replace(point, lr=lr, groups=set(point.groups))

    def add(self, point: SweepPoint, group: str) -> SweepPoint:
        point = self.tuned(point)
        key = self.key(point)
        kept = self.points.setdefault(key, point)
        kept.groups.add(group)
        return kept

    def group(self, name: str) -> list[tuple[str, SweepPoint]]:
        return [(k, p) for k, p in self.points.items() if name in p.groups]

    def base_shape(self) -> Shape:
        um = self.cfg.base.user_model
        return Shape(um.num_layers, um.d_model, um.max_history)

    def add_axes(self) -> None:
        """One-factor-at-a-time: each axis value on top of the base shape."""
        base = self.base_shape()
        for axis in self.cfg.axes_enabled:
            if axis == "diversity":
                for actions in self.cfg.axes.diversity:
                    self.add(SweepPoint("user", base, actions), "axis:diversity")
                continue
            for value in getattr(self.cfg.axes, axis):
                shape = Shape(**{**vars(base), axis: value})
                self.add(SweepPoint("user", shape), f"axis:{axis}")

    def balanced_shapes(self) -> list[Shape]:
        sc = self.cfg.synergy
        s = sc.start
        return [
            Shape(
                s.depth * sc.depth_factor**k, s.width * sc.width_factor**k, s.seq_len * sc.seq_len_factor**k
            )
            for k in range(sc.steps + 1)
        ]

    def add_synergy_ladder(self) -> list[SweepPoint]:
        """The balanced ladder (start, then every axis grown by its factor per step)."""
        shapes = self.balanced_shapes()
        return [self.add(SweepPoint("user", s), f"synergy:balanced-{k}") for k, s in enumerate(shapes)]

    def add_synergy_arm(self, axis: str, step: int, value: int) -> SweepPoint:
        shape = Shape(**{**vars(self.cfg.synergy.start), axis: value})
        return self.add(SweepPoint("user", shape), f"synergy:{axis}-{step}")

    def add_composition(self) -> None:
        cc, base = self.cfg.composition, self.base_shape()
        for length in cc.seq_lens:
            shape = Shape(base.depth, base.width, length)
            self.add(SweepPoint("user", shape, ALL_ACTIONS), f"composition:diverse-{length}")
            self.add(SweepPoint("user", shape, cc.homogeneous), f"composition:homogeneous-{length}")

    def add_tunability(self) -> None:
        tc = self.cfg.tunability
        small = self.add(SweepPoint("user", tc.user_small), "tunability:user-small")
        large = self.add(SweepPoint("user", tc.user_large), "tunability:user-large")
        self.add(SweepPoint("ranker", tc.ranker_small, user_point=small), "tunability:base")
        self.add(SweepPoint("ranker", tc.ranker_small, user_point=large), "tunability:grow-user")
        self.add(SweepPoint("ranker", tc.ranker_large, user_point=small), "tunability:grow-ranker")


__all__ = ["AXIS_KEYS", "Grid", "SweepPoint", "point_key", "train_config"]
