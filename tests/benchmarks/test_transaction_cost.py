"""benchmarks/transaction_cost.py measures what it says: both ways run the same step.

Oracle: the step's loss with transactions and through the pass-through
transaction is the same, from the same weights (the pass-through adds each
gradient at once, as the calls did before there were transactions), and the
measurement returns two positive medians.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import transaction_cost  # noqa: E402
from benchmarks.workloads.gpt import GPTConfig  # noqa: E402

import qkvnp  # noqa: E402
from qkvnp.layers import transaction  # noqa: E402
from qkvnp.optim import AdamW  # noqa: E402


def _losses(pass_through):
    rng = np.random.default_rng(0)
    model = qkvnp.GPTModel(32, 8, 8, 2, 1, rng=0, dtype=np.float32)
    optimizer = AdamW(model.params, lr=1e-3)
    inputs, targets = rng.integers(0, 32, (2, 8)), rng.integers(0, 32, (2, 8))
    losses = []
    for _ in range(3):
        if pass_through:
            transaction._LOCAL.current = transaction_cost._PassThrough()
        try:
            losses.append(transaction_cost._step(model, optimizer, inputs, targets))
        finally:
            transaction._LOCAL.current = None
    return losses


def test_the_pass_through_runs_the_same_steps():
    assert _losses(True) == _losses(False)


def test_measure_returns_two_medians():
    with_transaction, without = transaction_cost.measure(GPTConfig(32, 8, 8, 2, 1, 2), rounds=2)
    assert with_transaction > 0 and without > 0
