"""The distributed-training section of a run config (``TrainRunConfig.distributed``), YAML + ``--set``.

Plain dataclasses with no heavy imports: ``models.config`` embeds them, and the launcher reads them before any
process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FP8_RECIPES = ("none", "tensorwise", "rowwise")
FP8_GROUPS = ("attention", "ffn")
FP8_CPU_GEMMS = ("auto", "scaled_mm", "emulated")  # models.training.distributed.fp8_gemm.CPU_GEMMS
SHARDINGS = ("table_wise", "row_wise")
SPARSE_COMMS = ("auto", "fp32", "bf16")
LAUNCHERS = ("torchrun", "deepspeed")
COMPILE_MODES = ("off", "on", "auto")  # models.inference.compile
PRECISIONS = ("auto", "bf16", "fp32")  # models.training.distributed.precision
ZERO_STAGES = ("auto", "0", "1", "2")  # models.training.distributed.zero


@dataclass
class MoEConfig:
    """Mixture-of-experts FFN blocks; which blocks use them is ``user_model.ffn`` (one entry per layer)."""

    num_experts: int = 4
    ep_size: int = 1  # ranks the experts are split across (divides nproc and num_experts)
    top_k: int = 1  # experts per token (1 or 2)
    capacity_factor: float = 1.25  # slots per expert = factor * tokens / experts while training
    eval_capacity_factor: float = 2.0  # used only with eval_drop_tokens
    # false: evaluation routes every token to its experts (no capacity limit, top-2 without sampling), exactly
    # what the exported plain-PyTorch model (models.architectures.layers.MixtureOfExperts) computes
    eval_drop_tokens: bool = False
    min_capacity: int = 4
    aux_loss_weight: float = 0.01  # load-balancing loss added to the training loss


@dataclass
class Float8Config:
    """torchao float8 training of the dense tower's big Linears (embeddings, norms, gates, heads stay bf16)."""

    recipe: str = "none"  # "none" | "tensorwise" | "rowwise"
    groups: list[str] = field(default_factory=lambda: list(FP8_GROUPS))  # "attention", "ffn"
    min_features: int = 64  # smaller Linears gain nothing from float8 (and scaling costs more than it saves)
    # the float8 GEMM on CPU: "auto" = the faster of torch._scaled_mm and its bf16 emulation, measured once per
    # run (_scaled_mm is ~13,000x slower than bf16 on some Intel CPUs); "scaled_mm" | "emulated" force one
    cpu_gemm: str = "auto"


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # 0 = only at the end
    keep: int = 2  # committed checkpoints kept on disk (the newest ones)


