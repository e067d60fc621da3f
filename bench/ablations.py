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
    # the synthetic acceptance (docs/model-results.md): user model trained on earlier days, daily snapshots,
    # 3 seeds, mean +- spread per variant
    .venv/bin/python bench/ablations.py --training-set syn --user-training-set syn-um --user-snapshot day \
        --max-history 512 --epochs 4 --seeds 0,1,2

``--user-training-set`` trains the user model on another training set (e.g. the days before the ranker's
train days, so the cached tokens of the ranker's train rows are not fitted to those rows' own labels);
``--user-snapshot day`` cuts the user model's history at each example's day start (the daily refresh).
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


def base_overrides(args, training_set: str, out: Path, seed: int) -> dict:
    d = args.d_model
    return {
        "training_set": training_set,
        "tracking.enabled": args.track,
        "resume": False,
        "optim.epochs": args.epochs,
        "optim.batch_size": args.batch_size,
        "optim.max_train_examples": args.max_train,
        "optim.seed": seed,
        "user_model.d_model": d,
        "user_model.max_history": args.max_history,
        "user_model.snapshot": args.user_snapshot,
        "ranker.d_model": d,
        "output_dir": str(out),
    }


def run(args, seed: int, subdir: str = "") -> dict:
    """Every requested variant (and the leave-one-out rows) for one seed; run folders under
    ``<workspace>/ablations/<subdir>``."""
    from models.config import TrainRunConfig
    from models.inference.bundle import load_bundle
    from models.training.prepare import user_tokens_per_example
    from models.training.train import train

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
    runs = ws.root / "ablations" / subdir
    rows: dict[str, dict] = {}

    def fit(name: str, overrides: dict, user_embeddings=None, on: str = ""):
        cfg = load_config(
            TrainRunConfig,
            None,
            {**base_overrides(args, on or training_set, runs / name, seed), **overrides},
        )
        start, cpu = time.perf_counter(), time.process_time()
        result = train(cfg, ws, user_embeddings=user_embeddings)
        rows[name] = {
            **result.metrics,
            "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu,
            "run_dir": str(result.run_dir),
        }
        m = result.metrics
        judged = (
            f"valid NE {m['valid_ne']:.4f}" if "valid_ne" in m else f"valid NDCG@10 {m['valid_ndcg@10']:.4f}"
        )
        print(
            f"# seed {seed} {name}: {judged} "
            f"({rows[name]['seconds']:.0f} s, {rows[name]['cpu_seconds']:.0f} cpu s)",
            flush=True,
        )
        return result

    from models.training.data import TrainingSet
    from models.training.prepare import resolve_training_set

    data = TrainingSet(resolve_training_set(training_set, ws))
    variants = [v for v in args.variants.split(",") if v]  # "" with --loo: the leave-one-out rows only
    embeddings = None
    if "multi_stage" in variants:  # the cached tokens come from the user model, embedded as of each example
        if args.user_model:
            user_dir = Path(args.user_model)
        else:
            user_set = args.user_training_set or training_set
            user_dir = fit("user_model", {"model": "user", **user_overrides(args)}, on=user_set).run_dir
        cpu = time.process_time()
        user_bundle = load_bundle(user_dir)
        embeddings = user_tokens_per_example(user_bundle, data)
        rows.setdefault("user_model", {"run_dir": str(user_dir)})
        rows["user_model"]["embed_flops_per_user"] = embed_flops_per_user(user_bundle, data)
        if args.user_training_set and user_bundle.cfg.objective != "next_item":
            # its own click head, scored on the ranker's valid/test (a next-item model has no click head)
            rows["user_model"].update(
                user_model_metrics(user_bundle, data), trained_on=args.user_training_set
            )
        print(
            f"# seed {seed} user tokens of {len(embeddings)} examples: {time.process_time() - cpu:.0f} cpu s"
        )
    for name in variants:
        overrides = VARIANTS[name]
        fit(
            name,
            {"model": "ranker", **overrides},
            embeddings if overrides["ranker.use_user_tokens"] else None,
        )

    loo = {}
    if args.loo:
        from models.training.evaluate import leave_one_out, load_for_evaluation, popularity_leave_one_out

        # the click-trained user model ranked by its heads, as this table always did; the next-item
        # objective and its baselines are bench/sequential.py's table
        loo_set = {"split_mode": "leave_one_out", "model": "user", "user_model.objective": "click"}
        for name, extra in (("loo_full", {}), ("loo_mean", {"user_model.pooling": "mean"})):
            result = fit(name, {**loo_set, **extra})
            b, d, builder = load_for_evaluation(result.run_dir, resolve_training_set(training_set, ws))
            loo[name] = leave_one_out(b, d, builder, num_negatives=args.negatives)
        loo["popularity"] = popularity_leave_one_out(data, num_negatives=args.negatives)
    return {"rows": rows, "loo": loo}


def user_overrides(args) -> dict:
    """``--user-set key=value`` pairs: settings of the user model only (objective, width, epochs, ...)."""
    out = {}
    for item in args.user_set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--user-set wants key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def embed_flops_per_user(bundle, data, users: int = 256) -> float:
    """Matmul FLOPs of one offline embedding (``encode_user``) per user, on a fixed sample of users: the
    offline cost a bigger user model adds, which the ranker's serving cost does not see."""
    import numpy as np
    import torch

    from models.training.distributed.mfu import counted_flops

    cfg = bundle.cfg
    rows = np.random.default_rng(0).permutation(len(data.examples))[:users]
    history = data.history(rows, cfg.max_history, cfg.time_buckets, gap_to="previous")
    user_id = torch.from_numpy(data.examples["user_id"].to_numpy(np.int64)[rows])
    with torch.no_grad():
        return counted_flops(lambda: bundle.model.encode_user(history, user_id)) / len(rows)


