"""The timing protocols: which calls run in which order, and what is reported of them.

L <= 128 (:data:`workloads.grid.PROCESS_MAX_LENGTH`): each implementation in a worker
process of its own (the qkvnp ones never import PyTorch); the parent asks
them in turn for one timed round each, qkvnp, PyTorch, qkvnp, ..., pausing
between rounds; a round is as many calls as last at least ``--round-time``
seconds (:data:`ROUND_SECONDS`); reported: the median over rounds of the
time per call. Idle threads of one library's pool slow the other's calls
at these sizes when both live in one process. The processes and their
rounds are :mod:`harness.workers`.

Longer: one process (:func:`time_interleaved`); within a configuration,
dtype and mode the implementations run interleaved round by round (the
starting one rotating), after a warm-up round, so that a change in the
machine's load hits them alike. The process sleeps ``--pause`` seconds
before each call that follows another implementation's. Idle
OpenBLAS/OpenMP threads spin for a while after a call and slow whatever
runs next on a machine with few cores: the fast core right after the
reference path (multi-threaded OpenBLAS), and the fast layer right after
the tiled layer (whose calls with a single block of work also run on
OpenBLAS's threads), ran slower without the pause. PyTorch runs with its
default thread count, as users get it; numpy's
BLAS with its own default. Reported (:func:`timing_stats`): median, minimum
and interquartile range of ``--repeats`` timed calls (7 by default), and
the ratio ``median(qkvnp) / median(PyTorch)`` of the same workload
(``nn.MultiheadAttention`` for layers, ``scaled_dot_product_attention`` for
the core): below 1 means qkvnp is faster.

>>> format_ms(1234.5), format_ms(12.345), format_ms(0.12345)
('1234', '12.3', '0.123')
"""
import math
import time

import numpy as np

from benchmarks.workloads.grid import MODE_LABELS

__all__ = ["ROUND_SECONDS", "calls_per_round", "format_ms", "time_interleaved",
           "timing_stats"]

#: A round of the one-library-per-process protocol lasts at least this long (s).
#: NOTE: each round follows a pause, and the first calls after it run slow on
#: some hosts; shorter rounds measured the smallest shapes slower for both
#: libraries, with wider spreads (benchmarks/NOTES.md).
ROUND_SECONDS = 0.25



def calls_per_round(call, seconds):
    """Calls of ``call`` that make a round last at least ``seconds``, from a short trial
    after a warm call (the worker processes of both harnesses pick their rounds so)."""
    call()
    done, start = 0, time.perf_counter()
    while True:
        call()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min(seconds, 0.02) and done >= 2:
            break
    return max(1, math.ceil(seconds / (elapsed / done)))


def format_ms(value):
    """Milliseconds with 3 to 4 significant digits: 1234, 123, 12.3, 1.23, 0.123."""
    return format(value, ".0f" if value >= 100 else ".1f" if value >= 10 else
                  ".2f" if value >= 1 else ".3f")


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
    query block) spin for a while after a call, and the next call measured
    slower without a pause (benchmarks/NOTES.md).
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


def timing_stats(seconds, flops):
    """What the report keeps of one implementation's times: median, minimum, quartiles, rate.

    ``seconds``: one time per call (or per call of a round); ``flops``: the
    matmul FLOPs of one call (:data:`workloads.grid.FLOPS`). Times in milliseconds;
    ``gflops`` at the median.
    """
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