@dataclass
class DistributedConfig:
    nproc: int = 1  # processes (ranks) on this machine
    threads_per_rank: int = 0  # 0 = the machine's cores / nproc (ranks share the cores, never oversubscribe)
    launcher: str = "torchrun"  # "torchrun" | "deepspeed" (the DeepSpeed CLI)
    backend: str = "auto"  # "auto" = nccl on CUDA, gloo on CPU
    # DeepSpeed ZeRO stage of the dense tower: "0", "1" or "2"; "auto" = 0 (plain data parallel) while its optimizer
    # state fits every rank easily (< 1 GiB), else 2 (models.training.distributed.zero)
    zero_stage: str = "auto"
    # the dense tower's ("bf16" | "fp32"; embeddings stay fp32); "auto" = bf16 where this machine multiplies bf16
    # at least as fast as fp32, else fp32 (measured at launch: models.training.distributed.precision)
    precision: str = "auto"
    sharding: str = "table_wise"  # embedding sharding across ranks: "table_wise" | "row_wise"
    # precision of the sharded embeddings' all-to-all (lookups forward, their gradients backward), the largest
    # exchange of a step: "auto" = bf16 on GPUs when the tower is bf16 (the lookups are cast to bf16 anyway:
    # half the bytes, nothing lost), fp32 on CPU (measured: converting costs more CPU than the loopback copy
    # of the extra bytes); "fp32" | "bf16" force one
    sparse_comm: str = "auto"
    # tables of at most this many rows (ids + the OOV row) are replicated on every rank instead of sharded: their
    # lookups stay local, one all-reduce of their gradients per step (see models.training.distributed.sparse); 0 = shard all
    replicate_max_rows: int = 1024
    reduce_bucket_mb: int = 64  # ZeRO-1/2 gradient reduce-scatter / all-gather buckets, MB of elements x 4
    tokens_per_step: int = 4096  # global token budget of one optimizer step (sum of history lengths + 1 each)
    max_steps: int = 0  # 0 = optim.epochs passes over the train split
    eval_every: int = 0  # steps between validation passes; 0 = at the end of every epoch
    peak_tflops: float = 0.0  # machine matmul peak for MFU; 0 = the launcher measures it (bf16 or fp32)
    master_port: int = 0  # 0 = a free port
    # torch.compile of the dense tower's per-token work (norm + projections, FFN, residuals, head; attention stays
    # eager): "off"; "on" (errors surface); "auto" (a probe compiles a tiny block first; if inductor cannot build,
    # one logged line and eager). Off by default: see models/inference/compile.py for what it measured on CPU.
    compile: str = "off"
    # profile 4 steps and write where each rank's step goes (GEMM, attention, embedding, optimizer,
    # communication, other: models.training.distributed.step_account) to perf.json; those steps leave the throughput figures
    step_account: bool = False
    # the first of them: later steps are past the warm-up (on an AMX Xeon, steps 4-7 still met new GEMM shapes
    # whose kernels oneDNN compiled, and a heap still growing: page faults); needs max_steps >= it + 4
    step_account_from: int = 4
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: Float8Config = field(default_factory=Float8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        # YAML reads a bare on/off as a boolean (and the str field then holds "True"/"False"): take it as meant
        self.compile = {"true": "on", "false": "off"}.get(str(self.compile).lower(), self.compile)
        self.zero_stage = str(self.zero_stage)  # YAML and Python callers write the stage as a number


def validate_distributed(cfg: DistributedConfig, ffn: list[str], num_layers: int) -> None:
    """Reject settings that cannot run, naming the key."""
    if cfg.nproc < 1:
        raise ValueError(f"distributed.nproc must be >= 1, got {cfg.nproc}")
    if cfg.threads_per_rank < 0:
        raise ValueError(f"distributed.threads_per_rank must be >= 0, got {cfg.threads_per_rank}")
    if cfg.launcher not in LAUNCHERS:
        raise ValueError(f"distributed.launcher must be one of {LAUNCHERS}, got {cfg.launcher!r}")
    if cfg.backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"distributed.backend must be 'auto', 'gloo' or 'nccl', got {cfg.backend!r}")
    if str(cfg.zero_stage) not in ZERO_STAGES:
        raise ValueError(f"distributed.zero_stage must be auto, 0, 1 or 2, got {cfg.zero_stage!r}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"distributed.precision must be one of {PRECISIONS}, got {cfg.precision!r}")
    if cfg.compile not in COMPILE_MODES:
        raise ValueError(f"distributed.compile must be one of {COMPILE_MODES}, got {cfg.compile!r}")
    if cfg.sparse_comm not in SPARSE_COMMS:
        raise ValueError(f"distributed.sparse_comm must be one of {SPARSE_COMMS}, got {cfg.sparse_comm!r}")
    if cfg.sharding not in SHARDINGS:
        raise ValueError(f"distributed.sharding must be one of {SHARDINGS}, got {cfg.sharding!r}")
    if cfg.step_account_from < 0:
        raise ValueError(f"distributed.step_account_from must be >= 0, got {cfg.step_account_from}")
    if cfg.step_account and 0 < cfg.max_steps < cfg.step_account_from + 4:
        raise ValueError(f"distributed.step_account profiles steps {cfg.step_account_from}-{cfg.step_account_from + 3}: "
                         f"distributed.max_steps={cfg.max_steps} ends before (lower step_account_from)")  # fmt: skip
    if cfg.tokens_per_step < cfg.nproc:
        raise ValueError(f"distributed.tokens_per_step={cfg.tokens_per_step} is below nproc={cfg.nproc}")
    if cfg.fp8.recipe not in FP8_RECIPES:
        raise ValueError(f"distributed.fp8.recipe must be one of {FP8_RECIPES}, got {cfg.fp8.recipe!r}")
    if cfg.fp8.cpu_gemm not in FP8_CPU_GEMMS:
        raise ValueError(f"distributed.fp8.cpu_gemm must be one of {FP8_CPU_GEMMS}, got {cfg.fp8.cpu_gemm!r}")
    unknown = sorted(set(cfg.fp8.groups) - set(FP8_GROUPS))
    if unknown:
        raise ValueError(f"distributed.fp8.groups: unknown group(s) {unknown}; known: {list(FP8_GROUPS)}")
    if ffn and len(ffn) != num_layers:
        raise ValueError(f"user_model.ffn has {len(ffn)} entries for {num_layers} layers (one per layer)")
    bad = sorted({f for f in ffn if f not in ("dense", "moe")})
    if bad:
        raise ValueError(f"user_model.ffn entries must be 'dense' or 'moe', got {bad}")
    moe = cfg.moe
    if "moe" in ffn:
        if moe.top_k not in (1, 2):
            raise ValueError(f"distributed.moe.top_k must be 1 or 2, got {moe.top_k}")
        if moe.num_experts < moe.top_k or moe.num_experts % moe.ep_size:
            raise ValueError(
                f"distributed.moe.num_experts={moe.num_experts} must be >= top_k and divisible by "
                f"ep_size={moe.ep_size}"
            )
        if moe.ep_size < 1 or cfg.nproc % moe.ep_size:
            raise ValueError(f"distributed.moe.ep_size={moe.ep_size} must divide nproc={cfg.nproc}")
    if cfg.replicate_max_rows < 0:
        raise ValueError(f"distributed.replicate_max_rows must be >= 0, got {cfg.replicate_max_rows}")
    if cfg.reduce_bucket_mb < 1:
        raise ValueError(f"distributed.reduce_bucket_mb must be >= 1, got {cfg.reduce_bucket_mb}")
    if cfg.checkpoint.every_steps < 0 or cfg.checkpoint.keep < 1:
        raise ValueError("distributed.checkpoint.every_steps must be >= 0 and checkpoint.keep >= 1")
