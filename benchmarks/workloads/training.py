"""Training steps per second: qkvnp's two training tasks against the same models in PyTorch.

Shape key: B batch, P stored key/value pairs, T sequence length, E embedding,
H heads, V value vocabulary.

One step is what a training loop repeats: zero the gradients, forward, loss,
backward, optimizer step (Adam), and read the loss as a Python float. The
batches are sampled beforehand (:data:`TRAINING_BATCHES` of them, cycled), so
no sampling is timed. Both libraries start from the same initial weights and
see the same batches:

``kv-recall``
    qkvnp: :class:`qkvnp.training.KVRecallModel` (the ``train`` command's
    default configuration: K = V = 64, P = 16, E = 64, B = 64), cross-entropy
    from :mod:`qkvnp.losses`, :class:`qkvnp.optim.Adam`, BLAS at one thread
    as in :func:`qkvnp.training.train`. PyTorch: the same forward written in
    torch ops (embedding lookups, matmuls, softmax, ``F.cross_entropy``),
    autograd, ``torch.optim.Adam``. Both fold the key and value projections
    onto the one query, as the model does (its Notes): neither forms ``K``
    or ``V``; both look the query's key up apart from the items'.
``teacher``
    qkvnp: :class:`qkvnp.training.AttentionRegressor`, a
    :class:`~qkvnp.MultiHeadAttention` with (B, T, E, H) = (64, 8, 16, 2),
    mean squared error against the teacher's outputs. PyTorch:
    ``nn.MultiheadAttention(batch_first=True)`` called with
    ``need_weights=False``, ``F.mse_loss``, ``torch.optim.Adam``.

Before timing, :data:`CHECK_STEPS` steps from the initial weights must give
the same losses in both libraries (:data:`LOSS_TOLERANCES`).
"""
import math
import os
import tempfile

import numpy as np

from benchmarks.harness.workers import WorkerError, time_alternating
from benchmarks.workloads.attention import import_torch

__all__ = [
    "TRAINING_TASKS",
    "TRAINING_BATCHES",
    "CHECK_STEPS",
    "LOSS_TOLERANCES",
    "training_config",
    "make_training_data",
    "training_batches",
    "make_training_runner",
    "check_losses",
    "run_training_case",
]

TRAINING_TASKS = ("kv-recall", "teacher")
#: Batches sampled before timing, used in turn.
TRAINING_BATCHES = 16
#: Steps from the initial weights whose losses are compared before timing.
CHECK_STEPS = 5
#: Largest relative difference between the two libraries' losses over the
#: check steps. float64: as tests/training/test_trajectory_torch.py (over 100
#: steps there). float32: the paths' float32 tolerance
#: (qkvnp.kernels.PATH_TOLERANCES); measured 1.1e-7 for kv-recall, 8e-8 for teacher.
LOSS_TOLERANCES = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-5}


def training_config(task, dtype):
    """The :class:`qkvnp.training.TrainConfig` of one benchmark case: defaults, constant lr."""
    from qkvnp.training import TrainConfig

    return TrainConfig(task=task, dtype=np.dtype(dtype).name, schedule="constant").resolved()


def make_training_data(task, dtype, batches=TRAINING_BATCHES):
    """Initial weights and pre-sampled batches of one case, as a flat dict of arrays.

    Drawn as :func:`qkvnp.training.train` draws them (the seed's ``init``,
    ``teacher`` and ``data`` streams). Keys: ``param/<name>`` and
    ``batch/<i>/<field>`` (``keys, values, query, target`` for kv-recall,
    ``x, target`` for the teacher task).
    """
    from qkvnp.training import make_streams
    from qkvnp.training.loop import build_model, build_task

    config = training_config(task, dtype)
    streams = make_streams(config.seed)
    task_object = build_task(config, streams.teacher)
    model = build_model(config, streams.init)
    data = {"param/" + name: np.array(value) for name, value in model.params.items()}
    for index in range(batches):
        batch = task_object.sample(streams.data, config.batch_size)
        for field in _fields(task):
            data[f"batch/{index}/{field}"] = np.array(getattr(batch, field))
    return data


def _fields(task):
    return ("keys", "values", "query", "target") if task == "kv-recall" else ("x", "target")


def training_batches(task, data):
    """The batches of ``data`` as a list of tuples, the target last.

    kv-recall: ``(keys, values, query, target)``; teacher: ``(x, target)``.
    """
    count = len({key.split("/")[1] for key in data if key.startswith("batch/")})
    return [tuple(data[f"batch/{index}/{field}"] for field in _fields(task))
            for index in range(count)]


