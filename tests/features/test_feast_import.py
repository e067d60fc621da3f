"""Feast imported through ``features`` skips typeguard's import-time instrumentation and PyTorch's import
(features.feast_import)."""

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


# in a fresh interpreter: whether importing Feast (the online store's read path included) imported PyTorch, and
# that Feast's torch accessor still hands it out when called
TORCH_PROBE = """
import sys
import {first}
import feast
from feast.infra.online_stores.sqlite import SqliteOnlineStore
from feast.online_response import OnlineResponse
print("torch" in sys.modules)
from feast.torch_wrapper import get_torch
assert get_torch().zeros(2).shape == (2,)
"""


def _last_line(probe: str, first: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", probe.format(first=first)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return out.stdout.strip().splitlines()[-1]


def _instrumented(first: str) -> bool:
    return _last_line(PROBE, first) == "True"


def test_feast_through_features_is_not_instrumented_and_plain_feast_still_is():
    assert not _instrumented("features")
    assert _instrumented("sys")  # the probe sees instrumentation where it happens


def test_feast_through_features_imports_torch_only_when_asked_for_it():
    assert _last_line(TORCH_PROBE, "features") == "False"
    assert _last_line(TORCH_PROBE, "os") == "True"  # plain Feast imports it at once


def test_the_pass_through_keeps_what_it_decorates():
    from features.feast_import import _unchecked

    def f(x: int) -> int:
        return x

    assert _unchecked(f) is f
    assert _unchecked(forward_ref_policy=None)(f) is f
