"""The floor of a kv-recall training step: its matrix products alone, at 1 and 2 BLAS threads.

Usage: ``python benchmarks/kv_recall_ceiling.py [float64|float32]``

Shape key: B sequences, P stored pairs, E width, V value vocabulary.

The default kv-recall step (B = 64, P = 16, E = 64, V = 64) multiplies the
(B*P, E) items by the key and value projections and, backward, forms their
weight and input gradients: six (1024, 64) x (64, 64) products, plus the
query's and the readout's small ones. Whatever the model's Python costs, a
step cannot be faster than these products; RESULTS.md compares that floor with
the whole step and with PyTorch's.

The second floor is the whole step written as straight numpy: the model's
math on the benchmark's initial weights and batches (``train_bench``), with
the same ops where they cost (scipy's ``softmax`` and ``log_softmax``, the
sparse one-hot product of the embedding backward, Adam on one flat array) and
none of the library's checks, layers or caches. Its losses must match
qkvnp's own step before it is timed. What the library's step takes beyond it
is the price of the checks and the layers; a target below it cannot be met by
the readable model, whatever those cost.
"""
import math
import os
import sys
import time

import numpy as np

from qkvnp.kernels import blas_threads
from qkvnp.kernels.openblas import openblas_thread_functions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_bench


def step_products(X, q, Wq, Wk, Wv, Wr, dY, dlogits):
    """The products of one step, forward and backward (values discarded)."""
    k, v = X @ Wk, X @ Wv  # (B*P, E) @ (E, E): keys and values of the items
    query = q @ Wq  # (B, E) @ (E, E)
    query @ Wr  # readout (B, E) @ (E, V)
    query.T @ dlogits, dlogits @ Wr.T  # readout backward
    X.T @ dY, dY @ Wk.T, X.T @ dY, dY @ Wv.T  # key and value projections backward
    q.T @ query, query @ Wq.T  # query projection backward
    return k, v


class StepFloor:
    """The kv-recall step as straight numpy: forward, loss, backward, Adam (see the module).

    ``blas_products=2`` runs the six (B*P, E) x (E, E) products on two BLAS
    threads, the rest on one (the step itself runs under ``blas_threads(1)``).
    """

    def __init__(self, dtype, blas_products=1):
        import train_bench

        self.dtype = np.dtype(dtype)
        config = train_bench.training_config("kv-recall", self.dtype)
        if (config.variant, config.optimizer, config.weight_decay) != ("separate", "adam", 0):
            raise ValueError("the floor is written for the default kv-recall configuration")
        data = train_bench.make_training_data("kv-recall", self.dtype)
        self.batches = train_bench._batches("kv-recall", data)
        names = [key[len("param/"):] for key in data if key.startswith("param/")]
        sizes = [data["param/" + name].size for name in names]
        ends = np.cumsum(sizes)
        # parameters, gradients and Adam's two buffers: one flat array each
        self.flat = np.concatenate([data["param/" + name].ravel() for name in names])
        self.grad, self.m, self.v = (np.zeros_like(self.flat) for _ in range(3))
        self.p, self.g = ({name: flat[end - size:end].reshape(data["param/" + name].shape)
                           for name, size, end in zip(names, sizes, ends)}
                          for flat in (self.flat, self.grad))
        self.lr, self.scale, self.t, self.index = config.lr, 1 / math.sqrt(config.dim), 0, 0
        set_threads = openblas_thread_functions()
        self.set_threads = set_threads[1] if set_threads and blas_products > 1 else None
        self.blas_products = blas_products

    def product(self, a, b):
        """``a @ b`` of two 2-D arrays, on ``blas_products`` threads."""
        if self.set_threads is None:
            return a @ b
        self.set_threads(self.blas_products)
        try:
            return a @ b
        finally:
            self.set_threads(1)

    def step(self):
        from scipy.sparse import csc_array
        from scipy.special import log_softmax, softmax

        keys, values, query, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        p, g, c = self.p, self.g, self.scale
        B, P = keys.shape
        self.grad[...] = 0
        tokens = np.concatenate([keys, query[:, None]], axis=1)  # (B, P+1)
        key_vectors = p["embed_key.weight"][tokens]  # (B, P+1, E)
        items = key_vectors[:, :P] + p["embed_value.weight"][values]  # (B, P, E)
        x = items.reshape(B * P, -1)  # (B*P, E)
        query_token = key_vectors[:, P] + p["query_marker"]  # (B, E)
        q = query_token @ p["attention.W_query"]  # (B, E)
        k = self.product(x, p["attention.W_key"]).reshape(items.shape)  # (B, P, E)
        v = self.product(x, p["attention.W_value"]).reshape(items.shape)  # (B, P, E)
        weights = softmax((k @ q[:, :, None])[..., 0] * c, axis=-1)  # (B, P)
        attended = (weights[:, None] @ v)[:, 0]  # (B, E)
        logits = attended @ p["readout.W"] + p["readout.b"]  # (B, V)
        log_probs = log_softmax(logits, axis=-1)
        loss = -log_probs[np.arange(B), target].mean()
        dlogits = np.exp(log_probs)  # softmax - onehot, over B
        dlogits[np.arange(B), target] -= 1
        dlogits /= B
        g["readout.W"] += attended.T @ dlogits
        g["readout.b"] += dlogits.sum(axis=0)
        dattended = dlogits @ p["readout.W"].T  # (B, E)
        dv = weights[:, :, None] * dattended[:, None]  # (B, P, E)
        dweights = (v @ dattended[:, :, None])[..., 0]  # (B, P)
        dscores = weights * (dweights - (weights * dweights).sum(axis=-1, keepdims=True)) * c
        dq = (dscores[:, None] @ k)[:, 0]  # (B, E)
        dk = dscores[:, :, None] * q[:, None]  # (B, P, E)
        dv2, dk2 = dv.reshape(B * P, -1), dk.reshape(B * P, -1)
        g["attention.W_value"] += x.T @ dv2
        g["attention.W_key"] += x.T @ dk2
        dx = self.product(dv2, p["attention.W_value"].T)
        dx += self.product(dk2, p["attention.W_key"].T)  # (B*P, E)
        g["attention.W_query"] += query_token.T @ dq
        dquery_token = dq @ p["attention.W_query"].T  # (B, E)
        g["query_marker"] += dquery_token.sum(axis=0)
        for table, ids, rows in (("embed_value.weight", values, dx),
                                 ("embed_key.weight", tokens,
                                  np.concatenate([dx.reshape(items.shape), dquery_token[:, None]],
                                                 axis=1))):
            ids = ids.reshape(-1)
            onehot_t = csc_array((np.ones(ids.size, self.dtype), ids, np.arange(ids.size + 1)),
                                 shape=(g[table].shape[0], ids.size))
            g[table] += onehot_t @ rows.reshape(ids.size, -1)
        self.t += 1  # Adam (betas 0.9, 0.999, eps 1e-8), as qkvnp.optim.Adam
        self.m += 0.1 * (self.grad - self.m)
        self.v *= 0.999
        self.v += 0.001 * self.grad * self.grad
        denom = np.sqrt(self.v) / (1 - 0.999 ** self.t) ** 0.5 + 1e-8
        self.flat -= (self.lr / (1 - 0.9 ** self.t)) * self.m / denom
        return float(loss)


