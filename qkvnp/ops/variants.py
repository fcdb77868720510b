"""The attention of today's models: rotary positions, score biases, soft-caps, sinks, windows.

Shape key: ``...`` any leading (batch, head) dims, H heads, T query length,
S key length, D head dim (of queries and keys), Dv head dim of values.

The reference ops of the variants, written as the math reads; the
derivation of every backward is in ``docs/derivations_variants.md``.

- :func:`rope_forward` / :func:`rope_backward`: rotary position embedding
  (RoFormer, Llama). The backward rotates by the opposite angle.
- :func:`variant_attention_forward` / :func:`variant_attention_backward`:
  scaled dot-product attention with a learnable additive ``score_bias``,
  Gemma 2's ``softcap``, gpt-oss's ``sinks`` and a sliding ``window``.
  :func:`qkvnp.functional.attention_forward` calls it when one of those is
  given, so users call that one.

The order of the score pipeline (every path follows it)::

    s = scale * q k^T                    (..., T, S)
    s = s + score_bias                   learnable, gets dscore_bias
    s = softcap * tanh(s / softcap)      bounded in (-softcap, softcap)
    s = s + float mask; -inf where a bool mask, is_causal or the window forbids
    P_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))

Every op is analytic in its float inputs (``tanh``, ``exp``, products), so the
gradient checker's complex step runs through it.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, broadcast_shapes, check_attention_inputs,
                      check_scale, declare_complex_step, is_real_number, owned)
from .dropout import dense_keep, keep_scale, prepare_dropout
from .gqa import GroupedCache, split_groups, split_head_axis, split_per_head
from .masks import causal_offset, check_is_causal, prepare_mask
from .overflow import product
from .reductions import sum_to_shape

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import ArrayLike, FloatArray

__all__ = ["RopeCache", "VariantCache", "VariantGroupedCache", "ROPE_LAYOUTS", "rope_angles",
           "rope_forward", "rope_backward", "check_window", "check_softcap", "window_keep",
           "has_variants", "variant_attention_forward", "variant_attention_backward"]

#: How :func:`rope_forward` pairs the entries of a head it rotates together.
ROPE_LAYOUTS = ("half", "interleaved")

RopeCache = namedtuple("RopeCache", "cos sin layout x_shape")
RopeCache.__doc__ = """What :func:`rope_backward` reads.

cos, sin : ndarray, shape (..., T, D/2), of the angles ``position * base**(-2i/D)``.
layout : "half" or "interleaved".
x_shape : shape of the forward's ``x`` (the gradient is summed to it).

With ``inverse_frequency`` the angles are ``position * inverse_frequency``;
``cos`` and ``sin`` are both multiplied by ``attention_factor``.
"""

VariantCache = namedtuple(
    "VariantCache",
    "query key value weights scale dropout_mask dropout_p score_bias_shape capped softcap "
    "sinks_shape sink_weight")
VariantCache.__doc__ = """What :func:`variant_attention_backward` reads.

- ``query, key, value, weights, scale, dropout_mask, dropout_p``: as
  :class:`qkvnp.functional.AttentionCache` (weights before dropout).
- ``score_bias_shape``: the shape of ``score_bias``, or None without one.
- ``capped``: ndarray ``tanh(s / softcap)``, shape (..., T, S), or None
  without a soft-cap.
- ``softcap``: float or None.
- ``sinks_shape``: the shape of ``sinks``, or None without sinks.
- ``sink_weight``: ndarray, shape (..., T, 1), the sink's share
  ``exp(sink) / (exp(sink) + sum_k exp(s_k))``, or None without sinks.
