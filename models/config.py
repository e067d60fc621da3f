"""Dataclass configs of the GEM model family and of one training run (YAML + ``--set`` overrides).

``TrainRunConfig`` is what ``gemflow train`` loads: which model, which training set, the model's shape, the
optimizer and the tracking settings. Ablations are flags here, never separate code paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from models.training.distributed.config import DistributedConfig


@dataclass
class UserModelConfig:
    """Offline user model: a deep transformer over the jagged history -> K cached user tokens."""

    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_mult: int = 4
    dropout: float = 0.0
    max_history: int = 512  # events read per user (the most recent ones); works up to >= 4096
    causal: bool = True  # causal lets the next-event loss train on every position
    num_user_tokens: int = 4  # K summary queries -> K user tokens (the cached embedding)
    max_rel_pos: int = 64  # relative position bias covers |i - j| <= max_rel_pos
    time_buckets: int = 32  # log2 buckets of time gaps (seconds) for tokens and the attention bias
    # What the model is trained for: "click" (labelled impressions: click/conversion heads, next-ad loss as an
    # auxiliary), "next_item" (positive-only logs: the next-item softmax is THE loss, judged by leave-one-out
    # ranking) or "auto" (next_item when the training set was split leave-one-out, else click).
    objective: str = "auto"
    # Every attribute of an item (items.parquet: categories, brand, ...) mean-pooled into one more token field
    # of each event and of the item side of the next-item score: "all" or "none"; "auto" = all for next_item,
    # none for click.
    item_attributes: str = "auto"
    # Embedding init: "blocks" (each table in its own block of dimensions, N(0, 1): id matches dominate dot
    # products at step 0, what the click heads start from) or "normal" (N(0, 0.05)); "auto" = normal for
    # next_item, where unit-scale random rows barely moved in training and buried the cosine scores.
    embedding_init: str = "auto"
    next_item_temperature: float = 0.05  # the next-item score is cosine / temperature
    # next_item with item attributes: the probability that a training step leaves an item's own id row out of
    # its item-side vector (its category, brand and attribute tokens still stand for it), so a rare item's row
    # cannot fit the few users who touched it alone. 0 = off.
    item_id_dropout: float = 0.0
    next_event_weight: float = 0.1  # click objective: auxiliary sampled-softmax next-ad loss; 0 disables it
    num_negatives: int = 64  # shared uniform negatives for the sampled softmax
    pooling: str = "transformer"  # ablation: "mean" = mean-pooled history tokens, no attention
    # History cut for training and embedding: "example" = each example's own cut; "day" = as of the start of
    # the example's UTC day (what a daily refresh caches), encoded once per user-day for all its impressions.
    snapshot: str = "example"
    attention_backend: str = "auto"
    # Feed-forward kind per block ("dense" | "moe"); empty = all dense. MoE blocks run under
    # ``gemflow train --nproc`` (settings in ``distributed.moe``).
    ffn: list[str] = field(default_factory=list)


@dataclass
class RankerConfig:
    """Online ranker: candidates attend over [cached user tokens ++ recent fresh events]."""

    d_model: int = 64
    num_layers: int = 2  # stacked target-aware blocks
    num_heads: int = 4
    dropout: float = 0.0
    recent_events: int = 64  # fresh events read at request time (<= features.schema.ONLINE_LIST_EVENTS)
    # Fresh events count only once older than this many seconds (``models.architectures.transforms.fresh_cutoff``), in
    # training as in serving: the event path's visibility budget (its p99 is under 1 s).
    fresh_delay_s: int = 1
    time_buckets: int = 32
    ffn_mult: int = 2  # query-side FFN width: it runs once per candidate, so it sets the serving cost
    interaction_layers: int = 0  # self-attention layers over one candidate's 6 head tokens (cost per cand)
    head_hidden: int = 0  # hidden width of the click/conversion MLP; 0 = d_model
    pooling: str = "target"  # "target" (target-aware MHA) | "mean" | "din" (ablations)
    use_user_tokens: bool = True  # False = the online-only ablation
    num_user_tokens: int = 4  # how the flat cached embedding splits into tokens
    # Where the cached user tokens come from: "" = the training set's ``user_embedding`` column; a user-model
    # run directory = embed every example's history (as of its cut) with that model.
    user_model: str = ""
    attention_backend: str = "auto"


@dataclass
class SASRecConfig:
    """The SASRec baseline (``models.sequential.sasrec``), the paper's shape for sparse Amazon logs."""

    d_model: int = 50  # the paper's and the reference code's width
    num_blocks: int = 2
    num_heads: int = 1  # the paper's single head
    dropout: float = 0.5  # the paper's rate for the sparse Amazon sets (0.2 for MovieLens-1M)
    max_len: int = 50


