"""``bench/sequential.py``'s report: the per-seed rows summarized (mean, std, every-seed comparisons and their
budget), the markdown table, the speed record for docs/benchmarks.md and the plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.report import record
from bench.sequential_anchors import anchor_lines
from bench.sequential_paired import OWN, kept_on_sampled
from bench.sequential_paired import markdown as paired_markdown
from models.sequential.evaluate import PROTOCOL_PREFIX as PROTOCOLS

METRICS = ("hr@1", "hr@5", "hr@10", "ndcg@5", "ndcg@10", "mrr")
PROTOCOL_LABELS = {
    "sampled": "sampled: 1 positive + 99 items the user never touched",
    "masked": "full ranking, history masked: every trained item except the user's earlier ones (published convention)",
    "unmasked": "full ranking, unmasked: every trained item",
}
# OWN: the sampled figures of the state each run kept on a sampled valid metric (``next_item.also_select_metric``),
# the sampled protocol with its own selection, as S3-Rec selects; a table has it when every trained run has one
OWN_LABEL = (
    "sampled, each run's state chosen on its valid sampled {metric} (the sampled protocol's own selection)"
)


def has_own_view(per_seed: dict[int, dict[str, dict]]) -> bool:
    return all(
        "epoch_cap" not in row or ("also_test_hr@10" in row and kept_on_sampled(row))
        for rows in per_seed.values()
        for row in rows.values()
    )


def view_value(row: dict, view: str, metric: str) -> float:
    """A row's test ``metric`` under ``view`` (a protocol, or ``OWN``: popularity, never selected, has one)."""
    if view == OWN:
        return row.get(f"also_test_{metric}", row[f"test_{metric}"])
    return row[f"test_{PROTOCOLS[view]}{metric}"]


def summarize(per_seed: dict[int, dict[str, dict]]) -> dict:
    """Mean and sample std over seeds of every test metric, and the per-seed comparisons of record."""
    names = list(next(iter(per_seed.values())))
    views = [*PROTOCOLS, *([OWN] if has_own_view(per_seed) else [])]
    table = {}
    for name in names:
        table[name] = {}
        for view in views:
            for metric in METRICS:
                values = np.array([view_value(r[name], view, metric) for r in per_seed.values()])
                table[name][f"{view}_{metric}"] = {
                    "mean": float(values.mean()),
                    "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                    "per_seed": values.tolist(),
                }
        for key in ("parameters", "epochs", "train_seconds", "eval_seconds", "seconds"):
            table[name][key] = float(np.mean([r[name].get(key, 0.0) for r in per_seed.values()]))
        table[name]["epochs_per_seed"] = [r[name].get("epochs", 0) for r in per_seed.values()]
        table[name]["shape"] = " / ".join(sorted({r[name].get("shape", "—") for r in per_seed.values()}))
        chosen = {selection_label(r[name].get("select_metric", "ndcg@10")) for r in per_seed.values()}
        table[name]["chosen_on"] = " / ".join(sorted(chosen))
        also = {r[name].get("also_select_metric", "") for r in per_seed.values()} - {""}
        table[name]["also_chosen_on"] = " / ".join(sorted(selection_label(m) for m in also))
        table[name]["epoch_cap"] = [r[name].get("epoch_cap", 0) for r in per_seed.values()]
        table[name]["stopped_early_per_seed"] = [
            r[name].get("stopped_early", True) for r in per_seed.values()
        ]
    wins, budgets = {}, {}
    for baseline in names:
        if "gemflow" in names and baseline != "gemflow":
            budgets[f"gemflow > {baseline}"] = budget_verdict(table["gemflow"], table[baseline])
            wins[f"gemflow > {baseline}"] = {
                f"{view}_{metric}": all(
                    view_value(r["gemflow"], view, metric) > view_value(r[baseline], view, metric)
                    for r in per_seed.values()
                )
                for view in views
                for metric in ("hr@10", "ndcg@10")
            }
    return {"seeds": sorted(per_seed), "views": views, "table": table, "every_seed": wins, "budget": budgets}


def own_metric(summary: dict) -> str:
    """The sampled metric the ``OWN`` view's states were chosen on, in words (without the protocol)."""
    chosen = {row["also_chosen_on"] for row in summary["table"].values() if row.get("also_chosen_on")}
    return " / ".join(sorted(c.removesuffix(" (sampled)") for c in chosen))


def selection_label(metric: str) -> str:
    """``next_item.select_metric`` in words: "ndcg@10" -> "NDCG@10 (sampled)"."""
    protocol = "full ranking, masked" if metric.startswith("full_") else "sampled"
    return f"{metric.removeprefix('full_').upper()} ({protocol})"


