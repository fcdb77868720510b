"""Scaled dot-product attention, forward and backward: the reference.

Shape key: B batch, H heads, T query length, S key length, D head dim (of
queries and keys), Dv head dim of values. ``...`` stands for any leading
dims (possibly none), which broadcast between query, key and value.

The backward is the derivation of ``docs/derivations.md`` line for line,
with each special case in one named place: variant and grouped caches are
dispatched before it (:mod:`qkvnp.ops.variants`, ``qkvnp.ops.gqa``),
an overflowing product is retried by a wrapper (:mod:`qkvnp.ops.overflow`),
and one array as both key and value has its own backward. Users reach it
through :mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_upstream_grad, broadcast_shapes, check_attention_inputs, check_scale,
                       declare_complex_step, owned)
from .dropout import dense_keep, keep_scale, prepare_dropout
from .gqa import GroupedCache, grouped_backward, grouped_forward, split_groups
from .masks import prepare_mask
from .overflow import product
from .reductions import sum_to_shape
from .softmax import SoftmaxCache, softmax_backward, softmax_forward
from .variants import (VariantCache, VariantGroupedCache, has_variants, variant_attention_backward,
                       variant_attention_forward)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import BoolArray, FloatArray

__all__ = ["attention_forward", "attention_backward", "AttentionCache", "dropped_weights",
           "scaled_dot_product_attention", "key_value_factors"]

AttentionCache = namedtuple("AttentionCache", "query key value weights scale dropout_mask dropout_p",
                            defaults=(None, 0.0))


def attention_forward(query: FloatArray, key: FloatArray, value: FloatArray,
                      attn_mask: BoolArray | FloatArray | None = None,
                      is_causal: bool | str = False, scale: float | None = None, *,
                      dropout_p: float = 0.0, rng: np.random.Generator | int | None = None,
                      dropout_mask: BoolArray | None = None, enable_gqa: bool = False,
                      check: bool = True, score_bias: Any = None, softcap: Any = None,
                      sinks: Any = None, window: Any = None) -> tuple[FloatArray, Any]:
    """Scaled dot-product attention ``dropout(softmax(q k^T * scale + mask)) v``.

    Parameters
    ----------
    query : ndarray, shape (..., T, D)
    key : ndarray, shape (..., S, D)
    value : ndarray, shape (..., S, Dv)
        Leading dims of the three broadcast against each other.
    attn_mask : ndarray of bool or float, optional
        Broadcastable to ``(..., T, S)``. Bool: True = may attend. Float: added
        to the scores.
    is_causal : bool or "bottom_right"
        Query ``i`` attends to keys ``0..i`` (True) or ``0..i + S - T`` (``"bottom_right"``).
        The float mask is added first, then every boolean mask removes what it forbids.
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    dropout_p : float
        Drop probability of each weight, in ``[0, 1)``; the kept weights are
        scaled by ``1 / (1 - dropout_p)`` (PyTorch's ``dropout_p``). 0: no
        dropout, bitwise the forward without it.
    rng : numpy.random.Generator or int, optional
        Draws the dropout mask (one 64-bit draw; see ``qkvnp/ops/dropout.py``).
        Unused when ``dropout_p == 0`` or ``dropout_mask`` is given.
    dropout_mask : ndarray of bool, optional
        Broadcastable to ``(..., T, S)``, True = keep: replays a mask (from
        ``cache.dropout_mask``, or one applied in PyTorch by hand). Needs
        ``0 < dropout_p < 1``.
    enable_gqa : bool, keyword-only
        ``key``/``value`` may have ``K`` heads dividing the query's ``H`` (``qkvnp/ops/gqa.py``).
    check : bool, keyword-only
        False: ``query``, ``key`` and ``value`` are a composite's own arrays
        (float, one dtype, valid shapes, finite), which it does not edit
        before the backward: they are neither checked again nor copied into
        the cache. Inputs are then checked once, where the data entered, as
        gradients are with the backwards' ``check=False``: at the kv-recall
        model's shapes the checks and copies were a tenth of a training step.
        Masks and dropout arguments are checked either way.
    score_bias, softcap, sinks, window : keyword-only, optional
        The variants of :mod:`qkvnp.ops.variants` (a learnable bias added to the
        scaled scores, ``softcap * tanh(s / softcap)``, one extra logit per
        head in the softmax's denominator, a sliding ``(left, right)``
        window); given any, the forward is
        :func:`qkvnp.ops.variants.variant_attention_forward` and the backward
        returns ``(dquery, dkey, dvalue, dscore_bias, dsinks)``.

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    cache : AttentionCache (or ``qkvnp.ops.gqa.GroupedCache`` around one)
        Holds the inputs, the softmax weights ``(..., T, S)`` (before
        dropout), the scale, and ``dropout_mask`` (bool, True = keep, or
        None) with ``dropout_p``.

    Raises
    ------
    ValueError
        On mismatched dims, a mask that does not broadcast, non-finite
        inputs, ``dropout_p`` outside ``[0, 1)``, a ``dropout_mask`` with
        ``dropout_p == 0``.
    TypeError
        On a mask that is neither bool nor float, a ``dropout_mask`` that is
        not bool, or an input that does not hold real numbers or is wider
        than float64 (float128); the message names the argument.

    Notes
    -----
    Forward, with :math:`c` the scale and :math:`M` the additive mask:

    .. math:: S = c\\,Q K^T + M, \\quad P = \\mathrm{softmax}_{rows}(S), \\quad O = P V

    With dropout, :math:`O = \\tilde P V` with :math:`\\tilde P = P \\odot Z /
    (1 - p)` (:math:`Z` the 0/1 mask), and the backward starts with
    :math:`\\bar V = \\tilde P^T \\bar O`, :math:`\\bar P = (\\bar O V^T) \\odot
    Z / (1 - p)`; the rest is unchanged (``docs/derivations.md``).

    Backward (see ``docs/derivations.md``):

    .. math:: \\bar V = P^T \\bar O, \\quad \\bar P = \\bar O V^T, \\quad
              \\bar S = P \\odot (\\bar P - \\mathrm{rowsum}(P \\odot \\bar P)),
    .. math:: \\bar Q = c\\, \\bar S K, \\quad \\bar K = c\\, \\bar S^T Q

    A query row whose keys are all masked has ``P = 0``: its output row is 0
    and no gradient flows through it.

    Near the float maximum: a score whose exact value fits the dtype is
    computed as such, even when partial products of ``q . k`` overflow
    (``[1e308, 1e308] . [10, -9]``), and so are the gradients
    (:mod:`qkvnp.ops.overflow`). A score whose exact value is beyond the range
    is clipped to the dtype's largest finite value of its sign, so the
    output stays finite; its gradient is taken as if unclipped. NaN is never
    turned into a finite score (NaN and inf inputs are refused).

    Examples
    --------
    One key: every query returns that key's value.

    >>> out, cache = attention_forward(np.ones((2, 4)), np.ones((1, 4)), np.array([[3., 5.]]))
    >>> out
    array([[3., 5.],
           [3., 5.]])
    """
    if has_variants(score_bias, softcap, sinks, window):
        return variant_attention_forward(query, key, value, attn_mask, is_causal, scale,
                                         score_bias=score_bias, softcap=softcap, sinks=sinks,
                                         window=window, dropout_p=dropout_p, rng=rng,
                                         dropout_mask=dropout_mask, enable_gqa=enable_gqa,
                                         check=check)
    grouped = split_groups(query, key, value, attn_mask, enable_gqa)
    if grouped is not None:  # K < H key/value heads, broadcast over each group
        return grouped_forward(attention_forward, grouped, is_causal, scale, dropout_p=dropout_p,
                               rng=rng, dropout_mask=dropout_mask, check=check)
    originals = (query, key, value) if check else ()  # the arrays the cache copies if it reads them
    if check:
        query, key, value, lead = check_attention_inputs(query, key, value)
    else:
        lead = broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    scale = check_scale(scale, query.shape[-1])
    T, S = query.shape[-2], key.shape[-2]
    bias, keep = prepare_mask(attn_mask, is_causal, lead + (T, S), query.dtype)
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, lead + (T, S))

    # NOTE: exact where the exact score fits the dtype, even when partial
    # products overflow; beyond the range, +-inf is clipped to +-max (qkvnp.ops.overflow)
    scores = product(query, np.swapaxes(key, -1, -2), scale, clip=True)  # (..., T, D) @ (..., D, S) -> (..., T, S)
    if bias is not None:
        scores = np.minimum(scores + bias, np.finfo(scores.dtype).max)  # -inf stays -inf
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    weights, _ = softmax_forward(scores)  # (..., T, S), rows sum to 1 (or 0 if fully masked)
    if dropout is None:
        out = weights @ value  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
        query, key, value = owned((query, key, value), originals)  # the cache owns what backward reads
        return out, AttentionCache(query, key, value, weights, scale)
    (drop_keep,) = owned((dense_keep(dropout),), (dropout_mask,))  # (..., T, S) bool, True = keep
    cache = AttentionCache(query, key, value, weights, scale, drop_keep, dropout.p)
    out = dropped_weights(cache) @ value  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
    query, key, value = owned((query, key, value), originals)  # the cache owns what backward reads
    return out, cache._replace(query=query, key=key, value=value)


def dropped_weights(cache: Any) -> FloatArray:
    """The weights after dropout, ``P * Z / (1 - p)``, of an :class:`AttentionCache` (a new array).

    >>> _, cache = attention_forward(np.zeros((1, 2)), np.zeros((2, 2)), np.ones((2, 1)),
    ...                              dropout_p=0.5, dropout_mask=np.array([True, False]))
    >>> dropped_weights(cache)
    array([[1., 0.]])
    """
    if cache.dropout_mask is None:
        return cache.weights.copy()
    # NOTE: the mask times 1/(1-p) in the weights' dtype, as PyTorch's dropout scales
    kept = cache.weights * cache.dropout_mask  # (..., T, S)
    kept *= keep_scale(cache.dropout_p, kept.dtype)
    return kept


def attention_backward(dout: FloatArray, cache: Any, check: bool = True, *,
                       key_is_value: bool = False) -> tuple[Any, ...]:
    """Backward of :func:`attention_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, Dv)
        Same shape as the forward output (it is not broadcast).
    cache : AttentionCache
        Or the grouped or variant cache of such a forward.
    check : bool
        False: the gradient is already checked (composite backwards).
    key_is_value : bool, keyword-only
        True: the forward got one array ``X`` as both ``key`` and ``value``
        (attention over raw items); its gradient, the sum of the two, is
        returned in the ``dkey`` slot and ``dvalue`` is None
        (``qkvnp.ops.attention.key_value_factors``).

    Returns
    -------
    dquery : ndarray, shape of ``query``
    dkey : ndarray, shape of ``key`` (with ``key_is_value``: ``dkey + dvalue``)
    dvalue : ndarray, shape of ``value``, or None with ``key_is_value``
    dscore_bias, dsinks : ndarray or None
        Only after a forward with a variant (:mod:`qkvnp.ops.variants`): the
        gradients of ``score_bias`` and ``sinks`` (None for one not given).

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...), or
        ``key_is_value`` is not a bool.
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf;
        with ``key_is_value``, if the forward's key and value were not one
        array, or the cache is grouped or has a variant.

    Notes
    -----
    The forward was :math:`S = c\\,Q K^T + M`, :math:`P = \\mathrm{softmax}_{rows}(S)`,
    :math:`O = \\tilde P V` with :math:`\\tilde P = P \\odot Z / (1 - p)` after
    dropout (:math:`\\tilde P = P` without). Backward, derived in
    ``docs/derivations.md``:

    .. math:: \\bar V = \\tilde P^T \\bar O, \\quad
              \\bar P = (\\bar O V^T) \\odot Z / (1 - p), \\quad
              \\bar S = P \\odot (\\bar P - \\mathrm{rowsum}(P \\odot \\bar P)),
    .. math:: \\bar Q = c\\, \\bar S K, \\quad \\bar K = c\\, \\bar S^T Q

    each summed back to its input's shape where the leading dims broadcast.
    The special cases each have one place: a variant cache goes to
    :func:`qkvnp.ops.variants.variant_attention_backward`, a grouped one to
    ``qkvnp.ops.gqa.grouped_backward``, ``key_is_value`` to
    ``key_value_factors``; a gradient that overflowed to inf or NaN
    (the inputs are finite) is computed again with products that overflow
    only where the exact result does (:mod:`qkvnp.ops.overflow`).
    """
    if _key_is_value(key_is_value):
        return _key_value_backward(dout, cache, check)
    if isinstance(cache, (VariantCache, VariantGroupedCache)):  # (dq, dk, dv, dscore_bias, dsinks)
        return variant_attention_backward(dout, cache, check)
    if isinstance(cache, GroupedCache):  # the core's backward sums each group
        return grouped_backward(attention_backward, dout, cache, check_dout=check, check=False)
    if check:
        dout = _checked_dout(dout, cache)
    return _retry_on_overflow(_plain_backward, dout, cache)


def _plain_backward(dout, cache, careful=False):
    """The derivation of :func:`attention_backward`'s Notes, for a checked ``dout``.

    ``careful``: every product through :func:`qkvnp.ops.overflow.product`.
    """
    query, key, value, weights, scale = cache[:5]
    matmul = product if careful else _product
    kept = weights if cache.dropout_mask is None else dropped_weights(cache)  # P~, (..., T, S)
    dvalue = matmul(np.swapaxes(kept, -1, -2), dout)  # (..., S, T) @ (..., T, Dv) -> (..., S, Dv)
    dscores = _scores_backward(dout, cache, matmul, careful)  # (..., T, S)
    dquery = matmul(dscores, key, scale)  # (..., T, S) @ (..., S, D) -> (..., T, D)
    dkey = matmul(np.swapaxes(dscores, -1, -2), query, scale)  # (..., S, T) @ (..., T, D) -> (..., S, D)
    return (sum_to_shape(dquery, query.shape), sum_to_shape(dkey, key.shape),
            sum_to_shape(dvalue, value.shape))


def _scores_backward(dout, cache, matmul, careful):
    """``dS`` from ``dO``: back through ``O = P~ V``, the dropout and the softmax."""
    dweights = matmul(dout, np.swapaxes(cache.value, -1, -2))  # (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
    if cache.dropout_mask is not None:  # in the forward: P~ = P * Z / (1 - p)
        dweights *= cache.dropout_mask
        dweights *= keep_scale(cache.dropout_p, dweights.dtype)
    weights = cache.weights
    if weights.shape != dweights.shape:
        weights = np.broadcast_to(weights, dweights.shape)  # (..., T, S) -> (lead, T, S)
    if careful:  # P dP - P delta: each term finite, unlike dP - delta where P = 0
        return weights * dweights - weights * np.sum(weights * dweights, axis=-1, keepdims=True)
    return softmax_backward(dweights, SoftmaxCache(weights, -1), check=False)  # (..., T, S)


def _checked_dout(dout, cache):
    """``dout`` checked against the forward's output: shape, real dtype, cast, finite."""
    value, weights = cache.value, cache.weights
    # NOTE: value's leading dims may broadcast beyond the weights' (query, key) ones.
    lead = broadcast_shapes(weights.shape[:-2], value.shape[:-2])
    return as_upstream_grad(dout, "dout", lead + (weights.shape[-2], value.shape[-1]),
                            weights.dtype)


def _retry_on_overflow(backward, dout, cache):
    """``backward(dout, cache)``, again with ``careful=True`` if a gradient is not finite.

    NOTE: the inputs are finite, so an inf or NaN gradient means that a
    product overflowed: the careful products overflow only where the exact
    result does (:mod:`qkvnp.ops.overflow`); what is still inf is so exactly.
    """
    grads = backward(dout, cache)
    if all(np.isfinite(g).all() for g in grads if g is not None):
        return grads
    with np.errstate(over="ignore", invalid="ignore"):
        return backward(dout, cache, careful=True)


def _product(a, b, factor=1.0):
    """``(a @ b) * factor``; a contraction of length 1 (one query row) as the outer products it is.

    NOTE: numpy's batched matmul takes a slow loop when the contracted axis
    has length 1; einsum computes the same products (no sums) several times
    faster (benchmarks/NOTES.md).
    """
    out = np.einsum("...ik,...kj->...ij", a, b) if a.shape[-1] == 1 else a @ b
    if factor != 1.0:
        out *= factor  # in place: new arrays, whose allocation costs as much as the multiply
    return out


# ---------------------------------------------------------------- one array as key and value


def key_value_factors(dout: FloatArray, cache: Any,
                      careful: bool = False) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Attention's gradients when one array ``X`` is both key and value, ``dX`` as two factors.

    Parameters
    ----------
    dout : ndarray, shape (..., T, D)
        Already checked and cast (see :func:`attention_backward`'s ``check``).
    cache : AttentionCache
        Of an ungrouped forward without variants, given one array (the same
        object) as both ``key`` and ``value``.
    careful : bool
        Every product through :func:`qkvnp.ops.overflow.product`.

    Returns
    -------
    dquery : ndarray, shape of ``query``
    left : ndarray, shape (..., 2T, S)
    right : ndarray, shape (..., 2T, D)
        ``dX = sum_to_shape(swapaxes(left, -1, -2) @ right, X.shape)``. A
        caller that multiplies ``dX`` further may multiply a factor first
        (``qkvnp.ops.embedding.embedding_backward_factored``).

    Raises
    ------
    ValueError
        If the forward's key and value were two arrays, or the cache is
        grouped or has a variant.

    Notes
    -----
    ``X`` is used twice, so it receives the sum of the two gradients of
    :func:`attention_backward`'s Notes, which stack into one product whose
    inner dim is ``2T`` (``docs/derivations.md``, "One array as both key
    and value"):

    .. math:: \\bar X = c\\, \\bar S^T Q + \\tilde P^T \\bar O
              = \\begin{bmatrix} c\\, \\bar S \\\\ \\tilde P \\end{bmatrix}^T
                \\begin{bmatrix} Q \\\\ \\bar O \\end{bmatrix}
    """
    _check_one_array(cache)
    matmul = product if careful else _product
    query, scale = cache.query, cache.scale
    kept = cache.weights if cache.dropout_mask is None else dropped_weights(cache)  # P~, (..., T, S)
    dscores = _scores_backward(dout, cache, matmul, careful)  # (..., T, S)
    dquery = matmul(dscores, cache.key, scale)  # (..., T, S) @ (..., S, D) -> (..., T, D)
    dscores *= scale
    left = np.concatenate(np.broadcast_arrays(dscores, kept), axis=-2)  # (..., 2T, S)
    right = np.concatenate(np.broadcast_arrays(query, dout), axis=-2)  # (..., 2T, D)
    return sum_to_shape(dquery, query.shape), left, right


def _key_value_backward(dout, cache, check):
    """:func:`attention_backward` with ``key_is_value=True``: ``(dquery, dX, None)``."""
    _check_one_array(cache)
    if check:
        dout = _checked_dout(dout, cache)

    def backward(dout, cache, careful=False):
        dquery, left, right = key_value_factors(dout, cache, careful)
        matmul = product if careful else _product
        ditems = matmul(np.swapaxes(left, -1, -2), right)  # (..., S, 2T) @ (..., 2T, D) -> (..., S, D)
        return dquery, sum_to_shape(ditems, cache.key.shape), None

    return _retry_on_overflow(backward, dout, cache)


def _key_is_value(flag):
    """:func:`attention_backward`'s ``key_is_value`` checked, as a bool."""
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    if isinstance(flag, str) and flag == "factors":
        raise ValueError("key_is_value='factors' is no mode of the reference op: the kv-recall "
                         "model's factored backward is qkvnp.kernels.kv_recall.items_backward_factors")
    raise TypeError(f"key_is_value must be a bool, got {type(flag).__name__}")


def _check_one_array(cache):
    """Refuse a cache whose forward did not get one array as both key and value."""
    if isinstance(cache, (VariantCache, VariantGroupedCache)):
        raise ValueError("key_is_value needs a forward without score_bias, softcap, sinks "
                         "or window")
    if isinstance(cache, GroupedCache):
        raise ValueError("key_is_value=True needs an ungrouped cache (enable_gqa=False in the "
                         "forward), got a grouped one")
    if cache.key is not cache.value:
        raise ValueError("key_is_value=True needs the forward's key and value to be one array "
                         "(the same object, passed as both), got two arrays")


def scaled_dot_product_attention(query: FloatArray, key: FloatArray, value: FloatArray,
                                 attn_mask: BoolArray | FloatArray | None = None,
                                 is_causal: bool | str = False, scale: float | None = None,
                                 return_weights: bool = False, *, dropout_p: float = 0.0,
                                 rng: np.random.Generator | int | None = None,
                                 dropout_mask: BoolArray | None = None, enable_gqa: bool = False,
                                 score_bias: Any = None, softcap: Any = None, sinks: Any = None,
                                 window: Any = None) -> FloatArray | tuple[FloatArray, FloatArray]:
    """Scaled dot-product attention, the forward alone.

    Same arguments as :func:`~qkvnp.functional.attention_forward` (and as PyTorch's
    ``torch.nn.functional.scaled_dot_product_attention``, mask polarity
    included: True = may attend; ``"bottom_right"`` is ``causal_lower_right``;
    ``dropout_p`` included, plus ``rng`` and ``dropout_mask`` to seed or replay
    the dropout mask).

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    weights : ndarray, shape (..., T, S)
        Only when ``return_weights=True``: after dropout (zeros where
        dropped, the rest scaled by ``1 / (1 - dropout_p)``), as PyTorch's
        ``MultiheadAttention`` returns them.

    Examples
    --------
    Equal scores give the mean of the values:

    >>> scaled_dot_product_attention(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[0., 2.], [4., 6.]]))
    array([[2., 4.]])
    """
    out, cache = attention_forward(query, key, value, attn_mask, is_causal, scale,
                                   dropout_p=dropout_p, rng=rng, dropout_mask=dropout_mask,
                                   enable_gqa=enable_gqa, score_bias=score_bias, softcap=softcap,
                                   sinks=sinks, window=window)
    if not return_weights:
        return out
    return out, (cache.weights if cache.dropout_mask is None else dropped_weights(cache))




declare_complex_step(attention_forward)  # see qkvnp._checks.complex_step_mode
