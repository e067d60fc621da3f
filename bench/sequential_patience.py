"""What a smaller early-stopping patience would have cost the finished runs of a ``bench/sequential.py`` workspace.

Each run folder keeps every epoch's validation metrics and seconds (``history.json``). Replaying the training
loop's own stopping rule (``models.training.loop``: stop after ``patience`` evaluations without improvement) on
that history says, for each smaller patience, at which epoch the run would have stopped, which state it would
have kept and the share of the run's time it would have spent. Where the kept state is the one the full run
kept, its test figures are the full run's too; where it is an earlier one, the table gives how much lower its
selection metric is on valid (its test figures were never measured).

    .venv/bin/python bench/sequential_patience.py --workspace W --patience 3 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.training.loop import improved  # noqa: E402


def replay(history: list[dict], select: str, patience: int) -> dict:
    """The training loop's early stopping on a finished run's ``history`` with ``patience``."""
    best, best_at, bad = None, 0, 0
    for i, row in enumerate(history):
        if improved(row[select], best, True):
            best, best_at, bad = row[select], i, 0
        else:
            bad += 1
        if bad >= patience:
            break
    seconds = [row.get("train_seconds", 0.0) + row.get("eval_seconds", 0.0) for row in history]
    return {
        "stop": i,
        "kept": best_at,
        "valid_lost": max(r[select] for r in history) - best,
        "time_share": sum(seconds[: i + 1]) / sum(seconds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace", type=Path, required=True)
    p.add_argument("--patience", type=int, nargs="+", default=[3, 5])
    args = p.parse_args()
    runs = sorted((args.workspace / "sequential").glob("seed*/*/history.json"))
    if not runs:
        raise SystemExit(f"error: no finished runs under {args.workspace / 'sequential'}")
    print(
        "| run | epochs run (kept) | "
        + " | ".join(f"patience {k}: stop (kept), valid lost, time" for k in args.patience)
        + " |"
    )
    print("|---|---|" + "---|" * len(args.patience))
    for path in runs:
        history = json.loads(path.read_text())
        select = (
            "valid_" + yaml.safe_load((path.parent / "config.yaml").read_text())["next_item"]["select_metric"]
        )
        full = replay(history, select, len(history))
        cells = []
        for k in args.patience:
            r = replay(history, select, k)
            same = "same state" if r["kept"] == full["kept"] else f"-{r['valid_lost']:.5f}"
            cells.append(f"{r['stop']} ({r['kept']}), {same}, {r['time_share']:.0%}")
        print(
            f"| {path.parent.parent.name}/{path.parent.name} | {full['stop']} ({full['kept']}) | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    main()