class _QkvnpTraining:
    library = "qkvnp"

    def __init__(self, task, dtype, data):
        from qkvnp.kernels import blas_threads
        from qkvnp.losses import (cross_entropy_backward, cross_entropy_forward, mse_backward,
                                  mse_forward)
        from qkvnp.training.loop import build_model, build_optimizer

        config = training_config(task, dtype)
        self.model = build_model(config, 0)
        params = self.model.params
        for name, value in params.items():
            value[...] = data["param/" + name]  # in place: the layers share these arrays
        self.optimizer = build_optimizer(config, params)
        self.loss_forward, self.loss_backward = ((cross_entropy_forward, cross_entropy_backward)
                                                 if task == "kv-recall" else
                                                 (mse_forward, mse_backward))
        self.batches = training_batches(task, data)
        self.index = 0
        self.blas_threads = blas_threads

    def step(self):
        """One training step on the next batch; returns the loss."""
        *inputs, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        model = self.model
        model.zero_grad()
        out = model.forward(*inputs)
        loss, cache = self.loss_forward(out, target)
        model.backward(self.loss_backward(1.0, cache))
        self.optimizer.step(model.grads)
        return float(loss)

    def repeat(self, method, calls):
        # NOTE: BLAS at one thread, as qkvnp.training.train runs its loop:
        # these matrices are too small to share between threads
        with self.blas_threads(1):
            for _ in range(calls):
                self.step()

    def result(self):
        with self.blas_threads(1):
            return {"loss": np.array([self.step() for _ in range(CHECK_STEPS)])}


def _torch_kv_recall_logits(torch, weights, roles, keys, values, query, dim):
    """The forward of :class:`qkvnp.training.KVRecallModel`, in torch ops."""
    # the query's key looked up apart from the items', as the model does
    # (PyTorch's step is faster that way too than with one lookup of both)
    items = weights["embed_key.weight"][keys] + weights["embed_value.weight"][values]  # (B, P, E)
    query_token = weights["embed_key.weight"][query][:, None] + weights["query_marker"]  # (B, 1, E)
    role_q, role_k, role_v = roles
    # the same ops as qkvnp's model, which folds the key and value
    # projections onto the one query (its Notes): K and V are never formed
    q = query_token @ weights[role_q]  # (B, 1, E)
    q_items = q @ weights[role_k].T  # (B, 1, E): q K^T = (q W_k^T) X^T
    scores = q_items @ items.transpose(-1, -2) / math.sqrt(dim)  # (B, 1, P)
    mixed = torch.softmax(scores, dim=-1) @ items  # (B, 1, E)
    attended = mixed if role_v is None else mixed @ weights[role_v]  # (B, 1, E)
    return attended[:, 0] @ weights["readout.W"] + weights["readout.b"]  # (B, V)


class _TorchTraining:
    library = "torch"

    def __init__(self, task, dtype, data):
        torch = import_torch()
        self.torch = torch
        config = training_config(task, dtype)
        if config.optimizer != "adam":
            raise ValueError(f"the benchmark rebuilds Adam only, got {config.optimizer!r}")
        self.batches = [tuple(torch.from_numpy(array) for array in batch)
                        for batch in training_batches(task, data)]
        self.index = 0
        params = {name[len("param/"):]: value for name, value in data.items()
                  if name.startswith("param/")}
        if task == "kv-recall":
            from qkvnp.training import VARIANTS

            weights = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
            roles = tuple(None if name is None else "attention." + name
                          for name in VARIANTS[config.variant])
            self.forward = lambda keys, values, query: _torch_kv_recall_logits(
                torch, weights, roles, keys, values, query, config.dim)
            self.loss = torch.nn.functional.cross_entropy
            parameters = list(weights.values())
        else:
            E, H = config.embed_dim, config.num_heads
            mha = torch.nn.MultiheadAttention(E, H, bias=True, batch_first=True,
                                              dtype=getattr(torch, np.dtype(dtype).name))
            with torch.no_grad():
                # PyTorch stores the transposes of qkvnp's x @ W weights
                in_proj = np.concatenate([params["attention.W_" + name].T
                                          for name in ("query", "key", "value")])  # -> (3E, E)
                mha.in_proj_weight.copy_(torch.from_numpy(in_proj))
                mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate(
                    [params["attention.b_" + name] for name in ("query", "key", "value")])))
                mha.out_proj.weight.copy_(torch.from_numpy(params["attention.W_out"].T.copy()))
                mha.out_proj.bias.copy_(torch.from_numpy(params["attention.b_out"]))
            self.forward = lambda x: mha(x, x, x, need_weights=False)[0]
            self.loss = torch.nn.functional.mse_loss
            parameters = list(mha.parameters())
        self.optimizer = torch.optim.Adam(parameters, lr=config.lr)

    def step(self):
        """One training step on the next batch; returns the loss."""
        *inputs, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        self.optimizer.zero_grad()
        loss = self.loss(self.forward(*inputs), target)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def repeat(self, method, calls):
        for _ in range(calls):
            self.step()

    def result(self):
        return {"loss": np.array([self.step() for _ in range(CHECK_STEPS)])}


