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

from ._runtime import single_threaded_blas

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
    kind = logits.dtype.type
    C = logits.shape[-1]
    rows = logits.reshape(-1, C)  # (..., C) -> (N, C)
    positions = np.arange(rows.shape[0])  # (N,)
    # NOTE: the row maximum read at argmax: measured faster than max
    top = rows[positions, rows.argmax(axis=1)]  # m, (N, C) -> (N,)
    shifted = rows - top[:, None]  # z - m, (N, C), every entry <= 0
    picked = shifted[positions, targets.reshape(-1)]  # z_y - m, (N,)
    probs = shifted
    probs *= kind(_LOG2_E)
    with np.errstate(under="ignore"):
        np.exp2(probs, out=probs)  # exp(z - m), (N, C)
    ones = np.ones((C, 1), logits.dtype)
    # NOTE: at one BLAS thread: OpenBLAS's threads spin after a call and slowed the
    # worker threads that run next by half (benchmarks/NOTES.md, "The Qwen3-like decoder")
    with single_threaded_blas():
        sums = probs @ ones  # row sums, (N, C) @ (C, 1) -> (N, 1)
    probs /= sums  # softmax, (N, C)
    picked -= np.log(sums[:, 0])  # log softmax(z)_y, (N,)
    # NOTE: no counted position -> loss 0 by definition, as the reference path.
    loss = -np.sum(picked, where=counted.reshape(-1)) / count if count else 0.0  # (N,) -> ()
    return np.asarray(loss, dtype=logits.dtype), probs.reshape(logits.shape)
