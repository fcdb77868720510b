"""Layer normalisation over the last axis, forward and backward.

Shape key: ``...`` any leading dims (B batch, T tokens), E the normalised
(last) axis.

The forward is analytic (no ``abs``, no ``maximum``): the gradient
checker's complex step runs it on complex arrays. Derived in
``docs/derivations_gpt.md``; users reach it through :mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, check_eps, compute_dtype,
                       declare_complex_step)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["layer_norm_forward", "layer_norm_backward", "LayerNormCache"]

LayerNormCache = namedtuple("LayerNormCache", "normalized rstd scale")



def layer_norm_forward(x: FloatArray, scale: FloatArray, shift: FloatArray,
                       eps: float | None = 1e-05) -> tuple[FloatArray, LayerNormCache]:
    """Layer normalisation over the last axis (the book's ``LayerNorm``).

    Parameters
    ----------
    x : ndarray, shape (..., E)
    scale : ndarray, shape (E,)
    shift : ndarray, shape (E,)
    eps : float
        Added to the variance (the book's and PyTorch's ``1e-5``).

    Returns
    -------
    out : ndarray, shape (..., E)
    cache : LayerNormCache

    Raises
    ------
    ValueError
        If ``scale`` or ``shift`` is not ``(E,)``, ``eps <= 0``, or an input
        holds NaN or inf.
    TypeError
        If an input does not hold real numbers.

    Notes
    -----
    Forward, per row of :math:`E` entries, with the biased variance (divided
    by :math:`E`, as the book's ``unbiased=False`` and ``nn.LayerNorm``):

    .. math:: \\mu = \\frac1E \\sum_j x_j, \\quad
              \\sigma^2 = \\frac1E \\sum_j (x_j - \\mu)^2, \\quad
              r = (\\sigma^2 + \\epsilon)^{-1/2}, \\quad
              \\hat x = (x - \\mu)\\, r, \\quad y = \\gamma \\odot \\hat x + \\beta

    Backward, with :math:`g = \\gamma \\odot \\bar y` and :math:`\\langle\\cdot\\rangle`
    the mean over the row (derived in ``docs/derivations_gpt.md``):

    .. math:: \\bar x = r \\left(g - \\langle g \\rangle
              - \\hat x \\langle g \\odot \\hat x \\rangle\\right), \\quad
              \\bar\\gamma = \\sum_{rows} \\bar y \\odot \\hat x, \\quad
              \\bar\\beta = \\sum_{rows} \\bar y

    :math:`\\langle g \\rangle` is the mean's term, :math:`\\hat x \\langle g
    \\odot \\hat x \\rangle` the variance's.

    Examples
    --------
    >>> out, cache = layer_norm_forward(np.array([[1.0, 2.0, 3.0]]), np.ones(3), np.zeros(3))
    >>> np.round(out, 4)
    array([[-1.2247,  0.    ,  1.2247]])
    >>> dx, dscale, dshift = layer_norm_backward(np.array([[1.0, 1.0, 1.0]]), cache)
    >>> bool(np.allclose(dx, 0.0)), dshift
    (True, array([1., 1., 1.]))
    """
    eps = check_eps(eps)
    scale = as_float_array(scale, "scale")
    shift = as_float_array(shift, "shift")
    if x is None:
        raise TypeError("x must be an array, got None")
    dtype = compute_dtype(np.asarray(x).dtype, scale.dtype, shift.dtype,
                          names=("x", "scale", "shift"))
    x = as_float_array(x, "x", dtype)
    scale, shift = scale.astype(x.dtype, copy=False), shift.astype(x.dtype, copy=False)
    if x.ndim < 1:
        raise ValueError(f"x must have shape (..., E), got shape {x.shape}")
    E = x.shape[-1]
    for name, value in (("scale", scale), ("shift", shift)):
        if value.shape != (E,):
            raise ValueError(f"{name} must have shape ({E},) to match x of shape {x.shape}, "
                             f"got shape {value.shape}")
    mean = x.mean(axis=-1, keepdims=True)  # (..., E) -> (..., 1)
    centered = x - mean  # (..., E)
    # NOTE: centered * centered, not centered ** 2 or abs(): analytic, so complex step works
    var = (centered * centered).mean(axis=-1, keepdims=True)  # (..., E) -> (..., 1)
    rstd = 1.0 / np.sqrt(var + eps)  # (..., 1)
    normalized = centered * rstd  # (..., E)
    out = normalized * scale + shift  # (..., E)
    return out, LayerNormCache(normalized, rstd, scale.copy())


def layer_norm_backward(dout: FloatArray, cache: LayerNormCache,
                        check: bool = True) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Backward of :func:`layer_norm_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., E)
    cache : LayerNormCache
    check : bool
        False: ``dout`` is a composite's own gradient, already checked.

    Returns
    -------
    dx : ndarray, shape (..., E)
    dscale : ndarray, shape (E,)
    dshift : ndarray, shape (E,)

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape or holds NaN or inf.
    """
    normalized, rstd, scale = cache
    if check:
        dout = as_upstream_grad(dout, "dout", normalized.shape, normalized.dtype)
    E = normalized.shape[-1]
    rows_dout = dout.reshape(-1, E)  # (..., E) -> (R, E)
    rows_normalized = normalized.reshape(-1, E)  # (..., E) -> (R, E)
    dshift = rows_dout.sum(axis=0)  # (R, E) -> (E,)
    dscale = (rows_dout * rows_normalized).sum(axis=0)  # (R, E) -> (E,)
    g = dout * scale  # dL/d normalized, (..., E)
    mean_term = g.mean(axis=-1, keepdims=True)  # (..., 1)
    variance_term = normalized * (g * normalized).mean(axis=-1, keepdims=True)  # (..., E)
    dx = rstd * (g - mean_term - variance_term)  # (..., E)
    return dx, dscale, dshift



declare_complex_step(layer_norm_forward)  # see qkvnp._checks.complex_step_mode
