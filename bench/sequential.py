"""Next-item recommendation on a positive-only log: every model, several seeds, one table.

    .venv/bin/python bench/sequential.py --workspace /tmp/toys --training-set toys --seeds 0,1,2 \
        --docs docs/model-results-sequential.md

Every model trains through ``gemflow train`` (``models.training.train.train``) on the same leave-one-out split and is
ranked on the same lists (``next_item.eval_seed``: 99 items the user never touched, sampled once) and against
the whole catalog:

    popularity        train-positive counts (no training)
    sasrec            SASRec as published: 2 blocks, d 50, 1 head, max length 50, dropout, learned positions,
                      binary cross-entropy with one sampled negative per position (the paper's loss), the
                      reference code's optimizer and initialisation
    sasrec_ce         the same network with the full softmax cross-entropy the gemflow model uses
    sasrec_sampled    the same network with sampled softmax over 256 shared negatives (the strongest published
                      full-ranking SASRec figures use this loss)
    sasrec_sampled_published  SASRec + sampled softmax at the config of those published figures (eSASRec's
                      code, blondered/transformer_benchmark): d 256, 1 block, 1 head, dropout 0.2, 256
                      negatives drawn per position
    mean_pooling      the gemflow user model with its attention removed: causal mean of the event tokens
    gemflow           the gemflow user model: jagged causal transformer (relative position / time biases), item
                      attributes tokenized into every event and into the item side, full softmax
    gemflow_ids_only  the same without item attributes (the attribute ablation)

The base config is ``configs/sequential.yaml``; ``--set`` overrides apply to every trained model, and
``--baseline-epochs`` / ``--baseline-patience`` give the SASRec baselines their own budget (early stopping on
valid NDCG@10, sampled lists). The table states the protocol of every row (``models.training.leave_one_out``): sampled,
full ranking with the user's history masked (the published convention) and unmasked; per model the epochs run
in each seed and whether it stopped early or hit the cap; the published anchors of the set with their protocol
(``bench/sequential_anchors.py``); and each "gemflow > baseline" line says whether the baseline converged or
both ran equal epochs. Mean +- sample std over seeds, per-model parameters and time, and a plot go to
``--json`` / ``--docs``; ``--paired`` adds gemflow's difference to every model per test user, bootstrapped over
users (``bench/sequential_paired.py``). ``--profile`` only times the phases of a training step per model.
Run folders stay under ``<workspace>/sequential/seed<N>/<model>``: ``--collect`` tables them again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import add_record_flag  # noqa: E402
from bench.sequential_paired import compare, user_ranks  # noqa: E402
from bench.sequential_profile import step_profile  # noqa: E402
from bench.sequential_report import PROTOCOLS, markdown, plot, record_speed, summarize, write_docs  # noqa: E402
from gemflow.config import load_config  # noqa: E402
from gemflow.workspace import Workspace  # noqa: E402
from models.training.run_folder import ResumeRefused  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# SASRec's reference optimizer (pmixer/SASRec.pytorch): Adam lr 1e-3, betas (0.9, 0.98), batch 128, no
# gradient clipping, no L2; the baselines train with it, not with the user model's settings
SASREC_OPTIM = {"optim.batch_size": "128", "optim.adam_beta2": "0.98", "optim.grad_clip": "0"}
MODELS = {
    "popularity": None,
    "sasrec": {"model": "sasrec", "next_item.loss": "bce", **SASREC_OPTIM},
    "sasrec_ce": {"model": "sasrec", "next_item.loss": "full", **SASREC_OPTIM},
    "sasrec_sampled": {
        "model": "sasrec",
        "next_item.loss": "sampled",
        "next_item.num_negatives": "256",
        **SASREC_OPTIM,
    },  # fmt: skip
    "sasrec_sampled_published": {
        "model": "sasrec",
        "sasrec.d_model": "256",
        "sasrec.num_blocks": "1",
        "sasrec.num_heads": "1",
        "sasrec.dropout": "0.2",
        "next_item.loss": "sampled",
        "next_item.num_negatives": "256",
        "next_item.shared_negatives": "false",
        **SASREC_OPTIM,
    },  # fmt: skip
    "mean_pooling": {"model": "user", "user_model.pooling": "mean"},
    "gemflow": {"model": "user"},
    "gemflow_ids_only": {"model": "user", "user_model.item_attributes": "none"},
}
# trained with --baseline-epochs / --baseline-patience
BASELINES = ("sasrec", "sasrec_ce", "sasrec_sampled", "sasrec_sampled_published")


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r} must look like key=value")
        out[key.strip()] = value
    return out


def popularity_row(cfg, ws: Workspace) -> dict:
    """Popularity on the same split and lists as the trained models."""
    from models.sequential.data import SequenceSet
    from models.sequential.evaluate import popularity_scorer, rank_split, sequence_negatives
    from models.training.data import TrainingSet
    from models.training.prepare import resolve_training_set

    start = time.perf_counter()
    seqs = SequenceSet(TrainingSet(resolve_training_set(cfg.training_set, ws)), 1, 0)
    negatives = sequence_negatives(seqs, cfg.next_item.eval_negatives, cfg.next_item.eval_seed)
    out = rank_split(popularity_scorer(seqs), seqs, "test", negatives, prefix="test_")
    return {**out, "parameters": 0, "train_seconds": 0.0, "seconds": time.perf_counter() - start}


def paired(args, per_seed: dict[int, dict], overrides: dict[str, str]) -> dict[str, dict]:
    """``bench.sequential_paired.compare`` of gemflow against every other model of the table."""
    ws = Workspace(Path(args.workspace).resolve())
    ranks = {
        name: [
            user_ranks(_config(args, ws, seed, name, overrides), ws, per_seed[seed][name])
            for seed in per_seed
        ]
        for name in args.models
    }
    return compare(ranks)


def trained_row(cfg, ws: Workspace) -> dict:
    from models.training.train import train

    start, cpu = time.perf_counter(), time.process_time()
    result = train(cfg, ws)
    return {
        **run_row(
            result.run_dir, cfg.optim.epochs
        ),  # its seconds: train + eval of every epoch, resumed or not
        "invocation_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
    }


def run_row(run_dir: Path, epoch_cap: int) -> dict:
    """A finished run's row from its folder: test metrics, parameters, epochs (and whether it stopped before
    ``epoch_cap``) and their time."""
    from models.inference.bundle import load_bundle

    history = json.loads((run_dir / "history.json").read_text())
    epochs = [h for h in history if "train_seconds" in h]
    model = load_bundle(run_dir).model
    run_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    row = {
        **json.loads((run_dir / "metrics.json").read_text()),
        "select_metric": run_cfg["next_item"]["select_metric"],
        "also_select_metric": run_cfg["next_item"].get("also_select_metric", ""),
        "shape": run_shape(run_cfg, model.num_items),
        "parameters": sum(p.numel() for p in model.parameters()),
        "epochs": len(epochs),
        "epoch_cap": epoch_cap,
        "stopped_early": len(epochs) < epoch_cap,
        "train_seconds": sum(h["train_seconds"] for h in epochs),
        "eval_seconds": sum(h["eval_seconds"] for h in epochs),
        "run_dir": str(run_dir),
    }
    row["seconds"] = row["train_seconds"] + row["eval_seconds"]
    return row


def run_shape(run_cfg: dict, num_items: int) -> str:
    """What a run trained as, for its table row: its width, and its full-softmax GEMMs where not fp32 (a table
    can hold runs of different widths, each model at the one its valid chose)."""
    nic = run_cfg["next_item"]
    d = run_cfg["sasrec" if run_cfg["model"] == "sasrec" else "user_model"]["d_model"]
    precision = nic.get("loss_precision", "fp32")
    full = nic["loss"] == "full" or (nic["loss"] == "auto" and num_items <= nic["full_softmax_max_items"])
    return f"d {d}" + (f", {precision} loss GEMMs" if full and precision != "fp32" else "")


def collect(args, overrides: dict[str, str]) -> dict[int, dict]:
    """Rows of the runs already finished under ``<workspace>/sequential/seed*/<model>`` (a stopped bench loses
    nothing it finished); popularity is recomputed (seconds)."""
    ws = Workspace(Path(args.workspace).resolve())
    per_seed = {}
    for folder in sorted((ws.root / "sequential").glob("seed*")):
        seed = int(folder.name.removeprefix("seed"))
        rows = {}
        for name in args.models:
            if MODELS[name] is None:
                rows[name] = popularity_row(_config(args, ws, seed, name, overrides), ws)
            elif (folder / name / "metrics.json").exists():
                rows[name] = run_row(folder / name, _config(args, ws, seed, name, overrides).optim.epochs)
        if all(name in rows for name in args.models):
            per_seed[seed] = rows
        else:
            print(f"# seed {seed}: skipped, unfinished: {[n for n in args.models if n not in rows]}")
    return per_seed


def _config(args, ws: Workspace, seed: int, name: str, overrides: dict[str, str]):
    from models.config import TrainRunConfig

    return load_config(
        TrainRunConfig,
        args.config,
        {
            "training_set": args.training_set,
            "tracking.enabled": "false",
            "resume": "false",
            "optim.seed": str(seed),
            "output_dir": str(ws.root / "sequential" / f"seed{seed}" / name),
            **(MODELS[name] or {}),
            **overrides,
            **(baseline_budget(args) if name in BASELINES else {}),
        },
    )


def baseline_budget(args) -> dict[str, str]:
    out = {}
    if args.baseline_epochs:
        out["optim.epochs"] = str(args.baseline_epochs)
    if args.baseline_patience:
        out["optim.patience"] = str(args.baseline_patience)
    return out


def run_seed(args, seed: int, overrides: dict[str, str]) -> dict[str, dict]:
    ws = Workspace(Path(args.workspace).resolve())
    rows = {}
    for name in args.models:
        cfg = _config(args, ws, seed, name, overrides)
        if args.profile:
            if MODELS[name] is not None:
                rows[name] = step_profile(cfg, ws)
                print(f"# {name:<16} " + "  ".join(f"{k} {v:.1f}" for k, v in rows[name].items()), flush=True)
            continue
        rows[name] = popularity_row(cfg, ws) if MODELS[name] is None else trained_row(cfg, ws)
        m = rows[name]
        cells = " | ".join(
            f"{protocol} HR@10 {m[f'test_{p}hr@10']:.4f} NDCG@10 {m[f'test_{p}ndcg@10']:.4f}"
            for protocol, p in PROTOCOLS.items()
        )
        print(f"# seed {seed} {name:<16} {cells} | {epochs_note(m)}, {m['seconds']:.0f} s", flush=True)
    return rows


def epochs_note(row: dict) -> str:
    if "epoch_cap" not in row:
        return "no training"
    how = "stopped early" if row["stopped_early"] else "hit the cap"
    return f"{row['epochs']}/{row['epoch_cap']} epochs, {how}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace", required=True)
    p.add_argument("--training-set", required=True, help="name under <workspace>/training/ or a folder")
    p.add_argument("--config", default=str(ROOT / "configs" / "sequential.yaml"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--set", action="append", default=[], help="key=value for every trained model")
    p.add_argument("--title", default="", help="section title (default: the training set's name)")
    p.add_argument("--json", help="write the per-seed rows and the summary here")
    p.add_argument("--docs", help="write the table into this markdown file (its section for this set)")
    p.add_argument(
        "--collect", action="store_true", help="train nothing: table the finished runs of the workspace"
    )
    add_record_flag(p)
    p.add_argument(
        "--paired",
        action="store_true",
        help="add a paired bootstrap over test users of gemflow against every other model (ranks each run's best "
        "state on test once, cached as test_ranks.npz in its folder)",
    )
    p.add_argument("--profile", action="store_true", help="only time the phases of a training step per model")
    p.add_argument(
        "--baseline-epochs", type=int, default=0, help="epoch cap of the SASRec baselines (0: config's)"
    )
    p.add_argument(
        "--baseline-patience", type=int, default=0, help="their early-stopping patience (0: the config's)"
    )
    p.add_argument(
        "--merge",
        default="",
        help="comma-separated JSON files of earlier runs (e.g. one seed each, or the baselines and the user model "
        "run apart): train nothing, summarize their seeds together (per seed, the union of their models)",
    )
    args = p.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {list(MODELS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    overrides = parse_overrides(args.set)
    title = args.title or Path(args.training_set).name
    command = "bench/sequential.py " + " ".join(sys.argv[1:])
    from gemflow.malloc import keep_freed_memory

    keep_freed_memory()  # as `gemflow train` does: each step's catalog-sized tensors reuse mapped memory
    if args.profile:
        rows = run_seed(args, seeds[0], overrides)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    per_seed: dict[int, dict] = collect(args, overrides) if args.collect else {}
    for path in filter(
        None, args.merge.split(",")
    ):  # per seed, the union of the files' models (later files win)
        for seed, rows in json.loads(Path(path).read_text())["per_seed"].items():
            per_seed.setdefault(int(seed), {}).update(rows)
    for seed in (
        [] if args.merge or args.collect else seeds
    ):  # the JSON is rewritten after each seed: a stop keeps the rest
        try:
            per_seed[seed] = run_seed(args, seed, overrides)
        except ResumeRefused as err:  # a finished or stopped run is never overwritten
            raise SystemExit(f"error: {err}; --collect tables the finished runs") from None
        if args.json:
            Path(args.json).write_text(json.dumps({"per_seed": per_seed, "summary": summarize(per_seed)},
                                                  indent=2, default=float))  # fmt: skip
    out = {"per_seed": per_seed, "summary": summarize(per_seed)}
    if args.paired and "gemflow" in args.models:
        out["paired"] = paired(args, per_seed, overrides)
    if args.json and (args.merge or args.collect or args.paired):
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    section = markdown(out["summary"], title, command, out.get("paired"))
    print("\n" + section)
    if args.record:
        record_speed(out["summary"], title)
    if args.docs:
        image = Path(args.docs).parent / "img" / f"sequential-{title}.png"
        plot(out["summary"], title, image)
        write_docs(Path(args.docs), title, section + f"\n![{title}](img/{image.name})\n")


if __name__ == "__main__":
    main()
