"""benchmarks/moe_bench.py runs and measures what it says, at a tiny size (not timed).

Oracle: the router gives every token ``top_k`` experts, so the counts sum to
``k N``; each median is a positive time; the command prints one row a thread
count and exits 0.
"""
import os
import sys
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import moe_bench  # noqa: E402

TINY = SimpleNamespace(emb=8, hidden=4, experts=4, top_k=2, batch=2, tokens=3, rounds=2)


def test_the_measurement_routes_k_tokens_a_row_and_times_both_layers():
    result = moe_bench.measure(TINY, threads=1)
    counts = result["counts"]
    assert counts.shape == (TINY.experts,)
    assert counts.sum() == TINY.top_k * TINY.batch * TINY.tokens
    for sparse, dense in (result["layer"], result["products"]):
        assert sparse > 0 and dense > 0


def test_the_command_prints_a_row_a_thread_count(capsys):
    argv = ["--emb", "8", "--hidden", "4", "--experts", "4", "--batch", "2", "--tokens", "3",
            "--rounds", "2", "--threads", "1", "2"]
    assert moe_bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(np.isfinite(float(row[5])) for row in rows)  # the layer's ratio
