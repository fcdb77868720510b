"""The SiLU (swish) activation ``x * sigmoid(x)``, forward and backward.

Shape key: ``...`` any shape (elementwise).

The forward is analytic (it branches on the sign of the real part only, a
choice that no infinitesimal imaginary step can flip): the gradient
checker's complex step runs it on complex arrays. Derived in
``docs/derivations_gpt.md``; users reach it through :mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import as_float_array, as_upstream_grad, declare_complex_step

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["silu_forward", "silu_backward", "SiluCache"]

SiluCache = namedtuple("SiluCache", "x sigmoid")


def _sigmoid(x):
    """``1 / (1 + exp(-x))`` without overflow: ``exp`` only of ``-|x|`` (by the real part)."""
    positive = x.real >= 0
    e = np.exp(np.where(positive, -x, x))  # exp(-|x|) in (0, 1]: never overflows
    # NOTE: for x < 0, 1 / (1 + exp(-x)) = exp(x) / (1 + exp(x)); at x = -1000
    # exp(x) underflows to 0 and so does the sigmoid, with no warning and no NaN
    return np.where(positive, 1.0 / (1.0 + e), e / (1.0 + e))


def silu_forward(x: FloatArray) -> tuple[FloatArray, SiluCache]:
    """The SiLU activation ``x * sigmoid(x)`` (``nn.SiLU``; Llama's, Qwen's, Mistral's ``"silu"``).

    Parameters
    ----------
    x : ndarray, shape (...)

    Returns
    -------
    out : ndarray, shape (...)
    cache : SiluCache
        ``x`` (a copy) and ``sigmoid(x)``.

    Raises
    ------
    ValueError
        If ``x`` holds NaN or inf.
    TypeError
        If ``x`` does not hold real numbers.

    Notes
    -----
    With :math:`s = \\sigma(x) = 1 / (1 + e^{-x})`, computed from
    :math:`e^{-|x|}` so that no exponential overflows:

    .. math:: y = x\\, s, \\qquad \\frac{dy}{dx} = s + x\\, s (1 - s)

    (as :math:`\\sigma' = \\sigma (1 - \\sigma)`). Backward:
    :math:`\\bar x = \\bar y\\, dy/dx`, elementwise. :math:`y \\to x` as
    :math:`x \\to \\infty` and :math:`y \\to 0` as :math:`x \\to -\\infty`;
    :math:`y(0) = 0`, :math:`y'(0) = 1/2`.

    Examples
    --------
    >>> out, cache = silu_forward(np.array([-1.0, 0.0, 1.0]))
    >>> np.round(out, 4)
    array([-0.2689,  0.    ,  0.7311])
    >>> np.round(silu_backward(np.ones(3), cache), 4)
    array([0.0723, 0.5   , 0.9277])
    """
    x = as_float_array(x, "x")
    s = _sigmoid(x)  # (...)
    out = x * s  # (...)
    return out, SiluCache(x.copy(), s)


def silu_backward(dout: FloatArray, cache: SiluCache, check: bool = True) -> FloatArray:
    """Backward of :func:`silu_forward`.

    Parameters
    ----------
    dout : ndarray, shape (...)
    cache : SiluCache
    check : bool
        False: ``dout`` is a composite's own gradient, already checked.

    Returns
    -------
    dx : ndarray, shape (...)

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape or holds NaN or inf.
    """
    x, s = cache.x, cache.sigmoid
    if check:
        dout = as_upstream_grad(dout, "dout", x.shape, x.dtype)
    # in the forward pass this was: out = x * s, with ds/dx = s (1 - s)
    local = s + x * s * (1.0 - s)  # dy/dx, (...)
    return dout * local


declare_complex_step(silu_forward)  # see qkvnp._checks.complex_step_mode
