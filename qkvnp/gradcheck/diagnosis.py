"""Diagnosis of a failing gradient row: which typical backward bug fits the numbers.

Shape key: a checked tensor may have any shape; the rules read its last two
axes (transpose) or any axis (zero slices, shift invariance).

:func:`diagnose` compares the analytic gradient ``a`` with the numeric one
``n`` and returns one code of :data:`DIAGNOSES` and a sentence. The rules run
in the order of the table and the first that fits wins:

``nonfinite``
    ``a`` holds NaN or inf.
``noise``
    ``a`` matches ``n`` normwise to ``10 rtol``, or every difference is
    within ten times the round-off model of the numerical side
    (:func:`qkvnp.gradcheck.checker.round_off_noise`): the failing entries
    are small ones, at the noise of the differences; a step or tolerance
    too tight for the problem, not a bug of the backward.
``zero``
    ``a`` is exactly zero, ``n`` is not: a gradient that is never
    accumulated, or a softmax taken over a single score (its derivative is 0).
``sign``
    ``a = -n``: a sign flip.
``ratio``
    ``a = c n`` for a constant ``c``: a missing or extra factor, printed as a
    number and as the nearest of :data:`FORMS` (small integers ``k <= 16``,
    ``sqrt(k)``, ``1/k``, ``1/sqrt(k)``) when it is within 0.1%, e.g.
    ``1/sqrt(2)`` for a scale of ``1/sqrt(E)`` where ``1/sqrt(E/2)`` belongs
    (near 1 it is printed as ``1 + d``: an error common to every entry).
``transposed``
    ``a = n^T`` over the last two (square) axes.
``zero_slices``
    some rows or columns (slices along an axis) of ``a`` are exactly zero
    where ``n``'s are not: a mask applied with the wrong polarity or to the
    wrong positions.
``softmax_axis``
    ``n`` sums to zero along an axis (a softmax over that axis ignores a
    constant added along it, so does everything after it), ``a`` does not:
    the error is confined to that softmax axis, a reduction over the wrong
    axis or a missing row-sum term.
``ones_dout``
    ``a`` matches ``n`` when the check is re-run with ``dout`` all ones (and
    only then): the backward ignores the values of ``dout``, its errors
    cancel along a row. Found by :mod:`qkvnp.gradcheck.checker`, which re-runs.
``unknown``
    none of the above.

In ``"direction"`` mode only the projections ``<u, a>`` and ``<u, n>`` are
known, so only ``nonfinite``, ``zero``, ``sign``, ``ratio`` and ``ones_dout``
can be told.
"""
import math

import numpy as np

__all__ = ["DIAGNOSES", "FORMS", "diagnose", "nearest_form"]

#: The documented codes and what each says in words.
DIAGNOSES = {
    "nonfinite": "the analytic gradient holds NaN or inf",
    "noise": "errors at the noise of the numerical derivative: the step or tolerance, not a bug",
    "zero": "the analytic gradient is zero where the numeric one is not",
    "sign": "sign flip: analytic = -numeric",
    "ratio": "constant ratio analytic / numeric: a missing or extra factor",
    "transposed": "transposed: analytic = numeric with its last two axes swapped",
    "zero_slices": "zero rows/columns in the analytic gradient where the numeric one is not zero",
    "softmax_axis": "error confined to a softmax axis: wrong reduction axis or missing row-sum",
    "ones_dout": "matches only for an all-ones dout: the backward ignores dout's values",
    "rotation": ("the analytic gradient has the numeric one's length along the last axis, not "
                 "its direction: a rotation by the wrong angle (+theta for -theta) or a "
                 "permutation within rows"),
    "unknown": "no known pattern",
}


def _forms():
    forms = {"1": 1.0}
    for k in range(2, 17):
        forms[str(k)] = float(k)
        forms[f"1/{k}"] = 1.0 / k
        root = math.sqrt(k)
        if root != int(root):
            forms[f"sqrt({k})"] = root
            forms[f"1/sqrt({k})"] = 1.0 / root
    return forms


#: The nearest forms a constant ratio is printed as: small integers, their
#: square roots and their reciprocals.
FORMS = _forms()


def nearest_form(ratio, rtol=1e-3):
    """The name of the form of :data:`FORMS` nearest to ``|ratio|``, or None beyond ``rtol``.

    >>> nearest_form(0.70710678), nearest_form(-4.0), nearest_form(0.83)
    ('1/sqrt(2)', '4', None)
    """
    if not np.isfinite(ratio) or ratio == 0:
        return None
    name, value = min(FORMS.items(), key=lambda item: abs(math.log(abs(ratio) / item[1])))
    return name if abs(abs(ratio) / value - 1) <= rtol else None


def _close(a, b, rtol):
    """``||a - b|| <= rtol ||b||`` (Frobenius norms)."""
    return float(np.linalg.norm(a - b)) <= rtol * float(np.linalg.norm(b))


