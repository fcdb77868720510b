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
from collections import namedtuple

import numpy as np

from ..ops.gelu import GeluCache
from ..ops.layer_norm import LayerNormCache
from ..ops.reductions import column_sums
from ..ops.rms_norm import RMSNormCache
from ..ops.silu import SiluCache
from ._runtime import row_slices

__all__ = ["gated_forward_fused", "gated_backward_fused", "GatedCache", "rms_norm_forward_fused",
           "rms_norm_backward_fused", "silu_forward_fused", "silu_backward_fused",
           "layer_norm_forward_fused", "layer_norm_backward_fused", "gelu_tanh_forward_fused",
           "gelu_tanh_backward_fused", "gelu_tanh_reference_cache"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_LOG2_E = 1.0 / math.log(2.0)
#: Elements of one row chunk of the gated pair (256 KiB of float32): with the
#: chunk's few arrays it stays in a core's L2 from one pass to the next.
_GATED_CHUNK = 1 << 16

GatedCache = namedtuple("GatedCache", "act act_cache up")
GatedCache.__doc__ = """What :func:`gated_backward_fused` reads: ``act`` ``(N, F)``, the activation's cache, ``up`` ``(N, F)``."""


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
    sigmoid = np.empty_like(x)  # (...), x's layout
    _gelu_tanh_sigmoid(x, sigmoid)
    with np.errstate(over="ignore", under="ignore"):
        out = x * sigmoid  # (...)
    return out, GeluCache(x, None, "tanh", sigmoid)


def _gelu_tanh_sigmoid(x, s):
    """``s = sigmoid(2u) = 1 / (1 + 2^(-2u log2 e))`` into ``s`` (the shape of ``x``), in place."""
    kind = x.dtype.type
    with np.errstate(over="ignore", under="ignore"):
        np.multiply(x, x, out=s)
        s *= kind(-2.0 * _LOG2_E * _SQRT_2_OVER_PI * _GELU_CUBIC)
        s += kind(-2.0 * _LOG2_E * _SQRT_2_OVER_PI)
        s *= x  # -2u log2(e)
        np.exp2(s, out=s)  # exp(-2u), inf for very negative x
        s += 1.0
        np.divide(1.0, s, out=s)  # s = 1 / (1 + exp(-2u)) = (1 + t) / 2


def _gelu_tanh_local(dout, x, s, local, spread):
    """``local = dout (s + 2 x s (1 - s) c (1 + 3 a x^2))`` into ``local``; ``spread`` is scratch of its shape."""
    kind = x.dtype.type
    np.multiply(x, x, out=local)
    local *= kind(6.0 * _GELU_CUBIC * _SQRT_2_OVER_PI)
    local += kind(2.0 * _SQRT_2_OVER_PI)  # 2 c (1 + 3 a x^2)
    np.subtract(1.0, s, out=spread)
    spread *= s  # s (1 - s)
    local *= spread
    local *= x
    local += s  # dy/dx
    local *= dout


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
    x, sigmoid = cache.x, cache.sigmoid
    if sigmoid is None:  # the reference op's cache
        sigmoid = cache.inner + 1.0  # (...)
        sigmoid *= 0.5  # s = (1 + t) / 2
    local = np.empty_like(x)  # (...)
    _gelu_tanh_local(dout, x, sigmoid, local, np.empty_like(sigmoid))
    return local


def _silu_sigmoid(x, s):
    """``s = 1 / (1 + exp(-x))`` into ``s`` (the shape of ``x``), four passes in place."""
    np.negative(x, out=s)
    # NOTE: below -88 (float32) exp(-x) overflows to inf and s to 0: the limit, no NaN
    with np.errstate(over="ignore"):
        np.exp(s, out=s)
    s += 1
    np.reciprocal(s, out=s)


def _silu_local(dout, x, s, local):
    """``local = dout * s * (1 + x (1 - s))`` into ``local``: SiLU's backward."""
    np.subtract(1, s, out=local)  # 1 - s
    local *= x
    local += 1
    local *= s
    local *= dout


def silu_forward_fused(x):
    """``silu_forward`` of a real float ``x`` in three in-place passes: ``s = 1 / (1 + exp(-x))``, ``out = x * s``.

    Replaces :func:`qkvnp.ops.silu.silu_forward` for a composite's own
    array: no check, no copy (the cache keeps ``x`` itself), one sigmoid
    formula for both signs instead of the reference's two branches
    (``benchmarks/NOTES.md``, "SiLU's fused passes").
    """
    s = np.empty_like(x)  # (...), x's layout
    _silu_sigmoid(x, s)
    return x * s, SiluCache(x, s)


def silu_backward_fused(dout, cache):
    """``silu_backward``: ``dout * (s + x s (1 - s))``, written as ``dout * s * (1 + x (1 - s))`` in place."""
    local = np.empty_like(cache.sigmoid)  # (...)
    _silu_local(dout, cache.x, cache.sigmoid, local)
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
    scratch = dout * normalized  # (..., E)
    dweight = column_sums(scratch.reshape(-1, E))  # (..., E) -> (E,)
    g = dout * gain  # dL/d normalized, (..., E)
    dot = np.einsum("...i,...i->...", g, normalized)[..., None]  # (..., 1)
    dot *= normalized.dtype.type(1 / E)
    g -= np.multiply(normalized, dot, out=scratch)  # - normalized mean(g normalized), (..., E)
    g *= rstd
    return g, dweight


class row_buffers:
    """Context manager: numpy's ufunc buffer at about one row of ``C`` entries inside.

    NOTE: with rows shorter than the buffer (8192 entries), numpy gathers a
    strided ``(rows, C)`` view (a half of ``gate_up``) into its buffer and
    scatters it back on every pass, and copies a per-row column such as
    ``top[:, None]`` into it; at one row a loop both run in place, measured
    two to three times faster (benchmarks/NOTES.md). The buffer size
    changes no result: the same loops on the same values. This thread's
    setting, as numpy's error state; put back on exit. Rows under 256
    entries keep the default (a small buffer measured slower there).
    """

    __slots__ = ("size", "previous")

    def __init__(self, C):
        self.size = C - C % 16 if 256 <= C < np.getbufsize() else None  # numpy 1: a multiple of 16
        self.previous = None

    def __enter__(self):
        if self.size is not None:
            self.previous = np.setbufsize(self.size)
        return self

    def __exit__(self, *exc):
        if self.size is not None:
            np.setbufsize(self.previous)
        return False


def gated_forward_fused(gate_up, activation):
    """The gated activation ``hidden = act(gate) * up`` of ``gate_up = [gate | up]`` ``(N, 2F)``, by row chunks.

    Parameters
    ----------
    gate_up : ndarray, shape (N, 2F)
        The product ``x [W_gate | W_up]``, real float, owned by the caller and
        not edited before the backward (the cache keeps views of it).
    activation : {"silu", "gelu_tanh"}
        SwiGLU's or GeGLU's activation.

    Returns
    -------
    hidden : ndarray, shape (N, F)
    cache : GatedCache
        ``act`` ``(N, F)``, the activation's cache (a :class:`SiluCache` or a
        :class:`GeluCache` of the ``gate`` view, as :func:`silu_forward_fused`
        and :func:`gelu_tanh_forward_fused` make them) and the ``up`` view.

    Notes
    -----
    The same passes per element as ``silu_forward_fused(gate)`` (or
    ``gelu_tanh_forward_fused``) followed by ``act * up``, so the same bits;
    run on row chunks of ``_GATED_CHUNK`` elements so that each pass finds
    the chunk in cache, writing into the arrays the call allocates.

    Examples
    --------
    >>> gate_up = np.array([[0.0, 2.0, 3.0, 5.0]])
    >>> hidden, cache = gated_forward_fused(gate_up, "silu")
    >>> np.allclose(hidden, gate_up[:, :2] / (1 + np.exp(-gate_up[:, :2])) * gate_up[:, 2:])
    True
    """
    N, F = gate_up.shape[0], gate_up.shape[1] // 2
    gate, up = gate_up[:, :F], gate_up[:, F:]  # views (N, F)
    sigmoid = np.empty((N, F), gate_up.dtype)  # the activation's sigmoid, (N, F)
    act, hidden = np.empty_like(sigmoid), np.empty_like(sigmoid)  # (N, F)
    fill = _silu_sigmoid if activation == "silu" else _gelu_tanh_sigmoid
    chunks = row_slices(N, _GATED_CHUNK // max(F, 1))
    with np.errstate(over="ignore", under="ignore"), row_buffers(F):  # as the fused activations
        for rows in chunks:
            fill(gate[rows], sigmoid[rows])
            np.multiply(gate[rows], sigmoid[rows], out=act[rows])
            np.multiply(act[rows], up[rows], out=hidden[rows])
    act_cache = SiluCache(gate, sigmoid) if activation == "silu" else \
        GeluCache(gate, None, "tanh", sigmoid)
    return hidden, GatedCache(act, act_cache, up)


def gated_backward_fused(dhidden, cache):
    """Backward of :func:`gated_forward_fused`: ``dgate_up = [d gate | d up]`` ``(N, 2F)``.

    ``dhidden`` ``(N, F)`` is the caller's own array and is overwritten (it
    ends as ``d act``). With ``d act = dhidden * up`` and ``d up = dhidden *
    act``, ``d gate`` is the activation's backward of ``d act``: the same
    passes as ``np.multiply(dhidden, act, out=...)``, ``dhidden *= up`` and
    :func:`silu_backward_fused` (or :func:`gelu_tanh_backward_fused`), so
    the same bits, by row chunks written straight into ``dgate_up``.
    """
    act, act_cache, up = cache
    N, F = dhidden.shape
    dgate_up = np.empty((N, 2 * F), dhidden.dtype)  # (N, 2F)
    dgate, dup = dgate_up[:, :F], dgate_up[:, F:]  # views (N, F)
    x, sigmoid = act_cache.x, act_cache.sigmoid
    chunks = row_slices(N, _GATED_CHUNK // max(F, 1))
    rows = max((part.stop - part.start for part in chunks), default=0)
    spread = None if isinstance(act_cache, SiluCache) else np.empty((rows, F), dhidden.dtype)
    with row_buffers(F):
        for part in chunks:
            np.multiply(dhidden[part], act[part], out=dup[part])  # d up = dh * act
            dact = dhidden[part]
            dact *= up[part]  # d act = dh * up
            if spread is None:
                _silu_local(dact, x[part], sigmoid[part], dgate[part])
            else:
                _gelu_tanh_local(dact, x[part], sigmoid[part], dgate[part],
                                 spread[:part.stop - part.start])
    return dgate_up
