"""The DeepSpeed config of one run, generated from ``TrainRunConfig`` (never written by hand).

One engine call per optimizer step: a "micro batch" is one token-budget batch (see ``batching``), so the
micro-batch size is 1 and DeepSpeed's batch-size arithmetic stays trivially consistent.
``torch_adam`` keeps DeepSpeed from JIT-building its fused CPU Adam (a minute on first use); PyTorch's own
``fused`` AdamW updates each flat ZeRO partition in one pass instead of ~10 (CPU, one thread: 0.42 vs 5.7 ms per
million parameters, ``bench/train.py``'s optimizer share in docs/training-speed.md).

Gradient reduction (ZeRO 1/2): contiguous gradient buffers and buckets of ``reduce_bucket_mb`` (a few large
messages rather than one per parameter: a gloo or NCCL call has a fixed cost); ``overlap_comm`` runs the
reduction on a side CUDA stream during backward, so it is on for GPUs only (a CPU has no streams: DeepSpeed
would reduce in the same thread anyway, plus bookkeeping).
"""

from __future__ import annotations

from typing import Any

import torch

from models.config import TrainRunConfig


def deepspeed_config(cfg: TrainRunConfig, world_size: int) -> dict[str, Any]:
    dc, oc = cfg.distributed, cfg.optim
    bucket = dc.reduce_bucket_mb * 2**20 // 4  # elements (fp32)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": oc.grad_clip if oc.grad_clip > 0 else 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": oc.lr,
                "betas": [0.9, oc.adam_beta2],
                "weight_decay": oc.weight_decay,
                "torch_adam": True,
                "fused": True,
            },
        },
        "zero_optimization": {
            "stage": int(dc.zero_stage),  # resolved by the trainer (models.training.distributed.zero)
            "contiguous_gradients": True,
            "overlap_comm": torch.cuda.is_available(),
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "bf16": {"enabled": dc.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves (rank 0, MLflow)
        "wall_clock_breakdown": False,
    }
