"""FP8 (torchao float8 training) goes to the attention / FFN Linears of the chosen groups, nowhere else."""

from __future__ import annotations

import copy

import torch
from torch import nn

from gemflow.workspace import Workspace
from models.training.distributed.config import Float8Config, MoEConfig
from models.training.distributed.fp8 import (
    ScaledMMLinear,
    convert_to_float8,
    convert_to_scaled_mm,
    float8_filter,
    group_of,
)
from models.training.distributed.model import DenseTower, ShardableSparse, sparse_ids
from models.training.distributed.moe import swap_in_moe
from models.training.prepare import prepare
from models.training.train import loss_fn
from tests.models.distributed.conftest import small_config


def test_groups_by_module_path():
    assert group_of("model.blocks.0.attn.qkv") == "attention"
    assert group_of("model.target.attn.kv") == "attention"
    assert group_of("model.summary.out") == "attention"
    assert group_of("model.blocks.1.ffn.net.2") == "ffn"
    assert group_of("model.blocks.1.ffn.moe.deepspeed_moe.experts.deepspeed_experts.3.net.0") == "ffn"
    for kept_high_precision in (
        "model.blocks.1.ffn.moe.deepspeed_moe.gate.wg",
        "model.head.1",
        "model.cand_proj",
        "model.next_proj",
    ):
        assert group_of(kept_high_precision) is None, kept_high_precision


def test_shape_guard_skips_dims_not_multiple_of_16_or_too_small():
    keep = float8_filter(Float8Config(recipe="tensorwise", min_features=64))
    assert keep(nn.Linear(64, 256), "blocks.0.ffn.net.0")
    assert not keep(nn.Linear(64, 250), "blocks.0.ffn.net.0")  # 250 is no multiple of 16
    assert not keep(nn.Linear(32, 128), "blocks.0.ffn.net.0")  # too small to gain
    assert not keep(nn.LayerNorm(64), "blocks.0.ffn.net.0")


def _tower(training_set, tmp_path, ffn=None):
    cfg = small_config(training_set)
    setup = prepare(cfg, Workspace(tmp_path / "ws"))
    model = setup.bundle.model
    sparse = ShardableSparse(model.sparse, cfg.user_model.d_model)
    if ffn:
        swap_in_moe(model.blocks, ffn, MoEConfig(num_experts=4), rank=0, seed=0)
    return cfg, setup, sparse, DenseTower(model)


def test_per_group_conversion_of_a_real_tower(training_set, tmp_path):
    _, _, _, tower = _tower(training_set, tmp_path, ffn=["dense", "moe"])
    converted = convert_to_float8(tower, Float8Config(recipe="rowwise", groups=["ffn"]))
    assert converted and all(group_of(n) == "ffn" for n in converted)
    assert any("deepspeed_experts" in n for n in converted) and any("blocks.0.ffn" in n for n in converted)
    types = {n: type(m).__name__ for n, m in tower.named_modules()}
    assert types["model.blocks.0.attn.qkv"] == "Linear"  # attention group not chosen
    assert types["model.blocks.1.ffn.moe.deepspeed_moe.gate.wg"] == "Linear"
    assert types["model.head.1"] == "Linear"
    assert all(types[n] == "Float8Linear" for n in converted)
    assert convert_to_float8(tower, Float8Config(recipe="none")) == []


def test_fp8_tower_trains_close_to_bf16(training_set, tmp_path):
    """Forward + backward run with float8 Linears; logits stay close to the bf16 tower's."""
    results = {}
    for recipe in ("none", "tensorwise"):
        cfg, setup, sparse, tower = _tower(training_set, tmp_path / recipe)
        converted = convert_to_float8(tower, Float8Config(recipe=recipe))
        tower.to(torch.bfloat16).train()
        batch = setup.builder(setup.train_rows[:32])
        torch.manual_seed(0)
        ids, negatives = sparse_ids(tower.model, batch)
        emb = {k: v.to(torch.bfloat16) for k, v in sparse(ids, batch.history.batch_size).items()}
        batch.candidates.dense = batch.candidates.dense.to(torch.bfloat16)
        logits, aux = tower(emb, batch, negatives)
        loss_fn(logits.float(), batch.labels, aux.float(), cfg).backward()
        grad = tower.model.blocks[0].attn.qkv.weight.grad
        assert grad is not None and torch.isfinite(grad).all()
        results[recipe] = (logits.float().detach(), len(converted))
    assert results["none"][1] == 0 and results["tensorwise"][1] >= 8
    base, fp8 = results["none"][0], results["tensorwise"][0]
    rel = (fp8 - base).norm() / base.norm()
    assert rel < 0.1, f"float8 logits differ from bf16 by {rel:.3f} (relative)"


def test_scaled_mm_linear_trains_like_a_linear_without_torchao():
    """The torchao-free float8 Linear (torch._scaled_mm): forward and both gradients close to bf16, any row
    count (jagged token totals), the same Parameters and state_dict keys after the swap."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(torch.bfloat16)
    fp8 = copy.deepcopy(ref)
    keep = float8_filter(Float8Config(recipe="tensorwise", min_features=16))
    assert convert_to_scaled_mm(fp8, lambda m, name: keep(m, f"blocks.0.ffn.net.{name}")) == ["0", "2"]
    assert all(isinstance(fp8[i], ScaledMMLinear) for i in (0, 2))
    assert list(fp8.state_dict()) == list(ref.state_dict())
    x = torch.randn(37, 64, dtype=torch.bfloat16)  # 37 rows: not a multiple of the 16-row tile
    outs = {}
    for name, model in (("bf16", ref), ("fp8", fp8)):
        x_in = x.clone().requires_grad_()
        y = model(x_in)
        y.float().square().mean().backward()
        outs[name] = (
            y.detach().float(),
            x_in.grad.float(),
            model[0].weight.grad.float(),
            model[2].bias.grad.float(),
        )

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    for got, want in zip(outs["fp8"], outs["bf16"], strict=True):
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert rel(got, want) < 0.1