def make_training_runner(library, task, dtype, data):
    """The training step of ``task`` in ``library`` ("qkvnp" or "torch").

    Parameters
    ----------
    library : {"qkvnp", "torch"}
    task : {"kv-recall", "teacher"}
    dtype : float32 or float64
    data : dict of ndarray or str
        :func:`make_training_data`'s dict, or the path of an ``.npz`` file holding it.

    Returns
    -------
    runner
        ``library``, ``step()`` (one step, returns the loss),
        ``repeat(method, calls)`` (``calls`` steps: what is timed) and
        ``result()`` (``{"loss": losses of CHECK_STEPS steps}``, to call first,
        from the initial weights).
    """
    if task not in TRAINING_TASKS:
        raise ValueError(f"task must be one of {TRAINING_TASKS}, got {task!r}")
    if isinstance(data, str):
        with np.load(data, allow_pickle=False) as stored:
            data = dict(stored)
    classes = {"qkvnp": _QkvnpTraining, "torch": _TorchTraining}
    if library not in classes:
        raise ValueError(f"library must be 'qkvnp' or 'torch', got {library!r}")
    return classes[library](task, dtype, data)


def check_losses(losses, expected, dtype):
    """Largest relative difference of two loss sequences, and whether it is within tolerance.

    Returns
    -------
    error : float
        ``max |losses - expected| / |expected|``; inf on a shape mismatch or
        a non-finite loss.
    ok : bool

    >>> error, ok = check_losses(np.array([2.0, 1.0]), np.array([2.0, 1.5]), "float64")
    >>> error, ok
    (0.3333333333333333, False)
    """
    losses = np.asarray(losses, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if losses.shape != expected.shape or not np.isfinite(losses).all():
        return float("inf"), False
    error = float(np.max(np.abs(losses - expected) / np.abs(expected)))
    return error, error <= LOSS_TOLERANCES[np.dtype(dtype)]


def run_training_case(task, dtype, pool, repeats, warmup=1, pause=0.3, round_seconds=0.05,
                      progress=None, torch_threads=None):
    """Check, then time, one task's training step in qkvnp and PyTorch, one process each.

    Parameters
    ----------
    task : {"kv-recall", "teacher"}
    dtype : float32 or float64
    pool : workers.WorkerPool
        Its workers ``"qkvnp"`` and ``"torch"`` run the steps.
    repeats, warmup, pause, round_seconds, progress
        As :func:`harness.workers.time_alternating`.
    torch_threads : int, optional
        PyTorch's thread count; default PyTorch's own.

    Returns
    -------
    dict
        ``task, dtype, status`` ("ok"; "refused" when the losses disagree;
        "error"), ``reason`` (also why PyTorch is missing), ``check``
        (``max_rel_err``, ``tolerance``, the ``losses`` of both libraries),
        ``qkvnp`` and ``torch`` (``step_ms``: median and the per-round times
        of one step, ``calls_per_round``; ``steps_per_s`` = 1000 / median),
        ``speedup`` (qkvnp's steps/s / PyTorch's).
    """
    dtype = np.dtype(dtype)
    record = {"task": task, "dtype": dtype.name, "status": "ok", "reason": None, "check": None,
              "qkvnp": None, "torch": None, "speedup": None}
    losses, workers = {}, {}
    with tempfile.TemporaryDirectory(prefix="qkvnp-bench-") as directory:
        data_path = os.path.join(directory, "data.npz")
        np.savez(data_path, **make_training_data(task, dtype))
        for library in ("qkvnp", "torch"):
            worker = pool.get(library)
            try:
                reply = worker.request("setup", workload="training", spec={
                    "library": library, "task": task, "dtype": dtype.name, "data": data_path,
                    "torch_threads": torch_threads if library == "torch" else None})
                if "missing" in reply:  # PyTorch: qkvnp is still timed
                    record["reason"] = reply["missing"]
                    continue
                path = os.path.join(directory, library + ".npz")
                worker.request("result", path=path)
                with np.load(path, allow_pickle=False) as stored:
                    losses[library] = stored["loss"]
            except WorkerError as error:
                record["status"], record["reason"] = "error", str(error)
                return record
            workers[library] = worker
    if "torch" in losses:
        error, ok = check_losses(losses["qkvnp"], losses["torch"], dtype)
        record["check"] = {"max_rel_err": error if np.isfinite(error) else None,
                           "tolerance": LOSS_TOLERANCES[dtype],
                           "losses": {name: [float(x) for x in value]
                                      for name, value in losses.items()}}
        if not ok:
            record["status"] = "refused"
            record["reason"] = (f"the losses of the first {CHECK_STEPS} steps disagree: relative "
                                f"difference {error:.3g} > {LOSS_TOLERANCES[dtype]:g}")
            return record
    try:
        seconds, calls = time_alternating(workers, "fwd_bwd", repeats, warmup, pause,
                                          round_seconds, progress)
    except WorkerError as error:
        record["status"], record["reason"] = "error", f"while timing: {error}"
        return record
    for library in workers:
        ms = 1e3 * np.asarray(seconds[library])
        median = float(np.median(ms))
        record[library] = {"step_ms": median, "q1_ms": float(np.percentile(ms, 25)),
                           "q3_ms": float(np.percentile(ms, 75)),
                           "times_ms": [float(t) for t in ms], "calls_per_round": calls[library],
                           "steps_per_s": 1e3 / median}
    if record["qkvnp"] and record["torch"]:
        record["speedup"] = record["qkvnp"]["steps_per_s"] / record["torch"]["steps_per_s"]
    return record
