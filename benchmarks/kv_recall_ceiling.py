"""The floor of a kv-recall training step: its matrix products alone, at 1 and 2 BLAS threads.

Usage: ``python benchmarks/kv_recall_ceiling.py [float64|float32]``

Shape key: B sequences, P stored pairs, E width, V value vocabulary.

The default kv-recall step (B = 64, P = 16, E = 64, V = 64) multiplies the
(B*P, E) items by the key and value projections and, backward, forms their
weight and input gradients: six (1024, 64) x (64, 64) products, plus the
query's and the readout's small ones. Whatever the model's Python costs, a
step cannot be faster than these products; RESULTS.md compares that floor with
the whole step and with PyTorch's.
"""
import sys
import time

import numpy as np

from qkvnp.kernels import blas_threads


def step_products(X, q, Wq, Wk, Wv, Wr, dY, dlogits):
    """The products of one step, forward and backward (values discarded)."""
    k, v = X @ Wk, X @ Wv  # (B*P, E) @ (E, E): keys and values of the items
    query = q @ Wq  # (B, E) @ (E, E)
    query @ Wr  # readout (B, E) @ (E, V)
    query.T @ dlogits, dlogits @ Wr.T  # readout backward
    X.T @ dY, dY @ Wk.T, X.T @ dY, dY @ Wv.T  # key and value projections backward
    q.T @ query, query @ Wq.T  # query projection backward
    return k, v


def main(dtype="float64", B=64, P=16, E=64, V=64, rounds=7, calls=200):
    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    X, dY = (rng.standard_normal((B * P, E)).astype(dtype) for _ in range(2))
    q, Wq, Wk, Wv = (rng.standard_normal(shape).astype(dtype)
                     for shape in ((B, E), (E, E), (E, E), (E, E)))
    Wr, dlogits = rng.standard_normal((E, V)).astype(dtype), rng.standard_normal((B, V)).astype(dtype)
    args = (X, q, Wq, Wk, Wv, Wr, dY, dlogits)
    for threads in (1, 2):
        with blas_threads(threads):
            for _ in range(calls // 4):
                step_products(*args)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(calls):
                    step_products(*args)
                times.append((time.perf_counter() - start) / calls)
        print(f"{dtype.name}: the products of one kv-recall step at {threads} BLAS thread(s): "
              f"{1e3 * float(np.median(times)):.3f} ms (median of {rounds} rounds of {calls})")


if __name__ == "__main__":
    main(*sys.argv[1:2])