def _ratio(a, n, rtol):
    """``(c, fits)``: the least-squares ``c`` of ``a ~ c n`` and whether it explains ``a``."""
    nn = float(np.sum(n * n))
    if nn == 0:
        return np.nan, False
    c = float(np.sum(a * n)) / nn
    return c, _close(a, c * n, rtol) and c != 0


def _zero_slices(a, n, rtol):
    """``(axis, indices)`` of slices where ``a`` is exactly 0 and ``n`` is not, else None."""
    scale = float(np.abs(n).max())
    if a.ndim < 2:  # rows and columns need two axes
        return None
    for axis in range(a.ndim):
        if a.shape[axis] < 2:
            continue
        others = tuple(i for i in range(a.ndim) if i != axis)
        a_peak = np.abs(a).max(axis=others)
        n_peak = np.abs(n).max(axis=others)
        bad = (a_peak == 0) & (n_peak > 10 * rtol * scale)
        if bad.any() and not bad.all():
            return axis, [int(i) for i in np.flatnonzero(bad)]
    return None


def _invariant_axes(g, rtol):
    """Axes along which ``g`` sums to zero (relative to its size)."""
    axes = []
    for axis in range(g.ndim):
        if g.shape[axis] < 2:
            continue
        sums = np.abs(g.sum(axis=axis)).max()
        if sums <= rtol * np.abs(g).max() * math.sqrt(g.shape[axis]):
            axes.append(axis)
    return axes


def diagnose(analytic, numeric, rtol, mode="elementwise", noise=0.0):
    """Return ``(code, words)`` for a failing row: the first rule of the table that fits.

    Parameters
    ----------
    analytic, numeric : ndarray
        The two gradients (elementwise mode) or their projections on the
        directions (direction mode).
    rtol : float
        The check's tolerance: the rules accept a pattern that explains the
        analytic gradient to ``max(10 rtol, 1e-6)``.
    mode : {"elementwise", "direction"}
    noise : float
        Absolute round-off of the numerical side, by the checker's model
        (0: unknown).

    Returns
    -------
    code : str
        A key of :data:`DIAGNOSES`.
    words : str

    Examples
    --------
    >>> diagnose(np.array([1.0, 2.0]) / np.sqrt(2), np.array([1.0, 2.0]), 1e-6)
    ('ratio', 'constant ratio analytic / numeric = 0.707107 ~ 1/sqrt(2): a missing or extra factor')
    """
    a = np.asarray(analytic, dtype=np.float64)
    n = np.asarray(numeric, dtype=np.float64)
    fit = max(10 * rtol, 1e-6)
    if not np.isfinite(a).all():
        return "nonfinite", DIAGNOSES["nonfinite"]
    if not np.isfinite(n).all() or not np.abs(n).max(initial=0.0) > 0:
        return "unknown", DIAGNOSES["unknown"]
    if (noise > 0 and np.abs(a - n).max() <= 10 * noise) or _close(a, n, 10 * rtol):
        return "noise", DIAGNOSES["noise"]
    if not np.abs(a).max(initial=0.0) > 0:
        return "zero", DIAGNOSES["zero"] + " (all of it)"
    c, fits = _ratio(a, n, fit)
    if fits and abs(c + 1) <= fit:
        return "sign", DIAGNOSES["sign"]
    if fits:
        form = nearest_form(c)
        if form == "1":  # an error common to every entry, not a factor
            return "ratio", (f"constant ratio analytic / numeric = 1 {c - 1:+.2e}: the same "
                             "relative error in every entry")
        where = f" ~ {'-' if c < 0 else ''}{form}" if form else " (no simple form)"
        return "ratio", f"constant ratio analytic / numeric = {c:.6g}{where}: a missing or extra factor"
    if mode != "elementwise":
        return "unknown", DIAGNOSES["unknown"]
    if a.ndim >= 2 and a.shape[-1] == a.shape[-2] and _close(a, np.swapaxes(n, -1, -2), fit):
        return "transposed", DIAGNOSES["transposed"]
    zero = _zero_slices(a, n, fit)
    if zero is not None:
        axis, indices = zero
        return "zero_slices", (f"zero slices {indices} along axis {axis} of the analytic gradient "
                               "where the numeric one is not zero (a mask or a slice dropped)")
    lost = [axis for axis in _invariant_axes(n, fit) if axis not in _invariant_axes(a, fit)]
    if lost:
        return "softmax_axis", (f"error confined to softmax axis {lost[0] - n.ndim}: the numeric "
                                "gradient sums to zero along it (a softmax ignores a shift), the "
                                "analytic one does not: wrong reduction axis or missing row-sum")
    if _close(np.linalg.norm(a, axis=-1), np.linalg.norm(n, axis=-1), fit):
        return "rotation", DIAGNOSES["rotation"]
    return "unknown", DIAGNOSES["unknown"]
