"""What a model's calls being transactions costs on the GPT training step.

Usage::

    python benchmarks/transaction_cost.py [--rounds 200] [--configs tiny small]

One AdamW step (float32, the book's GPT at the ``tiny`` and ``small``
configurations of ``workloads/gpt.py``, BLAS and the kernels at one thread) is
timed two ways, alternated in one process so that a host whose speed drifts
moves both alike:

- ``transaction``: as the library runs it: the model's forward and backward
  journal what they change and add the gradients when the call returns
  (``qkvnp.layers.transaction``);
- ``pass-through``: every call made inside an open transaction that journals
  nothing and adds each gradient at once, as the calls did before there was
  a transaction.

It prints the median of each and their ratio (the cost, in percent).
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

from benchmarks.workloads.gpt import CONFIGS  # noqa: E402


class _PassThrough:
    """An open transaction that keeps nothing: the journal forgets, gradients add at once."""

    class _Forget(dict):
        def __contains__(self, key):
            return True  # every object counts as journaled already

    class _AddNow(list):
        def append(self, entry):
            owner, attribute, name, grad = entry
            getattr(owner, attribute)[name] += grad

        def extend(self, entries):
            for entry in entries:
                self.append(entry)

    def __init__(self):
        self.journal, self.grads = self._Forget(), self._AddNow()


def _step(model, optimizer, inputs, targets):
    from qkvnp.losses import cross_entropy_backward, cross_entropy_forward

    model.zero_grad()
    loss, cache = cross_entropy_forward(model.forward(inputs), targets)
    model.backward(cross_entropy_backward(1.0, cache))
    optimizer.step(model.grads)
    return float(loss)


def measure(config, rounds):
    """``(median seconds with transactions, median pass-through)`` of one config."""
    from qkvnp import GPTModel
    from qkvnp.layers import transaction as _transaction
    from qkvnp.kernels import blas_threads, num_threads
    from qkvnp.optim import AdamW

    rng = np.random.default_rng(0)
    model = GPTModel(config.vocab, config.context, config.width, config.heads, config.layers,
                     rng=0, dtype=np.float32)
    optimizer = AdamW(model.params, lr=4e-4, weight_decay=0.1)
    shape = (config.batch, config.seq_len)  # (B, T)
    inputs = rng.integers(0, config.vocab, shape)
    targets = rng.integers(0, config.vocab, shape)
    times = {"transaction": [], "pass-through": []}
    with blas_threads(1), num_threads(1):
        for _ in range(5):
            _step(model, optimizer, inputs, targets)  # warm-up
        for i in range(2 * rounds):
            kind = ("transaction", "pass-through")[i % 2]
            if kind == "pass-through":
                _transaction._LOCAL.current = _PassThrough()
            start = time.perf_counter()
            _step(model, optimizer, inputs, targets)
            times[kind].append(time.perf_counter() - start)
            _transaction._LOCAL.current = None
    return statistics.median(times["transaction"]), statistics.median(times["pass-through"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["tiny", "small"])
    args = parser.parse_args(argv)
    print(f"{'config':8s} {'transaction':>12s} {'pass-through':>13s} {'cost':>7s}")
    for name in args.configs:
        with_txn, without = measure(CONFIGS[name], args.rounds)
        print(f"{name:8s} {with_txn * 1e3:9.2f} ms {without * 1e3:10.2f} ms "
              f"{100 * (with_txn / without - 1):+6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
