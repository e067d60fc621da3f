"""Ablations of the GEM model family on one training set, printed as one table.

    mean         ranker, recent events mean-pooled (no attention), no cached user tokens
    din          ranker, DIN-style MLP-scored target attention, no cached user tokens
    online_only  ranker, target-aware MHA over recent events, no cached user tokens
    multi_stage  ranker, target-aware MHA over [cached user tokens ++ recent events] (the full model);
                 the tokens come from the user model trained first, embedded as of each example

With ``--loo`` (positive-only logs such as MovieLens) it also trains the user model (full and mean-pooled) on
the leave-one-out split and ranks 1 positive + 99 sampled negatives per user: HR@10, NDCG@10, MRR, next to
a popularity baseline.

    .venv/bin/python bench/ablations.py --training-set default            # ws.training("default")
    .venv/bin/python bench/ablations.py --fixture-users 1500               # the planted-structure fixture
    .venv/bin/python bench/ablations.py --training-set movielens --loo
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemflow.config import load_config  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402

VARIANTS = {
    "mean": {"ranker.pooling": "mean", "ranker.use_user_tokens": False},
    "din": {"ranker.pooling": "din", "ranker.use_user_tokens": False},
    "online_only": {"ranker.pooling": "target", "ranker.use_user_tokens": False},
    "multi_stage": {"ranker.pooling": "target", "ranker.use_user_tokens": True},
}


def base_overrides(args, training_set: str, out: Path) -> dict:
    d = args.d_model
    return {
        "training_set": training_set,
        "tracking.enabled": args.track,
        "resume": False,
        "optim.epochs": args.epochs,
        "optim.batch_size": args.batch_size,
        "optim.max_train_examples": args.max_train,
        "optim.seed": args.seed,
        "user_model.d_model": d,
        "user_model.max_history": args.max_history,
        "ranker.d_model": d,
        "output_dir": str(out),
    }


def run(args) -> dict:
    from models.config import TrainRunConfig
    from models.inference import embed_examples, load_bundle
    from models.train import train

    ws = Workspace(Path(args.workspace).resolve())
    training_set = args.training_set
    if args.fixture_users:
        from tests.models.fixtures import write_training_set

        path = ws.training(f"fixture-{args.fixture_users}")
        if not (path / "examples.parquet").exists():
            write_training_set(
                path, num_users=args.fixture_users, num_ads=400, num_categories=12, num_advertisers=40
            )
        training_set = str(path)
    runs = ws.root / "ablations"
    rows: dict[str, dict] = {}

    def fit(name: str, overrides: dict, user_embeddings=None):
        cfg = load_config(
            TrainRunConfig, None, {**base_overrides(args, training_set, runs / name), **overrides}
        )
        start = time.perf_counter()
        result = train(cfg, ws, user_embeddings=user_embeddings)
        rows[name] = {
            **result.metrics,
            "seconds": time.perf_counter() - start,
            "run_dir": str(result.run_dir),
        }
        print(
            f"# {name}: valid NE {result.metrics['valid_ne']:.4f} ({rows[name]['seconds']:.0f} s)", flush=True
        )
        return result

    from models.data import TrainingSet
    from models.train import resolve_training_set

    data = TrainingSet(resolve_training_set(training_set, ws))
    variants = [v for v in args.variants.split(",") if v]  # "" with --loo: the leave-one-out rows only
    embeddings = None
    if "multi_stage" in variants:  # the cached tokens come from the user model, embedded as of each example
        user_dir = Path(args.user_model) if args.user_model else fit("user_model", {"model": "user"}).run_dir
        embeddings = embed_examples(load_bundle(user_dir), data)
    for name in variants:
        overrides = VARIANTS[name]
        fit(
            name,
            {"model": "ranker", **overrides},
            embeddings if overrides["ranker.use_user_tokens"] else None,
        )

    loo = {}
    if args.loo:
        from models.evaluate import leave_one_out, load_for_evaluation, popularity_leave_one_out

        loo_set = {"split_mode": "leave_one_out", "model": "user"}
        for name, extra in (("loo_full", {}), ("loo_mean", {"user_model.pooling": "mean"})):
            result = fit(name, {**loo_set, **extra})
            b, d, builder = load_for_evaluation(result.run_dir, resolve_training_set(training_set, ws))
            loo[name] = leave_one_out(b, d, builder, num_negatives=args.negatives)
        loo["popularity"] = popularity_leave_one_out(data, num_negatives=args.negatives)
    return {"rows": rows, "loo": loo}


def print_table(out: dict) -> None:
    rows = out["rows"]
    print(
        f"\n{'variant':<13} {'valid NE':>9} {'test NE':>9} {'test AUC':>9} {'calib':>7} {'conv NE':>8} {'sec':>6}"
    )
    for name, m in rows.items():
        print(
            f"{name:<13} {m['valid_ne']:>9.4f} {m['test_ne']:>9.4f} {m['test_auc']:>9.4f} "
            f"{m['test_calibration']:>7.3f} {m['test_conversion_ne']:>8.4f} {m['seconds']:>6.0f}"
        )
    if {"mean", "online_only"} <= set(rows):
        gain = 1 - rows["online_only"]["test_ne"] / rows["mean"]["test_ne"]
        print(
            f"\ntarget-aware attention vs mean pooling: {100 * gain:+.2f}% relative test NE (>= +3% wanted)"
        )
    if {"online_only", "multi_stage"} <= set(rows):
        stage = 1 - rows["multi_stage"]["test_ne"] / rows["online_only"]["test_ne"]
        print(f"multi-stage vs online-only:             {100 * stage:+.2f}% relative test NE (> 0 wanted)")
    if out["loo"]:
        print(f"\n{'leave-one-out':<13} {'HR@10':>7} {'NDCG@10':>8} {'MRR':>7} {'users':>6}")
        for name, m in out["loo"].items():
            print(f"{name:<13} {m['hr@10']:>7.4f} {m['ndcg@10']:>8.4f} {m['mrr']:>7.4f} {int(m['users']):>6}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--training-set", default="default", help="name under <workspace>/training/ or a folder")
    p.add_argument("--workspace", default=str(Path(tempfile.gettempdir()) / "gemflow-ablations"))
    p.add_argument("--fixture-users", type=int, default=0, help="write and use the planted-structure fixture")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-train", type=int, default=0, help="subsample the train split (0 = all)")
    p.add_argument("--max-history", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    p.add_argument("--user-model", default="", help="reuse this trained user-model run dir for multi_stage")
    p.add_argument("--loo", action="store_true", help="also leave-one-out HR/NDCG/MRR (positive-only logs)")
    p.add_argument("--negatives", type=int, default=99)
    p.add_argument("--track", action="store_true", help="log every run to MLflow in the workspace")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    unknown = {v for v in args.variants.split(",") if v} - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    if not args.variants.strip(",") and not args.loo:
        p.error("--variants '' trains nothing: name variants, or add --loo for the leave-one-out rows only")
    out = run(args)
    print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
