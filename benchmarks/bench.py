"""Time qkvnp's attention paths against PyTorch on this CPU, forward and backward.

Shape key: B batch, L sequence length (queries and keys alike), E embedding,
H heads, D = E // H head dim.

The harness of a checkout, not part of the installed package: run it as
``python benchmarks/run.py [options]`` (``--help`` lists them). It uses the
public names of qkvnp, plus the shared helpers of :mod:`qkvnp.kernels._runtime`
(worker threads, the OpenBLAS probe) and ``qkvnp._io.atomic_write``. Dated
results: ``benchmarks/RESULTS.md``.

What runs
---------
The grid: the users' sizes (:data:`USER_CONFIGS`, from the seeds' (1, 6, 3, 1)
to (32, 64, 128, 8)) and four large ones (:data:`LARGE_CONFIGS`, L = 128 to
4096), float32 and float64, each without a mask and causal. Configurations
with L <= 128 time the layer's default path against PyTorch's layer, each
in a process of its own (:mod:`workers`); the longer ones run every
workload and implementation in this process. The training steps of the two
training tasks are timed too (:mod:`train_bench`), and :mod:`summary` turns
the report into plain sentences, a ratio table and the ratio plot.

For a configuration, dtype and mask, two workloads, each in two modes,
``fwd`` (the forward of a training step: qkvnp keeps its caches, PyTorch
records the autograd graph; timed in this process only) and ``fwd+bwd``
(that forward, then the backward with a fixed random upstream gradient):

``layer``
    Self-attention of ``x`` of shape (B, L, E) through
    ``MultiHeadAttention(E, H, bias=True, impl=NAME)`` for each qkvnp
    implementation ``reference``, ``fast``, ``tiled`` and ``auto`` (the
    layers' default, which picks fast or tiled), and through PyTorch's
    ``nn.MultiheadAttention(E, H, batch_first=True)`` called with
    ``need_weights=False``. The weights are copied across, so that all of
    them compute the same function. Causal: qkvnp's ``is_causal=True``;
    PyTorch gets the float causal mask with ``is_causal=True``, which with
    ``need_weights=False`` reaches ``scaled_dot_product_attention`` as its
    causal hint.
``core``
    The attention core alone on (B, H, L, D) inputs, no projections:
    ``attention_forward``/``attention_backward`` of ``qkvnp.functional``
    (reference), ``qkvnp.kernels.fast`` and ``qkvnp.kernels.tiled``, against
    ``torch.nn.functional.scaled_dot_product_attention``.

An implementation that this qkvnp does not offer (a module that does not
import, a layer that refuses the ``impl=`` name) or that PyTorch's absence
rules out is reported as missing; the others still run.

Correctness before speed
------------------------
Before anything is timed, every implementation's output and gradients (of
the input and of every weight and bias) are compared with qkvnp's reference
path, the oracle that the test suite checks against PyTorch autograd and
central differences. The error of an array is ``max|a - r| / max|r|``
(relative to the array's scale); the tolerance is the one the tests use,
:data:`qkvnp.kernels.PATH_TOLERANCES` (1e-12 in float64, 1e-5 in float32). An
implementation that exceeds it, or returns a
non-finite value or a wrong shape, is *refused*: its times are not reported,
and the command exits with status 1.

FLOPs
-----
Matmul FLOPs only, 2 per multiply-add; softmax, masking, bias adds and
copies are not counted, and no causal mask is used.

* layer forward: ``8*B*L*E*E`` for the four projections (Q, K, V and the
  output, each ``(B*L, E) @ (E, E)``) plus ``4*B*L*L*E`` for attention;
* core forward: ``4*B*L*L*E`` = ``2 * 2*B*H*L*L*D`` (``Q K^T`` and ``P V``);
* forward+backward = 3 x forward: the backward of each matmul is two matmuls
  of the same size (one per input).

These are the nominal FLOPs of the dense algorithm: the tiled path's
recomputation of ``Q K^T`` in its backward is not counted (as FlashAttention
papers report it). Achieved GFLOP/s = counted FLOPs / median time; "% peak"
divides it by the GEMM peak measured in the same run: ``numpy.matmul`` of two
square matrices (n = 2048, ``out=`` given) in the same dtype, best of several.

Timing
------
L <= 128 (:data:`PROCESS_MAX_LENGTH`): each implementation in a worker process
of its own (the qkvnp ones never import PyTorch); the parent asks them in
turn for one timed round each, qkvnp, PyTorch, qkvnp, ..., pausing between
rounds; a round is as many calls as last at least ``--round-time`` seconds;
reported: the median over rounds of the time per call. Idle threads of one
library's pool slowed the other by up to 4x at these sizes when both lived
in one process.

Longer: one process; within a configuration, dtype and mode the implementations run
interleaved round by round (the starting one rotating), after a warm-up
round, so that a change in the machine's load hits them alike. The process
sleeps ``--pause`` seconds before each call that follows another
implementation's. Idle OpenBLAS/OpenMP threads spin for a while after a call
and slow whatever runs next on the 2 cores: without the pause after the
reference path (multi-threaded OpenBLAS), the fast core measured up to 1.7x
slower, and the fast layer 1.6x slower right after the tiled layer (whose
calls with a single block of work also run on OpenBLAS's threads). PyTorch runs with
its default thread count (2 on the 2-core machine), as users get it; numpy's
BLAS with its own default. Reported:
median, minimum and interquartile range of ``--repeats`` timed calls (7 by
default), and the ratio ``median(qkvnp) / median(PyTorch)`` of the same
workload (``nn.MultiheadAttention`` for layers, ``scaled_dot_product_attention``
for the core): below 1 means qkvnp is faster.

Memory
------
Peak extra memory of one forward+backward, measured for every
implementation in a fresh Python process: the inputs and weights are built,
every library is warmed up on a tiny problem, then the kernel's peak-RSS
counter is reset (``/proc/self/clear_refs``), and the peak resident set
during the call minus the resident set before it is reported (it includes
the outputs, gradients and caches that the call creates). PyTorch's
allocations do not show in ``tracemalloc``, so the RSS number is the one that
compares libraries; for qkvnp the ``tracemalloc`` peak of a second call is
also recorded in the JSON output. Where ``clear_refs`` cannot be written, the
``ru_maxrss`` delta is used instead (an underestimate when importing cost more
than the call) and the method is named in the output.

Import cost
-----------
``import numpy`` and ``import qkvnp`` are timed inside fresh interpreters
(``time.perf_counter`` around the import statement, interpreter start-up
excluded), interleaved, median of several; the output also lists every
module outside the standard library that ``import qkvnp`` loads beyond those
of ``import numpy`` (there should be none: scipy is imported on first use).

Examples
--------
>>> layer_flops(Config(1, 2, 4, 2))      # 8*1*2*4*4 + 4*1*2*2*4
320
>>> core_flops(Config(1, 2, 4, 2), backward=True)   # 3 * 4*1*2*2*4
192
"""
import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import namedtuple

import numpy as np

import qkvnp
from qkvnp import MultiHeadAttention
from qkvnp._io import atomic_write  # the package's one atomic write (shared helper module)
from qkvnp.kernels import IMPLS, PATH_TOLERANCES, blas_threads
from qkvnp.kernels._runtime import get_num_threads, openblas_info
from qkvnp.kernels._runtime import run as run_in_workers

__all__ = [
    "Config",
    "DEFAULT_CONFIGS",
    "QUICK_CONFIGS",
    "OFF_GRID_CONFIGS",
    "IMPLEMENTATIONS",
    "ImplementationMissing",
    "Problem",
    "Check",
    "layer_flops",
    "core_flops",
    "make_problem",
    "make_runner",
    "relative_error",
    "cross_check",
    "time_interleaved",
    "measure_gemm_peak",
    "measure_attention_gemm_ceiling",
    "measure_import_time",
    "measure_memory",
    "checkout_commit",
    "environment_info",
    "run_benchmark",
    "target_requirements",
    "format_report",
    "write_json",
    "read_json",
    "plot_results",
    "add_arguments",
    "run",
    "main",
]

Config = namedtuple("Config", "batch length embed heads")
Config.__doc__ = "One benchmark configuration (B, L, E, H)."

#: The sizes qkvnp's users work at: the seeds' 6-token example, learners'
#: experiments, the teacher task's (64, 8, 16, 2).
USER_CONFIGS = (
    Config(1, 6, 3, 1),
    Config(8, 16, 32, 4),
    Config(64, 8, 16, 2),
    Config(16, 32, 64, 4),
    Config(64, 33, 64, 1),
    Config(32, 64, 128, 8),
)
LARGE_CONFIGS = (
    Config(8, 128, 256, 8),
    Config(4, 512, 512, 8),
    Config(1, 2048, 512, 8),
    Config(1, 4096, 256, 4),
)
DEFAULT_CONFIGS = USER_CONFIGS + LARGE_CONFIGS
QUICK_CONFIGS = USER_CONFIGS + (Config(8, 128, 256, 8), Config(4, 512, 512, 8))
#: ``--off-grid``: sizes users bring that the grid does not hold. BERT-base's
#: attention (E = 768, 12 heads) on one short sentence, one 128-token sentence
#: and a batch of 8; GPT-2 small's as the book pretrains it (2 x 256 tokens)
#: and at its full context; lengths that are not powers of two.
OFF_GRID_CONFIGS = (
    Config(1, 16, 768, 12),
    Config(4, 100, 64, 4),
    Config(1, 128, 768, 12),
    Config(8, 128, 768, 12),
    Config(32, 200, 64, 4),
    Config(2, 256, 768, 12),
    Config(1, 1000, 64, 1),
    Config(1, 1024, 768, 12),
)
#: Configurations up to this L are timed with one library per process
#: (:mod:`workers`); longer ones in this process, with pauses.
PROCESS_MAX_LENGTH = 128
PROTOCOLS = ("processes", "same process")
MASKS = ("none", "causal")
#: A round of the one-library-per-process protocol lasts at least this long (s).
#: 0.25 (was 0.05): each round follows a pause, and the first calls after it
#: run slow on some hosts. On an AMD EPYC host (2026-11-24 23:40 UTC, one run
#: of 7 rounds each) 0.05 s rounds took 0.95-1.64x as long a call as 0.25 s
#: rounds at (8, 16, 32, 4) and (64, 8, 16, 2), both libraries alike (qkvnp's
#: (8, 16, 32, 4) float32 331 against 221 us, PyTorch's 769 against 508), and
#: 0.78-1.28x at (16, 32, 64, 4). At (1, 6, 3, 1) float64 causal a hot loop
#: took 115 us, 0.25 s rounds 137, 0.05 s rounds 175-209.
ROUND_SECONDS = 0.25

