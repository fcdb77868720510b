"""Correctness before speed: every implementation's results against the reference path's.

Before anything is timed, every implementation's output and gradients (of
the input and of every weight and bias) are compared with qkvnp's reference
path, the oracle that the test suite checks against PyTorch autograd and
central differences. The error of an array is ``max|a - r| / max|r|``
(relative to the array's scale); the tolerance is the one the tests use,
:data:`qkvnp.kernels.PATH_TOLERANCES` (1e-12 in float64, 1e-5 in float32).
An implementation that exceeds it, or returns a non-finite value or a wrong
shape, is *refused*: its times are not reported, and the command exits with
status 1.
"""
from collections import namedtuple

import numpy as np

from benchmarks.workloads.grid import check_dtype
from qkvnp.kernels import PATH_TOLERANCES

__all__ = ["Check", "relative_error", "cross_check"]

Check = namedtuple("Check", "ok error worst tolerance")
Check.__doc__ = "Cross-check verdict: ok, worst relative error, its array name, tolerance."


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
    tolerance = PATH_TOLERANCES[check_dtype(dtype)]
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
