"""benchmarks/generate_bench.py measures what it says, on a tiny GPT-2 (untimed).

Oracle: the two libraries' greedy tokens agree (the command refuses to time
otherwise), and every round reports a positive rate.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import generate_bench, load_bench  # noqa: E402


def test_measure_a_tiny_directory(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    directory = load_bench.make_gpt2(str(tmp_path / "tiny"), vocab_size=50, n_embd=16,
                                     n_layer=2, n_head=2, n_positions=32)
    result = generate_bench.measure(directory, rounds=1, prompt_tokens=4, new_tokens=3)
    assert len(result["qkvnp"]) == len(result["transformers"]) == 1
    assert min(result["qkvnp"] + result["transformers"]) > 0 and result["ratio"] > 0