def user_model_metrics(bundle, data) -> dict[str, float]:
    """The user model's own click/conversion head on ``data``'s valid and test splits."""
    from models.training.batch_builder import BatchBuilder
    from models.training.train import evaluate_rows

    cfg = bundle.cfg
    builder = BatchBuilder(
        data, bundle.dense, history_len=cfg.max_history, time_buckets=cfg.time_buckets, gap_to="previous",
        snapshot=cfg.snapshot,
    )  # fmt: skip
    out = {}
    for split in ("valid", "test"):
        out |= evaluate_rows(bundle.model, builder, data.split_rows(split), 1024, f"{split}_")
    return out


METRICS = ("valid_ne", "test_ne", "test_auc", "test_calibration", "test_conversion_ne", "cpu_seconds")
COMPARISONS = (  # (label, better, baseline, wanted)
    ("target-aware attention vs mean pooling", "online_only", "mean", ">= +3%"),
    ("target-aware attention vs DIN", "online_only", "din", "> 0"),
    ("multi-stage vs online-only", "multi_stage", "online_only", "> 0"),
)


def relative_gain(rows: dict, better: str, baseline: str) -> float:
    """Relative test-NE improvement of ``better`` over ``baseline`` (percent; > 0 = better)."""
    return 100 * (1 - rows[better]["test_ne"] / rows[baseline]["test_ne"])


def summarize(per_seed: dict[int, dict]) -> dict:
    """Mean, sample std, min and max over seeds of every metric and of every available comparison."""
    import numpy as np

    def stats(values: list[float]) -> dict[str, float]:
        v = np.asarray(values, np.float64)
        std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        return {
            "mean": float(v.mean()),
            "std": std,
            "min": float(v.min()),
            "max": float(v.max()),
            "n": len(v),
        }

    outs = list(per_seed.values())
    names = [n for n in outs[0]["rows"] if all(n in o["rows"] for o in outs)]
    table = {n: {m: stats([o["rows"][n].get(m, np.nan) for o in outs]) for m in METRICS} for n in names}
    gains = {
        label: {**stats([relative_gain(o["rows"], b, a) for o in outs]), "wanted": wanted}
        for label, b, a, wanted in COMPARISONS
        if b in names and a in names
    }
    return {"seeds": sorted(per_seed), "table": table, "comparisons": gains}


def print_summary(summary: dict) -> None:
    seeds = summary["seeds"]
    print(f"\nseeds {seeds}: mean +- sample std over seeds")
    print(f"{'variant':<13} " + " ".join(f"{m:>17}" for m in METRICS))
    for name, metrics in summary["table"].items():
        print(f"{name:<13} " + " ".join(f"{m['mean']:>9.4f} +-{m['std']:<6.4f}" for m in metrics.values()))
    for label, g in summary["comparisons"].items():
        print(
            f"{label:<40} {g['mean']:+.2f}% +- {g['std']:.2f} (min {g['min']:+.2f}, max {g['max']:+.2f}; "
            f"{g['wanted']} wanted)"
        )


def print_table(out: dict) -> None:
    rows = out["rows"]
    print(
        f"\n{'variant':<13} {'valid NE':>9} {'test NE':>9} {'test AUC':>9} {'calib':>7} {'conv NE':>8} {'sec':>6}"
    )
    for name, m in rows.items():
        if "test_ne" not in m:  # a reused or next-item user model: not scored here; its offline cost
            print(f"{name:<13} offline embedding {m['embed_flops_per_user'] / 1e6:.1f} MFLOP/user")
            continue
        print(
            f"{name:<13} {m['valid_ne']:>9.4f} {m['test_ne']:>9.4f} {m['test_auc']:>9.4f} "
            f"{m['test_calibration']:>7.3f} {m['test_conversion_ne']:>8.4f} {m['seconds']:>6.0f}"
        )
    for label, better, baseline, wanted in COMPARISONS:
        if {better, baseline} <= set(rows):
            gain = relative_gain(rows, better, baseline)
            print(f"{label + ':':<40} {gain:+.2f}% relative test NE ({wanted} wanted)")
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
    p.add_argument("--seeds", default="", help="comma-separated seeds, run one after another; mean +- spread")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    p.add_argument("--user-model", default="", help="reuse this trained user-model run dir for multi_stage")
    p.add_argument("--user-training-set", default="", help="train the user model on this set (default: same)")
    p.add_argument(
        "--user-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the user model's run only, e.g. user_model.objective=next_item (repeatable)",
    )
    p.add_argument(
        "--user-snapshot", default="example", choices=["example", "day"], help="user-model history cut"
    )
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
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [args.seed]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if len(seeds) == 1:
        out = run(args, seeds[0])
        print_table(out)
    else:
        per_seed: dict[int, dict] = {}
        for seed in seeds:  # one after another; the JSON is rewritten after each so a stop keeps the rest
            per_seed[seed] = run(args, seed, f"seed{seed}")
            print(f"\n## seed {seed}")
            print_table(per_seed[seed])
            out = {"per_seed": per_seed, "summary": summarize(per_seed)}
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=2, default=float))
        print_summary(out["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
