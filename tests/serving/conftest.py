"""One tiny serving world and one real ``gemflow serve`` over HTTP, shared by the serving test modules."""

from __future__ import annotations

import time

import pytest

from tests.serving.world import REQUEST_TS, build_world, free_port, running_server

MAX_CANDIDATES = 50
MAX_BODY_BYTES = 4096
# The world's request_ts is a fixed date: the accepted window reaches back to it (and 30 days more).
TS_MAX_AGE_DAYS = (time.time() - REQUEST_TS) / 86400 + 30
SERVER_SETTINGS = (
    f"limits.max_candidates={MAX_CANDIDATES}", f"limits.max_body_bytes={MAX_BODY_BYTES}",
    "limits.feature_timeout_ms=1500", "limits.request_timeout_ms=10000", "ad_table.refresh_seconds=3600",
    f"limits.request_ts_max_age_days={TS_MAX_AGE_DAYS:.1f}", "connections.header_timeout_s=1",
    "connections.idle_timeout_s=2",
)  # fmt: skip


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="session")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-log") / "serve.log"


@pytest.fixture(scope="session")
def server(world, server_log):
    try:
        with running_server(world, free_port(), server_log, *SERVER_SETTINGS) as base:
            yield base
    except RuntimeError as err:
        pytest.fail(str(err))