KINDS = ("layer", "core")
MODES = ("fwd", "fwd_bwd")
MODE_LABELS = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}
# the layers' impl names (qkvnp.kernels.IMPLS), the three paths first and
# "auto", the layers' default dispatch (fast or tiled), after them; then PyTorch
IMPLEMENTATIONS = tuple(sorted(IMPLS, key=lambda impl: impl == "auto")) + ("torch",)
# the core has no dispatch
KIND_IMPLEMENTATIONS = {"layer": IMPLEMENTATIONS,
                        "core": tuple(i for i in IMPLEMENTATIONS if i != "auto")}
ORACLE = "reference"

# the memory target for the tiled core: (B, H, L, D), float32, MiB
TILED_MEMORY_SHAPE = (1, 1, 16384, 64)
TILED_MEMORY_LIMIT_MIB = 64

GEMM_SIZE = 2048
#: One head of this (L, D) measures the BLAS ceiling on attention shapes (in cache).
CEILING_LENGTH = 512
CEILING_HEAD_DIM = 64
MIB = 2.0 ** 20

LAYER_PARAMS = ("W_query", "W_key", "W_value", "W_out", "b_query", "b_key", "b_value", "b_out")
CORE_MODULES = {"reference": "qkvnp.functional", "fast": "qkvnp.kernels.fast",
                "tiled": "qkvnp.kernels.tiled"}
#: What a child process (memory, import cost) puts first on ``sys.path``: this
#: harness's directory, and the directory of the qkvnp this process imported.
CHILD_PATH = [os.path.dirname(os.path.abspath(__file__)),
              os.path.dirname(os.path.dirname(os.path.abspath(qkvnp.__file__)))]


class ImplementationMissing(Exception):
    """This qkvnp (or this machine) does not offer the implementation."""


Problem = namedtuple("Problem", "kind config dtype arrays causal", defaults=(False,))
Problem.__doc__ = ("A workload's concrete inputs: kind, Config, dtype, dict of arrays, and "
                   "whether the attention is causal.")

Check = namedtuple("Check", "ok error worst tolerance")
Check.__doc__ = "Cross-check verdict: ok, worst relative error, its array name, tolerance."


# ---------------------------------------------------------------- FLOPs


def layer_flops(config, backward=False):
    """Matmul FLOPs of multi-head self-attention, projections included.

    Forward: ``8*B*L*E*E + 4*B*L*L*E``; with ``backward=True``, 3 x that.

    Parameters
    ----------
    config : Config
    backward : bool
        Count forward+backward instead of the forward alone.

    Returns
    -------
    int
    """
    B, L, E, _ = config
    forward = 4 * 2 * B * L * E * E + 4 * B * L * L * E
    return 3 * forward if backward else forward


def core_flops(config, backward=False):
    """Matmul FLOPs of the attention core: ``4*B*L*L*E`` forward, 3 x with backward.

    ``Q K^T`` and ``P V`` each cost ``2*L*L*D`` per (batch, head) pair, and
    ``H*D = E``.
    """
    B, L, E, _ = config
    forward = 4 * B * L * L * E
    return 3 * forward if backward else forward


FLOPS = {"layer": layer_flops, "core": core_flops}


# ---------------------------------------------------------------- problems


def _check_config(config, name="config"):
    try:
        config = Config(*(int(n) for n in config))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be four integers (B, L, E, H), got {config!r}") from None
    if min(config) < 1:
        raise ValueError(f"{name} must hold positive integers (B, L, E, H), got {tuple(config)}")
    if config.embed % config.heads:
        raise ValueError(
            f"{name} must have E divisible by H, got E={config.embed} and H={config.heads}"
        )
    return config


def _check_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype not in PATH_TOLERANCES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def make_problem(kind, config, dtype, seed=0, causal=False):
    """Build the inputs of one workload, reproducibly.

    Parameters
    ----------
    kind : {"layer", "core"}
    config : Config or tuple (B, L, E, H)
    dtype : float32 or float64
    seed : int
    causal : bool
        Every implementation then attends causally (position i to keys <= i).

    Returns
    -------
    Problem
        ``layer``: ``x`` and ``dout`` of shape (B, L, E), the weights
        ``W_*`` (E, E) (Xavier uniform) and biases ``b_*`` (E,) (small,
        nonzero so that their gradients are checked). ``core``: ``query``,
        ``key``, ``value`` and ``dout`` of shape (B, H, L, D). Entries are
        standard normal unless said otherwise.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    config = _check_config(config)
    dtype = _check_dtype(dtype)
    rng = np.random.default_rng(seed)
    B, L, E, H = config
    if kind == "layer":
        arrays = {
            "x": rng.standard_normal((B, L, E), dtype=dtype),
            "dout": rng.standard_normal((B, L, E), dtype=dtype),
        }
        bound = np.sqrt(6.0 / (E + E))
        for name in LAYER_PARAMS:
            if name.startswith("W_"):
                arrays[name] = rng.uniform(-bound, bound, (E, E)).astype(dtype)
            else:
                arrays[name] = (0.1 * rng.standard_normal(E)).astype(dtype)
    else:
        shape = (B, H, L, E // H)
        arrays = {name: rng.standard_normal(shape, dtype=dtype)
                  for name in ("query", "key", "value", "dout")}
    return Problem(kind, config, dtype, arrays, bool(causal))


# ---------------------------------------------------------------- runners
# A runner owns one implementation set up on one problem. forward() and
# forward_backward() are what is timed; result() returns the output and every
# gradient, computed afresh, as a dict of numpy arrays for the cross-check.


def _import_torch():
    try:
        import torch
    except ImportError:
        raise ImplementationMissing(
            "PyTorch is not installed (pip install 'qkvnp[torch]')"
        ) from None
    return torch  # NOTE: at its default thread count, as users get it


class _QkvnpLayer:
    library = "qkvnp"

    def __init__(self, impl, problem):
        B, L, E, H = problem.config
        try:
            self.layer = MultiHeadAttention(E, H, bias=True, rng=0, dtype=problem.dtype, impl=impl)
        except (ValueError, TypeError) as error:
            if "impl" in str(error):
                raise ImplementationMissing(f"MultiHeadAttention(impl={impl!r}): {error}") from None
            raise
        for name in LAYER_PARAMS:
            np.copyto(self.layer.params[name], problem.arrays[name])
        self.layer.zero_grad()
        self.x = problem.arrays["x"]
        self.dout = problem.arrays["dout"]
        self.causal = problem.causal

    @property
    def dispatch(self):
        """The path the layer's last forward ran and why, as a dict (None before one)."""
        last = self.layer.last_dispatch
        return None if last is None else {"path": last.path, "reason": last.reason}

    def forward(self):
        return self.layer.forward(self.x, is_causal=self.causal)

    def forward_backward(self):
        self.layer.forward(self.x, is_causal=self.causal)
        return self.layer.backward(self.dout)

    def result(self):
        self.layer.zero_grad()
        out = self.layer.forward(self.x, is_causal=self.causal)
        dx = self.layer.backward(self.dout)
        results = {"out": out, "dx": dx}
        results.update(("d" + name, self.layer.grads[name].copy()) for name in LAYER_PARAMS)
        self.layer.zero_grad()
        return results


class _QkvnpCore:
    library = "qkvnp"

    def __init__(self, impl, problem):
        import importlib

        module_name = CORE_MODULES[impl]
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImplementationMissing(f"{module_name} does not import: {error}") from None
        try:
            self.attention_forward = module.attention_forward
            self.attention_backward = module.attention_backward
        except AttributeError as error:
            raise ImplementationMissing(f"{module_name}: {error}") from None
        self.query = problem.arrays["query"]
        self.key = problem.arrays["key"]
        self.value = problem.arrays["value"]
        self.dout = problem.arrays["dout"]
        self.causal = problem.causal

    def forward(self):
        return self.attention_forward(self.query, self.key, self.value, is_causal=self.causal)[0]

    def forward_backward(self):
        out, cache = self.attention_forward(self.query, self.key, self.value, is_causal=self.causal)
        return self.attention_backward(self.dout, cache)

    def result(self):
        out, cache = self.attention_forward(self.query, self.key, self.value, is_causal=self.causal)
        dquery, dkey, dvalue = self.attention_backward(self.dout, cache)
        return {"out": out, "dquery": dquery, "dkey": dkey, "dvalue": dvalue}


class _TorchLayer:
    library = "torch"

    def __init__(self, problem):
        torch = _import_torch()
        B, L, E, H = problem.config
        a = problem.arrays
        tensor = torch.from_numpy
        self.torch = torch
        self.mha = torch.nn.MultiheadAttention(
            E, H, bias=True, batch_first=True, dtype=getattr(torch, problem.dtype.name)
        )
        with torch.no_grad():
            # PyTorch stores the transposes of qkvnp's x @ W weights
            in_proj = np.concatenate([a["W_query"].T, a["W_key"].T, a["W_value"].T])  # -> (3E, E)
            self.mha.in_proj_weight.copy_(tensor(in_proj))
            self.mha.in_proj_bias.copy_(tensor(np.concatenate([a["b_query"], a["b_key"], a["b_value"]])))
            self.mha.out_proj.weight.copy_(tensor(np.ascontiguousarray(a["W_out"].T)))
            self.mha.out_proj.bias.copy_(tensor(a["b_out"]))
        self.x = tensor(a["x"]).requires_grad_()
        self.dout = tensor(a["dout"])
        self.leaves = [self.x] + list(self.mha.parameters())
        self.masks = {}
        if problem.causal:
            # NOTE: the float mask with the is_causal hint, as PyTorch documents it:
            # with need_weights=False it reaches scaled_dot_product_attention as
            # is_causal=True, and the mask itself is not applied
            self.masks = {"attn_mask": torch.nn.Transformer.generate_square_subsequent_mask(
                L, dtype=self.mha.in_proj_weight.dtype), "is_causal": True}

    def forward(self):
        # query is key is value: PyTorch takes its packed in-projection path
        return self.mha(self.x, self.x, self.x, need_weights=False, **self.masks)[0]

    def forward_backward(self):
        for leaf in self.leaves:
            leaf.grad = None
        self.forward().backward(self.dout)

    def result(self):
        for leaf in self.leaves:
            leaf.grad = None
        out = self.forward()
        out.backward(self.dout)
        E = self.x.shape[-1]
        weight_grad = self.mha.in_proj_weight.grad.numpy()
        bias_grad = self.mha.in_proj_bias.grad.numpy()
        results = {"out": out.detach().numpy(), "dx": self.x.grad.numpy()}
        for i, name in enumerate(("query", "key", "value")):
            results["dW_" + name] = weight_grad[i * E:(i + 1) * E].T  # (E, E) transposed back
            results["db_" + name] = bias_grad[i * E:(i + 1) * E]
        results["dW_out"] = self.mha.out_proj.weight.grad.numpy().T
        results["db_out"] = self.mha.out_proj.bias.grad.numpy()
        return results


