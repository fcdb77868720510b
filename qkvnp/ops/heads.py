"""Splitting the embedding axis into attention heads and merging them back (part of :mod:`qkvnp.functional`).

Shape key: T sequence length, E embedding, H heads, D = E / H head dim,
``...`` any leading dims.

Both ops are reshapes and axis swaps: each one's backward is the other's
forward. Kept out of :mod:`qkvnp.functional` only for that module's length;
import them from there (``qkvnp.functional.split_heads_forward``).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import as_upstream_grad, check_int, check_ndim, compute_dtype, declare_complex_step

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["split_heads_forward", "split_heads_backward", "merge_heads_forward",
           "merge_heads_backward", "HeadsCache"]

HeadsCache = namedtuple("HeadsCache", "num_heads out_shape dtype")


def split_heads_forward(x: FloatArray, num_heads: int) -> tuple[FloatArray, HeadsCache]:
    """Split the last axis into heads: ``(..., T, H*D) -> (..., H, T, D)``.

    Head ``h`` gets the contiguous columns ``h*D:(h+1)*D`` (as PyTorch and BERT).

    Parameters
    ----------
    x : ndarray, shape (..., T, E)
    num_heads : int
        Must divide ``E``.

    Returns
    -------
    out : ndarray, shape (..., H, T, E // H)
    cache : HeadsCache

    Raises
    ------
    TypeError
        If ``x`` does not hold real numbers (complex, object...), or
        ``num_heads`` is not an int (bools and strings refused).
    ValueError
        If ``x`` has fewer than 2 dims or ``num_heads`` does not divide ``E``.

    Examples
    --------
    >>> out, cache = split_heads_forward(np.arange(4.0).reshape(1, 4), 2)
    >>> out.tolist()
    [[[0.0, 1.0]], [[2.0, 3.0]]]
    """
    x = np.asarray(x)
    check_ndim(x, "x", 2, "(..., T, E)")
    grad_dtype = _heads_grad_dtype(x)
    E = x.shape[-1]
    num_heads = check_int(num_heads, "num_heads", 1, expected=f"a positive divisor of E={E}")
    if E % num_heads:
        raise ValueError(f"num_heads must be a positive divisor of E={E}, got {num_heads}")
    heads = x.reshape(x.shape[:-1] + (num_heads, E // num_heads))  # (..., T, E) -> (..., T, H, D)
    out = np.swapaxes(heads, -2, -3)  # (..., T, H, D) -> (..., H, T, D)
    return out, HeadsCache(num_heads, out.shape, grad_dtype)


def _heads_grad_dtype(x):
    """dtype of the gradient of a head split/merge input: ``x``'s own, if float."""
    # NOTE: the split is a reshape: no compute dtype, a float input keeps its own.
    return x.dtype if x.dtype.kind == "f" else compute_dtype(x.dtype, names=("x",))


def split_heads_backward(dout: FloatArray, cache: HeadsCache, check: bool = True) -> FloatArray:
    """Backward of :func:`split_heads_forward`: merge the heads of ``dout``.

    Parameters
    ----------
    dout : ndarray, shape (..., H, T, D)
        Same shape as the forward output.
    cache : HeadsCache
    check : bool
        False: the gradient is already checked (composite backwards).

    Returns
    -------
    dx : ndarray, shape (..., T, H*D)
        In the dtype of the forward's ``x`` (float64 for an integer ``x``).

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
    """
    if check:
        dout = as_upstream_grad(dout, "dout", cache.out_shape, cache.dtype)
    return _split_heads_backward(dout, cache)


def _split_heads_backward(dout, cache):
    """:func:`split_heads_backward` of a ``dout`` already checked and cast."""
    return merge_heads_forward(dout)[0]


def merge_heads_forward(x: FloatArray) -> tuple[FloatArray, HeadsCache]:
    """Merge heads: ``(..., H, T, D) -> (..., T, H*D)``, inverse of the split.

    Returns
    -------
    out : ndarray, shape (..., T, H*D)
    cache : HeadsCache

    Raises
    ------
    TypeError
        If ``x`` does not hold real numbers (complex, object...).
    ValueError
        If ``x`` has fewer than 3 dims.
    """
    x = np.asarray(x)
    check_ndim(x, "x", 3, "(..., H, T, D)")
    grad_dtype = _heads_grad_dtype(x)
    H, T, D = x.shape[-3:]
    heads = np.swapaxes(x, -2, -3)  # (..., H, T, D) -> (..., T, H, D)
    out = heads.reshape(heads.shape[:-2] + (H * D,))  # (..., T, H, D) -> (..., T, H*D)
    return out, HeadsCache(H, out.shape, grad_dtype)


def merge_heads_backward(dout: FloatArray, cache: HeadsCache, check: bool = True) -> FloatArray:
    """Backward of :func:`merge_heads_forward`: split ``dout`` into heads.

    Parameters
    ----------
    dout : ndarray, shape (..., T, H*D)
        Same shape as the forward output.
    cache : HeadsCache
    check : bool
        False: the gradient is already checked (composite backwards).

    Returns
    -------
    dx : ndarray, shape (..., H, T, D)
        In the dtype of the forward's ``x`` (float64 for an integer ``x``).

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
    """
    if check:
        dout = as_upstream_grad(dout, "dout", cache.out_shape, cache.dtype)
    return _merge_heads_backward(dout, cache)


def _merge_heads_backward(dout, cache):
    """:func:`merge_heads_backward` of a ``dout`` already checked and cast."""
    return split_heads_forward(dout, cache.num_heads)[0]


declare_complex_step(split_heads_forward, merge_heads_forward)  # see qkvnp._checks.complex_step_mode