def budget_verdict(ours: dict, baseline: dict) -> str:
    """How the compared runs were budgeted: never a comparison line without it."""
    if baseline["epoch_cap"] == [0] * len(baseline["epoch_cap"]):
        return "untrained baseline"
    if all(baseline["stopped_early_per_seed"]):
        return f"baseline converged (stopped early on valid {baseline['chosen_on']} in every seed)"
    if ours["epochs_per_seed"] == baseline["epochs_per_seed"]:
        return f"at equal epochs {baseline['epochs_per_seed']} (baseline NOT converged: it hit its cap)"
    capped = [i for i, early in enumerate(baseline["stopped_early_per_seed"]) if not early]
    return (
        f"baseline NOT converged (hit its {baseline['epoch_cap'][0]}-epoch cap in seed index {capped}) and "
        f"NOT at equal epochs (gemflow {ours['epochs_per_seed']}, baseline {baseline['epochs_per_seed']})"
    )


def markdown(summary: dict, title: str, command: str, paired: dict | None = None) -> str:
    seeds = summary["seeds"]
    lines = [
        f"### {title}",
        "",
        f"`{command}`; seeds {seeds}, mean ± sample std over seeds, test split (each user's last item).",
        "",
    ]
    for protocol in summary.get("views", PROTOCOLS):
        label = PROTOCOL_LABELS.get(protocol) or OWN_LABEL.format(metric=own_metric(summary))
        lines += [f"**{label}**", "", "| model | " + " | ".join(m.upper() for m in METRICS) + " |"]
        lines.append("|---|" + "---:|" * len(METRICS))
        for name, row in summary["table"].items():
            cells = [
                f"{row[f'{protocol}_{m}']['mean']:.4f} ± {row[f'{protocol}_{m}']['std']:.4f}" for m in METRICS
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += anchor_lines(title)
    lines += [
        "| model | shape | parameters | chosen on valid | epochs run per seed / cap | stopped early per seed | train s | eval s"
        " | wall s |",
        "|---|---|---:|---|---|---|---:|---:|---:|",
    ]
    for name, row in summary["table"].items():
        trained = any(row["epoch_cap"])
        epochs = f"{row['epochs_per_seed']} / {row['epoch_cap'][0]}" if trained else "—"
        early = (
            ", ".join("yes" if e else "NO (cap)" for e in row["stopped_early_per_seed"]) if trained else "—"
        )
        chosen = row["chosen_on"] if trained else "—"
        if trained and row.get("also_chosen_on"):
            chosen += f"; also kept: {row['also_chosen_on']}"
        lines.append(
            f"| {name} | {row['shape']} | {row['parameters']:,.0f} | {chosen} | {epochs} | {early} | {row['train_seconds']:.0f} | "
            f"{row['eval_seconds']:.0f} | {row['seconds']:.0f} |"
        )
    lines.append("")
    for label, checks in summary["every_seed"].items():
        held = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checks.items())
        lines.append(f"- {label} in every seed ({summary['budget'][label]}): {held}")
    if paired:
        lines += ["", *paired_markdown(paired, summary["seeds"])]
    return "\n".join(lines) + "\n"


def record_speed(summary: dict, title: str) -> None:
    """``--record``: each trained model's seconds per epoch (train, then the valid evaluation) and its epochs
    to convergence, into docs/benchmarks.md (quality stays in the model-results doc)."""
    import os

    rows = []
    for name, row in summary["table"].items():
        if not any(row["epoch_cap"]):
            continue
        epochs = max(row["epochs"], 1)
        early = ", ".join("yes" if e else "NO (cap)" for e in row["stopped_early_per_seed"])
        rows.append((f"{name}: s/epoch train + eval (1 thread)",
                     f"{row['train_seconds'] / epochs:.1f} + {row['eval_seconds'] / epochs:.1f}"))  # fmt: skip
        rows.append((f"{name}: epochs run per seed / cap, stopped early",
                     f"{row['epochs_per_seed']} / {row['epoch_cap'][0]}, {early}"))  # fmt: skip
    rows.append(("load average at the end (1 min)", f"{os.getloadavg()[0]:.1f}"))
    record(
        f"sequential.{title.lower()}",
        f"next-item training to convergence (bench/sequential.py), {title}",
        rows,
    )


def write_docs(path: Path, key: str, section: str) -> None:
    """Replace (or append) the section between ``<!-- sequential:key -->`` markers."""
    from gemflow.markdown import write_marked_section

    title = "# Next-item recommendation on positive-only logs"
    write_marked_section(path, f"<!-- sequential:{key} -->", f"<!-- /sequential:{key} -->", section, title)


def plot(summary: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["table"])
    panels = [("sampled", "hr@10"), ("sampled", "ndcg@10"), ("masked", "hr@10"), ("masked", "ndcg@10")]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (protocol, metric) in zip(axes, panels, strict=True):
        stats = [summary["table"][n][f"{protocol}_{metric}"] for n in names]
        ax.bar(range(len(names)), [s["mean"] for s in stats], yerr=[s["std"] for s in stats], capsize=3,
               color=["#1f77b4" if n.startswith("gemflow") else "#999999" for n in names])  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(
            f"{metric.upper()} ({'99 sampled' if protocol == 'sampled' else 'full, history masked'})"
        )
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
