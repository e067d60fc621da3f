"""Where a training run writes, and whether it may continue an earlier one (``gemflow train``, both strategies).

Every invocation is a new run unless the user asks to resume (``resume: true``, ``gemflow train --resume``):
- a new run whose default folder ``<workspace>/models/<model>/<run name>`` already holds a run gets the next free
  ``<run name>-2``, ``-3``, ... (an explicit ``output_dir`` that holds a run is refused instead: the user named
  that folder, so silently writing elsewhere, or over it, would both surprise);
- a resume continues the folder's run only when the config it was trained with (its ``config.yaml``) matches
  this one in every key that shapes the model or its data; otherwise it is refused with the keys that differ,
  before anything is written. Keys a continuation may change (more epochs, patience, tracking, the launcher's
  runtime settings) are ``RESUMABLE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gemflow.config import load_config, to_dict
from gemflow.workspace import Workspace

# dotted keys (or prefixes ending in ".") a resume may change; "distributed." except its model-shaping "moe."
RESUMABLE = (
    "resume", "output_dir", "optim.epochs", "optim.patience", "optim.eval_batch_size", "optim.log_every",
    "tracking.",
)  # fmt: skip
DISTRIBUTED_MODEL_KEYS = ("distributed.moe.",)
RUN_MARKERS = (
    "config.yaml",
    "checkpoint.pt",
    "checkpoints",
    "model.pt",
)  # a folder with any of these holds a run


class ResumeRefused(ValueError):
    """A resume that would continue a run with another model or data config (or a folder already in use)."""


def holds_run(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_MARKERS)


def new_run_folder(default: Path) -> Path:
    """``default`` when it holds no run yet, else the first free ``<default>-N`` (N = 2, 3, ...)."""
    if not holds_run(default):
        return default
    n = 2
    while holds_run(default.with_name(f"{default.name}-{n}")):
        n += 1
    return default.with_name(f"{default.name}-{n}")


def choose(cfg, ws: Workspace, default_name: str) -> Path:
    """The folder this invocation trains in (see the module doc)."""
    if cfg.output_dir:
        folder = Path(cfg.output_dir)
        if not cfg.resume and holds_run(folder):
            raise ResumeRefused(
                f"output_dir {folder} already holds a training run: pass --resume (resume=true) to continue it, "
                "or choose another output_dir"
            )
        return folder
    default = ws.root / "models" / cfg.model / default_name
    return default if cfg.resume else new_run_folder(default)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resumable(key: str) -> bool:
    if key.startswith(DISTRIBUTED_MODEL_KEYS):
        return False
    return key.startswith("distributed.") or any(
        key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE
    )


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key (saved -> current)`` for every non-resumable key whose value differs (a key one side lacks, too)."""
    before, after = _flat(saved), _flat(current)
    return [
        f"{key} ({before.get(key, '<unset>')!r} -> {after.get(key, '<unset>')!r})"
        for key in sorted(before.keys() | after.keys())
        if not _resumable(key) and before.get(key) != after.get(key)
    ]


def check_resume(cfg, run_dir: Path, same_training_set) -> None:
    """Refuse to resume ``run_dir`` with a config that differs from the one it was trained with.

    ``same_training_set(saved, current)``: whether two ``training_set`` values name the same folder (a name and
    the path it resolves to are the same set).
    """
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        if holds_run(run_dir):
            raise ResumeRefused(
                f"cannot resume {run_dir}: it has no config.yaml to check this config against"
            )
        return
    try:  # keys added since the run was trained take their defaults, as they did for it
        saved = to_dict(load_config(type(cfg), saved_path))
    except (ValueError, TypeError):  # a key since removed: compare what the file says
        saved = yaml.safe_load(saved_path.read_text()) or {}
    current = to_dict(cfg)
    if same_training_set(str(saved.get("training_set", "")), str(current["training_set"])):
        saved["training_set"] = current["training_set"]
    diff = differences(saved, current)
    if diff:
        raise ResumeRefused(
            f"cannot resume {run_dir}: its run was trained with another config; differing key(s): "
            f"{', '.join(diff)}. Start a new run (without --resume / resume=true), or resume with the run's own "
            f"values ({saved_path})"
        )
