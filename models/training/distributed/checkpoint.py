"""Atomic, multi-rank checkpoints: a kill at any moment never leaves one that loads wrong.

    <run>/checkpoints/.step-00000040.tmp/   being written (every rank writes its part here)
    <run>/checkpoints/step-00000040/        committed: the rename of the complete temp folder
    <run>/checkpoints/latest                the committed name to resume from, replaced atomically, last

Order of a save: rank 0 clears a stale temp folder -> barrier -> every rank writes its part -> barrier ->
rank 0 fsyncs and renames the folder (the commit point), then points ``latest`` at it (write a temp file,
rename) and prunes old checkpoints -> barrier. A crash before the rename leaves only a temp folder, which is
never read and is removed at the next start; a crash between the rename and ``latest`` leaves the previous
``latest``, still complete. ``latest`` is the only thing a resume reads to choose. The best state's checkpoint outlives pruning (``protect``):
the run's state names its step, and the export restores it.

Our own parts (replicated tables, RNG states) are written pickle-free by ``save_state``: the tensors in a file
``torch.load(weights_only=True)`` reads, everything else (numbers, strings, the nesting) in JSON beside it.
DeepSpeed's own files are read with ``weights_only=True`` too (``weights_only_engine_loads``), so a resume never
unpickles arbitrary objects from a checkpoint folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"
PREFIX = "step-"


class CheckpointError(RuntimeError):
    """The checkpoint folder is inconsistent (``latest`` names a checkpoint that is not there)."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


class CheckpointStore:
    def __init__(self, root: Path, *, rank: int, keep: int = 2):
        self.root, self.rank, self.keep = Path(root), rank, keep

    # ------------------------------------------------------------------------------------------- reading
    def latest(self) -> Path | None:
        """The committed checkpoint to resume from, or None when there is none yet."""
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not name.startswith(PREFIX) or not path.is_dir():
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a committed checkpoint in {self.root}"
            )
        return path

    def committed(self) -> list[Path]:
        return sorted(p for p in self.root.glob(f"{PREFIX}*") if p.is_dir())

    # ------------------------------------------------------------------------------------------- writing
    def remove_stale(self) -> list[Path]:
        """Rank 0: delete temp folders of saves that never committed (a crash mid-write)."""
        stale = sorted(self.root.glob(f".{PREFIX}*.tmp")) if self.rank == 0 else []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        _barrier()
        return stale

    def reset(self) -> None:
        """Rank 0: forget every checkpoint (a run started with resume=false)."""
        if self.rank == 0 and self.root.exists():
            shutil.rmtree(self.root)
        _barrier()

    def path(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    def save(self, step: int, write: Callable[[Path], None], *, protect: int | None = None) -> Path:
        """Every rank calls this; ``write(folder)`` writes the rank's part into the (temporary) folder.

        Pruning keeps the ``keep`` newest and the checkpoint of step ``protect`` (the best state, for export).
        """
        name = checkpoint_name(step)
        tmp, final = self.root / f".{name}.tmp", self.root / name
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        write(tmp)
        _barrier()
        if self.rank == 0:
            _fsync_tree(tmp)
            if final.exists():  # the same step saved again after a resume: replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)  # the commit point
            _fsync(self.root)
            pointer = self.root / f".{LATEST}.tmp"
            pointer.write_text(name)
            _fsync(pointer)
            os.replace(pointer, self.root / LATEST)
            _fsync(self.root)
            kept = {final, self.path(protect)} if protect is not None else {final}
            for old in self.committed()[: -self.keep]:
                if old not in kept:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final


# ----------------------------------------------------------------------------------------------- pickle-free state
def _encode(obj, tensors: list[torch.Tensor]):
    """JSON-able form of ``obj``; tensors (and numpy arrays, as tensors) go to ``tensors``, referenced by index."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().cpu())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return {"__ndarray__": len(tensors) - 1}
    if isinstance(obj, dict):  # keys may be ints (optimizer state): keep them as (key, value) pairs
        return {"__dict__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} without pickle")


def _decode(obj, tensors: list[torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}


def save_state(obj, stem: Path) -> None:
    """Write ``obj`` (nested dicts / lists / tuples of tensors, arrays, numbers, strings) as ``<stem>.pt`` (the
    tensors) and ``<stem>.json`` (the rest)."""
    tensors: list[torch.Tensor] = []
    encoded = _encode(obj, tensors)
    torch.save(tensors, stem.with_suffix(".pt"))
    stem.with_suffix(".json").write_text(json.dumps(encoded))


def load_state(stem: Path):
    """Read what ``save_state`` wrote; the tensor file loads with ``weights_only=True``."""
    tensors = torch.load(stem.with_suffix(".pt"), weights_only=True)
    return _decode(json.loads(stem.with_suffix(".json").read_text()), tensors)


# ----------------------------------------------------------------------------------------------- DeepSpeed's files
def deepspeed_safe_globals() -> list:
    """The only non-tensor types DeepSpeed's checkpoint files hold (ZeRO-2, bf16, MoE: found with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on a real run's files)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_engine_loads(engine) -> Iterator[None]:
    """Within the block, ``engine.load_checkpoint`` reads every file with ``weights_only=True`` (DeepSpeed's own
    checkpoint engine passes ``weights_only=False``), allowing only ``deepspeed_safe_globals``. A file holding
    anything else fails to load, naming the type, instead of running its pickle."""
    checkpoint_engine = engine.checkpoint_engine
    allowed = deepspeed_safe_globals()

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    checkpoint_engine.load = load  # shadows the method on this instance only
    try:
        yield
    finally:
        del checkpoint_engine.load
