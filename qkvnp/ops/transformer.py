"""The ops of a transformer block around attention: LayerNorm, GELU, dropout, residual add.

Shape key: ``...`` any leading dims (B batch, T tokens), E the normalised
(last) axis.

Part of :mod:`qkvnp.functional` (import them from there); kept apart only
for that module's length. Each op is a pure ``name_forward(...) -> (out,
cache)`` and ``name_backward(dout, cache) -> gradients``. Every forward is
analytic (no ``abs``, no ``maximum``): the gradient checker's complex step
runs it on complex arrays. The derivations are in ``docs/derivations_gpt.md``.
"""
from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, compute_dtype, declare_complex_step,
                      is_real_number, make_rng)
from .dropout import check_dropout_p

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import BoolArray, FloatArray

__all__ = [
    "layer_norm_forward",
    "layer_norm_backward",
    "gelu_forward",
    "gelu_backward",
    "activation_dropout_forward",
    "activation_dropout_backward",
    "residual_add_forward",
    "residual_add_backward",
    "LayerNormCache",
    "GeluCache",
    "ActivationDropoutCache",
    "ResidualCache",
    "GELU_APPROXIMATIONS",
]

LayerNormCache = namedtuple("LayerNormCache", "normalized rstd scale")
# NOTE: sigmoid is set by the fused pass qkvnp.kernels.pointwise.gelu_tanh_forward_fused
# (s = sigmoid(2u) = (1 + t) / 2, inner None); the ops here leave it None
GeluCache = namedtuple("GeluCache", "x inner approximate sigmoid", defaults=(None,))
ActivationDropoutCache = namedtuple("ActivationDropoutCache", "mask scale shape dtype")

#: The ``approximate`` values of :func:`gelu_forward` (PyTorch's names).
GELU_APPROXIMATIONS = ("tanh", "none")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_eps(eps):
    if not is_real_number(eps) or not float(eps) > 0.0 or not math.isfinite(float(eps)):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    return float(eps)


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
    eps = _check_eps(eps)
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


def activation_dropout_forward(x: FloatArray, p: float, *,
                               rng: np.random.Generator | int | None = None,
                               mask: BoolArray | None = None,
                               check: bool = True) -> tuple[FloatArray, ActivationDropoutCache]:
    """Dropout on activations (``nn.Dropout``): zero entries, scale the rest by ``1/(1-p)``.

    Parameters
    ----------
    x : ndarray, shape (...)
    p : float
        Drop probability in ``[0, 1)``. 0: the identity (nothing is drawn).
    rng : numpy.random.Generator or int, keyword-only, optional
        Draws the mask (``rng.random(x.shape) >= p``) when none is given.
    mask : ndarray of bool, keyword-only, optional
        True = keep, broadcastable to ``x.shape``: replays a mask (needs
        ``0 < p < 1``).
    check : bool, keyword-only
        False: ``x`` is a composite's own finite array, already checked.

    Returns
    -------
    out : ndarray, shape (...)
    cache : ActivationDropoutCache

    Raises
    ------
    TypeError
        If ``mask`` is not boolean or ``p`` not a number.
    ValueError
        If ``p`` is outside ``[0, 1)``, a mask comes with ``p = 0``, or the
        mask does not broadcast to ``x``.

    Notes
    -----
    Forward :math:`y = x \\odot m / (1 - p)`, backward
    :math:`\\bar x = \\bar y \\odot m / (1 - p)`.

    Examples
    --------
    >>> out, cache = activation_dropout_forward(np.ones(4), 0.5, mask=np.array([1, 0, 1, 0], bool))
    >>> out
    array([2., 0., 2., 0.])
    """
    p = check_dropout_p(p, "p")
    if check:
        x = as_float_array(x, "x")
    if mask is None and p == 0.0:
        return x, ActivationDropoutCache(None, None, x.shape, x.dtype)
    if mask is None:
        mask = make_rng(rng).random(x.shape) >= p  # (...)
    else:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array (True = keep), got dtype {mask.dtype}")
        if p == 0.0:
            raise ValueError("mask needs 0 < p < 1 (kept entries are scaled by 1 / (1 - p)), "
                             "got p=0.0")
        try:
            broadcast = np.broadcast_shapes(mask.shape, x.shape)
        except ValueError:
            broadcast = None
        if broadcast != x.shape:
            raise ValueError(f"mask must broadcast to x's shape {x.shape}, got shape {mask.shape}")
        mask = mask.copy()
    scale = x.real.dtype.type(1.0 / (1.0 - p))
    out = x * mask * scale  # (...)
    return out, ActivationDropoutCache(mask, scale, x.shape, x.dtype)


def activation_dropout_backward(dout: FloatArray, cache: ActivationDropoutCache,
                                check: bool = True) -> FloatArray:
    """Backward of :func:`activation_dropout_forward`: ``dout * mask / (1 - p)``.

    Parameters
    ----------
    dout : ndarray, shape (...)
    cache : ActivationDropoutCache
    check : bool
        False: ``dout`` is a composite's own gradient, already checked.

    Returns
    -------
    dx : ndarray, shape (...)
    """
    mask, scale, shape, dtype = cache
    if check:
        dout = as_upstream_grad(dout, "dout", shape, dtype)
    if mask is None:
        return dout
    return dout * mask * scale


ResidualCache = namedtuple("ResidualCache", "shape dtype")


def residual_add_forward(x: FloatArray, branch: FloatArray, *,
                         check: bool = True) -> tuple[FloatArray, ResidualCache]:
    """The residual connection ``out = x + branch`` (same shapes, no broadcasting).

    Parameters
    ----------
    x, branch : ndarray, shape (...)
    check : bool, keyword-only
        False: both are a composite's own finite arrays of one dtype and
        shape, already checked.

    Returns
    -------
    out : ndarray, shape (...)
    cache : ResidualCache

    Raises
    ------
    ValueError
        If the shapes differ.

    Notes
    -----
    Backward: both inputs receive :math:`\\bar y` unchanged, which is why a
    pre-LayerNorm block's input gradient is ``dout`` plus the branch's.

    Examples
    --------
    >>> out, cache = residual_add_forward(np.ones(2), np.arange(2.0))
    >>> residual_add_backward(np.array([3.0, 4.0]), cache)
    (array([3., 4.]), array([3., 4.]))
    """
    if check:
        x = as_float_array(x, "x")
        branch = as_float_array(branch, "branch")
        if x.shape != branch.shape:
            raise ValueError(f"branch must have x's shape {x.shape}, got shape {branch.shape}")
    out = x + branch
    return out, ResidualCache(out.shape, out.dtype)


def residual_add_backward(dout: Any, cache: Any, check: bool = True) -> Any:
    """Backward of :func:`residual_add_forward`: ``(dout, dout)``."""
    if check:
        dout = as_upstream_grad(dout, "dout", cache.shape, cache.dtype)
    return dout, dout


declare_complex_step(layer_norm_forward, gelu_forward, activation_dropout_forward,
                     residual_add_forward)  # see qkvnp._checks.complex_step_mode
