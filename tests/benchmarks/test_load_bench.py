"""benchmarks/load_bench.py measures what it says, on a tiny GPT-2 (untimed).

Oracle: the load child reports the directory's parameter count (the model's
own count), positive times, and a peak resident memory above the memory it
had before loading and under the cap the benchmark checks.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import load_bench  # noqa: E402


def test_measure_a_tiny_directory(tmp_path):
    directory = load_bench.make_gpt2(str(tmp_path / "tiny"), vocab_size=50, n_embd=16,
                                     n_layer=2, n_head=2, n_positions=32)
    result = load_bench.measure(directory, rounds=1)
    params = 50 * 16 + 32 * 16 + 2 * (4 * 16 + 3 * 16 * 16 + 3 * 16 + 16 * 16 + 16
                                      + 2 * 4 * 16 * 16 + 4 * 16 + 16) + 2 * 16
    assert result["params"] == params
    assert result["load_s"] > 0 and result["cat_s"] > 0 and result["touch_s"] > 0
    assert result["base_bytes"] <= result["peak_bytes"] < result["cap_bytes"]
