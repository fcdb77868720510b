"""Fused LayerNorm and tanh-GELU passes for the layers of the transformer block.

Shape key: ``...`` any leading dims (B batch, T tokens), E the normalised
(last) axis.

The same functions as :func:`qkvnp.functional.layer_norm_forward` /
``layer_norm_backward`` and ``gelu_forward`` / ``gelu_backward`` (tanh), up
to rounding, and the same caches (:class:`~qkvnp.functional.LayerNormCache`,
:class:`~qkvnp.functional.GeluCache`), so that either backward reads either
forward's cache. They take real floating arrays already checked by the layer
(dtype, shapes, finite values) and fewer passes over them: row sums through
``einsum``, the arithmetic in place in the arrays the call allocated itself
(never in an input, never in a buffer kept across calls). The reference ops
stay the readable statement of the math; the layers
(:class:`qkvnp.LayerNorm`, :class:`qkvnp.GELU`) call these for real input
and the reference ops otherwise (the gradient checker's complex step).
"""
from __future__ import annotations

import math

import numpy as np

from ..transformer_ops import GeluCache, LayerNormCache

__all__ = ["layer_norm_forward_fused", "layer_norm_backward_fused", "gelu_tanh_forward_fused",
           "gelu_tanh_backward_fused"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _row_means(a, b=None):
    """The mean over the last axis of ``a`` (or of ``a * b``), kept as ``(..., 1)``."""
    E = a.shape[-1]
    sums = np.einsum("...e->...", a) if b is None else np.einsum("...e,...e->...", a, b)
    return (sums / a.dtype.type(E))[..., None]  # (...,) -> (..., 1)


def layer_norm_forward_fused(x, scale, shift, eps):
    """:func:`qkvnp.functional.layer_norm_forward` of checked real ``x`` ``(..., E)``.

    ``scale`` and ``shift`` ``(E,)`` of ``x``'s dtype; the cache holds a
    copy of ``scale`` (the backward differentiates the forward as it ran).
    """
    normalized = x - _row_means(x)  # centred, (..., E); the call's own array from here
    var = _row_means(normalized, normalized)  # (..., E) -> (..., 1)
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
    dshift = np.einsum("re->e", rows_dout)  # (R, E) -> (E,)
    dscale = np.einsum("re,re->e", rows_dout, normalized.reshape(-1, E))  # (R, E) -> (E,)
    g = dout * scale  # dL/d normalized, (..., E); the call's own array
    variance_term = _row_means(g, normalized)  # (..., 1)
    g -= _row_means(g)
    g -= normalized * variance_term
    g *= rstd
    return g, dscale, dshift


def gelu_tanh_forward_fused(x):
    """:func:`qkvnp.functional.gelu_forward` with ``approximate="tanh"``, checked real ``x``.

    The cache holds ``x`` itself: the caller passes an array that it owns
    and does not edit before the backward (a copy if it came from a user).
    """
    inner = x * x
    inner *= x.dtype.type(_GELU_CUBIC)
    inner += 1.0
    inner *= x
    inner *= x.dtype.type(_SQRT_2_OVER_PI)  # u = c (x + a x^3)
    np.tanh(inner, out=inner)  # t
    out = inner + 1.0
    out *= x
    out *= 0.5  # x (1 + t) / 2
    return out, GeluCache(x, inner, "tanh")


def gelu_tanh_backward_fused(dout, cache):
    """:func:`qkvnp.functional.gelu_backward` (tanh) of a checked ``dout`` of the cache's dtype."""
    x, inner, _ = cache
    kind = x.dtype.type
    local = x * x
    local *= kind(3.0 * _GELU_CUBIC * _SQRT_2_OVER_PI)
    local += kind(_SQRT_2_OVER_PI)  # c (1 + 3 a x^2)
    sech2 = inner * inner
    np.subtract(1.0, sech2, out=sech2)  # 1 - t^2
    local *= sech2
    local *= x  # x (1 - t^2) c (1 + 3 a x^2)
    local += 1.0
    local += inner
    local *= 0.5  # dy/dx
    local *= dout
    return local
