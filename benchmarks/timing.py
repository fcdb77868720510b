"""The timing protocols: which calls run in which order, and what is reported of them.

L <= 128 (:data:`grid.PROCESS_MAX_LENGTH`): each implementation in a worker
process of its own (the qkvnp ones never import PyTorch); the parent asks
them in turn for one timed round each, qkvnp, PyTorch, qkvnp, ..., pausing
between rounds; a round is as many calls as last at least ``--round-time``
seconds (:data:`ROUND_SECONDS`); reported: the median over rounds of the
time per call. Idle threads of one library's pool slowed the other by up to
4x at these sizes when both lived in one process. The processes and their
rounds are :mod:`workers`.

Longer: one process (:func:`time_interleaved`); within a configuration,
dtype and mode the implementations run interleaved round by round (the
starting one rotating), after a warm-up round, so that a change in the
machine's load hits them alike. The process sleeps ``--pause`` seconds
before each call that follows another implementation's. Idle
OpenBLAS/OpenMP threads spin for a while after a call and slow whatever
runs next on the 2 cores: without the pause after the reference path
(multi-threaded OpenBLAS), the fast core measured up to 1.7x slower, and
the fast layer 1.6x slower right after the tiled layer (whose calls with a
single block of work also run on OpenBLAS's threads). PyTorch runs with its
default thread count (2 on the 2-core machine), as users get it; numpy's
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

from grid import MODE_LABELS

__all__ = ["ROUND_SECONDS", "calls_per_round", "format_ms", "time_interleaved",
           "timing_stats"]

#: A round of the one-library-per-process protocol lasts at least this long (s).
#: 0.25 (was 0.05): each round follows a pause, and the first calls after it
#: run slow on some hosts. On an AMD EPYC host (2026-11-24 23:40 UTC, one run
#: of 7 rounds each) 0.05 s rounds took 0.95-1.64x as long a call as 0.25 s
#: rounds at (8, 16, 32, 4) and (64, 8, 16, 2), both libraries alike (qkvnp's
#: (8, 16, 32, 4) float32 331 against 221 us, PyTorch's 769 against 508), and
#: 0.78-1.28x at (16, 32, 64, 4). At (1, 6, 3, 1) float64 causal a hot loop
#: took 115 us, 0.25 s rounds 137, 0.05 s rounds 175-209.
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


def timing_stats(seconds, flops):
    """What the report keeps of one implementation's times: median, minimum, quartiles, rate.

    ``seconds``: one time per call (or per call of a round); ``flops``: the
    matmul FLOPs of one call (:data:`grid.FLOPS`). Times in milliseconds;
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
