"""Feast imported through ``features`` skips typeguard's import-time instrumentation (features.feast_import)."""

from __future__ import annotations

import subprocess
import sys

# in a fresh interpreter: whether FeatureView.__init__ was rewritten by typeguard (its code calls typeguard's checks)
PROBE = """
import {first}
import feast
code = feast.FeatureView.__init__.__code__
print(any("typeguard" in name for name in code.co_names))
"""


def _instrumented(first: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return out.stdout.strip().splitlines()[-1] == "True"


def test_feast_through_features_is_not_instrumented_and_plain_feast_still_is():
    assert not _instrumented("features")
    assert _instrumented("sys")  # the probe sees instrumentation where it happens


def test_the_pass_through_keeps_what_it_decorates():
    from features.feast_import import _unchecked

    def f(x: int) -> int:
        return x

    assert _unchecked(f) is f
    assert _unchecked(forward_ref_policy=None)(f) is f
