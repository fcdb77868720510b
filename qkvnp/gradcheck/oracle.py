"""Mixed-precision checks: a float32 backward against the float64 one at the same point.

Shape key: a checked tensor may have any shape.

A float32 gradient cannot be checked against float32 central differences to
better than a few percent (round-off over a step of 1e-2). It can be checked
against the *analytic* float64 gradient of the same function at the same
point (the float32 inputs, parameters and ``dout`` upcast exactly), computed
on the reference path: the error of the float32 backward is then measured
alone, normwise per tensor,

.. math:: e = \\max|g_{32} - g_{64}| / \\max|g_{64}|

in units of float32's epsilon. A gradient that is zero in exact arithmetic
(``b_key``'s: its float64 value is round-off, below :data:`ZERO_BELOW` times
``G``, the largest ``|g_64|`` entry of the check) is measured against ``G``
instead, as its float32 value is the round-off of terms of that size. It
passes at :data:`ORACLE_EPS` epsilons.
"""
import numpy as np

from .report import GradcheckReport, GradcheckRow

__all__ = ["ORACLE_EPS", "ZERO_BELOW", "oracle_report"]

#: Default pass mark of a mixed-precision check, in epsilons of the checked dtype.
ORACLE_EPS = 64

#: A float64 gradient below this fraction of the check's largest entry is round-off of zero.
ZERO_BELOW = 1e-8


def oracle_report(grads, reference, dtype, oracle_dtype, rtol=None):
    """Compare ``grads`` (computed in ``dtype``) with ``reference`` (in ``oracle_dtype``).

    Parameters
    ----------
    grads, reference : dict name -> ndarray
        The same names and shapes (``reference`` may have more names).
    dtype, oracle_dtype : dtype
    rtol : float, optional
        Pass mark of the normwise error; default ``ORACLE_EPS * eps(dtype)``.

    Returns
    -------
    GradcheckReport
        ``method="oracle <oracle_dtype>"``; each row's ``max_rel_err`` is the
        normwise error ``e`` (the table prints it in epsilons).
    """
    dtype, oracle_dtype = np.dtype(dtype), np.dtype(oracle_dtype)
    if oracle_dtype.itemsize <= dtype.itemsize and oracle_dtype != dtype:
        raise ValueError(f"oracle_dtype must be at least as precise as dtype {dtype}, "
                         f"got {oracle_dtype}")
    eps = float(np.finfo(dtype).eps)
    rtol = ORACLE_EPS * eps if rtol is None else float(rtol)
    scale = max((float(np.abs(np.asarray(g, dtype=np.float64)).max(initial=0.0))
                 for g in reference.values() if g is not None), default=0.0)
    rows = []
    for name, grad in grads.items():
        test = np.asarray(grad, dtype=np.float64)
        exact = np.asarray(reference[name], dtype=np.float64)
        if exact.shape != test.shape:
            raise ValueError(f"the oracle's gradient of {name!r} has shape {exact.shape}, "
                             f"the checked one {test.shape}")
        diff = np.abs(test - exact)
        if diff.size == 0:
            rows.append(GradcheckRow(name, test.shape, 0.0, 0.0, (), 0.0, 0.0, True))
            continue
        worst = np.unravel_index(int(np.argmax(np.where(np.isnan(diff), np.inf, diff))), diff.shape)
        peak = float(np.abs(exact).max())
        denom = peak if peak > ZERO_BELOW * scale else scale
        error = float(diff.max()) / denom if denom > 0 else (0.0 if diff.max() == 0 else np.inf)
        error = np.inf if np.isnan(error) else error
        rows.append(GradcheckRow(name, test.shape, float(diff.max()), error,
                                 tuple(int(i) for i in worst), float(test[worst]),
                                 float(exact[worst]), bool(error <= rtol)))
    return GradcheckReport(rows, "elementwise", dtype, 0.0, rtol, 0.0,
                           method=f"oracle {oracle_dtype}", order="")
