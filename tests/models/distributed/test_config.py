"""The distributed config: validation names the key; the DeepSpeed config follows our dataclass config."""

from __future__ import annotations

import pytest

from gemflow.config import load_config
from models.config import TrainRunConfig
from models.training.distributed.config import DistributedConfig, validate_distributed
from models.training.distributed.ds_config import deepspeed_config


def test_deepspeed_config_from_run_config():
    cfg = load_config(
        TrainRunConfig,
        None,
        {
            "distributed.zero_stage": "1",
            "distributed.precision": "bf16",
            "optim.grad_clip": "0.5",
            "optim.lr": "3e-4",
            "distributed.reduce_bucket_mb": "16",
        },
    )
    ds = deepspeed_config(cfg, world_size=2)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 1 and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 16 * 2**20 // 4  # fp32 elements
    assert zero["overlap_comm"] is False  # CPU: no side stream to overlap on
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["type"] == "AdamW"
    assert ds["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.9, 0.999],  # optim.adam_beta2's default
        "weight_decay": cfg.optim.weight_decay,
        "torch_adam": True,
        "fused": True,  # PyTorch's one-pass AdamW on each flat ZeRO partition
    }
    assert (
        ds["train_batch_size"] == 2 * ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    )


def test_cli_style_overrides_reach_the_nested_sections():
    cfg = load_config(
        TrainRunConfig,
        None,
        [
            "user_model.ffn=dense,moe",
            "distributed.moe.ep_size=2",
            "distributed.fp8.groups=ffn",
            "distributed.nproc=2",
        ],
    )
    assert cfg.user_model.ffn == ["dense", "moe"]
    assert cfg.distributed.moe.ep_size == 2 and cfg.distributed.fp8.groups == ["ffn"]
    validate_distributed(cfg.distributed, cfg.user_model.ffn, cfg.user_model.num_layers)


@pytest.mark.parametrize(
    ("change", "ffn", "message"),
    [
        ({"zero_stage": 3}, [], "zero_stage must be auto, 0, 1 or 2, got 3"),
        ({"zero_stage": "3"}, [], "zero_stage must be auto, 0, 1 or 2, got '3'"),
        ({"precision": "fp16"}, [], "precision must be one of"),
        ({"sharding": "column_wise"}, [], "sharding must be one of"),
        ({"sparse_comm": "fp8"}, [], "sparse_comm must be one of"),
        ({"reduce_bucket_mb": 0}, [], "reduce_bucket_mb must be >= 1"),
        ({"launcher": "mpirun"}, [], "launcher must be one of"),
        ({}, ["dense"], "has 1 entries for 2 layers"),
        ({}, ["dense", "sparse"], "must be 'dense' or 'moe'"),
        ({"nproc": 3, "moe_ep": 2}, ["moe", "moe"], "ep_size=2 must divide nproc=3"),
        (
            {"moe_experts": 3, "moe_ep": 2, "nproc": 2},
            ["moe", "moe"],
            "num_experts=3 must be >= top_k and divisible",
        ),
        ({"fp8_recipe": "e4m3"}, [], "fp8.recipe must be one of"),
        ({"fp8_groups": ["heads"]}, [], "unknown group"),
        ({"fp8_cpu_gemm": "fast"}, [], "fp8.cpu_gemm must be one of"),
        ({"step_account_from": -1}, [], "step_account_from must be >= 0"),
        (
            {"step_account": True, "step_account_from": 8, "max_steps": 10},
            [],
            "profiles steps 8-11: distributed.max_steps=10 ends before",
        ),
    ],
)
def test_invalid_settings_name_the_key(change, ffn, message):
    dc = DistributedConfig()
    for key, value in change.items():
        if key == "moe_ep":
            dc.moe.ep_size = value
        elif key == "moe_experts":
            dc.moe.num_experts = value
        elif key == "fp8_recipe":
            dc.fp8.recipe = value
        elif key == "fp8_groups":
            dc.fp8.groups = value
        elif key == "fp8_cpu_gemm":
            dc.fp8.cpu_gemm = value
        else:
            setattr(dc, key, value)
    with pytest.raises(ValueError, match=message):
        validate_distributed(dc, ffn, num_layers=2)


def test_launch_rejects_a_missing_training_set_before_starting_ranks(tmp_path):
    from gemflow.workspace import Workspace
    from models.training.data import TrainingSetError
    from models.training.distributed.launch import launch

    cfg = load_config(TrainRunConfig, None, {"training_set": "nowhere", "distributed.nproc": "2"})
    with pytest.raises(TrainingSetError, match="nowhere is not a training set: sequences.parquet is missing"):
        launch(cfg, Workspace(tmp_path / "ws"))
