"""Shared test settings: hypothesis profiles and the optional PyTorch oracle.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE``, default ``dev``):
``dev`` and ``ci`` both run a bounded number of examples with no deadline
(timing a numerical test on a shared 2-core machine is noise); ``thorough``
runs many more for a local deep check.

PyTorch is an oracle, never a dependency: tests that need it take the
``torch`` fixture, which skips when PyTorch is absent, except under
``QKVNP_REQUIRE_TORCH=1`` (set by ``.ci/run``) where a missing PyTorch fails.
The skips it causes are reported as one, so that the short summary of a run
without PyTorch (``-ra``) ends with one line about them, not one per test
function; every other skip reason still gets its own line.
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# The one message that tells how to get the PyTorch oracle. It names the
# "torch" extra, which alone pins the version (tests/test_packaging.py checks
# that every such hint in the repository reads the same).
TORCH_INSTALL_HINT = "PyTorch is not installed (pip install 'qkvnp[torch]')"


def _import_torch():
    try:
        import torch
    except ImportError:
        if os.environ.get("QKVNP_REQUIRE_TORCH") == "1":
            raise
        pytest.skip(TORCH_INSTALL_HINT)
    torch.set_num_threads(1)
    return torch


@pytest.fixture(autouse=True)
def keep_torch_threads(request):
    """The benchmark tests (tests/benchmarks/) set PyTorch's thread count; give the other
    tests theirs back. (Here, not in a conftest.py of that directory: a second module
    named ``conftest`` would shadow this one for ``from conftest import ...``.)"""
    if "benchmarks" not in request.path.parts:
        yield
        return
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


#: The one line of the short test summary under which every skip for a
#: missing PyTorch is counted.
TORCH_SKIP_SUMMARY = f"the comparisons with PyTorch: {TORCH_INSTALL_HINT}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fold the skips for a missing PyTorch into one (path, line, reason) of this file.

    pytest's summary gives one line per distinct location and reason, and
    reports a skip raised in a fixture at the test function's location: one
    line per test function that takes the ``torch`` fixture (33 of them).
    """
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3
            and str(report.longrepr[2]).endswith(TORCH_INSTALL_HINT)):
        report.longrepr = (__file__, None, f"Skipped: {TORCH_SKIP_SUMMARY}")


@pytest.fixture(scope="session")
def torch():
    """The ``torch`` module, float64-ready; skipped (or failing in CI) if absent."""
    return _import_torch()


@pytest.fixture
def rng():
    """A fresh seeded generator per test, so failures reproduce."""
    return np.random.default_rng(12345)


# Every layer test runs on each implementation the layers offer.
LAYER_IMPLS = ["reference", "fast", "tiled"]


@pytest.fixture(params=LAYER_IMPLS)
def impl(request):
    """Name of the layer implementation under test (``impl=`` keyword)."""
    return request.param
