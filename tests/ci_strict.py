"""Under ``CI=true`` a skipped test is a failed one, unless it is marked ``gpu``.

Locally a missing component (the Airflow env, redis-server, helm, kubernetes-validate, hadolint, ../shared/data)
skips its tests with the reason; in CI every one of them is installed by ``make setup``, so a skip there means
the run did not test what it claims, and CI must not go green by skipping. Only tests that need a GPU may skip:
CI runs on CPU machines. Loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

import os

import pytest

ALLOWED_MARK = "gpu"


def ci_strict() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if not (ci_strict() and report.skipped) or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker(ALLOWED_MARK) is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true, where only tests marked '{ALLOWED_MARK}' may skip: {reason}\n"
        "install the missing component (make setup does) or mark the test gpu if it needs a GPU"
    )
