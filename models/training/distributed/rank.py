"""One rank's entry point (what torchrun or the DeepSpeed CLI starts): watch the launcher, then train.

The watchdog makes the rank exit when the launcher is gone (``models.training.distributed.orphans``); the training itself
is ``models.training.distributed.trainer``.
"""

from __future__ import annotations

from models.training.distributed.orphans import start_watchdog
from models.training.distributed.trainer import main

if __name__ == "__main__":
    start_watchdog()
    raise SystemExit(main())
