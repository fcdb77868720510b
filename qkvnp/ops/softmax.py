"""Softmax along an axis, forward and backward (the closed form, no Jacobian).

Shape key: ``...`` any shape; ``axis`` the one whose entries sum to 1.
Derived in ``docs/derivations.md``; users reach it through
:mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import as_float_array, as_upstream_grad, compute_dtype, declare_complex_step

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import ArrayLike, FloatArray

__all__ = ["softmax", "softmax_forward", "softmax_backward", "SoftmaxCache"]

SoftmaxCache = namedtuple("SoftmaxCache", "weights axis")


def softmax(x: ArrayLike, axis: int = -1) -> FloatArray:
    """``scipy.special.softmax``, except that an all ``-inf`` row gives zeros.

    Parameters
    ----------
    x : array_like
    axis : int
        Axis along which the entries sum to 1.

    Returns
    -------
    ndarray, same shape as ``x``
        Rows sum to 1, except fully masked rows (every entry ``-inf``), which
        are all zeros: such a query attends to nothing. No NaN, no warning.

    Examples
    --------
    >>> softmax(np.array([[0.0, 0.0], [-np.inf, -np.inf]]))
    array([[0.5, 0.5],
           [0. , 0. ]])
    """
    from scipy.special import softmax as scipy_softmax

    x = np.asarray(x)
    if x.dtype.kind != "f":
        x = x.astype(compute_dtype(x.dtype, names=("x",)))
    if x.size == 0:
        return np.zeros_like(x)  # no entries (e.g. no keys): nothing to normalise
    if x.dtype.kind == "c":  # the checker's complex step: max of the real part, no scipy
        row_max = np.max(x.real, axis=axis, keepdims=True)
        dead = row_max == -np.inf
        with np.errstate(over="ignore"):  # -big - big -> -inf, whose weight is 0
            shifted = np.where(dead, 0, x) - np.where(dead, 0, row_max)
        weights = np.exp(shifted) / np.sum(np.exp(shifted), axis=axis, keepdims=True)
        return np.where(dead, 0, weights)
    # NOTE: scipy >= 1.9 (our minimum) computes exp(x - max) / sum: the shift
    # that keeps scores at the float max finite (scipy 1.8's exp(x - logsumexp(x))
    # gave three scores tied at finfo.max weights summing to 3). Shifting here
    # as well would cost a pass more (measured in benchmarks/NOTES.md).
    with np.errstate(over="ignore", invalid="ignore"):  # -big - big -> -inf; dead rows below
        weights = scipy_softmax(x, axis=axis)
    # NOTE: a fully masked row (every entry -inf) has no defined softmax (0/0,
    # scipy's NaN); we define it as all zeros so that the query's output is 0
    # and no gradient flows through it. Its first entry is NaN, as that of a
    # row holding NaN or +inf, which stays NaN.
    first = weights[(slice(None),) * (axis % weights.ndim) + (slice(0, 1),)]  # a view
    if np.isnan(first).any():
        dead = np.all(x == -np.inf, axis=axis, keepdims=True)
        weights = np.where(dead, 0, weights)
    return weights.astype(x.dtype, copy=False)


def softmax_forward(scores: FloatArray, axis: int = -1) -> tuple[FloatArray, SoftmaxCache]:
    """Softmax along ``axis``, with the cache its backward needs.

    Parameters
    ----------
    scores : ndarray
    axis : int

    Returns
    -------
    weights : ndarray, same shape as ``scores``
    cache : SoftmaxCache

    Notes
    -----
    Forward: :math:`P_i = e^{s_i} / \\sum_j e^{s_j}`. The Jacobian is
    :math:`\\partial P_i / \\partial s_j = P_i(\\delta_{ij} - P_j)`, so the
    vector-Jacobian product collapses to the closed form

    .. math:: \\bar s = P \\odot (\\bar P - \\textstyle\\sum_j P_j \\bar P_j)

    which never builds the Jacobian. A fully masked row has ``P = 0`` and
    therefore ``dscores = 0``.

    Examples
    --------
    >>> weights, cache = softmax_forward(np.log([[1.0, 3.0]]))
    >>> weights
    array([[0.25, 0.75]])
    """
    scores = as_float_array(scores, "scores", finite=False)
    weights = softmax(scores, axis=axis)
    return weights, SoftmaxCache(weights, axis)


def softmax_backward(dweights: FloatArray, cache: SoftmaxCache, check: bool = True) -> FloatArray:
    """Backward of :func:`softmax_forward`: ``P * (dP - sum(P * dP, axis))``.

    Parameters
    ----------
    dweights : ndarray, same shape as the weights
    cache : SoftmaxCache
    check : bool
        False: the gradient is already checked (composite backwards).

    Returns
    -------
    dscores : ndarray, same shape as the weights

    Raises
    ------
    TypeError
        If ``dweights`` does not hold real numbers.
    ValueError
        If ``dweights`` does not have the weights' shape exactly or holds NaN
        or inf.
    """
    weights, _ = cache
    if check:
        dweights = as_upstream_grad(dweights, "dweights", weights.shape, weights.dtype)
    return _softmax_backward(dweights, cache)


def _softmax_backward(dweights, cache):
    """:func:`softmax_backward` of a ``dweights`` already checked and cast."""
    weights, axis = cache
    row_dot = np.sum(weights * dweights, axis=axis, keepdims=True)  # (..., 1)
    return weights * (dweights - row_dot)



declare_complex_step(softmax_forward)  # see qkvnp._checks.complex_step_mode
