"""Sweep grids: the width lr rule, the keys it changes, and the head-size floor."""

import pytest

from models.scaling.config import ScalingConfig, Shape, validate
from models.scaling.grid import Grid, SweepPoint, train_config


def _grid(lr_base_width: int) -> Grid:
    cfg = ScalingConfig(lr_base_width=lr_base_width)
    cfg.base.optim.lr = 0.002
    return Grid(cfg, "fingerprint")


def test_wider_user_models_get_the_lr_scaled_by_base_width_over_width():
    grid = _grid(32)
    narrow = grid.add(SweepPoint("user", Shape(2, 16, 32)), "axis:width")
    base = grid.add(SweepPoint("user", Shape(2, 32, 32)), "axis:width")
    wide = grid.add(SweepPoint("user", Shape(2, 128, 32)), "axis:width")
    lrs = [train_config(grid.cfg.base, p).optim.lr for p in (narrow, base, wide)]
    assert lrs == [0.002, 0.002, 0.0005]
    ranker = grid.add(SweepPoint("ranker", Shape(1, 64, 16), user_point=base), "tunability:base")
    assert train_config(grid.cfg.base, ranker).optim.lr == 0.002


def test_the_rule_changes_only_the_keys_of_points_it_retunes():
    off, on = _grid(0), _grid(32)
    base, wide = SweepPoint("user", Shape(2, 32, 32)), SweepPoint("user", Shape(2, 128, 32))
    assert off.key(base) == on.key(base)
    assert off.key(wide) != on.key(wide)
    assert on.key(wide) == on.key(on.add(wide, "axis:width"))  # planned and stored points agree


def test_a_grid_with_degenerate_attention_heads_is_refused_by_name():
    cfg = ScalingConfig()
    cfg.base.user_model.num_heads = 2
    cfg.axes.width = [4, 8, 32]
    with pytest.raises(ValueError, match=r"widths \[4\] give attention heads under min_head_dim=4"):
        validate(cfg)
    cfg.min_head_dim = 2  # a user may study tiny heads on purpose
    validate(cfg)