def check_floor(dtype):
    """The floor's first losses against qkvnp's own step on the same weights and batches.

    Returns the largest relative difference; raises ``RuntimeError`` beyond
    the benchmark's tolerance (``train_bench.LOSS_TOLERANCES``).
    """
    import train_bench

    data = train_bench.make_training_data("kv-recall", dtype)
    expected = train_bench.make_training_runner("qkvnp", "kv-recall", dtype, data).result()["loss"]
    floor = StepFloor(dtype)
    with blas_threads(1):
        got = np.array([floor.step() for _ in range(train_bench.CHECK_STEPS)])
    error, ok = train_bench.check_losses(got, expected, dtype)
    if not ok:
        raise RuntimeError(f"the floor's losses {got} differ from qkvnp's {expected} "
                           f"(relative error {error:.2g}): it is not the same step")
    return error


def time_steps(step, rounds, calls):
    """Median seconds of one ``step()`` over ``rounds`` rounds of ``calls`` (after a warm-up)."""
    for _ in range(calls // 4):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def main(dtype="float64", B=64, P=16, E=64, V=64, rounds=7, calls=200):
    import train_bench

    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    X, dY = (rng.standard_normal((B * P, E)).astype(dtype) for _ in range(2))
    q, Wq, Wk, Wv = (rng.standard_normal(shape).astype(dtype)
                     for shape in ((B, E), (E, E), (E, E), (E, E)))
    Wr, dlogits = rng.standard_normal((E, V)).astype(dtype), rng.standard_normal((B, V)).astype(dtype)
    args = (X, q, Wq, Wk, Wv, Wr, dY, dlogits)
    for threads in (1, 2):
        with blas_threads(threads):
            seconds = time_steps(lambda: step_products(*args), rounds, calls)
        print(f"{dtype.name}: the products of one kv-recall step at {threads} BLAS thread(s): "
              f"{1e3 * seconds:.3f} ms (median of {rounds} rounds of {calls})")
    check_floor(dtype)
    data = train_bench.make_training_data("kv-recall", dtype)
    library = train_bench.make_training_runner("qkvnp", "kv-recall", dtype, data)
    with blas_threads(1):
        for name, step in (("the whole step as straight numpy, one BLAS thread",
                            StepFloor(dtype).step),
                           ("the same, its six (B*P, E) x (E, E) products on two",
                            StepFloor(dtype, blas_products=2).step),
                           ("qkvnp's step (train_bench), one BLAS thread", library.step)):
            seconds = time_steps(step, rounds, calls * 2)
            print(f"{dtype.name}: {name}: {1e3 * seconds:.3f} ms (median of {rounds} rounds "
                  f"of {calls * 2})")


if __name__ == "__main__":
    main(*sys.argv[1:2])