"""


class VariantGroupedCache(GroupedCache):
    """A ``qkvnp.ops.gqa.GroupedCache`` whose ``shapes`` also hold ``score_bias``'s and ``sinks``'."""

    __slots__ = ()


# ---------------------------------------------------------------- RoPE


def rope_angles(positions, D, base=10000.0, inverse_frequency=None):
    """``cos`` and ``sin`` of RoPE's angles ``positions * base**(-2i/D)``, shape (..., T, D/2).

    A given ``inverse_frequency``, shape (D/2,), replaces ``base**(-2i/D)``.

    >>> cos, sin = rope_angles(np.arange(2), 4)
    >>> np.round(sin, 3).tolist()
    [[0.0, 0.0], [0.841, 0.01]]
    """
    if inverse_frequency is None:
        inverse_frequency = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # (D/2,)
    angles = np.asarray(positions, dtype=np.float64)[..., None] * inverse_frequency  # (..., T) -> (..., T, D/2)
    return np.cos(angles), np.sin(angles)


def _check_positions(positions, T):
    """``positions`` as integers broadcastable to ``(..., T)``, default ``arange(T)``."""
    if positions is None:
        return np.arange(T)
    positions = np.asarray(positions)
    if positions.dtype.kind not in "iu":
        raise TypeError(f"positions must hold integers, got dtype {positions.dtype}")
    if positions.ndim == 0 or positions.shape[-1] not in (1, T):
        raise ValueError(f"positions must have shape (T,) = ({T},) or broadcast to (..., {T}), "
                         f"got shape {positions.shape}")
    return positions


def _check_inverse_frequency(inverse_frequency, D):
    """``inverse_frequency`` as finite real float64 of shape (D/2,); else raise."""
    inverse_frequency = np.asarray(inverse_frequency)
    if inverse_frequency.dtype.kind not in "iuf":
        raise TypeError(f"inverse_frequency must hold real numbers, got dtype "
                        f"{inverse_frequency.dtype}")
    if inverse_frequency.shape != (D // 2,):
        raise ValueError(f"inverse_frequency must have shape (D/2,) = ({D // 2},), "
                         f"got shape {inverse_frequency.shape}")
    if not np.all(np.isfinite(inverse_frequency)):
        raise ValueError("inverse_frequency must be finite, got NaN or inf")
    return inverse_frequency.astype(np.float64)


def _rotate(x, cos, sin, layout):
    """The pairs ``(x1, x2)`` of ``layout`` rotated: ``(x1 cos - x2 sin, x2 cos + x1 sin)``."""
    D = x.shape[-1]
    if layout == "half":
        x1, x2 = x[..., :D // 2], x[..., D // 2:]  # (..., T, D) -> 2 x (..., T, D/2)
        return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)  # -> (..., T, D)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., T, D) -> 2 x (..., T, D/2)
    pairs = np.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)  # (..., T, D/2, 2)
    return pairs.reshape(pairs.shape[:-2] + (D,))  # (..., T, D/2, 2) -> (..., T, D)


def rope_forward(x: FloatArray, positions: ArrayLike | None = None, *, base: float = 10000.0,
                 layout: str = "half", inverse_frequency: ArrayLike | None = None,
                 attention_factor: float = 1.0) -> tuple[FloatArray, RopeCache]:
    """Rotary position embedding: rotate each pair of entries of ``x`` by its position's angle.

    Parameters
    ----------
    x : ndarray, shape (..., T, D)
        Queries or keys of each head; D even.
    positions : ndarray of int, shape (T,) or broadcastable to (..., T), optional
        The position of each row; default ``arange(T)``.
    base : float, keyword-only
        Pair ``i`` turns by ``position * base**(-2i/D)`` (Llama: 10000;
        Llama 3: 500000).
    layout : {"half", "interleaved"}, keyword-only
        ``"half"`` pairs entry ``i`` with ``i + D/2`` (Hugging Face's
        ``rotate_half``, the book's Llama chapter); ``"interleaved"`` pairs
        ``2i`` with ``2i + 1`` (RoFormer, Meta's original Llama).
    inverse_frequency : ndarray, shape (D/2,), keyword-only, optional
        Pair ``i`` turns by ``position * inverse_frequency[i]`` instead of
        ``position * base**(-2i/D)`` (``base`` is then unused): the scaled
        frequencies of :func:`qkvnp.functional.rope_inverse_frequency`.
    attention_factor : float, keyword-only
        Multiplies ``cos`` and ``sin`` (YaRN's; default 1.0, no change).

    Returns
    -------
    out : ndarray, shape broadcast of (..., T, D) with positions' leading dims
    cache : RopeCache

    Raises
    ------
    ValueError
        If D is odd, ``positions`` has the wrong length, ``base`` or
        ``attention_factor`` is not positive and finite, ``layout`` is
        unknown, or ``inverse_frequency`` is not finite of shape (D/2,).
    TypeError
        If ``x`` is not real or ``positions`` does not hold integers.

    Notes
    -----
    For each pair :math:`(x_1, x_2)` and angle :math:`\\theta = m\\,b^{-2i/D}`
    at position :math:`m`, :math:`y = R(\\theta) x`:

    .. math:: y_1 = x_1\\cos\\theta - x_2\\sin\\theta, \\quad
              y_2 = x_2\\cos\\theta + x_1\\sin\\theta

    :math:`R` is orthogonal, so the backward is
    :math:`\\bar x = R(\\theta)^T \\bar y = R(-\\theta)\\,\\bar y`. Since
    :math:`R(\\theta_m)^T R(\\theta_n) = R(\\theta_n - \\theta_m)`, the score
    :math:`q_m \\cdot k_n` after rotation depends only on :math:`n - m`.

    With scaled frequencies :math:`\\theta = m\\,w_i` (``inverse_frequency``)
    and an attention factor :math:`a`, :math:`y = a R(\\theta) x`: the
    frequencies are constants, so the map stays linear in :math:`x` and the
    backward is :math:`\\bar x = a R(\\theta)^T \\bar y`. The cache holds
    :math:`a\\cos\\theta` and :math:`a\\sin\\theta`, and
    :func:`rope_backward` rotates by them transposed, so it needs no change.

    Examples
    --------
    >>> out, cache = rope_forward(np.array([[1.0, 0.0]]), np.array([3]), layout="interleaved")
    >>> np.allclose(out, [[np.cos(3), np.sin(3)]])
    True
    """
    x = as_float_array(x, "x")
    if x.ndim < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape (..., T, D) with D even, got shape {x.shape}")
    if not isinstance(layout, str) or layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    if not is_real_number(base) or not base > 0 or not np.isfinite(base):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    positions = _check_positions(positions, x.shape[-2])
    if inverse_frequency is not None:
        inverse_frequency = _check_inverse_frequency(inverse_frequency, x.shape[-1])
    if not is_real_number(attention_factor) or not (attention_factor > 0
                                                     and np.isfinite(attention_factor)):
        raise ValueError(f"attention_factor must be a positive finite number, "
                         f"got {attention_factor!r}")
    cos, sin = rope_angles(positions, x.shape[-1], float(base),  # (..., T, D/2) each
                           inverse_frequency=inverse_frequency)
    if attention_factor != 1.0:  # YaRN's: y = a R x, so backward R^T times a from the same cache
        cos, sin = cos * float(attention_factor), sin * float(attention_factor)
    real = x.real.dtype if x.dtype.kind == "c" else x.dtype
    cos, sin = cos.astype(real), sin.astype(real)
    return _rotate(x, cos, sin, layout), RopeCache(cos, sin, layout, x.shape)


def rope_backward(dout: FloatArray, cache: RopeCache) -> FloatArray:
    """Backward of :func:`rope_forward`: rotate ``dout`` by the opposite angle.

    With scaled frequencies or an attention factor :math:`a` the forward is
    :math:`y = a R(\\theta) x`, and the cache holds :math:`a\\cos\\theta`,
    :math:`a\\sin\\theta`: rotating by them transposed gives
    :math:`a R(\\theta)^T \\bar y`, the backward, from the same code.

    Parameters
    ----------
    dout : ndarray, shape of the forward output
    cache : RopeCache

    Returns
    -------
    dx : ndarray, shape of the forward's ``x``
    """
    cos, sin, layout, x_shape = cache
    shape = broadcast_shapes(x_shape, cos.shape[:-1] + (x_shape[-1],))
    dout = as_upstream_grad(dout, "dout", shape, cos.dtype)
    dx = _rotate(dout, cos, -sin, layout)  # R(theta)^T = R(-theta)
    return sum_to_shape(dx, x_shape)


# ---------------------------------------------------------------- options


def check_softcap(softcap, name="softcap", allow_none=True):
    """``softcap`` as None (if ``allow_none``) or a positive finite Python float; else raise naming ``name``."""
    if softcap is None and allow_none:
        return None
    expected = "None or a positive" if allow_none else "a positive"
    if not is_real_number(softcap):
        raise TypeError(f"{name} must be {expected} number, got {type(softcap).__name__}")
    if not (softcap > 0 and np.isfinite(softcap)):
        raise ValueError(f"{name} must be {expected} finite number, got {softcap!r}")
    return float(softcap)


def check_window(window, is_causal=False):
    """``window`` as None or ``(left, right)`` of non-negative ints or None; else raise.

    With ``is_causal`` set, ``right`` must be None or 0 (the causal mask
    already bounds it): ``(W - 1, 0)`` is Mistral's window ``W``.

    >>> check_window((3, None)), check_window((3, 0), is_causal=True)
    ((3, None), (3, 0))
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints >= 0 or None, "
                        f"got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is not None:
            if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
                raise TypeError(f"window's {name} side must be an int >= 0 or None, got "
                                f"{side!r} ({type(side).__name__})")
            if side < 0:
                raise ValueError(f"window's {name} side must be >= 0 or None, got {side}")
            side = int(side)
        sides.append(side)
    if check_is_causal(is_causal) is not False and sides[1] not in (None, 0):
        raise ValueError(f"window=({sides[0]}, {sides[1]}) with is_causal={is_causal!r}: a causal "
                         "mask sees no key to the right, so right must be 0 or None "
                         "(Mistral's window W is (W - 1, 0))")
    return tuple(sides)


def window_keep(T, S, window, is_causal=False):
    """Boolean ``(T, S)``: True where query ``i`` may attend key ``j`` under ``window``.

    ``i - left <= j <= i + right`` with ``i`` shifted by ``S - T`` in the
    bottom-right alignment (``is_causal="bottom_right"``), as the causal mask.

    >>> window_keep(3, 3, (1, 0)).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [0, 1, 1]])
    """
    left, right = check_window(window, is_causal)
    offset = causal_offset(is_causal, T, S) or 0
    distance = np.arange(S)[None, :] - (np.arange(T)[:, None] + offset)  # j - i, (T, S)
    keep = np.ones((T, S), dtype=bool)
    if left is not None:
        keep &= distance >= -left
    if right is not None:
        keep &= distance <= right
    return keep


def has_variants(score_bias=None, softcap=None, sinks=None, window=None):
    """True when one of the variant options is given."""
    return not (score_bias is None and softcap is None and sinks is None and window is None)


# ---------------------------------------------------------------- attention


def _sink_softmax(scores, sinks):
    """Softmax over the last axis with an extra logit ``sinks`` (..., 1) in each denominator.

    Returns the weights and the sink's share (None without sinks). A row whose
    scores are all ``-inf`` gets zero weights (and, with a sink, share 1).
    """
    row_max = np.max(scores.real, axis=-1, keepdims=True)  # (..., T, 1); the real part: complex step
    if sinks is not None:
        row_max = np.maximum(row_max, np.broadcast_to(sinks.real, row_max.shape))
    dead = row_max == -np.inf  # fully masked, no sink: defined as zeros
    row_max = np.where(dead, 0, row_max)
    exps = np.exp(scores - row_max)  # exp(-inf) = 0 where masked
    total = np.sum(exps, axis=-1, keepdims=True)  # (..., T, 1)
    sink_exp = None
    if sinks is not None:
        sink_exp = np.exp(sinks - row_max)
        total = total + sink_exp
    total = np.where(dead, 1, total)
    weights = exps / total
    return weights, None if sink_exp is None else sink_exp / total


def variant_attention_forward(query, key, value, attn_mask=None, is_causal=False, scale=None, *,
                              score_bias=None, softcap=None, sinks=None, window=None,
                              dropout_p=0.0, rng=None, dropout_mask=None, enable_gqa=False,
                              check=True):
    """:func:`qkvnp.functional.attention_forward` with the variants (see its Parameters).

    Parameters
    ----------
    score_bias : ndarray, broadcastable to (..., T, S), optional
        Added to the scaled scores; gets a gradient (a float ``attn_mask``
        does not).
    softcap : float, optional
        Scores become ``softcap * tanh(scores / softcap)`` after the score
        bias, before any mask.
    sinks : ndarray, shape (H,) or broadcastable to the leading dims (..., ), optional
        One extra logit per head in each row's softmax denominator.
    window : (left, right), optional
        Query ``i`` may attend key ``j`` iff ``i - left <= j <= i + right``
        (in ``is_causal``'s alignment); None on a side: unbounded.

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    cache : VariantCache (or VariantGroupedCache with grouped-query attention)

    Notes
    -----
    With :math:`c` the scale, :math:`B` the score bias, :math:`\\kappa` the
    soft-cap, :math:`M` the masks and :math:`\\sigma` the sink:

    .. math:: A = c\\,QK^T + B, \\quad U = \\tanh(A/\\kappa), \\quad S = \\kappa U + M,
    .. math:: P_{ij} = e^{S_{ij}} / (e^{\\sigma} + \\textstyle\\sum_k e^{S_{ik}}), \\quad O = PV

    Backward, with :math:`\\pi_i = 1 - \\sum_j P_{ij}` the sink's share:

    .. math:: \\bar S = P \\odot (\\bar P - \\mathrm{rowsum}(P \\odot \\bar P)), \\quad
              \\bar\\sigma = -\\textstyle\\sum_i \\pi_i\\, \\mathrm{rowsum}(P \\odot \\bar P)_i,
    .. math:: \\bar A = \\bar S \\odot (1 - U^2), \\quad \\bar B = \\bar A, \\quad
              \\bar Q = c\\,\\bar A K, \\quad \\bar K = c\\,\\bar A^T Q

    each summed to its input's shape (``docs/derivations_variants.md``).
    """
    softcap = check_softcap(softcap)
    window = check_window(window, is_causal)
    grouped = split_groups(query, key, value, attn_mask, enable_gqa)
    if grouped is not None:
        return _grouped_forward(grouped, is_causal, scale, score_bias, softcap, sinks, window,
                                dropout_p=dropout_p, rng=rng, dropout_mask=dropout_mask,
                                check=check)
    originals = (query, key, value) if check else ()
    if check:
        query, key, value, lead = check_attention_inputs(query, key, value)
    else:
        lead = broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    scale = check_scale(scale, query.shape[-1])
    T, S = query.shape[-2], key.shape[-2]
    scores_shape = lead + (T, S)
    score_bias = _check_broadcast(score_bias, "score_bias", scores_shape, query.dtype, "(..., T, S)")
    sinks_column = None
    if sinks is not None:
        sinks = as_float_array(sinks, "sinks", query.dtype)
        sinks_column = _check_broadcast(sinks[..., None, None], "sinks", lead + (T, 1),
                                        query.dtype, "(H,) or broadcastable to the leading dims",
                                        shown=sinks.shape)
    bias, keep = prepare_mask(attn_mask, is_causal, scores_shape, query.dtype)
    if window is not None:
        band = window_keep(T, S, window, is_causal)
        keep = band if keep is None else keep & band
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, scores_shape)

    # NOTE: the plain path's numerics (qkvnp.ops.overflow): exact where the exact
    # score fits the dtype, even when partial products overflow; beyond it,
    # clipped to +-max. A sum with score_bias or the float mask that overflows
    # is clipped to +max as well (-inf stays -inf): score_bias is a float mask
    # that also gets a gradient, taken as if unclipped.
    big = np.finfo(query.real.dtype).max
    scores = product(query, np.swapaxes(key, -1, -2), scale, clip=True)  # (..., T, D) @ (..., D, S) -> (..., T, S)
    if score_bias is not None:
        scores = _clipped_sum(scores, score_bias, big)
    capped = None
    if softcap is not None:
        capped = np.tanh(scores / softcap)  # (..., T, S), in (-1, 1)
        scores = softcap * capped
    if bias is not None:
        scores = _clipped_sum(scores, bias, big)
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    weights, sink_weight = _sink_softmax(scores, sinks_column)  # (..., T, S), (..., T, 1)
    drop_keep = None if dropout is None else dense_keep(dropout)  # (..., T, S) bool or None
    if drop_keep is not None:
        (drop_keep,) = owned((drop_keep,), (dropout_mask,))
    cache = VariantCache(query, key, value, weights, scale, drop_keep,
                         0.0 if dropout is None else dropout.p,
                         None if score_bias is None else np.shape(score_bias),
                         capped, softcap, None if sinks is None else sinks.shape, sink_weight)
    out = _dropped(cache) @ value  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
    query, key, value = owned((query, key, value), originals)  # the cache owns what backward reads
    return out, cache._replace(query=query, key=key, value=value)


def _clipped_sum(scores, bias, big):
    """``scores + bias`` with ``+inf`` (an overflowed sum) clipped to ``big``; ``-inf`` stays."""
    total = scores + bias
    if np.isfinite(total).all():
        return total
    real = np.minimum(total.real, big)  # the real part: the complex step's imaginary part stays
    return real + 1j * total.imag if np.iscomplexobj(total) else real


def _check_broadcast(array, name, shape, dtype, expected, shown=None):
    """``array`` as a float array of ``dtype`` broadcastable to ``shape``; None stays None."""
    if array is None:
        return None
    array = as_float_array(array, name, dtype)
    try:
        ok = np.broadcast_shapes(array.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be {expected}, broadcasting to {tuple(shape)}, got shape "
                         f"{array.shape if shown is None else shown}")
    return array


def _dropped(cache):
    """The weights after dropout ``P * Z / (1 - p)`` (the weights themselves without dropout)."""
    if cache.dropout_mask is None:
        return cache.weights
    kept = cache.weights * cache.dropout_mask
    kept *= keep_scale(cache.dropout_p, kept.real.dtype)
    return kept


def _grouped_forward(grouped, is_causal, scale, score_bias, softcap, sinks, window, **options):
    """Grouped-query attention: the head axis of score_bias, sinks and dropout_mask split as the query's."""
    H, (K, G) = grouped.num_heads, grouped.query.shape[-4:-2]
    bias_shape = sinks_shape = None
    if score_bias is not None:
        score_bias = np.asarray(score_bias)
        bias_shape = score_bias.shape
        if score_bias.ndim >= 3 and score_bias.shape[-3] not in (1, H):
            raise ValueError(f"score_bias must broadcast to the scores' shape (..., {H}, T, S) "
                             f"(query heads), got shape {score_bias.shape}")
        score_bias = split_head_axis(score_bias, H, K, G)
    if sinks is not None:
        sinks_shape = np.shape(sinks)
        sinks = split_per_head(sinks, H, K, G, "sinks")  # (..., H or 1) -> (..., K or 1, G or 1)
    drop = options.get("dropout_mask")
    if drop is not None and np.ndim(drop) >= 3:
        options["dropout_mask"] = split_head_axis(np.asarray(drop), H, K, G)
    out, inner = variant_attention_forward(grouped.query, grouped.key, grouped.value,
                                           grouped.attn_mask, is_causal, scale,
                                           score_bias=score_bias, softcap=softcap, sinks=sinks,
                                           window=window, **options)
    out_shape = out.shape[:-4] + (H,) + out.shape[-2:]
    shapes = grouped.shapes + (bias_shape, sinks_shape)
    return (out.reshape(out_shape),  # (..., K, G, T, Dv) -> (..., H, T, Dv)
            VariantGroupedCache(inner, shapes, out_shape, out.shape, out.dtype))


def variant_attention_backward(dout, cache, check=True):
    """Backward of :func:`variant_attention_forward`.

    Returns
    -------
    dquery, dkey, dvalue : ndarray, shapes of the forward's inputs
    dscore_bias : ndarray, shape of ``score_bias``, or None without one
    dsinks : ndarray, shape of ``sinks``, or None without sinks
    """
    if isinstance(cache, VariantGroupedCache):
        if check:
            dout = as_upstream_grad(dout, "dout", cache.out_shape, cache.dtype)
        grads = variant_attention_backward(dout.reshape(cache.grouped_out_shape), cache.inner,
                                           check=False)
        # (..., K, G, T, D) -> (..., H, T, D); (..., K, 1, S, D) -> (..., K, S, D); (K, G) -> (H,)
        return tuple(None if g is None else g.reshape(shape)
                     for g, shape in zip(grads, cache.shapes))
    weights, value = cache.weights, cache.value
    lead = broadcast_shapes(weights.shape[:-2], value.shape[:-2])
    if check:
        dout = as_upstream_grad(dout, "dout", lead + (weights.shape[-2], value.shape[-1]),
                                weights.dtype)
    grads = _variant_backward(dout, cache)
    if all(np.isfinite(g).all() for g in grads if g is not None):
        return grads
    # NOTE: as the plain path's backward: an inf or NaN gradient of finite
    # inputs means that a product overflowed; once more with products that
    # overflow only where the exact result does (qkvnp.ops.overflow)
    with np.errstate(over="ignore", invalid="ignore"):
        return _variant_backward(dout, cache, careful=True)


def _variant_backward(dout, cache, careful=False):
    """:func:`variant_attention_backward` of a checked ``dout``.

    ``careful``: every product through :func:`qkvnp.ops.overflow.product`, and the
    softmax backward as ``P dP - P delta`` (no ``inf * 0`` where ``P = 0``).
    """
    query, key, value, weights, scale = cache[:5]
    matmul = product if careful else _plain_product
    kept = _dropped(cache)  # P~, (..., T, S)
    dvalue = matmul(np.swapaxes(kept, -1, -2), dout)  # (..., S, T) @ (..., T, Dv) -> (..., S, Dv)
    dweights = matmul(dout, np.swapaxes(value, -1, -2))  # (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
    if cache.dropout_mask is not None:
        dweights = dweights * cache.dropout_mask * keep_scale(cache.dropout_p, weights.real.dtype)
    row_dot = np.sum(weights * dweights, axis=-1, keepdims=True)  # (..., T, 1)
    if careful:  # P dP - P delta: each term finite, unlike dP - delta
        dscores = weights * dweights - weights * row_dot
    else:
        dscores = weights * (dweights - row_dot)  # (..., T, S); 0 where masked (P = 0)
    dsinks = None
    if cache.sinks_shape is not None:  # d/dsink of P_j is -P_j * sink_weight
        dsink_rows = -cache.sink_weight * row_dot  # (..., T, 1)
        column = sum_to_shape(dsink_rows, cache.sinks_shape + (1, 1))  # (..., 1, 1)
        dsinks = column.reshape(cache.sinks_shape)  # (..., 1, 1) -> sinks' shape
    if cache.capped is not None:
        dscores = dscores * (1 - cache.capped * cache.capped)  # d tanh = 1 - tanh^2
    dscore_bias = None
    if cache.score_bias_shape is not None:
        dscore_bias = sum_to_shape(dscores, cache.score_bias_shape)
    dquery = matmul(dscores, key, scale)  # (..., T, S) @ (..., S, D) -> (..., T, D)
    dkey = matmul(np.swapaxes(dscores, -1, -2), query, scale)  # (..., S, T) @ (..., T, D) -> (..., S, D)
    return (sum_to_shape(dquery, query.shape), sum_to_shape(dkey, key.shape),
            sum_to_shape(dvalue, value.shape), dscore_bias, dsinks)


def _plain_product(a, b, factor=1.0):
    """``(a @ b) * factor``, as numpy computes it."""
    out = a @ b
    return out * factor if factor != 1.0 else out


declare_complex_step(rope_forward, variant_attention_forward)  # see qkvnp._checks.complex_step_mode
