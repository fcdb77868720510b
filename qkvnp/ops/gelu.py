"""The GELU activation, tanh-approximated or exact, forward and backward.

Shape key: ``...`` any shape (elementwise).

The forward is analytic: the gradient checker's complex step runs it on
complex arrays. Derived in ``docs/derivations_gpt.md``; users reach it
through :mod:`qkvnp.functional`.
"""
from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from .._checks import as_float_array, as_upstream_grad, declare_complex_step

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["gelu_forward", "gelu_backward", "GeluCache", "GELU_APPROXIMATIONS"]

# NOTE: sigmoid is set by the fused pass qkvnp.kernels.pointwise.gelu_tanh_forward_fused
# (s = sigmoid(2u) = (1 + t) / 2, inner None); the ops here leave it None
GeluCache = namedtuple("GeluCache", "x inner approximate sigmoid", defaults=(None,))

#: The ``approximate`` values of :func:`gelu_forward` (PyTorch's names).
GELU_APPROXIMATIONS = ("tanh", "none")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_approximate(approximate):
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return approximate


def gelu_forward(x: FloatArray, approximate: str = "tanh") -> tuple[FloatArray, GeluCache]:
    """The GELU activation, tanh-approximated (the book's, GPT-2's) or exact (erf).

    Parameters
    ----------
    x : ndarray, shape (...)
    approximate : {"tanh", "none"}
        ``"tanh"`` (default here, as the book's ``GELU``); ``"none"`` is the
        exact :math:`x \\Phi(x)` through ``scipy.special.erf`` (PyTorch's
        ``nn.GELU()`` default).

    Returns
    -------
    out : ndarray, shape (...)
    cache : GeluCache

    Raises
    ------
    ValueError
        If ``approximate`` is unknown or ``x`` holds NaN or inf.
    TypeError
        If ``x`` does not hold real numbers.

    Notes
    -----
    tanh: with :math:`c = \\sqrt{2/\\pi}`, :math:`a = 0.044715`,
    :math:`u = c (x + a x^3)`, :math:`t = \\tanh u`:

    .. math:: y = \\tfrac12 x (1 + t), \\qquad
              \\frac{dy}{dx} = \\tfrac12 (1 + t) + \\tfrac12 x (1 - t^2)\\, c (1 + 3 a x^2)

    erf: :math:`y = \\tfrac12 x (1 + \\mathrm{erf}(x / \\sqrt2))`,

    .. math:: \\frac{dy}{dx} = \\tfrac12 (1 + \\mathrm{erf}(x/\\sqrt2))
              + \\frac{x}{\\sqrt{2\\pi}} e^{-x^2/2}

    Backward: :math:`\\bar x = \\bar y\\, dy/dx`, elementwise.

    Examples
    --------
    >>> out, cache = gelu_forward(np.array([-1.0, 0.0, 1.0]))
    >>> np.round(out, 4)
    array([-0.1588,  0.    ,  0.8412])
    >>> np.round(gelu_backward(np.ones(3), cache), 4)
    array([-0.0830,  0.5   ,  1.0830])
    """
    approximate = _check_approximate(approximate)
    x = as_float_array(x, "x")
    if approximate == "tanh":
        inner = np.tanh(_SQRT_2_OVER_PI * (x + _GELU_CUBIC * (x * x * x)))  # t, (...)
    else:
        from scipy.special import erf

        inner = erf(x * _INV_SQRT_2)  # (...)
    out = 0.5 * x * (1.0 + inner)  # (...)
    return out, GeluCache(x.copy(), inner, approximate)


def gelu_backward(dout: FloatArray, cache: GeluCache, check: bool = True) -> FloatArray:
    """Backward of :func:`gelu_forward`.

    Parameters
    ----------
    dout : ndarray, shape (...)
    cache : GeluCache
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
    x, inner, approximate = cache.x, cache.inner, cache.approximate  # (sigmoid: the fused pass's)
    if check:
        dout = as_upstream_grad(dout, "dout", x.shape, x.dtype)
    if approximate == "tanh":
        dinner = (1.0 - inner * inner) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * (x * x))
        local = 0.5 * (1.0 + inner) + 0.5 * x * dinner  # dy/dx, (...)
    else:
        local = 0.5 * (1.0 + inner) + x * _INV_SQRT_2PI * np.exp(-0.5 * (x * x))  # (...)
    return dout * local



declare_complex_step(gelu_forward)  # see qkvnp._checks.complex_step_mode