NEXT_ITEM_LOSSES = ("auto", "full", "sampled", "bce")


@dataclass
class NextItemConfig:
    """The next-item task (positive-only logs, leave-one-out): its loss and how it is judged."""

    loss: str = (
        "auto"  # "full" | "sampled" | "bce" | "auto" = full while the catalog <= full_softmax_max_items
    )
    full_softmax_max_items: int = 100_000
    # "full": the dtype of its training GEMMs. "bf16" keeps the softmax and the gradient sums in fp32 and runs
    # the GEMMs 3-5x faster where the CPU has bf16 matmul units (AMX, AVX-512 BF16); "auto" = bf16 where this
    # machine multiplies bf16 at least as fast as fp32 (measured once per run), else fp32. fp32 by default: the
    # tables of docs/model-results-sequential.md were measured in it, and bf16 is not neutral everywhere (Toys
    # d 256: the same figures to ~0.001; Sports d 256: SASRec-CE's dot-product logits learned slower).
    loss_precision: str = "fp32"
    num_negatives: int = 1024  # "sampled": uniform negatives
    # "sampled": one set of negatives shared by the batch (cheap: one matmul); false draws num_negatives per
    # position, as the published SASRec + sampled softmax figures do (blondered/transformer_benchmark)
    shared_negatives: bool = True
    eval_negatives: int = 99  # leave-one-out: sampled items per user (never touched by that user)
    eval_seed: int = 0  # the sampled lists are fixed by this seed: every model ranks the same lists
    # early stopping and the exported state: this valid metric, of the sampled lists, or "full_<metric>" of the
    # full ranking with the history masked (the published full-ranking figures select that way; it ranks the
    # catalog at every epoch)
    select_metric: str = "ndcg@10"
    # a second valid metric (the same names) whose best state the run keeps too, ``model-also.pt``, judged on
    # valid and test at the end (``also_*`` in metrics.json); early stopping reads select_metric only. With
    # select_metric full_ndcg@10 and this ndcg@10, each protocol's figures can come from the state its own
    # valid metric chose, as each published protocol selects (S3-Rec on sampled lists, the full-ranking papers
    # on full ranking). "": none
    also_select_metric: str = ""
    # every Nth epoch's validation also ranks the whole catalog (the learning curve's full-ranking line); the
    # others rank the sampled lists alone, which is all early stopping reads. 0: never during training. The
    # best state's final valid and test judgement always ranks both ways.
    full_ranking_every: int = 1


@dataclass
class OptimConfig:
    epochs: int = 5
    batch_size: int = 256
    eval_batch_size: int = 1024
    # Dense parameters, AdamW. The scaling lab's width rule (docs/scaling.md): 2e-3 x 32 / d_model, i.e. 1e-3
    # at the default d_model 64 (halving or doubling it trained worse); scale it with the width you choose.
    lr: float = 1e-3
    weight_decay: float = 1e-4
    adam_beta2: float = 0.999  # SASRec's reference code trains with 0.98
    sparse_lr: float = 0.02  # embedding rows, fused row-wise Adagrad applied in backward
    grad_clip: float = 1.0
    patience: int = 2  # evaluations without improvement of the selection metric before the run stops
    conversion_weight: float = 1.0  # weight of the conversion loss next to the click loss
    seed: int = 0
    max_train_examples: int = 0  # 0 = all; >0 = a deterministic subsample (quick runs)
    log_every: int = 10  # steps between per-step loss logs
    # Dense-lr schedule (default off = constant lr): linear warm-up over the first warmup_steps optimizer
    # steps, then lr_decay "cosine" | "linear" down to min_lr_ratio x lr at the last planned step.
    warmup_steps: int = 0
    lr_decay: str = "none"  # "none" | "cosine" | "linear"
    min_lr_ratio: float = 0.0


@dataclass
class TrackingConfig:
    enabled: bool = True
    # "" = $MLFLOW_TRACKING_URI, else sqlite:///<ws.mlflow>/mlflow.db with artifacts under <ws.mlflow>/artifacts
    tracking_uri: str = ""
    experiment: str = "gemflow"
    run_name: str = ""