class _TorchCore:
    library = "torch"

    def __init__(self, problem):
        torch = _import_torch()
        a = problem.arrays
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.query = torch.from_numpy(a["query"]).requires_grad_()
        self.key = torch.from_numpy(a["key"]).requires_grad_()
        self.value = torch.from_numpy(a["value"]).requires_grad_()
        self.dout = torch.from_numpy(a["dout"])
        self.causal = problem.causal

    def forward(self):
        return self.sdpa(self.query, self.key, self.value, is_causal=self.causal)

    def forward_backward(self):
        self.query.grad = self.key.grad = self.value.grad = None
        self.forward().backward(self.dout)

    def result(self):
        self.query.grad = self.key.grad = self.value.grad = None
        out = self.forward()
        out.backward(self.dout)
        return {"out": out.detach().numpy(), "dquery": self.query.grad.numpy(),
                "dkey": self.key.grad.numpy(), "dvalue": self.value.grad.numpy()}


def make_runner(impl, problem):
    """Set up implementation ``impl`` on ``problem``.

    Parameters
    ----------
    impl : {"reference", "fast", "tiled", "auto", "torch"}
        ``"auto"`` only for the layer workload.
    problem : Problem

    Returns
    -------
    runner
        With ``library`` ("qkvnp" or "torch"), ``forward()``,
        ``forward_backward()`` (the timed calls) and ``result()`` (output and
        every gradient, as a dict of arrays, for the cross-check).

    Raises
    ------
    ImplementationMissing
        If this qkvnp does not offer ``impl`` or PyTorch is not installed.
    """
    if impl not in KIND_IMPLEMENTATIONS[problem.kind]:
        raise ValueError(f"impl must be one of {KIND_IMPLEMENTATIONS[problem.kind]} for the "
                         f"{problem.kind} workload, got {impl!r}")
    if impl == "torch":
        return _TorchLayer(problem) if problem.kind == "layer" else _TorchCore(problem)
    if problem.kind == "layer":
        return _QkvnpLayer(impl, problem)
    return _QkvnpCore(impl, problem)


# ---------------------------------------------------------------- cross-check


def relative_error(actual, expected, scale=None):
    """``max|actual - expected| / scale``, ``scale`` defaulting to ``max|expected|``.

    Returns inf on a shape mismatch or a non-finite entry of ``actual``.

    >>> relative_error(np.array([1.0, 2.01]), np.array([1.0, 2.0]))
    0.005
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape or not np.isfinite(actual).all():
        return float("inf")
    if scale is None:
        scale = float(np.max(np.abs(expected), initial=0.0))
    scale = max(scale, np.finfo(np.float64).tiny)
    return float(np.max(np.abs(actual - expected), initial=0.0)) / scale


def _group(name):
    """Arrays compared on a common scale: all weight gradients, all bias gradients."""
    return name[:3] if name.startswith(("dW_", "db_")) else name


def cross_check(results, expected, dtype):
    """Compare one implementation's results with the oracle's.

    Parameters
    ----------
    results, expected : dict of str to ndarray
        Output and gradients, from ``runner.result()``.
    dtype : float32 or float64
        Selects the tolerance in :data:`qkvnp.kernels.PATH_TOLERANCES`.

    Returns
    -------
    Check
        ``ok`` is False if an array is missing, has another shape, holds a
        non-finite value, or differs by more than the tolerance.

    Notes
    -----
    Each array's error is relative to the largest entry of its group: the
    output, each input's gradient, the weight gradients ``dW_*`` together and
    the bias gradients ``db_*`` together. Grouping matters for ``db_key``,
    which is zero in exact arithmetic (softmax ignores a constant added to a
    row of scores): its computed value is rounding noise, to be judged on the
    scale of the other bias gradients, not on its own.

    NOTE: the tolerance is the tests' table, but the tests divide by
    ``max(1, max|reference|)`` (absolute below magnitude 1); the error here
    is relative to the group's largest entry, which is as strict or stricter.
    """
    tolerance = PATH_TOLERANCES[_check_dtype(dtype)]
    scales = {}
    for name, reference in expected.items():
        largest = float(np.max(np.abs(reference), initial=0.0))
        scales[_group(name)] = max(scales.get(_group(name), 0.0), largest)
    worst_name, worst = None, 0.0
    for name, reference in expected.items():
        error = (relative_error(results[name], reference, scales[_group(name)])
                 if name in results else float("inf"))
        if worst_name is None or error > worst:
            worst_name, worst = name, error
    return Check(bool(worst <= tolerance), worst, worst_name, tolerance)


# ---------------------------------------------------------------- timing


def time_interleaved(runners, mode, repeats, warmup=1, pause=0.3, progress=None):
    """Time ``runners`` round by round, the start of each round rotating.

    Parameters
    ----------
    runners : dict of str to runner
    mode : {"fwd", "fwd_bwd"}
    repeats : int
        Timed rounds.
    warmup : int
        Untimed rounds first.
    pause : float
        Seconds slept before every call that follows another implementation's.

    Notes
    -----
    NOTE: the pause separates every two implementations, not only two
    libraries: threads that one leaves spinning slow the next on 2 cores.
    OpenBLAS's own threads (the reference path; the fast and tiled paths
    too when a call has a single block of work, e.g. the tiled core with one
    query block) spin for about 0.05-0.1 s after a call: the fast layer at
    (8, 128, 256, 8) float64 measured 29 ms alone, 46-50 ms right after the
    tiled layer, 31 ms after a 0.1 s pause.
    progress : callable, optional
        Told which round is running, at most every 10 seconds.

    Returns
    -------
    dict of str to list of float
        Seconds per call, ``repeats`` per runner.
    """
    method = {"fwd": "forward", "fwd_bwd": "forward_backward"}[mode]
    names = list(runners)
    calls = {name: getattr(runners[name], method) for name in names}
    times = {name: [] for name in names}
    last_name = None
    last_report = time.perf_counter()
    for round_index in range(warmup + repeats):
        if progress and time.perf_counter() - last_report > 10:
            progress(f"      {MODE_LABELS[mode]}: round {round_index + 1} of {warmup + repeats}")
            last_report = time.perf_counter()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if last_name is not None and name != last_name and pause > 0:
                time.sleep(pause)
            last_name = name
            start = time.perf_counter()
            result = calls[name]()
            elapsed = time.perf_counter() - start
            del result  # freed outside the timed region
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def _timing_stats(seconds, flops):
    ms = np.asarray(seconds) * 1e3
    median = float(np.median(ms))
    stats = {
        "median_ms": median,
        "min_ms": float(ms.min()),
        "q1_ms": float(np.percentile(ms, 25)),
        "q3_ms": float(np.percentile(ms, 75)),
        "times_ms": [float(t) for t in ms],
        "flops": int(flops),
        "gflops": flops / (median * 1e-3) / 1e9,
    }
    return stats


def measure_gemm_peak(dtype, size=GEMM_SIZE, repeats=5, blas=None):
    """Best GFLOP/s of ``numpy.matmul`` on two (size, size) matrices of ``dtype``.

    Counts ``2 * size**3`` FLOPs per product; writes into a preallocated
    ``out=`` so that the number is the BLAS kernel's, not the allocator's.
    ``blas``: None for numpy's BLAS at its own thread count, or a thread
    count to pin it to for the measurement (``qkvnp.kernels.blas_threads``);
    None is returned when that count cannot be set (no OpenBLAS found).
    """
    if blas is not None:
        with blas_threads(blas) as pinned:
            return measure_gemm_peak(dtype, size, repeats) if pinned.available else None
    dtype = _check_dtype(dtype)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=dtype)
    b = rng.standard_normal((size, size), dtype=dtype)
    out = np.empty((size, size), dtype=dtype)
    np.matmul(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best / 1e9


def measure_attention_gemm_ceiling(dtype, length=CEILING_LENGTH, head_dim=CEILING_HEAD_DIM,
                                   rounds=20, repeats=5):
    """Best GFLOP/s of ``numpy.matmul`` on the attention core's own matmul shapes.

    Each of the fast path's threads (BLAS pinned to one thread inside, as in
    :mod:`qkvnp.kernels.fast`) multiplies its own one-head operands, all in cache:
    ``q k^T`` ``(L, D) @ (D, L)``, ``P v`` ``(L, L) @ (L, D)`` and
    ``q^T dS`` ``(D, L) @ (L, L)``, the three shapes of the core's six
    products, ``rounds`` times each. No softmax, no memory traffic beyond
    the cache: a ceiling for any attention core built on these BLAS calls,
    to read beside the square-matrix GEMM peak of :func:`measure_gemm_peak`.
    """
    dtype = _check_dtype(dtype)
    threads = max(1, get_num_threads())
    rng = np.random.default_rng(0)
    L, D = length, head_dim
    operands = [(rng.standard_normal((L, D), dtype=dtype), rng.standard_normal((L, D), dtype=dtype),
                 np.empty((L, L), dtype), np.empty((L, D), dtype), np.empty((D, L), dtype))
                for _ in range(threads)]

    def task(part):
        for (index,) in part:
            q, k, scores, out, out_t = operands[index]
            for _ in range(rounds):
                np.matmul(q, k.T, out=scores)  # (L, D) @ (D, L) -> (L, L), entries ~ sqrt(D)
                np.matmul(scores, k, out=out)  # (L, L) @ (L, D) -> (L, D)
                np.matmul(q.T, scores, out=out_t)  # (D, L) @ (L, L) -> (D, L)

    blocks = [(index,) for index in range(threads)]
    run_in_workers(task, blocks)  # warm-up, and starts the pinned workers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run_in_workers(task, blocks)
        best = min(best, time.perf_counter() - start)
    return threads * rounds * 3 * 2.0 * L * L * D / best / 1e9


# ---------------------------------------------------------------- memory


def _proc_status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak_rss():
    """Reset the kernel's peak-RSS counter; return False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        _proc_status_kib("VmHWM")
        return True
    except OSError:
        return False


