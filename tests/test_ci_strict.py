"""Under CI=true a skip fails unless the test is marked gpu; without CI a skip stays a skip."""

from __future__ import annotations

import pytest

TESTS = """
import pytest

def test_needs_a_tool():
    pytest.skip("redis-server is not installed")

@pytest.mark.skipif(True, reason="helm missing")
def test_marked_skip():
    pass

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("no CUDA device")

@pytest.mark.xfail(reason="known")
def test_known_failure():
    assert False

def test_passes():
    pass
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_skips_fail_under_ci_except_gpu_tests(pytester, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.makepyfile(TESTS)
    result = pytester.runpytest("-p", "tests.ci_strict")
    if ci:
        result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)  # a skipif fails in setup
        result.stdout.fnmatch_lines(["*skipped under CI=true*redis-server is not installed*"])
    else:
        result.assert_outcomes(passed=1, skipped=3, xfailed=1)