@dataclass
class TrainRunConfig:
    model: str = "user"  # "user" | "ranker" | "sasrec" (the next-item baseline)
    training_set: str = "default"  # ws.training(<name>) or a path to a training-set folder
    output_dir: str = ""  # "" = <workspace>/models/<model>/<run name>
    split_mode: str = "time"  # "time" (the set's split column) | "leave_one_out" (positive-only logs)
    # False = a new run (a new folder when the default one is taken); True = continue the run folder's
    # checkpoint, refused when its config.yaml differs in a key that shapes the model or data (models.training.run_folder)
    resume: bool = False
    user_model: UserModelConfig = field(default_factory=UserModelConfig)
    ranker: RankerConfig = field(default_factory=RankerConfig)
    sasrec: SASRecConfig = field(default_factory=SASRecConfig)
    next_item: NextItemConfig = field(default_factory=NextItemConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # gemflow train --nproc N


def resolve_user_model(um: UserModelConfig, leave_one_out: bool) -> UserModelConfig:
    """``um`` with every "auto" decided for a training set that is (or is not) split leave-one-out."""
    objective = um.objective if um.objective != "auto" else ("next_item" if leave_one_out else "click")
    next_item = objective == "next_item"

    def pick(value: str, if_next: str, if_click: str) -> str:
        return value if value != "auto" else (if_next if next_item else if_click)

    return replace(
        um,
        objective=objective,
        item_attributes=pick(um.item_attributes, "all", "none"),
        embedding_init=pick(um.embedding_init, "normal", "blocks"),
    )


def validate(cfg: TrainRunConfig) -> None:
    """Reject combinations that would train something meaningless, with a message naming the key."""
    if cfg.model not in ("user", "ranker", "sasrec"):
        raise ValueError(f"model must be 'user', 'ranker' or 'sasrec', got {cfg.model!r}")
    if cfg.next_item.loss not in NEXT_ITEM_LOSSES:
        raise ValueError(f"next_item.loss must be one of {NEXT_ITEM_LOSSES}, got {cfg.next_item.loss!r}")
    nic = cfg.next_item
    chosen = {"select_metric": nic.select_metric}
    if nic.also_select_metric:
        chosen["also_select_metric"] = nic.also_select_metric
    for key, metric in chosen.items():
        if metric.removeprefix("full_") not in ("mrr", "hr@1", "hr@5", "hr@10", "ndcg@5", "ndcg@10"):
            raise ValueError(
                f"next_item.{key} must be mrr, hr@K (1, 5, 10) or ndcg@K (5, 10), of the sampled lists or "
                f"prefixed full_ (full ranking, history masked), got {metric!r}"
            )
    if nic.also_select_metric == nic.select_metric:
        raise ValueError("next_item.also_select_metric must differ from select_metric (or be empty)")
    if nic.full_ranking_every < 0:
        raise ValueError(
            f"next_item.full_ranking_every must be >= 0 (0: never during training), got {cfg.next_item.full_ranking_every}"
        )
    if cfg.split_mode not in ("time", "leave_one_out"):
        raise ValueError(f"split_mode must be 'time' or 'leave_one_out', got {cfg.split_mode!r}")
    um, rk = cfg.user_model, cfg.ranker
    if um.pooling not in ("transformer", "mean"):
        raise ValueError(f"user_model.pooling must be 'transformer' or 'mean', got {um.pooling!r}")
    if um.next_event_weight > 0 and not um.causal and um.pooling == "transformer":
        raise ValueError(
            "user_model.next_event_weight > 0 needs user_model.causal=true (else the target leaks)"
        )
    if um.objective not in ("auto", "click", "next_item"):
        raise ValueError(f"user_model.objective must be 'auto', 'click' or 'next_item', got {um.objective!r}")
    for key in ("item_attributes", "embedding_init"):
        allowed = ("auto", "all", "none") if key == "item_attributes" else ("auto", "blocks", "normal")
        if getattr(um, key) not in allowed:
            raise ValueError(f"user_model.{key} must be one of {allowed}, got {getattr(um, key)!r}")
    if um.snapshot not in ("example", "day"):
        raise ValueError(f"user_model.snapshot must be 'example' or 'day', got {um.snapshot!r}")
    if rk.pooling not in ("target", "mean", "din"):
        raise ValueError(f"ranker.pooling must be 'target', 'mean' or 'din', got {rk.pooling!r}")
    for name, m in (("user_model", um), ("ranker", rk)):
        if m.d_model % m.num_heads:
            raise ValueError(
                f"{name}.d_model={m.d_model} must be divisible by {name}.num_heads={m.num_heads}"
            )
    if cfg.optim.epochs < 1 or cfg.optim.batch_size < 1:
        raise ValueError("optim.epochs and optim.batch_size must be >= 1")
    if cfg.optim.patience < 1:
        raise ValueError(
            f"optim.patience must be >= 1 (evaluations without improvement), got {cfg.optim.patience}"
        )
    if cfg.optim.lr_decay not in ("none", "cosine", "linear"):
        raise ValueError(f"optim.lr_decay must be 'none', 'cosine' or 'linear', got {cfg.optim.lr_decay!r}")
    if cfg.optim.warmup_steps < 0 or not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ValueError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1]")