def _memory_child(spec_json):
    """Body of the fresh process that :func:`measure_memory` starts; prints JSON."""
    import resource
    import tracemalloc

    spec = json.loads(spec_json)
    kind, impl, dtype = spec["kind"], spec["impl"], np.dtype(spec["dtype"])
    config = Config(*spec["config"])
    # warm every library up on a tiny problem: thread pools, lazy imports
    tiny = make_runner(impl, make_problem(kind, (1, 8, 4 * config.heads, config.heads), dtype))
    tiny.forward_backward()
    del tiny
    problem = make_problem(kind, config, dtype)
    runner = make_runner(impl, problem)
    gc.collect()
    if _reset_peak_rss():
        method = "rss"
        before = _proc_status_kib("VmRSS")
        result = runner.forward_backward()
        peak = _proc_status_kib("VmHWM")
    else:
        method = "ru_maxrss"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = runner.forward_backward()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = {"method": method, "rss_mib": (peak - before) / 1024.0, "tracemalloc_mib": None}
    del result, runner
    gc.collect()
    if impl != "torch":  # PyTorch's allocations are invisible to tracemalloc
        runner = make_runner(impl, problem)
        tracemalloc.start()
        result = runner.forward_backward()
        report["tracemalloc_mib"] = tracemalloc.get_traced_memory()[1] / MIB
        tracemalloc.stop()
        del result
    print(json.dumps(report))


