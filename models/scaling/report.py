"""From a sweep's results to numbers people act on: fits per axis and overall, the frontier, the three
experiments, plots (matplotlib, Agg) and a markdown summary.

NE everywhere is the click NE on the training set's test split (``test_ne``); compute C is the training FLOPs
(forward + backward per example, counted, times examples seen).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gemflow.markdown import write_marked_section
from models.scaling.config import ALL_ACTIONS, ScalingConfig
from models.scaling.fit import fit_log_linear, fit_power_law, frontier

AXIS_COLORS = {"depth": "tab:blue", "width": "tab:orange", "seq_len": "tab:green", "diversity": "tab:purple"}
NE = "test_ne"
ALPHA_RANGE = (1e-3, 4.99)  # fit_power_law bounds alpha to [0, 5]


def _group(results: dict[str, dict], name: str) -> list[dict]:
    return sorted((r for r in results.values() if name in r["groups"]), key=lambda r: r["compute_flops"])


def _fit_summary(points: list[dict], min_decades: float) -> dict:
    c = np.array([p["compute_flops"] for p in points], dtype=np.float64)
    y = np.array([p[NE] for p in points], dtype=np.float64)
    out: dict = {"n": len(points), "decades": float(np.log10(c.max() / c.min())) if len(c) else 0.0}
    if len(points) < 2 or np.ptp(np.log10(c)) == 0:
        out["verdict"] = "too few points or no compute range to fit"
        return out
    fit = fit_log_linear(c, y)
    lo, hi = fit.slope_ci()
    out |= {"a": fit.a, "b": fit.b, "r2": fit.r2, "b_ci": [lo, hi], "log_linear": fit}
    try:
        power = fit_power_law(c, y)
        if not ALPHA_RANGE[0] < power.alpha < ALPHA_RANGE[1]:  # collapsed onto a bound: no power law here
            raise ValueError(f"degenerate power law (alpha {power.alpha:.3g} at its bound)")
        out |= {"power_law": power, "power_r2": power.r2, "alpha": power.alpha, "E": power.e}
    except ValueError as err:
        out["power_law_error"] = str(err)
    if out["decades"] < min_decades:
        out["verdict"] = f"too small to scale: {out['decades']:.2f} decades of compute (< {min_decades})"
    elif len(points) > 2 and lo <= 0 <= hi:
        out["verdict"] = "no significant trend: the 95% interval of the slope includes 0"
    elif fit.b <= 0:
        out["verdict"] = "NE does not improve with compute here"
    elif fit.r2 < 0.9:
        out["verdict"] = f"improves with compute, but not log-linearly (R^2 {fit.r2:.2f} < 0.9)"
    else:
        out["verdict"] = "log-linear"
    return out


def analyze(cfg: ScalingConfig, results: dict[str, dict], matched: dict[str, dict]) -> dict:
    user = {k: r for k, r in results.items() if r["model"] == "user"}
    summary: dict = {"axes": {}, "points": sorted(results.values(), key=lambda r: r["compute_flops"])}
    for axis in cfg.axes_enabled:
        points = _group(user, f"axis:{axis}")
        if points:
            summary["axes"][axis] = _fit_summary(points, cfg.min_decades) | {"points": points}
    # "All points": every user model that reads full histories (axes, synergy, tunability, composition's
    # diverse arm). Points whose histories keep only some action types are a data ablation, not a model size.
    full = sorted((r for r in user.values() if r.get("actions", ALL_ACTIONS) == ALL_ACTIONS),
                  key=lambda r: r["compute_flops"])  # fmt: skip
    if full:
        summary["overall"] = _fit_summary(full, cfg.min_decades) | {"points": full}
        idx = frontier([p["compute_flops"] for p in full], [p[NE] for p in full])
        front = [full[i] for i in idx]
        summary["frontier"] = _fit_summary(front, cfg.min_decades) | {"points": front}
    if "synergy" in cfg.experiments:
        summary["synergy"] = _synergy(cfg, results, matched)
    if "composition" in cfg.experiments:
        summary["composition"] = _composition(cfg, results)
    if "tunability" in cfg.experiments:
        summary["tunability"] = _tunability(results)
    return summary


def _one(results: dict[str, dict], group: str) -> dict | None:
    found = _group(results, group)
    return found[0] if found else None


def _synergy(cfg: ScalingConfig, results, matched) -> list[dict]:
    rows = []
    start = _one(results, "synergy:balanced-0")
    for step in range(1, cfg.synergy.steps + 1):
        balanced = _one(results, f"synergy:balanced-{step}")
        if balanced is None:
            continue
        row = {"step": step, "start": start, "balanced": balanced, "arms": {}}
        for axis in ("depth", "width", "seq_len"):
            arm = _one(results, f"synergy:{axis}-{step}")
            if arm is None:
                continue
            m = matched.get(f"{axis}-{step}", {})
            ratio = arm["flops_per_example"] / balanced["flops_per_example"]
            row["arms"][axis] = {"point": arm, "value": m.get("value"), "compute_ratio": ratio,
                                 "ne_minus_balanced": arm[NE] - balanced[NE]}  # fmt: skip
        rows.append(row)
    return rows


def _composition(cfg: ScalingConfig, results) -> list[dict]:
    rows = []
    for length in cfg.composition.seq_lens:
        diverse = _one(results, f"composition:diverse-{length}")
        homogeneous = _one(results, f"composition:homogeneous-{length}")
        if diverse and homogeneous:
            rows.append({"seq_len": length, "diverse": diverse, "homogeneous": homogeneous,
                         "ne_gain_of_diversity": homogeneous[NE] - diverse[NE]})  # fmt: skip
    return rows


def _tunability(results) -> dict:
    base = _one(results, "tunability:base")
    grow_user = _one(results, "tunability:grow-user")
    grow_ranker = _one(results, "tunability:grow-ranker")
    small_user = _one(results, "tunability:user-small")
    large_user = _one(results, "tunability:user-large")
    if not all((base, grow_user, grow_ranker, small_user, large_user)):
        return {}
    d_user_flops = large_user["compute_flops"] - small_user["compute_flops"]
    d_ranker_flops = grow_ranker["compute_flops"] - base["compute_flops"]
    gain_user = base[NE] - grow_user[NE]
    gain_ranker = base[NE] - grow_ranker[NE]
    return {
        "base": base, "grow_user": grow_user, "grow_ranker": grow_ranker,
        "user_small": small_user, "user_large": large_user,
        "gain_user": gain_user, "gain_ranker": gain_ranker,
        "extra_flops_user": d_user_flops, "extra_flops_ranker": d_ranker_flops,
        "gain_per_pflop_user": gain_user / d_user_flops * 1e15 if d_user_flops > 0 else math.nan,
        "gain_per_pflop_ranker": gain_ranker / d_ranker_flops * 1e15 if d_ranker_flops > 0 else math.nan,
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------- metrics
def headline_metrics(summary: dict) -> dict[str, float]:
    """Flat numbers for the MLflow parent run."""
    out: dict[str, float] = {}
    for name, fit in [*(("axis_" + a, f) for a, f in summary["axes"].items()),
                      ("overall", summary.get("overall")), ("frontier", summary.get("frontier"))]:  # fmt: skip
        if fit and "b" in fit:
            out |= {
                f"{name}_slope_per_decade": fit["b"],
                f"{name}_r2": fit["r2"],
                f"{name}_decades": fit["decades"],
            }
            if "alpha" in fit:
                out[f"{name}_power_alpha"] = fit["alpha"]
    for row in summary.get("synergy", []):
        for axis, arm in row["arms"].items():
            out[f"synergy_{row['step']}_{axis}_ne_minus_balanced"] = arm["ne_minus_balanced"]
    for row in summary.get("composition", []):
        out[f"composition_gain_len{row['seq_len']}"] = row["ne_gain_of_diversity"]
    for k, v in (summary.get("command") or {}).items():
        out[f"command_{k}"] = float(v)
    t = summary.get("tunability") or {}
    for k in ("gain_user", "gain_ranker", "gain_per_pflop_user", "gain_per_pflop_ranker"):
        if k in t:
            out[f"tunability_{k}"] = t[k]
    return out


# ----------------------------------------------------------------------------------------------- plots
def plot_all(summary: dict, out_dir: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def band(ax, fit, cs, color):
        grid = np.geomspace(min(cs), max(cs), 100)
        lo, hi = fit.band(grid)
        ax.plot(grid, fit.predict(grid), color=color, lw=1.5)
        ax.fill_between(grid, lo, hi, color=color, alpha=0.15)

    if summary["axes"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for axis, fit in summary["axes"].items():
            cs = [p["compute_flops"] for p in fit["points"]]
            color = AXIS_COLORS[axis]
            label = f"{axis}" + (f": -{fit['b']:.3f}/decade, R²={fit['r2']:.2f}" if "b" in fit else "")
            ax.scatter(cs, [p[NE] for p in fit["points"]], color=color, label=label, zorder=3)
            if "log_linear" in fit:
                band(ax, fit["log_linear"], cs, color)
        _axes(ax, "NE vs training compute per axis (95% band)")
        written.append(_save(fig, out_dir / f"{prefix}-axes.png"))

    if summary.get("overall") and "log_linear" in summary["overall"]:
        fit, front = summary["overall"], summary["frontier"]["points"]
        cs = [p["compute_flops"] for p in fit["points"]]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.scatter(cs, [p[NE] for p in fit["points"]], color="0.6", label="all points", zorder=2)
        front_cs = [p["compute_flops"] for p in front]
        ax.scatter(
            front_cs, [p[NE] for p in front], color="tab:red", label="compute-optimal frontier", zorder=3
        )
        if "log_linear" in summary["frontier"]:
            ff = summary["frontier"]
            band(ax, ff["log_linear"], front_cs, "tab:red")
            ax.plot([], [], color="tab:red",
                    label=f"frontier: NE = {ff['a']:.3f} - {ff['b']:.3f}·log10 C, R²={ff['r2']:.2f}")  # fmt: skip
        band(ax, fit["log_linear"], cs, "tab:blue")
        ax.plot(
            [],
            [],
            color="tab:blue",
            label=f"all: NE = {fit['a']:.3f} - {fit['b']:.3f}·log10 C, R²={fit['r2']:.2f}",
        )
        if "power_law" in fit:
            grid = np.geomspace(min(cs), max(cs), 100)
            p = fit["power_law"]
            ax.plot(grid, p.predict(grid), "--", color="tab:green",
                    label=f"all, power law: NE = {p.e:.3f} + {p.a:.3f}·(C/C0)^-{p.alpha:.2f}, R²={p.r2:.2f}")  # fmt: skip
        _axes(ax, "All points, the compute-optimal frontier and their fits (95% bands)")
        written.append(_save(fig, out_dir / f"{prefix}-frontier.png"))

    if summary.get("synergy"):
        fig, ax = plt.subplots(figsize=(7, 4))
        labels, values, colors = [], [], []
        for row in summary["synergy"]:
            labels.append(f"balanced {row['step']}")
            values.append(row["balanced"][NE])
            colors.append("tab:red")
            for axis, arm in row["arms"].items():
                labels.append(f"{axis} only {row['step']}\n(C x{arm['compute_ratio']:.2f})")
                values.append(arm["point"][NE])
                colors.append(AXIS_COLORS[axis])
        ax.bar(labels, values, color=colors)
        ax.set_ylim(min(values) - 0.02, max(values) + 0.01)
        ax.set_ylabel("test NE (lower is better)")
        ax.set_title("Synergy: balanced growth vs one axis at matched compute")
        ax.tick_params(axis="x", labelsize=8)
        written.append(_save(fig, out_dir / f"{prefix}-synergy.png"))

    if summary.get("composition") or summary.get("tunability"):
        fig, axs = plt.subplots(1, 2, figsize=(10, 4))
        rows = summary.get("composition") or []
        if rows:
            x = np.arange(len(rows))
            axs[0].bar(x - 0.2, [r["diverse"][NE] for r in rows], 0.4, label="diverse actions")
            axs[0].bar(x + 0.2, [r["homogeneous"][NE] for r in rows], 0.4, label="homogeneous")
            axs[0].set_xticks(x, [f"history {r['seq_len']}" for r in rows])
            lo = min(min(r["diverse"][NE], r["homogeneous"][NE]) for r in rows)
            axs[0].set_ylim(lo - 0.02, None)
            axs[0].set_ylabel("test NE")
            axs[0].set_title("Composition at equal history length")
            axs[0].legend()
        t = summary.get("tunability") or {}
        if t:
            names = ["base", "grow user model", "grow ranker"]
            vals = [t["base"][NE], t["grow_user"][NE], t["grow_ranker"][NE]]
            axs[1].bar(names, vals, color=["0.6", "tab:blue", "tab:orange"])
            axs[1].set_ylim(min(vals) - 0.02, max(vals) + 0.01)
            axs[1].set_ylabel("ranker test NE")
            axs[1].set_title("Multi-stage tunability")
        written.append(_save(fig, out_dir / f"{prefix}-experiments.png"))
    plt.close("all")
    return written


def _axes(ax, title: str) -> None:
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs, forward + backward)")
    ax.set_ylabel("test NE (lower is better)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------------------------- markdown
def _e(x: float) -> str:
    return f"{x:.2e}"


def markdown(
    summary: dict, title: str, images: list[Path] | None = None, image_base: Path | None = None
) -> str:
    lines = [f"### {title}", ""]
    rows = [("all points (full histories)", summary.get("overall")), ("compute-optimal frontier", summary.get("frontier")),
            *((f"axis {a}", f) for a, f in summary["axes"].items())]  # fmt: skip
    lines += ["| fit | points | decades of C | NE = a - b·log10 C | R² | b 95% CI | power law | verdict |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, fit in rows:
        if not fit:
            continue
        if "b" in fit:
            power = (
                f"α={fit['alpha']:.2f}, E={fit['E']:.3f}, R²={fit['power_r2']:.2f}"
                if "alpha" in fit
                else fit.get("power_law_error", "-")
            )
            lines.append(f"| {name} | {fit['n']} | {fit['decades']:.2f} | a={fit['a']:.3f}, b={fit['b']:.4f} | "
                         f"{fit['r2']:.3f} | [{fit['b_ci'][0]:.4f}, {fit['b_ci'][1]:.4f}] | {power} | {fit['verdict']} |")  # fmt: skip
        else:
            lines.append(f"| {name} | {fit['n']} | {fit['decades']:.2f} | - | - | - | - | {fit['verdict']} |")
    lines += ["", "| point | groups | FLOPs/example | C (FLOPs) | epochs | wall s | test NE | test AUC |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in summary["points"]:
        groups = ", ".join(p["groups"])
        lines.append(f"| {p['name']} | {groups} | {_e(p['flops_per_example'])} | {_e(p['compute_flops'])} | "
                     f"{p['epochs_run']} | {p['wall_time_s']:.0f} | {p[NE]:.4f} | {p.get('test_auc', math.nan):.4f} |")  # fmt: skip
    for row in summary.get("synergy", []):
        b = row["balanced"]
        lines += ["", f"**Synergy, step {row['step']}**: balanced {b['name']} (C {_e(b['compute_flops'])}) "
                      f"test NE {b[NE]:.4f}" + (f"; start {row['start']['name']} NE {row['start'][NE]:.4f}" if row["start"] else "")]  # fmt: skip
        for axis, arm in row["arms"].items():
            p = arm["point"]
            lines.append(f"- {axis} only ({p['name']}, FLOPs/example x{arm['compute_ratio']:.2f} of balanced): "
                         f"NE {p[NE]:.4f}, {arm['ne_minus_balanced']:+.4f} vs balanced")  # fmt: skip
    if summary.get("composition"):
        lines += ["", "**Composition** (same examples and test split; history of equal length):"]
        for r in summary["composition"]:
            lines.append(f"- history {r['seq_len']}: diverse NE {r['diverse'][NE]:.4f} vs homogeneous "
                         f"NE {r['homogeneous'][NE]:.4f}: diversity gains {r['ne_gain_of_diversity']:+.4f} NE")  # fmt: skip
    t = summary.get("tunability") or {}
    if t:
        lines += ["", "**Multi-stage tunability** (ranker test NE):",
                  f"- base ({t['base']['name']}): NE {t['base'][NE]:.4f}, serving "
                  f"{t['base']['serving_ms_per_1000']:.2f} ms / 1,000 candidates ({_e(t['base']['serving_flops_per_1000'])} FLOPs)",
                  f"- grow the offline user model ({t['user_small']['name']} -> {t['user_large']['name']}): "
                  f"{t['gain_user']:+.4f} NE for {_e(t['extra_flops_user'])} more training FLOPs "
                  f"({t['gain_per_pflop_user']:+.4f} NE/PFLOP); serving cost unchanged "
                  f"({t['grow_user']['serving_ms_per_1000']:.2f} ms / 1,000)",
                  f"- grow the online ranker ({t['grow_ranker']['name']}): {t['gain_ranker']:+.4f} NE for "
                  f"{_e(t['extra_flops_ranker'])} more training FLOPs ({t['gain_per_pflop_ranker']:+.4f} NE/PFLOP); "
                  f"serving {t['grow_ranker']['serving_ms_per_1000']:.2f} ms / 1,000 candidates "
                  f"({_e(t['grow_ranker']['serving_flops_per_1000'])} FLOPs)"]  # fmt: skip
    walls = [p["wall_time_s"] for p in summary["points"]]
    cpus = [p.get("cpu_time_s", math.nan) for p in summary["points"]]
    loads = [p["load_avg_1m_at_start"] for p in summary["points"]]
    point_cpus = [p["point_cpu_time_s"] for p in summary["points"] if "point_cpu_time_s" in p]
    if walls:
        whole = (f", {sum(point_cpus):.0f} s with data loading, FLOP counting and evaluation"
                 if len(point_cpus) == len(walls) else "")  # fmt: skip
        lines += ["", f"Training wall time summed over points: {sum(walls):.0f} s "
                      f"({len(walls)} points, {summary['points'][0]['threads']} thread(s) each), "
                      f"training CPU time {sum(cpus):.0f} s{whole}; "
                      f"1-min load average at point starts: {min(loads):.1f}-{max(loads):.1f}."]  # fmt: skip
    cmd = summary.get("command")
    if cmd:
        lines += ["", f"This command: {cmd['wall_s']:.0f} s wall, {cmd['cpu_s']:.0f} CPU s summed over all its "
                      f"processes ({cmd['trained_points']} point(s) trained, {cmd['cores']} core(s) available; "
                      "a rerun skips finished points)."]  # fmt: skip
        total = summary.get("invocations")
        if total and total["count"] > 1:
            lines[-1] += (f" All {total['count']} invocations of this sweep: {total['wall_s']:.0f} s wall, "
                          f"{total['cpu_s']:.0f} CPU s, {total['trained_points']} point(s) trained.")  # fmt: skip
    for img in images or []:
        rel = img.relative_to(image_base) if image_base else img
        lines += ["", f"![{img.stem}]({rel.as_posix()})"]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, section: str, body: str) -> None:
    """Replace (or append) the block between this section's markers in ``doc``."""
    begin, end = f"<!-- scaling:{section}:begin -->", f"<!-- scaling:{section}:end -->"
    write_marked_section(doc, begin, end, body, "# Scaling laws")
