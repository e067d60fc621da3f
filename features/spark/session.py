"""One SparkSession per process for the data plane's Spark engine, configured from a dataclass.

``master`` is ``local[N]`` on one machine (tests, the bench, ``make demo ENGINE=spark``) and ``k8s://...`` or
``yarn`` on a cluster (there spark-submit usually sets it and the session only joins it). The session clock is
UTC so ``timestamp`` columns mean what the offline store's ``timestamp[us, UTC]`` means.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ENGINES = ("local", "spark")


@dataclass
class SparkConfig:
    master: str = "local[*]"  # "" = keep what spark-submit set
    app_name: str = "gemflow-data-plane"
    driver_memory: str = "2g"  # only applies when this process starts the JVM (local mode, client mode)
    shuffle_partitions: int = 8  # small for local[N]; a cluster sets ~2-3x its executor cores
    conf: dict[str, str] = field(default_factory=dict)  # any other spark.* setting


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def spark_session(cfg: SparkConfig | None = None) -> SparkSession:
    """The process's SparkSession (created on first use; later calls reuse it and its JVM)."""
    cfg = cfg or SparkConfig()
    if shutil.which("java") is None:
        raise RuntimeError(
            "engine: spark needs a Java runtime (17 or 21): `make java` installs Debian's OpenJDK"
        )
    from pyspark.sql import SparkSession

    # Python workers (executor-side writers) run this interpreter, with its packages, unless told otherwise
    # (pyspark reads only the environment variable).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(cfg.app_name)
    if cfg.master:
        builder = builder.master(cfg.master)
    settings = {
        "spark.driver.memory": cfg.driver_memory,
        "spark.sql.shuffle.partitions": str(cfg.shuffle_partitions),
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        **cfg.conf,
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
