"""FP8 training of the dense tower with torchao (``convert_to_float8_training``).

Which Linears: the groups named in ``distributed.fp8.groups`` — ``attention`` (the projections of the history
blocks' self-attention, the summary and target cross-attention) and ``ffn`` (the dense FFNs and every MoE
expert). Never converted: embeddings (torchrec, not Linears), norms, the MoE gate (routing must stay exact),
the candidate projection and the heads (small, and their precision shows directly in the logits).
Guard: a Linear whose in/out features are not multiples of 16 (the float8 GEMM tiles) or are below
``min_features`` (scaling overhead exceeds the gain) stays in bf16.

The swap keeps the Parameter objects, so DeepSpeed's MoE parameter grouping, done after it, still sees them.
"""

from __future__ import annotations

from torch import nn

from models.distributed.config import Float8Config

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
        convert_to_float8_training(
            module, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(cfg.recipe)
        )
    return chosen
