"""Dataclass configs of a scaling sweep (``configs/scaling-<preset>.yaml`` + ``--set`` overrides).

A sweep trains the user model at every value of each chosen axis while the other axes stay at ``base``'s
values (one-factor-at-a-time), plus the points each experiment needs. Everything an axis does not change
(optimizer, epochs, heads, ...) comes from ``base``, a full ``TrainRunConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from features.schema import ACTIONS
from models.config import TrainRunConfig

AXES = ("depth", "width", "seq_len", "diversity")
EXPERIMENTS = ("synergy", "composition", "tunability")
# Which user-model key each axis grows.
AXIS_KEYS = {"depth": "num_layers", "width": "d_model", "seq_len": "max_history"}
ALL_ACTIONS = "all"


@dataclass
class AxesConfig:
    depth: list[int] = field(default_factory=lambda: [1, 2, 4])  # user_model.num_layers
    width: list[int] = field(default_factory=lambda: [16, 32, 64, 128])  # user_model.d_model
    seq_len: list[int] = field(default_factory=lambda: [4, 16, 64])  # user_model.max_history
    # History action types kept, each "all" or types joined by "+", e.g. "impression+click+conversion".
    diversity: list[str] = field(default_factory=lambda: ["impression", "impression+click+conversion", "all"])


@dataclass
class Shape:
    """A user-model shape (depth, width, history length) or a ranker shape (blocks, width, recent events)."""

    depth: int = 1
    width: int = 16
    seq_len: int = 16


@dataclass
class SynergyConfig:
    """Balanced growth (all three axes by their factor per step) vs one axis grown to the same FLOPs."""

    start: Shape = field(default_factory=Shape)
    steps: int = 1
    depth_factor: int = 2
    width_factor: int = 2
    seq_len_factor: int = 4
    # Values a single-axis arm may take; the one whose FLOPs per example is closest to the balanced point's
    # is trained (the report states how far from matched it stayed).
    depth_choices: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16])
    width_choices: list[int] = field(default_factory=lambda: [16, 24, 32, 48, 64, 96, 128, 192, 256])
    seq_len_choices: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024])


@dataclass
class CompositionConfig:
    """Diverse action types vs homogeneous events at equal history length (same examples, same test set)."""

    seq_lens: list[int] = field(default_factory=lambda: [16, 64])
    homogeneous: str = "impression"


@dataclass
class TunabilityConfig:
    """NE gain per FLOP of growing the offline user model vs the online ranker (ranker NE on the test split)."""

    user_small: Shape = field(default_factory=lambda: Shape(1, 16, 16))
    user_large: Shape = field(default_factory=lambda: Shape(2, 64, 64))
    ranker_small: Shape = field(default_factory=lambda: Shape(1, 16, 16))  # blocks, d_model, recent events
    ranker_large: Shape = field(default_factory=lambda: Shape(2, 64, 64))
    serving_candidates: int = 1000
    serving_repeats: int = 20


@dataclass
class ScalingConfig:
    preset: str = "laptop"
    name: str = ""  # sweep folder <workspace>/scaling/<name>; "" = <preset>-<training set name>
    training_set: str = "default"
    axes_enabled: list[str] = field(default_factory=lambda: list(AXES))
    experiments: list[str] = field(default_factory=list)
    axes: AxesConfig = field(default_factory=AxesConfig)
    synergy: SynergyConfig = field(default_factory=SynergyConfig)
    composition: CompositionConfig = field(default_factory=CompositionConfig)
    tunability: TunabilityConfig = field(default_factory=TunabilityConfig)
    base: TrainRunConfig = field(default_factory=TrainRunConfig)
    threads_per_run: int = 1  # torch threads of one training run
    workers: int = 0  # parallel runs; 0 = cores // threads_per_run
    flop_batch: int = 256  # training examples in the batch whose forward + backward FLOPs are counted
    min_decades: float = 1.5  # a fit over less compute range is reported as "too small to scale"
    # Valid examples kept (a fixed random subsample; 0 = all): the valid split only picks a point's best
    # epoch, the test split (every reported NE) is never subsampled. See ``models.scaling.valid_split``.
    valid_examples: int = 0
    # Per-size optimizer setting: a user model wider than this gets the dense lr base.optim.lr x
    # lr_base_width / width (muP-style, the lr tuned at this width); 0 = every point keeps base.optim.lr.
    # Warm-up and decay (base.optim.warmup_steps, lr_decay) apply to every point alike.
    lr_base_width: int = 0
    # Smallest attention head (d_model / num_heads) a grid may hold. Below it a head's query-key product has
    # too few dimensions to tell tokens apart: such a model is a different regime, not a smaller one, and
    # as the grid's cheapest point it always sits on the compute-optimal frontier (docs/scaling.md).
    min_head_dim: int = 4


def parse_actions(spec: str) -> tuple[str, ...]:
    """``"all"`` -> every action; ``"impression+click"`` -> those two (in vocabulary order)."""
    if spec == ALL_ACTIONS:
        return ACTIONS
    names = [s.strip() for s in spec.split("+") if s.strip()]
    unknown = [n for n in names if n not in ACTIONS]
    if unknown or not names:
        raise ValueError(f"history action set {spec!r}: unknown action(s) {unknown}; known: {list(ACTIONS)}")
    return tuple(a for a in ACTIONS if a in names)


def validate(cfg: ScalingConfig) -> None:
    """Reject a sweep that could not run, naming the key."""
    unknown = [a for a in cfg.axes_enabled if a not in AXES]
    if unknown:
        raise ValueError(f"unknown axis(es) {unknown}; known: {list(AXES)}")
    unknown = [e for e in cfg.experiments if e not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; known: {list(EXPERIMENTS)}")
    if cfg.base.model != "user":
        raise ValueError(
            "scaling base.model must be 'user' (the ranker enters through the tunability experiment)"
        )
    for axis in ("depth", "width", "seq_len"):
        values = getattr(cfg.axes, axis)
        if any(v < 1 for v in values):
            raise ValueError(f"axes.{axis} values must be >= 1, got {values}")
    heads = cfg.base.user_model.num_heads
    widths = [*cfg.axes.width, *cfg.synergy.width_choices, cfg.synergy.start.width,
              cfg.tunability.user_small.width, cfg.tunability.user_large.width]  # fmt: skip
    bad = sorted({w for w in widths if w % heads})
    if bad:
        raise ValueError(f"widths {bad} are not divisible by base.user_model.num_heads={heads}")
    small = sorted({w for w in widths if w // heads < cfg.min_head_dim})
    if small:
        raise ValueError(
            f"widths {small} give attention heads under min_head_dim={cfg.min_head_dim} dimensions with"
            f" base.user_model.num_heads={heads}; widen them, use fewer heads or lower min_head_dim"
        )
    rheads = cfg.base.ranker.num_heads
    bad = sorted(
        {s.width for s in (cfg.tunability.ranker_small, cfg.tunability.ranker_large) if s.width % rheads}
    )
    if bad:
        raise ValueError(f"ranker widths {bad} are not divisible by base.ranker.num_heads={rheads}")
    for spec in (*cfg.axes.diversity, cfg.composition.homogeneous):
        parse_actions(spec)
    if (cfg.threads_per_run < 1 or cfg.workers < 0 or cfg.flop_batch < 1 or cfg.valid_examples < 0
            or cfg.lr_base_width < 0 or cfg.min_head_dim < 1):  # fmt: skip
        raise ValueError(
            "threads_per_run >= 1, workers >= 0, flop_batch >= 1, valid_examples >= 0, lr_base_width >= 0"
            " and min_head_dim >= 1 are required"
        )
