"""Shared test settings: hypothesis profiles and the optional PyTorch oracle.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE``, default ``dev``):
``dev`` and ``ci`` both run a bounded number of examples with no deadline
(timing a numerical test on a shared 2-core machine is noise); ``thorough``
runs many more for a local deep check.

PyTorch is an oracle, never a dependency: tests that need it take the
``torch`` fixture, which skips when PyTorch is absent, except under
``QKVNP_REQUIRE_TORCH=1`` (set by ``.ci/run``) where a missing PyTorch fails.
"""
import os

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
