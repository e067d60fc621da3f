"""FP8 training of the dense tower with torchao (``convert_to_float8_training``).

Which Linears: the groups named in ``distributed.fp8.groups`` — ``attention`` (the projections of the history
blocks' self-attention, the summary and target cross-attention) and ``ffn`` (the dense FFNs and every MoE
expert). Never converted: embeddings (torchrec, not Linears), norms, the MoE gate (routing must stay exact),
the candidate projection and the heads (small, and their precision shows directly in the logits).
Guard: a Linear whose in/out features are not multiples of 16 (the float8 GEMM tiles) or are below
``min_features`` (scaling overhead exceeds the gain) stays in bf16.

The swap keeps the Parameter objects, so DeepSpeed's MoE parameter grouping, done after it, still sees them.
Every float8 GEMM goes through ``fp8_gemm``: on CPU the faster of ``torch._scaled_mm`` and its emulation.
"""

from __future__ import annotations

import torch
from torch import nn

from models.training.distributed.config import Float8Config
from models.training.distributed.fp8_gemm import route_torchao_gemm, scaled_mm

# Module-path fragments of each group (paths inside the dense tower, i.e. the UserModel minus its embeddings)
GROUP_PATTERNS = {
    "attention": (".attn.qkv", ".attn.out", ".attn.q", ".attn.kv", "summary.q", "summary.kv", "summary.out"),
    "ffn": (".ffn.net.", "deepspeed_experts."),
}
NEVER = ("gate.wg", "head.", "cand_proj", "next_proj")


def group_of(fqn: str) -> str | None:
    """The fp8 group a Linear belongs to by its module path, or None (stays in higher precision)."""
    path = f".{fqn}"
    if any(n in path for n in NEVER):
        return None
    for group, patterns in GROUP_PATTERNS.items():
        if any(p in path for p in patterns):
            return group
    return None


def shape_ok(linear: nn.Linear, min_features: int) -> bool:
    dims = (linear.in_features, linear.out_features)
    return all(d % 16 == 0 and d >= min_features for d in dims)


def float8_filter(cfg: Float8Config):
    """The ``module_filter_fn`` for torchao: (module, fqn) -> convert?"""

    def keep(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and group_of(fqn) in cfg.groups
            and shape_ok(module, cfg.min_features)
        )

    return keep


def convert_to_float8(module: nn.Module, cfg: Float8Config) -> list[str]:
    """Swap the selected Linears for torchao Float8Linear in place; returns the converted module paths."""
    if cfg.recipe == "none":
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = float8_filter(cfg)
    chosen = [name for name, m in module.named_modules() if keep(m, name)]
    if chosen:
        route_torchao_gemm()
        convert_to_float8_training(
            module, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(cfg.recipe)
        )
    return chosen


# ------------------------------------------------------------------------ torchao-free float8 (torch._scaled_mm)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-wise dynamic scaling: (x / scale) in ``dtype`` and the fp32 scale that undoes it."""
    scale = (x.detach().abs().amax().float() / torch.finfo(dtype).max).clamp(min=1e-12)
    return (x / scale).clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype), scale


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


class _ScaledMMLinear(torch.autograd.Function):
    """y = x W^T + b with float8 GEMMs: e4m3 inputs and weights forward, e5m2 gradients backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x8, sx = _to_float8(x, E4M3)
        w8, sw = _to_float8(weight, E4M3)
        y = scaled_mm(x8, w8.t(), sx, sw, x.dtype)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        return y + bias.to(y.dtype) if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = _to_float8(grad, E5M2)
        grad_x = scaled_mm(g8, _col_major(w8), sg, sw, grad.dtype)
        grad_w = scaled_mm(g8.t().contiguous(), _col_major(x8), sg, sx, grad.dtype)
        grad_b = grad.sum(0).to(ctx.weight_dtype) if ctx.has_bias else None
        return grad_x, grad_w.to(ctx.weight_dtype), grad_b


class ScaledMMLinear(nn.Linear):
    """A Linear trained with float8 GEMMs through ``fp8_gemm.scaled_mm`` alone (torchao's tensorwise recipe,
    without torchao): for machines that have a float8-capable torch but not torchao (the stock GPU image
    ``bench/gpu_train.sh`` meets). Rows are zero-padded to a multiple of 16 (the float8 GEMM tile), so jagged
    token counts work; in/out features must be multiples of 16 (``shape_ok``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, rows = x.shape, x.reshape(-1, x.shape[-1])
        pad = -rows.shape[0] % 16
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        y = _ScaledMMLinear.apply(rows, self.weight, self.bias)
        return y[: y.shape[0] - pad].reshape(*shape[:-1], self.out_features)


def convert_to_scaled_mm(module: nn.Module, keep) -> list[str]:
    """Swap every Linear ``keep(linear, fqn)`` accepts for a ``ScaledMMLinear`` sharing its Parameters."""
    chosen = [name for name, m in module.named_modules() if type(m) is nn.Linear and keep(m, name)]
    for name in chosen:
        linear = module.get_submodule(name)
        linear.__class__ = ScaledMMLinear  # same Parameters, same state_dict keys
    return chosen