def measure_memory(kind, impl, config, dtype, timeout=900):
    """Peak extra memory (MiB) of one forward+backward, in a fresh process.

    Returns
    -------
    dict
        ``rss_mib`` (peak RSS during the call minus RSS before it),
        ``tracemalloc_mib`` (qkvnp only, else None), ``method``; or
        ``error`` with the child's last error line if it failed.
    """
    spec = json.dumps({"kind": kind, "impl": impl, "config": list(config),
                       "dtype": np.dtype(dtype).name})
    code = ("import sys; sys.path[:0] = sys.argv[2:]; "  # CHILD_PATH: this harness, this qkvnp
            "from bench import _memory_child; _memory_child(sys.argv[1])")
    try:
        child = subprocess.run([sys.executable, "-c", code, spec, *CHILD_PATH],
                               capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {child.returncode}: {tail}"}
    return json.loads(lines[-1])


# ---------------------------------------------------------------- import cost

_IMPORT_SNIPPET = (
    "import sys, time\n"
    "sys.path[:0] = sys.argv[1:]\n"  # CHILD_PATH: the same qkvnp as this process's
    "start = time.perf_counter()\n"
    "import {module}\n"
    "elapsed = time.perf_counter() - start\n"
    "print(elapsed)\n"
    "print(' '.join(sorted(sys.modules)))\n"
)


def _import_in_fresh_process(module):
    # NOTE: without PYTHONDONTWRITEBYTECODE (set on some machines, this one
    # included): the warm-up import writes qkvnp's .pyc files, as `pip install`
    # does, where numpy's were written at its install. With it, every import
    # compiled qkvnp's source, which was most of the difference measured (+20
    # against +8 ms beyond numpy, after issue 11 added six modules).
    env = {name: value for name, value in os.environ.items()
           if name != "PYTHONDONTWRITEBYTECODE"}
    child = subprocess.run([sys.executable, "-c", _IMPORT_SNIPPET.format(module=module),
                            *CHILD_PATH], capture_output=True, text=True, timeout=120, check=True,
                           env=env)
    elapsed, modules = child.stdout.splitlines()[:2]
    return float(elapsed), set(modules.split())


def measure_import_time(repeats=7):
    """Median time of ``import numpy`` and of ``import qkvnp`` in fresh interpreters.

    Both from cached bytecode, as an installed package runs (the warm-up
    imports write qkvnp's ``__pycache__``, even where
    ``PYTHONDONTWRITEBYTECODE`` is set).

    Returns
    -------
    dict
        ``numpy_ms``, ``qkvnp_ms``, ``ratio`` (qkvnp / numpy), ``repeats``,
        ``extra_modules``: top-level packages outside the standard library
        that ``import qkvnp`` loads and ``import numpy`` does not.
    """
    numpy_times, qkvnp_times = [], []
    for module in ("numpy", "qkvnp"):  # warm the file cache and .pyc files, not timed
        _import_in_fresh_process(module)
    for _ in range(repeats):
        elapsed, numpy_modules = _import_in_fresh_process("numpy")
        numpy_times.append(elapsed)
        elapsed, qkvnp_modules = _import_in_fresh_process("qkvnp")
        qkvnp_times.append(elapsed)
    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    extra = sorted({
        name.split(".")[0] for name in qkvnp_modules - numpy_modules
        if name.split(".")[0] not in stdlib and name.split(".")[0] not in ("qkvnp", "numpy")
        and not name.startswith("_")
    })
    numpy_ms = 1e3 * float(np.median(numpy_times))
    qkvnp_ms = 1e3 * float(np.median(qkvnp_times))
    return {"numpy_ms": numpy_ms, "qkvnp_ms": qkvnp_ms, "ratio": qkvnp_ms / numpy_ms,
            "numpy_min_ms": 1e3 * min(numpy_times), "qkvnp_min_ms": 1e3 * min(qkvnp_times),
            "repeats": repeats, "extra_modules": extra}


# ---------------------------------------------------------------- environment


def checkout_commit():
    """The commit of the qkvnp checkout measured (``git describe --always --dirty``), or None.

    None when qkvnp is not a git checkout (an installed wheel) or git is absent.
    """
    root = CHILD_PATH[1]  # the directory that holds the qkvnp measured
    if not os.path.exists(os.path.join(root, ".git")):  # a worktree has a .git file
        return None
    try:  # GIT_OPTIONAL_LOCKS=0: --dirty must not rewrite the checkout's index while it looks
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root,
                              capture_output=True, text=True, timeout=30,
                              env=dict(os.environ, GIT_OPTIONAL_LOCKS="0"))
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def environment_info():
    """What makes the numbers interpretable: machine, versions, BLAS, threads, env vars."""
    from importlib import metadata

    def version(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    blas_build = None
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas_build = f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # numpy < 1.26 has no mode="dicts"; the runtime probe still works
        pass
    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "numpy": np.__version__,
        "scipy": version("scipy"),
        "qkvnp": qkvnp.__version__,
        "commit": checkout_commit(),
        "torch": None,
        "torch_threads": None,
        "blas_build": blas_build,
        "openblas": openblas_info(),
        # other work on the machine slows both libraries, PyTorch's 2-thread
        # calls most at small sizes: its threads wait for each other
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {name: os.environ.get(name) for name in (
            "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    try:
        torch = _import_torch()
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImplementationMissing:
        pass
    return info


# ---------------------------------------------------------------- the run


def _progress(message):
    print(message, file=sys.stderr, flush=True)


def _new_record(kind, config, dtype, impl, mask, protocol, timed=True):
    return {"kind": kind, "config": list(config), "dtype": np.dtype(dtype).name, "mask": mask,
            "impl": impl, "library": "torch" if impl == "torch" else "qkvnp",
            "protocol": protocol, "status": "ok", "reason": None, "check": None,
            "dispatch": None, "memory": None, "timed": timed, "fwd": None, "fwd_bwd": None}


def _record_check(record, check):
    """Store a :class:`Check` in ``record``; refuse the implementation if it failed."""
    # JSON has no inf: a non-finite or misshapen result is recorded as None
    record["check"] = {"max_rel_err": check.error if np.isfinite(check.error) else None,
                       "worst": check.worst, "tolerance": check.tolerance}
    if not check.ok:
        record["status"] = "refused"
        record["reason"] = (f"disagrees with the reference path: {check.worst} relative "
                            f"error {check.error:.3g} > {check.tolerance:g}")


def _run_case(kind, config, dtype, impls, repeats, warmup, pause, progress=None, mask="none"):
    """Cross-check, then time, every implementation on one workload in this process.

    One record each (the oracle's too, untimed unless asked for). ``mask`` is
    "none" or "causal".
    """
    problem = make_problem(kind, config, dtype, causal=(mask == "causal"))
    records, runners = {}, {}
    impls = [impl for impl in impls if impl in KIND_IMPLEMENTATIONS[kind]]
    for impl in dict.fromkeys([ORACLE] + impls):
        record = _new_record(kind, config, dtype, impl, mask, "same process", impl in impls)
        records[impl] = record
        try:
            runners[impl] = make_runner(impl, problem)
        except ImplementationMissing as missing:
            record["status"], record["reason"] = "missing", str(missing)
        except Exception as error:  # a broken implementation must not stop the others
            record["status"], record["reason"] = "error", f"{type(error).__name__}: {error}"

    expected = None
    if ORACLE in runners:
        try:
            expected = runners[ORACLE].result()
        except Exception as error:
            records[ORACLE]["status"] = "error"
            records[ORACLE]["reason"] = f"{type(error).__name__}: {error}"
            del runners[ORACLE]
    for impl in list(runners):
        record = records[impl]
        if expected is None:
            record["status"], record["reason"] = "refused", "no oracle: the reference path failed"
            del runners[impl]
            continue
        try:
            check = cross_check(runners[impl].result(), expected, dtype)
        except Exception as error:
            record["status"], record["reason"] = "error", f"{type(error).__name__}: {error}"
            del runners[impl]
            continue
        record["dispatch"] = getattr(runners[impl], "dispatch", None)
        _record_check(record, check)
        if not check.ok:
            del runners[impl]
    del expected

    timed = {impl: runner for impl, runner in runners.items() if records[impl]["timed"]}
    runners.clear()  # an untimed oracle's caches (L x L weights) go now
    for mode in MODES:
        if not timed:
            break
        gc.collect()
        try:
            times = time_interleaved(timed, mode, repeats, warmup, pause, progress)
        except Exception as error:
            for impl in timed:
                records[impl]["status"] = "error"
                records[impl]["reason"] = f"while timing: {type(error).__name__}: {error}"
            break
        flops = FLOPS[kind](config, backward=(mode == "fwd_bwd"))
        for impl, seconds in times.items():
            records[impl][mode] = _timing_stats(seconds, flops)
        if progress:
            progress(f"    {MODE_LABELS[mode]}: " + ", ".join(
                f"{impl} {_ms(records[impl][mode]['median_ms'])} ms" for impl in times))
    timed.clear()
    gc.collect()
    return [record for impl, record in records.items() if record["timed"]]


def _run_case_in_processes(kind, config, dtype, impls, repeats, warmup, pause, pool,
                           mask="none", round_seconds=ROUND_SECONDS, progress=None,
                           torch_threads=None):
    """Cross-check, then time, each implementation in a worker process of its own.

    The reference path (the oracle) runs in this process; each
    implementation of ``impls`` runs in ``pool``'s worker of its name, which
    writes its results to a file for the cross-check, then times
    forward+backward in rounds alternating with the others'
    (:func:`workers.time_alternating`). One record per implementation.
    """
    from workers import WorkerError, time_alternating

    impls = [impl for impl in impls if impl in KIND_IMPLEMENTATIONS[kind]]
    records = {impl: _new_record(kind, config, dtype, impl, mask, "processes") for impl in impls}
    spec = {"kind": kind, "config": list(config), "dtype": np.dtype(dtype).name,
            "causal": mask == "causal", "torch_threads": torch_threads}
    try:
        expected = make_runner(ORACLE, make_problem(kind, config, dtype, causal=spec["causal"])).result()
    except Exception as error:
        for record in records.values():
            record["status"] = "refused"
            record["reason"] = f"no oracle: the reference path failed ({type(error).__name__}: {error})"
        return list(records.values())
    workers = {}
    with tempfile.TemporaryDirectory(prefix="qkvnp-bench-") as directory:
        for impl, record in records.items():
            worker = pool.get(impl)
            try:
                reply = worker.request("setup", workload="attention", spec=dict(spec, impl=impl))
                if "missing" in reply:
                    record["status"], record["reason"] = "missing", reply["missing"]
                    continue
                record["torch_threads"] = reply.get("torch_threads")
                path = os.path.join(directory, impl + ".npz")
                reply = worker.request("result", path=path)
                with np.load(path, allow_pickle=False) as stored:
                    results = dict(stored)
            except WorkerError as error:
                record["status"], record["reason"] = "error", str(error)
                continue
            record["dispatch"] = reply.get("dispatch")
            check = cross_check(results, expected, dtype)
            _record_check(record, check)
            if check.ok:
                workers[impl] = worker
    del expected
    if not workers:
        return list(records.values())
    try:
        seconds, calls = time_alternating(workers, "fwd_bwd", repeats, warmup, pause,
                                          round_seconds, progress)
    except WorkerError as error:
        for impl in workers:
            records[impl]["status"] = "error"
            records[impl]["reason"] = f"while timing: {error}"
        return list(records.values())
    flops = FLOPS[kind](config, backward=True)
    for impl in workers:
        records[impl]["fwd_bwd"] = dict(_timing_stats(seconds[impl], flops),
                                        calls_per_round=calls[impl])
    if progress:
        progress("    fwd+bwd: " + ", ".join(
            f"{impl} {1e3 * records[impl]['fwd_bwd']['median_ms']:.1f} us" for impl in workers))
    return list(records.values())


Case = namedtuple("Case", "protocol kind config dtype mask impls")
Case.__doc__ = "One workload to cross-check and time: protocol, kind, Config, dtype, mask, impls."


def plan_cases(configs, dtypes, masks=MASKS, kinds=None, impls=None, quick=False):
    """The cases of a run, in the order they run: one-process-per-library ones first.

    Parameters
    ----------
    configs, dtypes, masks : sequences
    kinds, impls : sequence, optional
        Workloads and implementations; each protocol has its own defaults.
    quick : bool
        The reduced defaults of ``--quick``.

    Returns
    -------
    list of Case

    Notes
    -----
    Defaults: configurations with L <= :data:`PROCESS_MAX_LENGTH` time the
    layer's default path (``auto``; the core's ``fast``)
    against PyTorch, each in a process of its own. Longer ones run in this
    process: without a mask every workload and implementation (the reference
    path untimed with ``quick``), causal the layer without the reference
    path; with ``quick`` only ``auto`` and PyTorch's layer.
    """
    cases = [[], []]
    for config in (_check_config(c) for c in configs):
        for dtype in (_check_dtype(d) for d in dtypes):
            for mask in masks:
                if config.length <= PROCESS_MAX_LENGTH:
                    protocol, case_kinds, case_impls = "processes", ("layer",), None
                elif quick:
                    protocol, case_kinds, case_impls = "same process", ("layer",), ("auto", "torch")
                elif mask == "none":
                    protocol, case_kinds, case_impls = "same process", KINDS, IMPLEMENTATIONS
                else:
                    protocol, case_kinds = "same process", ("layer",)
                    case_impls = tuple(i for i in IMPLEMENTATIONS if i != ORACLE)
                for kind in kinds or case_kinds:
                    # the layer's default path, or the core's fast path (it has no dispatch)
                    kind_impls = case_impls or ("auto" if kind == "layer" else "fast", "torch")
                    cases[protocol == "same process"].append(
                        Case(protocol, kind, config, dtype, mask, tuple(impls or kind_impls)))
    return cases[0] + cases[1]


def _add_ratios(records, peaks):
    """Add ``ratio_torch`` (median / PyTorch's median, same workload and mode) and
    ``percent_peak`` (achieved GFLOP/s / GEMM peak of the dtype) to each timing."""
    def key(r):
        return r["kind"], tuple(r["config"]), r["dtype"], r.get("mask", "none")

    torch_records = {key(r): r for r in records if r["impl"] == "torch" and r["status"] == "ok"}
    for record in records:
        reference = torch_records.get(key(record))
        for mode in MODES:
            if record[mode] is None:
                continue
            peak = peaks.get(record["dtype"])
            record[mode]["percent_peak"] = 100.0 * record[mode]["gflops"] / peak if peak else None
            record[mode]["ratio_torch"] = (
                record[mode]["median_ms"] / reference[mode]["median_ms"]
                if reference is not None and reference[mode] is not None else None
            )


def run_benchmark(configs=DEFAULT_CONFIGS, dtypes=("float32", "float64"), kinds=None,
                  impls=None, masks=MASKS, repeats=7, warmup=1, pause=0.3,
                  round_seconds=ROUND_SECONDS, memory=True, memory_kinds=KINDS,
                  memory_configs=None, import_repeats=7, tiled_memory=True, training=True,
                  training_dtypes=None, gemm_size=GEMM_SIZE, quick=False, torch_threads=None,
                  progress=_progress):
    """Run the whole benchmark and return the report (a JSON-ready dict).

    Parameters
    ----------
    configs : sequence of Config
    dtypes : sequence of dtype names
    kinds : sequence of {"layer", "core"}, optional
    impls : sequence of implementation names (see :data:`IMPLEMENTATIONS`), optional
        Default: each protocol's own (:func:`plan_cases`).
    masks : sequence of {"none", "causal"}
    repeats, warmup : int
        Timed and untimed rounds per workload and mode.
    pause : float
        Seconds slept when switching from one implementation (or process) to the next.
    round_seconds : float
        Shortest round of the one-library-per-process protocol.
    memory : bool
        Measure peak memory in fresh processes (configurations timed in this
        process, without a mask).
    memory_kinds : sequence of {"layer", "core"}
        Workloads whose memory is measured (with ``memory``).
    memory_configs : sequence of Config, optional
        Configurations whose memory is measured (default: those timed in this process).
    import_repeats : int
        Fresh interpreters per module for the import cost; 0 skips it.
    tiled_memory : bool
        Also measure the tiled core at :data:`TILED_MEMORY_SHAPE` (with ``memory``).
    training : bool
        Time the training steps (:mod:`train_bench`), in ``training_dtypes``
        (default ``dtypes``).
    gemm_size : int
        Size of the square matrices whose product measures the GEMM peak.
    quick : bool
        The reduced defaults of ``--quick`` (:func:`plan_cases`).
    torch_threads : int, optional
        PyTorch's thread count (``torch.set_num_threads``), in every process;
        default: PyTorch's own default, as users get it.
    progress : callable or None
        Receives one line of text per step.

    Returns
    -------
    dict
        ``environment``, ``gemm_peak_gflops`` (per dtype), ``import_time``,
        ``records`` (one per protocol, kind, config, dtype, mask and
        implementation), ``training`` (one per task and dtype),
        ``tiled_memory``, ``settings``, ``attention_gemm_ceiling_gflops``
        (per dtype, :func:`measure_attention_gemm_ceiling`),
        ``gemm_one_thread_gflops`` (per dtype, the GEMM peak's product on
        one BLAS thread; empty when its count cannot be set),
        ``target_requirements`` (see :func:`target_requirements`),
        ``summary`` (the plain-language lines of :func:`summary.summarize`).
    """
    from summary import summarize
    from train_bench import TRAINING_TASKS, run_training_case
    from workers import WorkerPool

    progress = progress or (lambda message: None)
    configs = [_check_config(c) for c in configs]
    dtypes = [_check_dtype(d) for d in dtypes]
    for impl in impls or ():
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impls must be chosen from {IMPLEMENTATIONS}, got {impl!r}")
    for mask in masks:
        if mask not in MASKS:
            raise ValueError(f"masks must be chosen from {MASKS}, got {mask!r}")
    cases = plan_cases(configs, dtypes, masks, kinds, impls, quick)
    training_dtypes = [_check_dtype(d) for d in (training_dtypes or dtypes)] if training else []
    started = time.perf_counter()
    if torch_threads:
        try:
            _import_torch().set_num_threads(torch_threads)
        except ImplementationMissing:
            pass
    report = {"environment": environment_info(), "settings": {
        "configs": [list(c) for c in configs], "dtypes": [d.name for d in dtypes],
        "kinds": list(kinds or KINDS), "impls": sorted({i for c in cases for i in c.impls},
                                                      key=IMPLEMENTATIONS.index),
        "masks": list(masks), "repeats": repeats, "warmup": warmup, "pause_s": pause,
        "round_seconds": round_seconds, "process_max_length": PROCESS_MAX_LENGTH,
        "training_dtypes": [d.name for d in training_dtypes], "gemm_size": gemm_size,
        "quick": bool(quick), "torch_threads": torch_threads}}
    progress(f"measuring the GEMM peak (numpy.matmul, n = {gemm_size})")
    # measured before and after the timings; the higher one is the peak (a
    # busy machine lowers it, nothing raises it)
    peak_runs = {d.name: [measure_gemm_peak(d, gemm_size)] for d in dtypes}
    # the same product on one BLAS thread: how much the second core adds,
    # and the one-thread rate the one-thread ceilings (layer_ceiling.py,
    # RESULTS.md's tables) are to be read against; hosts differ in both
    one_thread_runs = {d.name: [measure_gemm_peak(d, gemm_size, blas=1)] for d in dtypes}
    ceiling_runs = {d.name: [measure_attention_gemm_ceiling(d)] for d in dtypes}
    report["import_time"] = None
    if import_repeats:
        progress(f"timing import numpy / import qkvnp in {2 * import_repeats} fresh processes")
        report["import_time"] = measure_import_time(import_repeats)

    records, training_records = [], []

    def run_cases(selected, pool=None):
        for case in selected:
            index = cases.index(case) + 1
            label = (f"[{index}/{len(cases)}] {case.kind} {tuple(case.config)} {case.dtype.name} "
                     f"{'causal' if case.mask == 'causal' else 'no mask'}")
            if case.protocol == "processes":
                progress(f"{label}: one process per implementation ({', '.join(case.impls)}), "
                         f"{repeats} alternating rounds")
                case_records = _run_case_in_processes(
                    case.kind, case.config, case.dtype, case.impls, repeats, warmup, pause, pool,
                    case.mask, round_seconds, progress, torch_threads)
            else:
                progress(f"{label}: cross-check and {repeats} rounds x {len(MODES)} modes "
                         "in this process")
                case_records = _run_case(case.kind, case.config, case.dtype, case.impls, repeats,
                                         warmup, pause, progress, case.mask)
            for record in case_records:
                if record["status"] != "ok":
                    progress(f"    {record['impl']}: {record['status']}: {record['reason']}")
            records.extend(case_records)

    with WorkerPool(CHILD_PATH) as pool:
        run_cases([c for c in cases if c.protocol == "processes"], pool)
        training_cases = [(task, d) for d in training_dtypes for task in TRAINING_TASKS]
        for index, (task, dtype) in enumerate(training_cases, 1):
            progress(f"training [{index}/{len(training_cases)}] {task} {dtype.name}: loss check, "
                     f"then {repeats} alternating rounds of steps, one process per library")
            record = run_training_case(task, dtype, pool, repeats, warmup, pause,
                                       max(round_seconds, 0.1), progress, torch_threads)
            if record["status"] != "ok" or record["reason"]:
                progress(f"    {record['status']}: {record['reason']}")
            elif record["torch"]:
                progress(f"    qkvnp {record['qkvnp']['steps_per_s']:.0f} steps/s, "
                         f"PyTorch {record['torch']['steps_per_s']:.0f} steps/s")
            training_records.append(record)
    # the workers have quit: no idle process beside the same-process timings
    run_cases([c for c in cases if c.protocol == "same process"])
    progress("measuring the GEMM peak again")
    for dtype in dtypes:
        peak_runs[dtype.name].append(measure_gemm_peak(dtype, gemm_size))
        one_thread_runs[dtype.name].append(measure_gemm_peak(dtype, gemm_size, blas=1))
        ceiling_runs[dtype.name].append(measure_attention_gemm_ceiling(dtype))
    report["gemm_peak_runs"] = peak_runs
    report["gemm_peak_gflops"] = peaks = {name: max(runs) for name, runs in peak_runs.items()}
    report["attention_gemm_ceiling_gflops"] = {name: max(runs) for name, runs in ceiling_runs.items()}
    report["gemm_one_thread_gflops"] = {name: max(runs) for name, runs in one_thread_runs.items()
                                        if None not in runs}
    _add_ratios(records, peaks)

    if memory:
        memory_configs = ({tuple(c) for c in configs if c.length > PROCESS_MAX_LENGTH}
                          if memory_configs is None else
                          {tuple(_check_config(c)) for c in memory_configs})
        to_measure = [r for r in records if r["status"] == "ok" and r["kind"] in memory_kinds
                      and tuple(r["config"]) in memory_configs and r["mask"] == "none"
                      and r["timed"]]
        for index, record in enumerate(to_measure, 1):
            progress(f"memory [{index}/{len(to_measure)}] {record['kind']} "
                     f"{tuple(record['config'])} {record['dtype']} {record['impl']} (fresh process)")
            record["memory"] = measure_memory(record["kind"], record["impl"], record["config"],
                                              record["dtype"])
    report["tiled_memory"] = None
    if memory and tiled_memory and "tiled" in report["settings"]["impls"]:
        B, H, L, D = TILED_MEMORY_SHAPE
        progress(f"memory: tiled core at (B, H, L, D) = {TILED_MEMORY_SHAPE} float32 (fresh process)")
        measured = measure_memory("core", "tiled", Config(B, L, H * D, H), "float32")
        if "error" not in measured:
            outputs_mib = 4 * B * H * L * D * 4 / MIB  # out, dquery, dkey, dvalue in float32
            measured["outputs_mib"] = outputs_mib
            measured["beyond_outputs_mib"] = measured["rss_mib"] - outputs_mib
            measured["limit_mib"] = TILED_MEMORY_LIMIT_MIB
        report["tiled_memory"] = measured
    report["records"] = records
    report["training"] = training_records
    report["target_requirements"] = target_requirements(report)
    report["summary"] = summarize(report)
    report["elapsed_s"] = time.perf_counter() - started
    return report


# ---------------------------------------------------------------- output


def _ms(value):
    """Milliseconds with 3 to 4 significant digits: 1234, 123.4, 12.34, 0.123."""
    return format(value, ".0f" if value >= 100 else ".1f" if value >= 10 else
                  ".2f" if value >= 1 else ".3f")


def _fmt(value, spec, width):
    return format("-" if value is None else format(value, spec), f">{width}")


def _mode_cells(stats):
    if stats is None:
        return [_fmt(None, "", w) for w in (8, 7, 7, 6, 5)]
    return [format(_ms(stats["median_ms"]), ">8"),
            format(_ms(stats["q3_ms"] - stats["q1_ms"]), ">7"),
            _fmt(stats.get("ratio_torch"), ".2f", 7),
            _fmt(stats["gflops"], ".0f", 6),
            _fmt(stats["percent_peak"], ".0f", 5)]


def _verdict(ok):
    return "ok" if ok else "MISSED"


def _ceiling_note(report, dtype):
    """`` (BLAS on attention shapes: N%)`` for ``dtype``, or "" if not measured."""
    ceiling = (report.get("attention_gemm_ceiling_gflops") or {}).get(dtype)
    peak = (report.get("gemm_peak_gflops") or {}).get(dtype)
    return f" (BLAS on attention shapes: {100 * ceiling / peak:.0f}%)" if ceiling and peak else ""


def _targets(report):
    """Lines comparing the measured ratios with the issue's targets."""
    lines = []
    records = [r for r in report["records"] if r["status"] == "ok"]
    qkvnp_impls = [i for i in report["settings"]["impls"] if i not in ("torch", ORACLE)]

    def ratios(kind, impl, min_length=0):
        return [(tuple(r["config"]), r["dtype"], r["fwd_bwd"]["ratio_torch"]) for r in records
                if r["kind"] == kind and r["impl"] == impl and r["config"][1] >= min_length
                and r["fwd_bwd"] and r["fwd_bwd"].get("ratio_torch") is not None]

    for kind, limit, min_length, label in (
            ("layer", 0.8, 0, "layer fwd+bwd <= 0.8x nn.MultiheadAttention"),
            ("core", 1.0, 512, "core fwd+bwd <= 1.0x scaled_dot_product_attention, L >= 512")):
        for impl in qkvnp_impls:
            found = ratios(kind, impl, min_length)
            if found:
                worst = max(found, key=lambda item: item[2])
                lines.append(f"  {label}: {impl} worst {worst[2]:.2f} at {worst[0]} {worst[1]} "
                             f"({sum(r <= limit for _, _, r in found)}/{len(found)} within) "
                             f"{_verdict(worst[2] <= limit)}")
    for impl in qkvnp_impls:
        found = [(tuple(r["config"]), r["dtype"], r["fwd_bwd"]["percent_peak"]) for r in records
                 if r["kind"] == "layer" and r["impl"] == impl and r["config"][1] >= 512
                 and r["fwd_bwd"] and r["fwd_bwd"]["percent_peak"] is not None]
        if found:
            worst = min(found, key=lambda item: item[2])
            lines.append(f"  layer fwd+bwd >= 75% of GEMM peak, L >= 512: {impl} lowest "
                         f"{worst[2]:.0f}% at {worst[0]} {worst[1]} {_verdict(worst[2] >= 75)}"
                         + _ceiling_note(report, worst[1]))
    memory = {(r["impl"], tuple(r["config"]), r["dtype"]): r["memory"] for r in records
              if r["kind"] == "layer" and r["memory"] and "rss_mib" in r["memory"]}
    for (impl, config, dtype), measured in sorted(memory.items()):
        torch_memory = memory.get(("torch", config, dtype))
        if impl in qkvnp_impls and config == tuple(DEFAULT_CONFIGS[-1]) and torch_memory:
            lines.append(f"  layer memory <= nn.MultiheadAttention at {config} {dtype}: {impl} "
                         f"{measured['rss_mib']:.0f} MiB vs {torch_memory['rss_mib']:.0f} MiB "
                         f"{_verdict(measured['rss_mib'] <= torch_memory['rss_mib'])}")
    tiled = report.get("tiled_memory")
    if tiled and "beyond_outputs_mib" in tiled:
        lines.append(f"  tiled core {TILED_MEMORY_SHAPE} float32 fwd+bwd: "
                     f"{tiled['beyond_outputs_mib']:.1f} MiB beyond outputs and gradients "
                     f"({tiled['method']}; limit {tiled['limit_mib']} MiB) "
                     f"{_verdict(tiled['beyond_outputs_mib'] <= tiled['limit_mib'])}")
    elif tiled:
        lines.append(f"  tiled core {TILED_MEMORY_SHAPE} memory: {tiled['error']}")
    imports = report.get("import_time")
    if imports:
        lines.append(f"  import qkvnp <= 1.25x import numpy: {imports['ratio']:.2f} "
                     f"{_verdict(imports['ratio'] <= 1.25)}")
    return lines


def target_requirements(report, kinds_limits=(("layer", 0.8), ("core", 1.0))):
    """What each speed target asks of the machine: the share of the GEMM peak it needs.

    For every configuration that PyTorch ran, the target time is ``limit x``
    PyTorch's forward+backward median. The matmul FLOPs of that workload
    (:func:`layer_flops`, :func:`core_flops`), run at the GEMM peak measured in
    the same run with nothing else costing time, give a floor no
    implementation that does these matmuls can go below on this machine. The
    share of the peak the target needs is ``floor / target``: above 100% the
    target is out of reach for any such implementation, above the rate the
    BLAS reaches on the workload's own matmul shapes it is out of reach for
    one built on BLAS calls.

    Returns
    -------
    list of dict
        ``kind, config, dtype, limit, torch_ms, target_ms, floor_ms, needed_percent``
        and ``ceiling_percent`` (the attention-shape ceiling as a share of the
        peak, None if not measured).
    """
    peaks = report.get("gemm_peak_gflops") or {}
    ceilings = report.get("attention_gemm_ceiling_gflops") or {}
    limits = dict(kinds_limits)
    rows = []
    for r in report["records"]:
        if (r["impl"] != "torch" or r["status"] != "ok" or r["kind"] not in limits
                or r.get("mask", "none") != "none"
                or not r.get("fwd_bwd") or not peaks.get(r["dtype"])):
            continue
        config = Config(*r["config"])
        if r["kind"] == "core" and config.length < 512:
            continue  # the core target starts at L = 512
        torch_ms = r["fwd_bwd"]["median_ms"]
        target_ms = limits[r["kind"]] * torch_ms
        floor_ms = FLOPS[r["kind"]](config, backward=True) / (peaks[r["dtype"]] * 1e6)
        rows.append({"kind": r["kind"], "config": tuple(config), "dtype": r["dtype"],
                     "limit": limits[r["kind"]], "torch_ms": torch_ms, "target_ms": target_ms,
                     "floor_ms": floor_ms, "needed_percent": 100.0 * floor_ms / target_ms,
                     "ceiling_percent": (100.0 * ceilings[r["dtype"]] / peaks[r["dtype"]]
                                         if ceilings.get(r["dtype"]) else None)})
    return rows


def format_report(report):
    """The human-readable report: environment, peaks, import cost, tables, targets."""
    env = report["environment"]
    quick = " (--quick: a reduced set)" if report["settings"].get("quick") else ""
    lines = [f"qkvnp bench{quick}, {env['date_utc']} UTC, {report.get('elapsed_s', 0):.0f} s",
             f"machine: {env['cpu']}, {env['cores_usable']} usable cores; {env['platform']}",
             f"versions: python {env['python']}, numpy {env['numpy']}, scipy {env['scipy']}, "
             f"qkvnp {env['qkvnp']}" + (f" ({env['commit']})" if env.get("commit") else "")
             + f", torch {env['torch'] or 'not installed'}"]
    blas = env["openblas"]
    blas_text = (f"{blas['library']}, core {blas['corename']}, {blas['threads']} threads "
                 f"({blas['config']})" if blas else "runtime not identified")
    lines.append(f"numpy BLAS: {env['blas_build'] or '?'}; {blas_text}")
    lines.append("env: " + ", ".join(f"{k}={v if v is not None else '(unset)'}"
                                     for k, v in env["env"].items()))
    chosen = report["settings"].get("torch_threads")
    lines.append(f"torch threads: {env['torch_threads'] if env['torch'] else '-'} "
                 f"({'set by --torch-threads' if chosen else 'its default'})")
    load = env.get("load_average")
    if load:
        lines.append(f"load average at the start (1, 5, 15 min): {load[0]:.2f}, {load[1]:.2f}, "
                     f"{load[2]:.2f}" + (" -- the machine was busy: the times are not those of "
                                         "an idle machine" if load[0] > 0.5 else ""))
    peaks = report["gemm_peak_gflops"]
    lines.append(f"GEMM peak (numpy.matmul, n = {report['settings']['gemm_size']}, best of 5, "
                 "before and after the timings): "
                 + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in peaks.items()))
    one_thread = report.get("gemm_one_thread_gflops")
    if one_thread:
        lines.append("GEMM on one BLAS thread (same products): "
                     + ", ".join(f"{d} {g:.1f} GFLOP/s (numpy's threads give {peaks[d] / g:.2f}x it)"
                                 for d, g in one_thread.items() if peaks.get(d) and g))
    ceilings = report.get("attention_gemm_ceiling_gflops")
    if ceilings:
        lines.append(f"BLAS on attention shapes (one ({CEILING_LENGTH}, {CEILING_HEAD_DIM}) head per "
                     "thread, in cache, the core's three matmul shapes, best of 5): "
                     + ", ".join(f"{d} {g:.1f} GFLOP/s ({100 * g / peaks[d]:.0f}% of peak)"
                                 for d, g in ceilings.items() if peaks.get(d)))
    imports = report.get("import_time")
    if imports:
        extra = ", ".join(imports["extra_modules"]) or "none outside the standard library"
        lines.append(f"import time (fresh processes, cached bytecode, median of "
                     f"{imports['repeats']}): numpy "
                     f"{imports['numpy_ms']:.1f} ms, qkvnp {imports['qkvnp_ms']:.1f} ms, "
                     f"ratio {imports['ratio']:.2f} (of the minima: "
                     f"{imports['qkvnp_min_ms'] / imports['numpy_min_ms']:.2f}); "
                     f"loaded beyond numpy's: {extra}")
    settings = report["settings"]
    lines.append(f"timing, L <= {settings.get('process_max_length', PROCESS_MAX_LENGTH)}: each "
                 "implementation in a process of its own, rounds alternating between the "
                 f"processes, each round at least {settings.get('round_seconds', ROUND_SECONDS)} s "
                 f"of calls, median of {settings['repeats']} rounds after {settings['warmup']} "
                 f"warm-up, {settings['pause_s']} s pause between processes")
    lines.append(f"timing, longer: one process, median of {settings['repeats']} interleaved rounds "
                 f"after {settings['warmup']} warm-up, {settings['pause_s']} s pause between "
                 "implementations; IQR = interquartile range; x torch = median / PyTorch's median")
    memory_method = {r["memory"].get("method") for r in report["records"]
                     if r["memory"] and "method" in r["memory"]}
    lines.append("memory: peak extra RSS of one fwd+bwd in a fresh process "
                 f"({', '.join(sorted(memory_method)) or 'not measured'}); check: largest "
                 "relative error against the reference path (the oracle)")

    in_processes = [r for r in report["records"] if r.get("protocol") == "processes"]
    same_process = [r for r in report["records"] if r.get("protocol") != "processes"]
    header = (f"{'config (B,L,E,H)':<19}{'dtype':<8}{'mask':<7}{'impl':<10}"
              f"{'f+b us':>9}{'IQR':>8}{'calls':>7}{'xtorch':>7}{'check':>8}  path")
    titles = {"layer": "MultiHeadAttention layer, forward+backward, one process per "
                       "implementation (PyTorch: nn.MultiheadAttention, need_weights=False)",
              "core": "attention core on (B, H, L, D), forward+backward, one process per "
                      "implementation (PyTorch: scaled_dot_product_attention)"}
    for kind in KINDS:
        rows = [r for r in in_processes if r["kind"] == kind]
        if not rows:
            continue
        lines += ["", titles[kind] + "; microseconds a call, calls = calls per round",
                  header, "-" * len(header)]
        for r in rows:
            label = _row_label(r)
            if r["status"] != "ok":
                lines.append(f"{label}{r['status'].upper()}: {r['reason']}")
                continue
            stats = r["fwd_bwd"]
            error = r["check"]["max_rel_err"] if r["check"] else None
            path = (r.get("dispatch") or {}).get("path", "")
            lines.append(label + format(_ms(1e3 * stats["median_ms"]), ">9")
                         + format(_ms(1e3 * (stats["q3_ms"] - stats["q1_ms"])), ">8")
                         + format(stats.get("calls_per_round", 1), ">7")
                         + _fmt(stats.get("ratio_torch"), ".2f", 7) + _fmt(error, ".0e", 8)
                         + f"  {path}".rstrip())

    header = (f"{'config (B,L,E,H)':<19}{'dtype':<8}{'mask':<7}{'impl':<10}"
              f"{'fwd ms':>8}{'IQR':>7}{'xtorch':>7}{'GF/s':>6}{'%pk':>5} |"
              f"{'f+b ms':>8}{'IQR':>7}{'xtorch':>7}{'GF/s':>6}{'%pk':>5} |{'MiB':>6}{'check':>8}")
    titles = {"layer": "MultiHeadAttention layer, in one process (PyTorch: nn.MultiheadAttention, "
                       "need_weights=False)",
              "core": "attention core on (B, H, L, D), in one process (PyTorch: "
                      "scaled_dot_product_attention)"}
    for kind in KINDS:
        rows = [r for r in same_process if r["kind"] == kind]
        if not rows:
            continue
        lines += ["", titles[kind], header, "-" * len(header)]
        for r in rows:
            label = _row_label(r)
            if r["status"] != "ok":
                lines.append(f"{label}{r['status'].upper()}: {r['reason']}")
                continue
            memory = r["memory"]
            mib = (_fmt(memory["rss_mib"], ".0f", 6) if memory and "rss_mib" in memory
                   else _fmt(None, "", 6))
            error = r["check"]["max_rel_err"] if r["check"] else None
            check = "oracle" if r["impl"] == ORACLE else _fmt(error, ".0e", 8)
            lines.append(label + "".join(_mode_cells(r["fwd"])) + " |"
                         + "".join(_mode_cells(r["fwd_bwd"])) + " |" + mib + format(check, ">8"))

    training = report.get("training") or []
    if training:
        header = (f"{'task':<11}{'dtype':<9}{'qkvnp ms':>9}{'steps/s':>9}{'torch ms':>10}"
                  f"{'steps/s':>9}{'qkvnp/torch':>13}{'losses':>9}")
        lines += ["", "training step (zero_grad, forward, loss, backward, Adam step), one process "
                  "per library, ms a step; losses: largest relative difference of the first "
                  "steps' losses", header, "-" * len(header)]
        for t in training:
            label = f"{t['task']:<11}{t['dtype']:<9}"
            if t["status"] != "ok":
                lines.append(f"{label}{t['status'].upper()}: {t['reason']}")
                continue
            cells = []
            for library in ("qkvnp", "torch"):
                stats = t.get(library)
                cells += [_fmt(stats and stats["step_ms"], ".3f", 9 if library == "qkvnp" else 10),
                          _fmt(stats and stats["steps_per_s"], ".0f", 9)]
            error = (t.get("check") or {}).get("max_rel_err")
            lines.append(label + "".join(cells) + _fmt(t.get("speedup"), ".2f", 13)
                         + _fmt(error, ".0e", 9))

    from summary import ratio_table, summarize

    table = ratio_table(report)
    if table:
        lines += [""] + table
    if report.get("show_targets"):
        target_lines = _targets(report)
        if target_lines:
            lines += ["", "developers' targets (--targets; the project's speed and memory "
                      "targets of an earlier round):"] + target_lines
        needs = target_requirements(report)
        if needs:
            lines += ["", "what those speed targets ask of this machine (fwd+bwd; floor = the "
                      "matmul FLOPs at the GEMM peak above, nothing else costing time):"]
            for n in needs:
                lines.append(f"  {n['kind']:<6}{str(n['config']):<20}"
                             f"{n['dtype']:<8} target {n['limit']:.1f} x {_ms(n['torch_ms'])} = "
                             f"{_ms(n['target_ms'])} ms, floor {_ms(n['floor_ms'])} ms: needs "
                             f"{n['needed_percent']:.0f}% of peak" + _ceiling_note(report, n["dtype"]))
    summary = report.get("summary")
    if summary is None:
        summary = summarize(report)
    if summary:
        lines += ["", "Summary"] + summary
    problems = [r for r in report["records"] if r["status"] in ("refused", "error")]
    problems += [t for t in training if t["status"] in ("refused", "error")]
    if problems:
        lines += ["", f"{len(problems)} run(s) refused or failed: see above"]
    return "\n".join(lines)


def write_json(path, report):
    """Write ``report`` to ``path`` atomically (temp file, fsync, rename), then read it back."""
    path = os.fspath(path)
    with atomic_write(path, "w") as stream:
        json.dump(report, stream, indent=1, allow_nan=False, default=_json_default)
    return read_json(path)


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def read_json(path):
    """Read a report written by :func:`write_json` (plain JSON, no pickle)."""
    with open(path) as stream:
        return json.load(stream)


def _row_label(record):
    """The config, dtype, mask and impl columns of one report row."""
    config = "(" + ",".join(map(str, record["config"])) + ")"
    return f"{config:<19}{record['dtype']:<8}{record.get('mask', 'none'):<7}{record['impl']:<10}"


def plot_results(report, path):
    """Draw fwd+bwd time and peak memory against L (matplotlib, optional).

    Returns False, after saying how to install matplotlib, when it is missing.
    """
    from summary import import_pyplot

    plt = import_pyplot()
    if plt is None:
        return False
    records = [r for r in report["records"] if r["status"] == "ok" and r.get("mask", "none") == "none"]
    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]
    figure, axes = plt.subplots(len(kinds) or 1, 2, figsize=(12, 4.5 * max(len(kinds), 1)),
                                squeeze=False)
    for row, kind in zip(axes, kinds):
        series = {}
        for r in records:
            if r["kind"] == kind:
                series.setdefault((r["impl"], r["dtype"]), []).append(r)
        for (impl, dtype), points in sorted(series.items()):
            points.sort(key=lambda r: r["config"][1])
            lengths = [r["config"][1] for r in points]
            style = "-" if dtype == "float32" else "--"
            row[0].plot(lengths, [r["fwd_bwd"]["median_ms"] for r in points], style, marker="o",
                        label=f"{impl} {dtype}")
            memory = [(r["config"][1], r["memory"]["rss_mib"]) for r in points
                      if r["memory"] and "rss_mib" in r["memory"]]
            if memory:
                row[1].plot(*zip(*memory), style, marker="o", label=f"{impl} {dtype}")
        row[0].set(title=f"{kind}: forward+backward time", xlabel="L", ylabel="ms",
                   xscale="log", yscale="log")
        row[1].set(title=f"{kind}: peak extra memory (RSS)", xlabel="L", ylabel="MiB",
                   xscale="log", yscale="log")
        if not row[1].lines:
            row[1].text(0.5, 0.5, "memory not measured (--no-memory)", ha="center",
                        va="center", transform=row[1].transAxes)
        for axis in row:
            if axis.lines:
                axis.legend(fontsize="small")
    from summary import save_figure

    return save_figure(figure, plt, path)


# ---------------------------------------------------------------- command line


def _parse_config(text):
    try:
        return _check_config(text.replace("(", "").replace(")", "").split(","), "--configs")
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (expected B,L,E,H such as 8,128,256,8)")


def _count(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value}")
    return value


def add_arguments(parser):
    """Add the ``bench`` options to an ``argparse`` parser."""
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true",
                         help="reduced run, about a minute on an idle machine: configs %s, "
                              "float32, qkvnp's default path and PyTorch's layer only, the "
                              "training steps in float32, no import timing, memory of the "
                              "layers at the last config only"
                              % ", ".join(str(tuple(c)) for c in QUICK_CONFIGS))
    presets.add_argument("--off-grid", action="store_true",
                         help="sizes off the grid, about 5 minutes: configs %s (BERT-base, "
                              "GPT-2 small, lengths not powers of two), both dtypes and "
                              "masks, the layer on qkvnp's default path and PyTorch's only; "
                              "no training, memory or import timing"
                              % ", ".join(str(tuple(c)) for c in OFF_GRID_CONFIGS))
    parser.add_argument("--configs", nargs="+", type=_parse_config, metavar="B,L,E,H",
                        help="configurations (default: %s); those with L <= %d are timed "
                             "with each implementation in a process of its own"
                             % (" ".join(",".join(map(str, c)) for c in DEFAULT_CONFIGS),
                                PROCESS_MAX_LENGTH))
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "float64"),
                        help="dtypes (default: float32 float64)")
    parser.add_argument("--masks", nargs="+", choices=MASKS,
                        help="attention masks (default: none causal)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS,
                        help="workloads (default: the layer for L <= %d, both beyond)"
                             % PROCESS_MAX_LENGTH)
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS,
                        help="implementations (default: auto and torch for L <= %d, all "
                             "beyond; the reference path always runs as the cross-check's "
                             "oracle)" % PROCESS_MAX_LENGTH)
    parser.add_argument("--repeats", type=_count(1), help="timed rounds, median reported (default 7)")
    parser.add_argument("--warmup", type=_count(0), default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--pause", type=_seconds,
                        help="seconds slept before each call or round that follows another "
                             "implementation's, while idle BLAS/OpenMP threads stop spinning "
                             "(default 0.3, quick 0.15)")
    parser.add_argument("--round-time", type=_seconds,
                        help="shortest round, in seconds, when each implementation runs in a "
                             f"process of its own: enough calls to make it (default {ROUND_SECONDS}, "
                             "quick 0.02)")
    parser.add_argument("--torch-threads", type=_count(1),
                        help="PyTorch's thread count (default: PyTorch's own, as users get "
                             "it: 2 on a 2-core machine)")
    parser.add_argument("--no-training", action="store_true",
                        help="skip the training-step benchmark")
    parser.add_argument("--gemm-size", type=_count(16), default=GEMM_SIZE,
                        help="n of the n x n matmul that measures the GEMM peak "
                             f"(default {GEMM_SIZE})")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory measurements (fresh processes)")
    parser.add_argument("--import-repeats", type=_count(0),
                        help="fresh interpreters per module for the import cost (default 7, "
                             "quick 0: skipped)")
    parser.add_argument("--targets", action="store_true",
                        help="for qkvnp's developers: also print the check of the project's "
                             "earlier speed and memory targets, and the share of the GEMM peak "
                             "each speed target asks of this machine")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="draw qkvnp's time / PyTorch's against the work size, for the "
                             "default path over the whole grid (needs matplotlib)")
    parser.add_argument("--plot-times", metavar="PATH",
                        help="draw fwd+bwd time and memory of every implementation against L "
                             "(needs matplotlib)")


