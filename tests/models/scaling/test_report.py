"""The report: which points the all-points and frontier fits use, and the command's cost line."""

from __future__ import annotations

import numpy as np
import pytest

from models.scaling.config import ScalingConfig
from models.scaling.report import analyze, headline_metrics, markdown


def _point(name: str, compute: float, ne: float, groups: list[str], actions: str = "all") -> dict:
    return {"name": name, "model": "user", "groups": groups, "actions": actions, "compute_flops": compute,
            "flops_per_example": compute / 1e4, "examples_seen": 10_000, "epochs_run": 1, "test_ne": ne,
            "test_auc": 0.6, "wall_time_s": 10.0, "cpu_time_s": 9.0, "point_cpu_time_s": 12.0, "threads": 1,
            "load_avg_1m_at_start": 1.0}  # fmt: skip


def test_all_points_fit_skips_filtered_histories_and_the_frontier_is_the_lower_envelope():
    cfg = ScalingConfig(axes_enabled=["width", "diversity"], experiments=[], min_decades=1.5)
    compute = np.geomspace(1e9, 1e12, 6)
    ne = 0.9 - 0.02 * np.log10(compute / 1e9)
    results = {
        f"w{i}": _point(f"w{i}", c, y, ["axis:width"])
        for i, (c, y) in enumerate(zip(compute, ne, strict=True))
    }
    results["w5"]["test_ne"] += 0.05  # the largest point is off the frontier
    results["bal"] = _point("bal", 3e10, 0.86, ["synergy:balanced-1"])  # a full-history point off the axes
    results["imp"] = _point("imp", 5e11, 0.99, ["axis:diversity"], actions="impression")  # data ablation
    summary = analyze(cfg, results, {})
    overall = [p["name"] for p in summary["overall"]["points"]]
    assert "bal" in overall and "imp" not in overall and len(overall) == 7
    assert [p["name"] for p in summary["frontier"]["points"]] == ["w0", "w1", "w2", "bal", "w4"]
    assert summary["axes"]["diversity"]["n"] == 1
    summary["command"] = {"wall_s": 100.0, "cpu_s": 190.0, "trained_points": 8, "cores": 2}
    md = markdown(summary, "t")
    assert "| all points (full histories) | 7 |" in md and "| compute-optimal frontier | 5 |" in md
    assert "This command: 100 s wall, 190 CPU s" in md and "96 s with data loading" in md
    metrics = headline_metrics(summary)
    assert metrics["command_cpu_s"] == 190.0 and metrics["frontier_r2"] == pytest.approx(
        summary["frontier"]["r2"]
    )
