"""The affine map ``x @ W + b`` over the last axis, forward and backward.

Shape key: ``...`` any leading dims (possibly none), N input features, M
output features. Derived in ``docs/derivations.md``; users reach it through
:mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, check_ndim, compute_dtype,
                       declare_complex_step, owned)
from .reductions import column_sums

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["linear_forward", "linear_backward", "LinearCache"]

LinearCache = namedtuple("LinearCache", "x W has_bias")


def linear_forward(x: FloatArray, W: FloatArray, b: FloatArray | None = None, *,
                   check: bool = True) -> tuple[FloatArray, LinearCache]:
    """Affine map ``out = x @ W + b`` over the last axis of ``x``.

    Parameters
    ----------
    x : ndarray, shape (..., N)
    W : ndarray, shape (N, M)
        The ``x @ W`` convention (PyTorch stores the transpose).
    b : ndarray, shape (M,), optional
    check : bool, keyword-only
        False: the inputs are a composite's own arrays, already checked
        (float, one dtype, these shapes, finite), which it does not edit
        before the backward; they are neither checked again nor copied
        (see :func:`attention_forward`).

    Returns
    -------
    out : ndarray, shape (..., M)
    cache : LinearCache

    Raises
    ------
    ValueError
        If ``W`` is not 2-D, ``x``'s last dim is not ``N``, ``b`` is not
        ``(M,)``, or an input holds NaN or inf.
    TypeError
        If an input does not hold real numbers or is wider than float64
        (float128); the message names it.

    Notes
    -----
    Forward: :math:`Y = X W + b`. With the leading dims of ``X`` flattened
    into rows, backward:

    .. math:: \\bar X = \\bar Y W^T, \\quad \\bar W = X^T \\bar Y, \\quad
              \\bar b = \\sum_{rows} \\bar Y

    Examples
    --------
    >>> out, cache = linear_forward(np.ones((2, 3)), np.eye(3, 2), np.array([1., 0.]))
    >>> out
    array([[2., 1.],
           [2., 1.]])
    """
    x_in, W_in = x, W
    if check:
        x, W, b = _linear_inputs(x, W, b)
    # NOTE: one product over all rows, as in the backward: faster than numpy's
    # stack of one product per leading index
    out = x.reshape(-1, x.shape[-1]) @ W  # (..., N) -> (rows, N) @ (N, M) -> (rows, M)
    out = out.reshape(x.shape[:-1] + (W.shape[1],))  # (rows, M) -> (..., M)
    if b is not None:
        out = out + b
    if check:
        x, W = owned((x, W), (x_in, W_in))  # the cache owns what backward reads
    return out, LinearCache(x, W, b is not None)


def _linear_inputs(x, W, b):
    """``x, W, b`` of :func:`linear_forward` checked and cast to their compute dtype."""
    W = as_float_array(W, "W")
    dtype = compute_dtype(np.asarray(x).dtype, W.dtype, names=("x", "W"))
    x = as_float_array(x, "x", dtype)
    W = W.astype(dtype, copy=False)
    if W.ndim != 2:
        raise ValueError(f"W must have shape (N, M), got shape {W.shape}")
    check_ndim(x, "x", 1, "(..., N)")
    if x.shape[-1] != W.shape[0]:
        raise ValueError(
            f"x must have shape (..., {W.shape[0]}) to match W of shape {W.shape}, "
            f"got shape {x.shape}"
        )
    if b is not None:
        b = as_float_array(b, "b", dtype)
        if b.shape != (W.shape[1],):
            raise ValueError(f"b must have shape ({W.shape[1]},), got shape {b.shape}")
    return x, W, b


def linear_backward(dout: FloatArray, cache: LinearCache,
                    check: bool = True) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Backward of :func:`linear_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., M)
    cache : LinearCache
    check : bool
        False: the gradient is already checked (composite backwards).

    Returns
    -------
    dx : ndarray, shape (..., N)
    dW : ndarray, shape (N, M)
    db : ndarray, shape (M,), or None when the forward had no bias

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of shape ``(..., M)`` exactly (no broadcasting) or
        holds NaN or inf.
    """
    x, W, _ = cache
    if check:
        dout = as_upstream_grad(dout, "dout", x.shape[:-1] + (W.shape[1],), W.dtype)
    return _linear_backward(dout, cache)


def _linear_backward(dout, cache):
    """:func:`linear_backward` of a ``dout`` already checked and cast."""
    x, W, has_bias = cache
    x_rows = x.reshape(-1, x.shape[-1])  # (..., N) -> (rows, N)
    dout_rows = dout.reshape(-1, dout.shape[-1])  # (..., M) -> (rows, M)
    # NOTE: one product over all rows, not numpy's stack of one per leading
    # index: faster (measured at one BLAS thread)
    dx = (dout_rows @ W.T).reshape(x.shape)  # (rows, M) @ (M, N) -> (rows, N) -> (..., N)
    dW = x_rows.T @ dout_rows  # (N, rows) @ (rows, M) -> (N, M)
    db = column_sums(dout_rows) if has_bias else None  # (rows, M) -> (M,)
    return dx, dW, db



declare_complex_step(linear_forward)  # see qkvnp._checks.complex_step_mode