def run(args):
    """Run the benchmark described by parsed ``args``; return the exit status.

    0 when every available implementation agreed with the reference path
    (and the training losses agreed), 1 when one was refused or failed (its
    numbers are not reported).
    """
    from summary import plot_ratios

    quick, off_grid = args.quick, args.off_grid
    configs = args.configs or (QUICK_CONFIGS if quick else
                               OFF_GRID_CONFIGS if off_grid else DEFAULT_CONFIGS)
    dtypes = args.dtypes or (("float32",) if quick else ("float32", "float64"))
    pause = args.pause if args.pause is not None else 0.15 if quick else 0.3
    round_seconds = (args.round_time if args.round_time is not None
                     else 0.02 if quick else ROUND_SECONDS)
    repeats = args.repeats or 7
    import_repeats = (args.import_repeats if args.import_repeats is not None
                      else 0 if quick or off_grid else 7)
    if args.plot or args.plot_times:
        try:
            import matplotlib  # noqa: F401  (checked now, used at the end)
        except ImportError:
            print("note: --plot needs matplotlib, which is not installed: "
                  "pip install 'qkvnp[plot]'; the benchmark runs without the plot",
                  file=sys.stderr)
    if repeats < 7:
        _progress(f"note: {repeats} rounds: fewer than 7, medians are rough")
    report = run_benchmark(
        configs=configs, dtypes=dtypes, kinds=args.kinds or (("layer",) if off_grid else None),
        impls=args.impls or (("auto", "torch") if off_grid else None),
        masks=args.masks or MASKS, repeats=repeats, warmup=args.warmup, pause=pause,
        round_seconds=round_seconds, memory=not (args.no_memory or off_grid),
        import_repeats=import_repeats,
        memory_kinds=("layer",) if quick else KINDS,
        memory_configs=configs[-1:] if quick else None, tiled_memory=not quick,
        training=not (args.no_training or off_grid), gemm_size=args.gemm_size, quick=quick,
        torch_threads=args.torch_threads,
    )
    report["show_targets"] = bool(args.targets)
    print(format_report(report))
    if args.json:
        write_json(args.json, report)
        print(f"results written to {args.json}")
    if args.plot and plot_ratios(report, args.plot):
        print(f"plot written to {args.plot}")
    if args.plot_times and plot_results(report, args.plot_times):
        print(f"plot written to {args.plot_times}")
    failed = [r for r in report["records"] if r["status"] in ("refused", "error")]
    failed += [t for t in report["training"] if t["status"] in ("refused", "error")]
    return 1 if failed else 0


def main(argv=None):
    """``python benchmarks/run.py [options]``: parse ``argv``, run, return the exit status."""
    parser = argparse.ArgumentParser(prog="benchmarks/run.py",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
