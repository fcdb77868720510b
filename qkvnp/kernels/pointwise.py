"""Fused LayerNorm and tanh-GELU passes for the layers of the transformer block.

Shape key: ``...`` any leading dims (B batch, T tokens), E the normalised
(last) axis.

The same functions as :func:`qkvnp.functional.layer_norm_forward` /
``layer_norm_backward`` and ``gelu_forward`` / ``gelu_backward`` (tanh), up
to rounding, and the same caches (:class:`~qkvnp.functional.LayerNormCache`,
:class:`~qkvnp.functional.GeluCache`), so that either backward reads either
forward's cache. (The fused GELU caches ``sigmoid(2u)`` instead of
``tanh u``; its backward reads both, and :func:`gelu_tanh_reference_cache`
gives the reference backward the ``tanh u`` it reads.) They take real
floating arrays already checked by the layer (dtype, shapes, finite values)
and fewer passes over them: row sums as products with a column of ones, the
arithmetic in place in the arrays the call allocated itself (never in an
input, never in a buffer kept across calls). The reference ops stay the
readable statement of the math; the layers (:class:`qkvnp.LayerNorm`,
:class:`qkvnp.GELU`) call these for real input and the reference ops
otherwise (the gradient checker's complex step).
"""
from __future__ import annotations

import math

import numpy as np

from ..ops.gelu import GeluCache
from ..ops.layer_norm import LayerNormCache
from ..ops.reductions import column_sums
from ..ops.rms_norm import RMSNormCache
from ..ops.silu import SiluCache

