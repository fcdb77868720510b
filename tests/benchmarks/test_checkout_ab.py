"""benchmarks/checkout_ab.py: its timings come back named and positive, and the
comparison reads the ratios of the medians (oracle: hand-made runs)."""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import checkout_ab  # noqa: E402


def test_measure_names_each_timing():
    timings = checkout_ab.measure([(1, 6, 3, 1)], {"tiny": (32, 8, 8, 2, 1, 2)}, rounds=1)
    assert sorted(timings) == ["gpt step tiny", "layer (1, 6, 3, 1) causal",
                               "layer (1, 6, 3, 1) none"]
    assert all(ms > 0 for ms in timings.values())


def test_compare_is_the_ratio_of_the_medians():
    old = [{"a": 1.0}, {"a": 3.0}, {"a": 2.0}]
    new = [{"a": 1.0}, {"a": 1.0}, {"a": 5.0}]
    lines = checkout_ab.compare(old, new)
    assert "new/old 0.500" in lines[0]
    assert lines[-1].startswith("median of the ratios: 0.500")
