"""The floor of a kv-recall training step: its matrix products alone, and the step as straight numpy.

Usage: ``python benchmarks/kv_recall_ceiling.py [float64|float32]``

Shape key: B sequences, P stored pairs, E width, K key and V value vocabularies.

The default kv-recall step (B = 64, P = 16, E = 64, V = 64) folds the key
and value projections onto the one query
(:class:`qkvnp.training.KVRecallModel`'s Notes), so its matrix products are
the (B, E) x (E, E) projections of the query and of the attention's output,
the readout's, and the one-row attention's batched (1, E) x (E, P) and
(1, P) x (P, E) products, forward and backward, and the embedding tables'
folded (K, 2B) x (2B, E) products. Whatever the model's Python
costs, a step cannot be faster than these products; the command prints that
floor beside the whole step.

The second floor is the whole step written as straight numpy: the model's
math on the benchmark's initial weights and batches (``benchmarks/workloads/training.py``), with
the same ops where they cost (scipy's ``softmax`` and ``log_softmax``, the
embedding tables' backward folded onto the attention's gradient factors as
the model's, Adam on one flat array) and
none of the library's checks, layers or caches. Its losses must match
qkvnp's own step before it is timed. What the library's step takes beyond it
is the price of the checks and the layers; a target below it cannot be met by
the readable model, whatever those cost.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

from qkvnp.ops.embedding import BINCOUNT_MAX_ENTRIES  # noqa: E402
from qkvnp.kernels import blas_threads  # noqa: E402


def step_products(X, q, Wq, Wk, Wv, Wr, dlogits, num_keys):
    """The products of one folded step, forward and backward (values discarded).

    ``X`` (B, P, E) items, ``q`` (B, E) query tokens, ``W*`` (E, E) and ``Wr``
    (E, V) weights, ``dlogits`` (B, V); ``num_keys`` K, the key table's rows.
    """
    query = q @ Wq  # (B, E) @ (E, E)
    q_items = query @ Wk.T  # (B, E) @ (E, E): the key projection folded onto the query
    scores = (X @ q_items[:, :, None])[..., 0]  # (B, P, E) @ (B, E, 1) -> (B, P)
    mixed = (scores[:, None] @ X)[:, 0]  # (B, 1, P) @ (B, P, E) -> (B, E)
    attended = mixed @ Wv  # (B, E) @ (E, E)
    attended @ Wr  # readout (B, E) @ (E, V)
    attended.T @ dlogits, dlogits @ Wr.T  # readout backward
    mixed.T @ attended, attended @ Wv.T  # value map backward
    (X @ mixed[:, :, None]), (scores[:, None] @ X)  # attention backward: dweights, d(q_items)
    right = np.concatenate([q_items, mixed])  # (2B, E): [Q; dO] in the model
    for rows in (num_keys, Wr.shape[1]):  # each table's gradient (embedding_backward_factored)
        np.ones((2 * X.shape[0], rows), X.dtype).T @ right  # (K or V, 2B) @ (2B, E)
    q_items.T @ query, q_items @ Wk  # key map backward
    q.T @ query, query @ Wq.T  # query projection backward
    return scores


class StepFloor:
    """The kv-recall step as straight numpy: forward, loss, backward, Adam (see the module)."""

    def __init__(self, dtype):
        from benchmarks.workloads import training

        self.dtype = np.dtype(dtype)
        config = training.training_config("kv-recall", self.dtype)
        if (config.variant, config.optimizer, config.weight_decay) != ("separate", "adam", 0):
            raise ValueError("the floor is written for the default kv-recall configuration")
        data = training.make_training_data("kv-recall", self.dtype)
        self.batches = training.training_batches("kv-recall", data)
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

    def step(self):
        from scipy.sparse import csc_array
        from scipy.special import log_softmax, softmax

        keys, values, query, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        p, g, c = self.p, self.g, self.scale
        B = keys.shape[0]
        self.grad[...] = 0
        items = p["embed_key.weight"][keys] + p["embed_value.weight"][values]  # (B, P, E)
        query_token = p["embed_key.weight"][query] + p["query_marker"]  # (B, E)
        q = query_token @ p["attention.W_query"]  # (B, E)
        q_items = q @ p["attention.W_key"].T  # (B, E): q K^T = (q W_k^T) X^T
        weights = softmax((items @ q_items[:, :, None])[..., 0] * c, axis=-1)  # (B, P)
        mixed = (weights[:, None] @ items)[:, 0]  # (B, E)
        attended = mixed @ p["attention.W_value"]  # (B, E)
        logits = attended @ p["readout.W"] + p["readout.b"]  # (B, V)
        log_probs = log_softmax(logits, axis=-1)
        loss = -log_probs[np.arange(B), target].mean()
        dlogits = np.exp(log_probs)  # softmax - onehot, over B
        dlogits[np.arange(B), target] -= 1
        dlogits /= B
        g["readout.W"] += attended.T @ dlogits
        g["readout.b"] += dlogits.sum(axis=0)
        dattended = dlogits @ p["readout.W"].T  # (B, E)
        g["attention.W_value"] += mixed.T @ dattended
        dmixed = dattended @ p["attention.W_value"].T  # (B, E)
        dweights = (items @ dmixed[:, :, None])[..., 0]  # (B, P)
        dscores = weights * (dweights - (weights * dweights).sum(axis=-1, keepdims=True)) * c
        dq_items = (dscores[:, None] @ items)[:, 0]  # (B, E)
        # as keys plus as values: dX = [dS, P] (B, P, 2) @ [q_items; dO] (B, 2, E), never
        # formed: each table's one-hot product folds onto [dS, P] (embedding_backward_factored)
        left = np.stack([dscores, weights], axis=1).reshape(2 * B, -1)  # (2B, P)
        right = np.stack([q_items, dmixed], axis=1).reshape(2 * B, -1)  # (2B, E)
        g["attention.W_key"] += dq_items.T @ q
        dq = dq_items @ p["attention.W_key"]  # (B, E)
        g["attention.W_query"] += query_token.T @ dq
        dquery_token = dq @ p["attention.W_query"].T  # (B, E)
        g["query_marker"] += dquery_token.sum(axis=0)
        for table, ids in (("embed_value.weight", values), ("embed_key.weight", keys)):
            num = g[table].shape[0]
            slots = np.arange(2 * B).reshape(B, 2, 1) * num + ids[:, None, :]  # (B, 2, P)
            folded = np.bincount(slots.ravel(), weights=left.ravel(), minlength=2 * B * num)
            g[table] += folded.reshape(2 * B, num).T.astype(self.dtype) @ right  # (num, E)
        num, width = g["embed_key.weight"].shape  # the query's lookup: (B, E) entries
        if self.dtype == np.float64 and B * width <= BINCOUNT_MAX_ENTRIES:  # as embedding_backward
            slots = (query[:, None] * width + np.arange(width)).ravel()
            g["embed_key.weight"] += np.bincount(slots, weights=dquery_token.ravel(),
                                                 minlength=num * width).reshape(num, width)
        else:
            onehot_t = csc_array((np.ones(B, self.dtype), query, np.arange(B + 1)), shape=(num, B))
            g["embed_key.weight"] += onehot_t @ dquery_token
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
    the benchmark's tolerance (``training.LOSS_TOLERANCES``).
    """
    from benchmarks.workloads import training

    data = training.make_training_data("kv-recall", dtype)
    expected = training.make_training_runner("qkvnp", "kv-recall", dtype, data).result()["loss"]
    floor = StepFloor(dtype)
    with blas_threads(1):
        got = np.array([floor.step() for _ in range(training.CHECK_STEPS)])
    error, ok = training.check_losses(got, expected, dtype)
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


