"""The machine measured: what it is (CPU, versions, BLAS, threads) and what its BLAS can do.

What makes the numbers interpretable is printed at the top of the report
(:func:`environment_info`): the CPU, the versions, the commit of the qkvnp
checkout measured, the BLAS that numpy uses and the thread count it runs
with, the environment variables that steer OpenBLAS, and the load average.

The GEMM peak (:func:`measure_gemm_peak`): ``numpy.matmul`` of two square
matrices (n = 2048, ``out=`` given) in the same dtype, best of several,
measured before and after the timings; "% peak" in the report divides an
achieved rate by it. The same product on one BLAS thread says how much the
second core adds. :func:`measure_attention_gemm_ceiling` times the
attention core's own matmul shapes, one head per thread in cache: about the
most an attention core built on these BLAS calls can reach.
"""
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import qkvnp
from benchmarks.workloads.attention import ImplementationMissing, import_torch
from benchmarks.workloads.grid import check_dtype
from qkvnp.kernels import blas_threads
from qkvnp.kernels._runtime import get_num_threads, openblas_info
from qkvnp.kernels._runtime import run as run_in_workers

__all__ = [
    "CHILD_PATH",
    "run_json_child",
    "GEMM_SIZE",
    "CEILING_LENGTH",
    "CEILING_HEAD_DIM",
    "measure_gemm_peak",
    "measure_attention_gemm_ceiling",
    "checkout_commit",
    "environment_info",
]

GEMM_SIZE = 2048
#: One head of this (L, D) measures the BLAS ceiling on attention shapes (in cache).
CEILING_LENGTH = 512
CEILING_HEAD_DIM = 64
#: What a child process (memory, import cost, workers) puts first on
#: ``sys.path``: the directory holding the ``benchmarks`` package, and the directory of the
#: qkvnp this process imported.
CHILD_PATH = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
              os.path.dirname(os.path.dirname(os.path.abspath(qkvnp.__file__)))]


def run_json_child(module, function, spec, timeout):
    """``module.function(spec)`` in a fresh Python process (:data:`CHILD_PATH` first on its
    path); the JSON of the last line it printed, or ``{"error": ...}`` with its exit status and
    last error line (or the timeout).
    """
    code = ("import sys; sys.path[:0] = sys.argv[2:]; "
            f"from {module} import {function}; {function}(sys.argv[1])")
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
    dtype = check_dtype(dtype)
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
    dtype = check_dtype(dtype)
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


def environment_info(torch=True):
    """What makes the numbers interpretable: machine, versions, BLAS, threads, env vars.

    ``torch=False``: PyTorch's version from its package metadata, without
    importing it (a parent process whose workers alone run the libraries);
    ``torch_threads`` is then None.
    """
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
        "qkvnp_threads": get_num_threads(),
        "commit": checkout_commit(),
        "torch": None if torch else version("torch"),
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
    if torch:
        try:
            module = import_torch()
            info["torch"] = module.__version__
            info["torch_threads"] = module.get_num_threads()
        except ImplementationMissing:
            pass
    return info
