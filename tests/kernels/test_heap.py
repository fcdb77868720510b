"""glibc's malloc thresholds (qkvnp/kernels/heap.py).

Oracles: the minor page faults the kernel counts for this process
(``getrusage``), in fresh processes so that no earlier test's allocations
decide glibc's state; the documented rules of :func:`tune_heap` (what it
leaves alone). No test times anything.
"""
import os
import platform
import subprocess
import sys

import pytest

from qkvnp import kernels
from qkvnp.kernels import heap

GLIBC_LINUX = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# One process: the layer's forward+backward at (16, 32, 64, 4) float32, whose
# temporaries (128 KiB to 1.5 MiB) glibc gave back to the system and faulted
# in again on every step (192 faults a step measured) before the thresholds.
STEADY_STATE_FAULTS = r"""
import resource, sys
import numpy as np
import qkvnp
if sys.argv[1] == "off":
    qkvnp.kernels.set_block_sizes(heap_mmap_threshold=0)
rng = np.random.default_rng(0)
layer = qkvnp.MultiHeadAttention(64, 4, dtype=np.float32, rng=rng)
x = rng.standard_normal((16, 32, 64)).astype(np.float32)
for _ in range(5):
    layer.forward(x, is_causal=True); layer.backward(x)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer.forward(x, is_causal=True); layer.backward(x)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _faults_per_step(setting):
    env = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES}
    env.pop("GLIBC_TUNABLES", None)
    result = subprocess.run([sys.executable, "-c", STEADY_STATE_FAULTS, setting], env=env,
                            capture_output=True, text=True, check=True)
    return float(result.stdout)


@pytest.mark.skipif(not GLIBC_LINUX, reason="glibc's malloc only")
def test_a_steady_state_step_does_not_page_fault():
    # with the thresholds, the steady state reuses the heap: no fault a step
    assert _faults_per_step("on") < 2


def test_thresholds_are_those_glibc_reaches_itself():
    # glibc's dynamic rule: trim threshold = 2 x the mmap threshold
    assert heap.heap_thresholds(32 << 20) == (32 << 20, 64 << 20)


def _fresh_state(monkeypatch):
    """The state of a process before its first kernel section."""
    for key, value in (("seen", None), ("tuned", False), ("given", 0)):
        monkeypatch.setitem(heap._STATE, key, value)


def test_zero_leaves_malloc_alone_when_nothing_was_set(monkeypatch):
    _fresh_state(monkeypatch)
    monkeypatch.setitem(heap._STATE, "mallopt", lambda *args: pytest.fail("mallopt called"))
    assert heap.tune_heap(0) is False


def test_users_own_malloc_settings_win(monkeypatch):
    monkeypatch.setitem(heap._STATE, "mallopt", lambda *args: pytest.fail("mallopt called"))
    for name, value in (("MALLOC_TRIM_THRESHOLD_", "1000000"),
                        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1000000")):
        _fresh_state(monkeypatch)
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert heap.tune_heap(32 << 20) is False
        # decided once: the kernel sections after the first do not read the environment
        assert heap.tune_heap(32 << 20) is False


def test_given_once_then_again_only_when_the_setting_changes(monkeypatch):
    calls = []
    _fresh_state(monkeypatch)
    monkeypatch.setitem(heap._STATE, "mallopt", lambda *args: calls.append(args) or 1)
    for name in heap.USER_VARIABLES + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    assert heap.tune_heap(1 << 20) and heap.tune_heap(1 << 20)
    assert calls == [(heap.M_MMAP_THRESHOLD, 1 << 20), (heap.M_TRIM_THRESHOLD, 2 << 20)]
    assert heap.tune_heap(0) is False  # glibc's initial 128 KiB back
    assert calls[2:] == [(heap.M_MMAP_THRESHOLD, 128 << 10), (heap.M_TRIM_THRESHOLD, 256 << 10)]


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="heap_mmap_threshold"):
        kernels.set_block_sizes(heap_mmap_threshold=-1)
    with pytest.raises(TypeError, match="heap_mmap_threshold"):
        kernels.set_block_sizes(heap_mmap_threshold=1.5)
