"""Fused softmax cross-entropy for real floating logits.

Shape key: ``...`` any leading dims (batch, positions), N their product, C
classes.

Replaces ``qkvnp.ops.losses.cross_entropy_probs``, the reference
(``scipy.special.log_softmax``, then the target's entry): the same value up
to rounding, in fewer passes: the row maximum, one shift, ``exp2`` with
``log2(e)`` folded in, row sums as a product with a column of ones, and
the logarithm of the ``N`` sums only, never of the ``(N, C)`` entries. It
returns the softmax itself, which the backward reads instead of taking
``exp`` again. :func:`qkvnp.losses.cross_entropy_forward` calls it for real
floating logits after checking them; other logits (the gradient checker's
complex step) keep the reference path.
"""
from __future__ import annotations

import math

import numpy as np

from ._runtime import run

__all__ = ["cross_entropy_probs_fused"]

_LOG2_E = 1.0 / math.log(2.0)


def cross_entropy_probs_fused(logits, targets, counted, count):
    """The mean cross-entropy over the counted positions, and ``softmax(logits)``.

    Parameters
    ----------
    logits : ndarray, shape (..., C)
        Real floating (float32 or float64), checked finite.
    targets : ndarray of int, shape (...)
        A class index in ``[0, C)`` at every position (the caller puts 0 at
        the uncounted ones).
    counted : ndarray of bool, shape (...)
        True = the position counts.
    count : int
        ``counted.sum()``; 0 gives the loss 0.

    Returns
    -------
    loss : ndarray, shape ()
        ``-mean(log softmax(logits)[target])`` over the counted positions,
        of ``logits``' dtype.
    probs : ndarray, shape (..., C)
        ``softmax(logits)`` along the last axis, C order, of ``logits``' dtype.

    Notes
    -----
    With :math:`m` the row maximum and :math:`s = \\sum_j 2^{(z_j - m)\\log_2 e}`,
    :math:`\\log \\mathrm{softmax}(z)_y = (z_y - m) - \\log s` (scipy's
    formula), and :math:`\\mathrm{softmax}(z) = 2^{(z - m)\\log_2 e} / s`.

    NOTE: measured faster than ``log_softmax`` then ``exp``, forward and
    backward (a copy instead of an ``exp``); ``np.exp2`` faster than
    ``np.exp``, a row sum as ``@ ones`` than ``einsum`` (benchmarks/NOTES.md).

    Examples
    --------
    >>> loss, probs = cross_entropy_probs_fused(np.zeros((2, 4)), np.array([0, 3]),
    ...                                         np.array([True, True]), 2)
    >>> bool(np.isclose(loss, np.log(4))), probs[0]
    (True, array([0.25, 0.25, 0.25, 0.25]))
    """
    C = logits.shape[-1]
    rows = logits.reshape(-1, C)  # (..., C) -> (N, C)
    probs = np.empty(rows.shape, logits.dtype)  # each share writes its rows
    picked = np.empty(rows.shape[0], logits.dtype)  # z_y - m, then log softmax(z)_y, (N,)
    flat_targets = targets.reshape(-1)
    N = rows.shape[0]
    # NOTE: row by row the same operations whichever thread runs them: the same bits;
    # the rows shared among the worker threads (benchmarks/NOTES.md, "The Qwen3-like decoder")
    shares = [slice(lo, min(lo + _ROWS, N)) for lo in range(0, N, _ROWS)]
    run(lambda work: [_rows_softmax(rows[s], flat_targets[s], probs[s], picked[s]) for s in work],
        shares, flops=8 * rows.size)
    # NOTE: no counted position -> loss 0 by definition, as the reference path.
    loss = -np.sum(picked, where=counted.reshape(-1)) / count if count else 0.0  # (N,) -> ()
    return np.asarray(loss, dtype=logits.dtype), probs.reshape(logits.shape)


#: Rows of a share of :func:`cross_entropy_probs_fused`'s work.
_ROWS = 64


def _rows_softmax(rows, targets, probs, picked):
    """``softmax`` of ``rows`` ``(n, C)`` into ``probs``, ``log softmax(z)_y`` into ``picked`` ``(n,)``."""
    kind = rows.dtype.type
    positions = np.arange(rows.shape[0])  # (n,)
    # NOTE: the row maximum read at argmax: measured faster than max
    top = rows[positions, rows.argmax(axis=1)]  # m, (n, C) -> (n,)
    np.subtract(rows, top[:, None], out=probs)  # z - m, (n, C), every entry <= 0
    picked[...] = probs[positions, targets]  # z_y - m, (n,)
    probs *= kind(_LOG2_E)
    with np.errstate(under="ignore"):
        np.exp2(probs, out=probs)  # exp(z - m), (n, C)
    sums = probs @ np.ones((rows.shape[1], 1), rows.dtype)  # row sums, (n, C) @ (C, 1) -> (n, 1)
    probs /= sums  # softmax, (n, C)
    picked -= np.log(sums[:, 0])  # log softmax(z)_y, (n,)