def run(dtype="float64", B=64, P=16, E=64, K=64, V=64, rounds=7, calls=200):
    """Print the two floors and qkvnp's step of the default kv-recall task in ``dtype``."""
    from benchmarks.workloads import training

    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    X = rng.standard_normal((B, P, E)).astype(dtype)
    q, Wq, Wk, Wv = (rng.standard_normal(shape).astype(dtype)
                     for shape in ((B, E), (E, E), (E, E), (E, E)))
    Wr, dlogits = rng.standard_normal((E, V)).astype(dtype), rng.standard_normal((B, V)).astype(dtype)
    with blas_threads(1):
        seconds = time_steps(lambda: step_products(X, q, Wq, Wk, Wv, Wr, dlogits, K),
                             rounds, calls)
    print(f"{dtype.name}: the products of one kv-recall step at one BLAS thread: "
          f"{1e3 * seconds:.3f} ms (median of {rounds} rounds of {calls})")
    check_floor(dtype)
    data = training.make_training_data("kv-recall", dtype)
    library = training.make_training_runner("qkvnp", "kv-recall", dtype, data)
    with blas_threads(1):
        for name, step in (("the whole step as straight numpy, one BLAS thread",
                            StepFloor(dtype).step),
                           ("qkvnp's step (workloads/training.py), one BLAS thread", library.step)):
            seconds = time_steps(step, rounds, calls * 2)
            print(f"{dtype.name}: {name}: {1e3 * seconds:.3f} ms (median of {rounds} rounds "
                  f"of {calls * 2})")


def main(argv=None):
    """``python benchmarks/kv_recall_ceiling.py [float64|float32]``; return the exit status."""
    parser = argparse.ArgumentParser(prog="python benchmarks/kv_recall_ceiling.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dtype", nargs="?", default="float64", choices=("float64", "float32"))
    run(parser.parse_args(argv).dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
