"""The dense tower's ZeRO stage: plain data parallel (ZeRO-0) while its optimizer state is small, ZeRO-2 above.

What ZeRO-2 buys is memory: each rank keeps 1/N of the optimizer state and of the reduced gradients (Adam's two
fp32 moments, the gradients, and in bf16 the fp32 master weights: ~16 bytes a parameter) instead of all of it.
What it costs is per step: a Python gradient hook per parameter, the reduce-scatter bookkeeping and the gathers
after the update. For a tower whose state fits easily on every rank that is all cost: on 2 ranks of a 2-core
EPYC the step's optimizer phase went 20 -> 12 ms and 2-rank scaling 0.80 -> 0.86 with ZeRO-0 on a Zen 5 (bf16),
0.93 -> 0.97 on a Zen 3 (fp32) (docs/training-speed.md). ``distributed.zero_stage: auto`` (the default) takes 0
while the state one rank would hold whole stays under ``AUTO_MAX_STATE_BYTES``, else 2. A resumed run keeps
the stage its checkpoint was written with (the two lay out their optimizer state differently).
"""

from __future__ import annotations

STATE_BYTES_PER_PARAMETER = 16  # Adam moments (8) + gradient and/or fp32 master copy (~8)
AUTO_MAX_STATE_BYTES = 2**30  # 1 GiB: a ~67 M-parameter dense tower
LEGACY_STAGE = 2  # the fixed default before "auto": checkpoints that do not record their stage


def choose(dense_parameters: int, world: int) -> int:
    """0 (plain data parallel) when the optimizer state is small or there is one rank to hold it, else 2."""
    small = dense_parameters * STATE_BYTES_PER_PARAMETER <= AUTO_MAX_STATE_BYTES
    return 0 if world == 1 or small else 2


def resolve(requested: str, dense_parameters: int, world: int, resumed: dict | None) -> int:
    """The stage to run: ``requested`` when set; for "auto", the stage of the checkpoint this run resumes
    (``resumed``: its state.json; a checkpoint from before stages were recorded ran the old fixed 2), else
    ``choose``."""
    if requested != "auto":
        return int(requested)
    if resumed is not None:
        return int(resumed.get("zero_stage", LEGACY_STAGE))
    return choose(dense_parameters, world)


def check(saved: int | None, current: int, path) -> None:
    """A resume runs the ZeRO stage its checkpoint was written with (DeepSpeed's optimizer state files differ)."""
    if saved is not None and saved != current:
        raise ValueError(
            f"checkpoint {path} was written with ZeRO stage {saved} but this run uses stage {current}: resume "
            f"with distributed.zero_stage={saved} (or auto), or start fresh with resume=false"
        )