__all__ = ["rms_norm_forward_fused", "rms_norm_backward_fused", "silu_forward_fused", "silu_backward_fused", "layer_norm_forward_fused", "layer_norm_backward_fused", "gelu_tanh_forward_fused",
           "gelu_tanh_backward_fused", "gelu_tanh_reference_cache"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_LOG2_E = 1.0 / math.log(2.0)


def _row_means(a):
    """The mean over the last axis of ``a`` ``(..., E)``, as ``(..., 1)``: ``a @ (ones / E)``."""
    E = a.shape[-1]
    return a @ np.full((E, 1), 1.0 / E, a.dtype)  # (..., E) @ (E, 1) -> (..., 1)


def _column_sums(rows):
    """The sum over the first axis of ``rows`` ``(R, E)``, as ``(E,)``: ``ones @ rows``."""
    return (np.ones((1, rows.shape[0]), rows.dtype) @ rows)[0]  # (1, R) @ (R, E) -> (E,)


def layer_norm_forward_fused(x, scale, shift, eps):
    """:func:`qkvnp.functional.layer_norm_forward` of checked real ``x`` ``(..., E)``.

    ``scale`` and ``shift`` ``(E,)`` of ``x``'s dtype; the cache holds a
    copy of ``scale`` (the backward differentiates the forward as it ran).

    NOTE: row and column sums as products with ones, not ``einsum``:
    measured faster (benchmarks/NOTES.md).
    """
    normalized = x - _row_means(x)  # centred, (..., E); the call's own array from here
    var = _row_means(normalized * normalized)  # (..., E) -> (..., 1)
    rstd = 1.0 / np.sqrt(var + x.dtype.type(eps))  # (..., 1)
    normalized *= rstd
    out = normalized * scale
    out += shift
    return out, LayerNormCache(normalized, rstd, scale.copy())


def layer_norm_backward_fused(dout, cache):
    """:func:`qkvnp.functional.layer_norm_backward` of a checked ``dout`` of the cache's dtype."""
    normalized, rstd, scale = cache
    E = normalized.shape[-1]
    rows_dout = dout.reshape(-1, E)  # (..., E) -> (R, E)
    dshift = _column_sums(rows_dout)  # (R, E) -> (E,)
    dscale = _column_sums(rows_dout * normalized.reshape(-1, E))  # (R, E) -> (E,)
    g = dout * scale  # dL/d normalized, (..., E); the call's own array
    variance_term = _row_means(g * normalized)  # (..., 1)
    g -= _row_means(g)
    g -= normalized * variance_term
    g *= rstd
    return g, dscale, dshift


def gelu_tanh_forward_fused(x):
    """:func:`qkvnp.functional.gelu_forward` with ``approximate="tanh"``, checked real ``x``.

    Computed as ``x * sigmoid(2u)``, which equals ``x (1 + tanh u) / 2``;
    the cache holds ``x`` itself and ``sigmoid=s`` (``inner`` is None until
    :func:`gelu_tanh_reference_cache` fills it for the reference backward).
    The caller passes an ``x`` that it owns and does not edit before the
    backward (a copy if it came from a user).

    NOTE: ``exp2`` instead of ``tanh``: ``np.exp2`` measured faster than
    ``np.tanh``, the forward and the backward (two passes shorter on ``s``)
    too (benchmarks/NOTES.md). Where ``exp(-2u)``
    overflows (x below about -9.3 in float32) ``s`` is 0 and the output
    ``-0.0``: no NaN, no warning.
    """
    kind = x.dtype.type
    with np.errstate(over="ignore", under="ignore"):
        sigmoid = x * x  # (...)
        sigmoid *= kind(-2.0 * _LOG2_E * _SQRT_2_OVER_PI * _GELU_CUBIC)
        sigmoid += kind(-2.0 * _LOG2_E * _SQRT_2_OVER_PI)
        sigmoid *= x  # -2u log2(e)
        np.exp2(sigmoid, out=sigmoid)  # exp(-2u), inf for very negative x
        sigmoid += 1.0
        np.divide(1.0, sigmoid, out=sigmoid)  # s = 1 / (1 + exp(-2u)) = (1 + t) / 2
        out = x * sigmoid  # (...)
    return out, GeluCache(x, None, "tanh", sigmoid)


def gelu_tanh_reference_cache(cache):
    """``cache`` with ``inner = t = tanh u`` filled in, as the reference backward reads it.

    A cache of :func:`qkvnp.functional.gelu_forward` is returned as it is;
    one of :func:`gelu_tanh_forward_fused` gets ``t = 2 s - 1``.
    """
    if cache.inner is not None:
        return cache
    inner = cache.sigmoid * 2.0  # (...)
    inner -= 1.0  # t = 2 s - 1
    return cache._replace(inner=inner)


def gelu_tanh_backward_fused(dout, cache):
    """:func:`qkvnp.functional.gelu_backward` (tanh) of a checked ``dout`` of the cache's dtype.

    Reads either forward's cache: ``s = sigmoid(2u)``, or ``(1 + t) / 2``
    from the reference op's ``t``. With ``c = sqrt(2/pi)``, ``a = 0.044715``:
    ``dy/dx = s + 2 x s (1 - s) c (1 + 3 a x^2)``, the reference's
    ``(1 + t)/2 + x (1 - t^2) c (1 + 3 a x^2) / 2`` written in ``s``.
    """
    x, sigmoid, kind = cache.x, cache.sigmoid, cache.x.dtype.type
    if sigmoid is None:  # the reference op's cache
        sigmoid = cache.inner + 1.0  # (...)
        sigmoid *= 0.5  # s = (1 + t) / 2
    local = x * x  # (...)
    local *= kind(6.0 * _GELU_CUBIC * _SQRT_2_OVER_PI)
    local += kind(2.0 * _SQRT_2_OVER_PI)  # 2 c (1 + 3 a x^2)
    spread = 1.0 - sigmoid  # (...)
    spread *= sigmoid  # s (1 - s)
    local *= spread
    local *= x
    local += sigmoid  # dy/dx
    local *= dout
    return local


def silu_forward_fused(x):
    """``silu_forward`` of a real float ``x`` in three in-place passes: ``s = 1 / (1 + exp(-x))``, ``out = x * s``.

    Replaces :func:`qkvnp.ops.silu.silu_forward` for a composite's own
    array: no check, no copy (the cache keeps ``x`` itself), one sigmoid
    formula for both signs instead of the reference's two branches
    (``benchmarks/NOTES.md``, "SiLU's fused passes").
    """
    # NOTE: below -88 (float32) exp(-x) overflows to inf and s to 0: the limit, no NaN
    with np.errstate(over="ignore"):
        s = np.exp(-x)  # (...)
    s += 1
    np.reciprocal(s, out=s)
    return x * s, SiluCache(x, s)


def silu_backward_fused(dout, cache):
    """``silu_backward``: ``dout * (s + x s (1 - s))``, written as ``dout * s * (1 + x (1 - s))`` in place."""
    x, s = cache.x, cache.sigmoid
    local = np.subtract(1, s, dtype=s.dtype)  # 1 - s
    local *= x
    local += 1
    local *= s
    local *= dout
    return local


def rms_norm_forward_fused(x, weight, eps, unit_offset=False):
    """``rms_norm_forward`` of a real float ``x`` ``(..., E)``: row dot products instead of ``mean(x * x)``.

    Replaces :func:`qkvnp.ops.rms_norm.rms_norm_forward` for a composite's
    own array (no check); the same cache (``benchmarks/NOTES.md``,
    "RMSNorm's fused passes").
    """
    dtype = x.dtype.type
    mean_square = np.einsum("...i,...i->...", x, x)[..., None]  # (..., 1)
    mean_square *= dtype(1 / x.shape[-1])
    mean_square += dtype(eps)
    rstd = np.sqrt(mean_square, out=mean_square)
    np.divide(dtype(1), rstd, out=rstd)  # (..., 1)
    gain = weight + dtype(1) if unit_offset else weight.copy()  # (E,): a copy either way
    normalized = x * rstd  # (..., E)
    return normalized * gain, RMSNormCache(normalized, rstd, gain)


def rms_norm_backward_fused(dout, cache):
    """``rms_norm_backward``: ``dx = rstd (g - normalized mean(g normalized))``, ``g = dout gain``."""
    normalized, rstd, gain = cache
    E = normalized.shape[-1]
    dweight = column_sums((dout * normalized).reshape(-1, E))  # (..., E) -> (E,)
    g = dout * gain  # dL/d normalized, (..., E)
    dot = np.einsum("...i,...i->...", g, normalized)[..., None]  # (..., 1)
    dot *= normalized.dtype.type(1 / E)
    rms_term = normalized * dot  # (..., E)
    g -= rms_term
    g *= rstd
    return g, dweight
