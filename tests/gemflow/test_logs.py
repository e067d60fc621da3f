"""A command's log (``gemflow.logs``), read as an Airflow task log reads it (stderr not a terminal): no progress-bar
line per update, no fbgemm_gpu load chatter, third-party warnings only at DEBUG, our own warnings kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CODE = """
import logging, sys, time, warnings
from gemflow import logs
logs.setup(level=logging.DEBUG if sys.argv[1] == "debug" else logging.INFO)
warnings.simplefilter("always")
import fbgemm_gpu  # logs "Successfully loaded: 'fbgemm_gpu_*.so'" per library file through the root logger
from tqdm import tqdm
for _ in tqdm(range(40), desc="steps"):
    time.sleep(0.02)  # 0.8 s: a default bar redraws ~8 times
warnings.warn_explicit("old api", DeprecationWarning, "/x/site-packages/feast/thing.py", 3)
warnings.warn_explicit("detached", UserWarning, sys.argv[2], 7)
logging.getLogger("models.training.train").info("epoch 1: done")
"""


def _stderr(level: str) -> str:
    ours = str(REPO / "models" / "train.py")
    proc = subprocess.run([sys.executable, "-c", CODE, level, ours], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    return proc.stderr


@pytest.mark.integration  # a subprocess importing fbgemm_gpu (seconds; more on a loaded machine)
def test_a_non_terminal_log_is_free_of_bar_redraws_library_chatter_and_third_party_warnings():
    log = _stderr("info")
    assert log.count("steps:") <= 2, log  # the bar's first and last draw, not one line per update
    assert "steps: 100%" in log
    assert "Successfully loaded" not in log
    assert "old api" not in log  # a third-party DeprecationWarning: DEBUG only
    assert "WARNING py.warnings" in log and "UserWarning: detached" in log  # ours stays a warning
    assert "INFO models.training.train: epoch 1: done" in log


@pytest.mark.integration
def test_debug_shows_what_info_hides():
    log = _stderr("debug")
    assert "DEBUG py.warnings" in log and "DeprecationWarning: old api" in log
    assert "Successfully loaded" in log
