"""Expert-parallel mixture-of-experts FFN blocks (``deepspeed.moe.layer.MoE``), swapped in per layer.

``MoEFeedForward`` has the dense FFN's (total, d) -> (total, d) signature, so a ``TransformerBlock`` takes it
unchanged (``swap_in_moe`` replaces ``block.ffn`` where ``user_model.ffn[i] == "moe"``). Each expert is the
dense ``FeedForward``; with ``ep_size`` > 1 every rank holds ``num_experts / ep_size`` of them and tokens travel
to their expert with an all-to-all.

Jagged inputs: each rank's token count differs (histories differ in length), but DeepSpeed sizes the
all-to-all buffers from the local count, and a size mismatch fails the exchange. So the layer first agrees on
the largest count in its expert-parallel group (one all-reduce of a scalar), pads with zero tokens marked unused
(``used_token``: the top-1 gate routes them nowhere) and drops the padding from the output.

The load-balancing loss of the latest forward is kept on the module (``aux_loss``); ``moe_aux_loss`` sums it
over a model for the training loss, ``expert_counts`` reports tokens per expert for logging.

Evaluation (``eval()``) routes every token to its top-k experts, without a capacity limit and without the
random second-expert sampling of top-2 (unless ``moe.eval_drop_tokens``): the function the exported model
computes. ``export_state_dict`` turns the engine's weights into that plain-PyTorch form
(``models.architectures.layers.MixtureOfExperts``), gathering each rank's experts.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from models.architectures.layers import FeedForward
from models.training.distributed.config import MoEConfig


class MoEFeedForward(nn.Module):
    def __init__(
        self, dim: int, mult: int, dropout: float, cfg: MoEConfig, *, ep_rank: int = 0, seed: int = 0
    ):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(
            hidden_size=dim,
            expert=FeedForward(dim, mult, dropout),
            num_experts=cfg.num_experts,
            ep_size=cfg.ep_size,
            k=cfg.top_k,
            capacity_factor=cfg.capacity_factor,
            eval_capacity_factor=cfg.eval_capacity_factor,
            min_capacity=cfg.min_capacity,
            drop_tokens=True,
        )
        # DeepSpeed deep-copies one expert into every local slot: give each global expert its own init, the
        # same whichever rank holds it.
        local = self.moe.deepspeed_moe.experts.deepspeed_experts
        for j, expert in enumerate(local):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 100_003 + ep_rank * len(local) + j)
                for m in expert.modules():
                    if isinstance(m, nn.Linear):
                        m.reset_parameters()
        self.eval_drop_tokens = cfg.eval_drop_tokens
        self.aux_loss: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None

    def _ep_group(self):
        dm = self.moe.deepspeed_moe
        return dm.ep_group if self.moe.ep_size > 1 and dist.is_initialized() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.shape[0]
        padded = max(total, self.moe.deepspeed_moe.gate.min_capacity)
        group = self._ep_group()
        if group is not None:
            n = torch.tensor([padded], dtype=torch.int64)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
            padded = int(n.item())
        gate = self.moe.deepspeed_moe.gate
        gate.drop_tokens = self.training or self.eval_drop_tokens  # no capacity drop at evaluation
        gate.top2_2nd_expert_sampling = self.training  # deterministic top-2 at evaluation
        used = None
        if padded > total:
            x = torch.cat([x, x.new_zeros(padded - total, x.shape[1])])
            used = torch.zeros(padded, dtype=torch.int64, device=x.device)
            used[:total] = 1
        out, aux, counts = self.moe(x, used_token=used)
        self.aux_loss, self.expert_counts = aux, counts
        return out[:total]


def swap_in_moe(blocks: nn.ModuleList, kinds: list[str], cfg: MoEConfig, *, rank: int, seed: int) -> int:
    """Replace ``blocks[i].ffn`` by an MoE block where ``kinds[i] == "moe"``; returns how many were swapped."""
    swapped = 0
    for i, (block, kind) in enumerate(zip(blocks, kinds, strict=True)):
        if kind != "moe":
            continue
        first = block.ffn.net[0]
        dim, hidden = first.in_features, first.out_features
        dropout = block.ffn.net[3].p
        block.ffn = MoEFeedForward(
            dim, hidden // dim, dropout, cfg, ep_rank=rank % cfg.ep_size, seed=seed + i
        )
        swapped += 1
    return swapped


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the load-balancing losses of the latest forward (None without MoE blocks)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack([loss.float() for loss in losses]).sum() if losses else None


# DeepSpeed's module paths -> the plain MixtureOfExperts' (``models.architectures.layers``)
_DS_GATE = ".ffn.moe.deepspeed_moe.gate.wg."
_DS_EXPERT = re.compile(r"\.ffn\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.")


def export_state_dict(model: nn.Module, state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """``state`` (the engine's dense state dict, fp32 on CPU, keys as in ``model``) with every MoE block in the
    plain ``MixtureOfExperts`` layout and every expert present: ``blocks.i.ffn.gate.weight``,
    ``blocks.i.ffn.experts.<global expert>.net...``. A rank holds only its ``num_experts / ep_size`` experts
    (local index j is global expert ``ep_rank * local + j``), so every rank sends its own and rank 0 gets the
    whole set (other ranks get {}). Collective when distributed: every rank calls it.
    """
    layers = moe_layers(model)
    group = layers[0]._ep_group() if layers else None
    ep_rank = dist.get_rank(group=group) if group is not None else 0
    local = layers[0].moe.num_local_experts if layers else 0  # the same in every block (one MoEConfig)
    plain, mine = {}, {}
    for key, value in state.items():
        expert = _DS_EXPERT.search(key)
        if expert:
            global_id = ep_rank * local + int(expert.group(1))
            mine[_DS_EXPERT.sub(f".ffn.experts.{global_id}.", key)] = value
        else:
            plain[key.replace(_DS_GATE, ".ffn.gate.")] = value
    if not (dist.is_available() and dist.is_initialized()):
        return {**plain, **mine}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # data-parallel replicas of an expert send equal copies
    if rank != 0:
        return {}
    for part in everyone:
        plain.update(part)
    return plain
