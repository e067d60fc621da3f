"""What a logged gemflow model needs outside this repo: its code (``code_paths``) and pinned pip requirements.

The model's loader (``pyfunc_model.py``) imports ``models``, which imports ``gemflow`` and ``features``: those
three packages travel with the model. The requirements are the installed versions of every distribution the
loader imports, with their whole dependency closure pinned, like ``requirements/project.lock``: install them with
``pip install --no-deps -r requirements.txt``. No resolver: torchrec declares ``fbgemm-gpu`` (the CUDA build),
which a resolver would fetch next to the CPU build ``fbgemm-gpu-cpu`` that provides the same ``fbgemm_gpu``.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as _key

PACKAGES = ("models", "gemflow", "features")
# the distributions the loader imports (mlflow-skinny: pyfunc loading needs no tracking server or UI)
DISTRIBUTIONS = ("mlflow-skinny", "torch", "torchrec", "fbgemm-gpu-cpu", "numpy", "pandas", "pyarrow", "PyYAML",
                 "tqdm")  # fmt: skip
SUBSTITUTES = {"fbgemm-gpu": "fbgemm-gpu-cpu"}  # a declared dependency -> the installed one that provides it


def code_paths() -> list[str]:
    return [str(Path(importlib.import_module(p).__file__).parent) for p in PACKAGES]


def pip_requirements(roots: tuple[str, ...] = DISTRIBUTIONS) -> list[str]:
    """``name==version`` for ``roots`` and everything they depend on, as installed here (sorted)."""
    pinned: dict[str, str] = {}
    missing = [r for r in roots if not _installed(r)]
    if missing:
        raise RuntimeError(f"the logged model imports {missing}, which are not installed here")
    todo = [_key(r) for r in roots]
    while todo:
        key = todo.pop()
        if key in pinned or not _installed(key):  # declared but absent: the model runs here without it
            continue
        dist = metadata.distribution(key)
        pinned[key] = f"{key}=={dist.version}"
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_key(SUBSTITUTES.get(_key(req.name), req.name)))
    return sorted(pinned.values())


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True
