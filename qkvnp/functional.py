"""Every differentiable op of qkvnp as a pair of pure functions.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim (of queries and keys), Dv head dim of values, N input features,
M output features. ``...`` stands for any leading dims (possibly none).

Each op ``name`` has ``name_forward(inputs) -> (out, cache)`` and
``name_backward(dout, cache) -> gradients``, one gradient per differentiable
input, with that input's shape and (compute) dtype. The cache is a small named
tuple holding exactly what the backward reads. The derivations are in
``docs/derivations.md``.

Every public backward checks its upstream gradient once
(:func:`qkvnp._checks.as_upstream_grad`: exact shape, real dtype, cast to the
compute dtype, finite) and then runs the math in a private
``_name_backward``. Composite backwards (attention's softmax, the reference
layers of :mod:`qkvnp.layers.reference`) pass ``check=False`` for the
gradients they computed themselves, so that ``dout`` is checked once;
``linear_forward`` and ``attention_forward`` take ``check=False`` too, for
the arrays a model computed itself (:class:`qkvnp.training.KVRecallModel`).

This is the *reference* path: every formula is written line for line, with
scipy's softmax, so that it reads like the math and serves as the oracle.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from ._checks import (as_float_array, as_upstream_grad, broadcast_shapes, check_attention_inputs,
                      check_ndim, check_scale, compute_dtype, declare_complex_step, owned)
from .ops.dropout import dense_keep, keep_scale, prepare_dropout
from .ops.embedding import (EmbeddingCache, embedding_backward, embedding_backward_factored,
                        embedding_forward)
from .ops.gqa import GroupedCache, grouped_backward, grouped_forward, split_groups
from .ops.heads import (HeadsCache, merge_heads_backward, merge_heads_forward, split_heads_backward,
                    split_heads_forward)
from .ops.masks import prepare_mask
from .ops.overflow import product
from .ops.reductions import column_sums, sum_to_shape
from .ops.variants import (VariantCache, VariantGroupedCache, has_variants, rope_backward, rope_forward,
                       variant_attention_backward, variant_attention_forward)
from .ops.transformer import (ActivationDropoutCache, GeluCache, LayerNormCache, ResidualCache,
                              activation_dropout_backward, activation_dropout_forward,
                              gelu_backward, gelu_forward, layer_norm_backward,
                              layer_norm_forward, residual_add_backward, residual_add_forward)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from ._typing import ArrayLike, BoolArray, FloatArray

__all__ = [
    # this module's ops
    "softmax", "softmax_forward", "softmax_backward", "SoftmaxCache",
    "linear_forward", "linear_backward", "LinearCache",
    "attention_forward", "attention_backward", "AttentionCache", "dropped_weights",
    "scaled_dot_product_attention",
    # the ops of the modules kept apart for this one's length, exported here
    "sum_to_shape", "column_sums",
    "split_heads_forward", "split_heads_backward", "merge_heads_forward",
    "merge_heads_backward", "HeadsCache",
    "embedding_forward", "embedding_backward", "embedding_backward_factored", "EmbeddingCache",
    "rope_forward", "rope_backward",
    "layer_norm_forward", "layer_norm_backward", "LayerNormCache",
    "gelu_forward", "gelu_backward", "GeluCache",
    "activation_dropout_forward", "activation_dropout_backward", "ActivationDropoutCache",
    "residual_add_forward", "residual_add_backward", "ResidualCache",
]

LinearCache = namedtuple("LinearCache", "x W has_bias")
SoftmaxCache = namedtuple("SoftmaxCache", "weights axis")
AttentionCache = namedtuple("AttentionCache", "query key value weights scale dropout_mask dropout_p",
                            defaults=(None, 0.0))


# ---------------------------------------------------------------- linear


def linear_forward(x: FloatArray, W: FloatArray, b: FloatArray | None = None, *,
                   check: bool = True) -> tuple[FloatArray, LinearCache]:
    """Affine map ``out = x @ W + b`` over the last axis of ``x``.

    Parameters
    ----------
    x : ndarray, shape (..., N)
    W : ndarray, shape (N, M)
        The ``x @ W`` convention (PyTorch stores the transpose).
    b : ndarray, shape (M,), optional
    check : bool, keyword-only
        False: the inputs are a composite's own arrays, already checked
        (float, one dtype, these shapes, finite), which it does not edit
        before the backward; they are neither checked again nor copied
        (see :func:`attention_forward`).

    Returns
    -------
    out : ndarray, shape (..., M)
    cache : LinearCache

    Raises
    ------
    ValueError
        If ``W`` is not 2-D, ``x``'s last dim is not ``N``, ``b`` is not
        ``(M,)``, or an input holds NaN or inf.
    TypeError
        If an input does not hold real numbers or is wider than float64
        (float128); the message names it.

    Notes
    -----
    Forward: :math:`Y = X W + b`. With the leading dims of ``X`` flattened
    into rows, backward:

    .. math:: \\bar X = \\bar Y W^T, \\quad \\bar W = X^T \\bar Y, \\quad
              \\bar b = \\sum_{rows} \\bar Y

    Examples
    --------
    >>> out, cache = linear_forward(np.ones((2, 3)), np.eye(3, 2), np.array([1., 0.]))
    >>> out
    array([[2., 1.],
           [2., 1.]])
    """
    x_in, W_in = x, W
    if check:
        x, W, b = _linear_inputs(x, W, b)
    # NOTE: one product over all rows, as in the backward (numpy's stack of one
    # product per leading index: (8, 64, 64) @ (64, 256) float32, 189 -> 174 us)
    out = x.reshape(-1, x.shape[-1]) @ W  # (..., N) -> (rows, N) @ (N, M) -> (rows, M)
    out = out.reshape(x.shape[:-1] + (W.shape[1],))  # (rows, M) -> (..., M)
    if b is not None:
        out = out + b
    if check:
        x, W = owned((x, W), (x_in, W_in))  # the cache owns what backward reads
    return out, LinearCache(x, W, b is not None)


def _linear_inputs(x, W, b):
    """``x, W, b`` of :func:`linear_forward` checked and cast to their compute dtype."""
    W = as_float_array(W, "W")
    dtype = compute_dtype(np.asarray(x).dtype, W.dtype, names=("x", "W"))
    x = as_float_array(x, "x", dtype)
    W = W.astype(dtype, copy=False)
    if W.ndim != 2:
        raise ValueError(f"W must have shape (N, M), got shape {W.shape}")
    check_ndim(x, "x", 1, "(..., N)")
    if x.shape[-1] != W.shape[0]:
        raise ValueError(
            f"x must have shape (..., {W.shape[0]}) to match W of shape {W.shape}, "
            f"got shape {x.shape}"
        )
    if b is not None:
        b = as_float_array(b, "b", dtype)
        if b.shape != (W.shape[1],):
            raise ValueError(f"b must have shape ({W.shape[1]},), got shape {b.shape}")
    return x, W, b


def linear_backward(dout: FloatArray, cache: LinearCache,
                    check: bool = True) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Backward of :func:`linear_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., M)
    cache : LinearCache
    check : bool
        False: the gradient is already checked (composite backwards).

    Returns
    -------
    dx : ndarray, shape (..., N)
    dW : ndarray, shape (N, M)
    db : ndarray, shape (M,), or None when the forward had no bias

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of shape ``(..., M)`` exactly (no broadcasting) or
        holds NaN or inf.
    """
    x, W, _ = cache
    if check:
        dout = as_upstream_grad(dout, "dout", x.shape[:-1] + (W.shape[1],), W.dtype)
    return _linear_backward(dout, cache)


def _linear_backward(dout, cache):
    """:func:`linear_backward` of a ``dout`` already checked and cast."""
    x, W, has_bias = cache
    x_rows = x.reshape(-1, x.shape[-1])  # (..., N) -> (rows, N)
    dout_rows = dout.reshape(-1, dout.shape[-1])  # (..., M) -> (rows, M)
    # NOTE: one product over all rows, not numpy's stack of one per leading
    # index (x of shape (64, 16, 64): 105 -> 76 us float32, at one BLAS thread)
    dx = (dout_rows @ W.T).reshape(x.shape)  # (rows, M) @ (M, N) -> (rows, N) -> (..., N)
    dW = x_rows.T @ dout_rows  # (N, rows) @ (rows, M) -> (N, M)
    db = column_sums(dout_rows) if has_bias else None  # (rows, M) -> (M,)
    return dx, dW, db


# ---------------------------------------------------------------- softmax


def softmax(x: ArrayLike, axis: int = -1) -> FloatArray:
    """``scipy.special.softmax``, except that an all ``-inf`` row gives zeros.

    Parameters
    ----------
    x : array_like
    axis : int
        Axis along which the entries sum to 1.

    Returns
    -------
    ndarray, same shape as ``x``
        Rows sum to 1, except fully masked rows (every entry ``-inf``), which
        are all zeros: such a query attends to nothing. No NaN, no warning.

    Examples
    --------
    >>> softmax(np.array([[0.0, 0.0], [-np.inf, -np.inf]]))
    array([[0.5, 0.5],
           [0. , 0. ]])
    """
    from scipy.special import softmax as scipy_softmax

    x = np.asarray(x)
    if x.dtype.kind != "f":
        x = x.astype(compute_dtype(x.dtype, names=("x",)))
    if x.size == 0:
        return np.zeros_like(x)  # no entries (e.g. no keys): nothing to normalise
    if x.dtype.kind == "c":  # the checker's complex step: max of the real part, no scipy
        row_max = np.max(x.real, axis=axis, keepdims=True)
        dead = row_max == -np.inf
        with np.errstate(over="ignore"):  # -big - big -> -inf, whose weight is 0
            shifted = np.where(dead, 0, x) - np.where(dead, 0, row_max)
        weights = np.exp(shifted) / np.sum(np.exp(shifted), axis=axis, keepdims=True)
        return np.where(dead, 0, weights)
    # NOTE: scipy >= 1.9 (our minimum) computes exp(x - max) / sum: the shift
    # that keeps scores at the float max finite (scipy 1.8's exp(x - logsumexp(x))
    # gave three scores tied at finfo.max weights summing to 3). Shifting here
    # as well took 25 against 15 us on kv-recall's (64, 1, 16) scores.
    with np.errstate(over="ignore", invalid="ignore"):  # -big - big -> -inf; dead rows below
        weights = scipy_softmax(x, axis=axis)
    # NOTE: a fully masked row (every entry -inf) has no defined softmax (0/0,
    # scipy's NaN); we define it as all zeros so that the query's output is 0
    # and no gradient flows through it. Its first entry is NaN, as that of a
    # row holding NaN or +inf, which stays NaN.
    first = weights[(slice(None),) * (axis % weights.ndim) + (slice(0, 1),)]  # a view
    if np.isnan(first).any():
        dead = np.all(x == -np.inf, axis=axis, keepdims=True)
        weights = np.where(dead, 0, weights)
    return weights.astype(x.dtype, copy=False)


def softmax_forward(scores: FloatArray, axis: int = -1) -> tuple[FloatArray, SoftmaxCache]:
    """Softmax along ``axis``, with the cache its backward needs.

    Parameters
    ----------
    scores : ndarray
    axis : int

    Returns
    -------
    weights : ndarray, same shape as ``scores``
    cache : SoftmaxCache

    Notes
    -----
    Forward: :math:`P_i = e^{s_i} / \\sum_j e^{s_j}`. The Jacobian is
    :math:`\\partial P_i / \\partial s_j = P_i(\\delta_{ij} - P_j)`, so the
    vector-Jacobian product collapses to the closed form

    .. math:: \\bar s = P \\odot (\\bar P - \\textstyle\\sum_j P_j \\bar P_j)

    which never builds the Jacobian. A fully masked row has ``P = 0`` and
    therefore ``dscores = 0``.

    Examples
    --------
    >>> weights, cache = softmax_forward(np.log([[1.0, 3.0]]))
    >>> weights
    array([[0.25, 0.75]])
    """
    scores = as_float_array(scores, "scores", finite=False)
    weights = softmax(scores, axis=axis)
    return weights, SoftmaxCache(weights, axis)


def softmax_backward(dweights: FloatArray, cache: SoftmaxCache, check: bool = True) -> FloatArray:
    """Backward of :func:`softmax_forward`: ``P * (dP - sum(P * dP, axis))``.

    Parameters
    ----------
    dweights : ndarray, same shape as the weights
    cache : SoftmaxCache
    check : bool
        False: the gradient is already checked (composite backwards).

    Returns
    -------
    dscores : ndarray, same shape as the weights

    Raises
    ------
    TypeError
        If ``dweights`` does not hold real numbers.
    ValueError
        If ``dweights`` does not have the weights' shape exactly or holds NaN
        or inf.
    """
    weights, _ = cache
    if check:
        dweights = as_upstream_grad(dweights, "dweights", weights.shape, weights.dtype)
    return _softmax_backward(dweights, cache)


def _softmax_backward(dweights, cache):
    """:func:`softmax_backward` of a ``dweights`` already checked and cast."""
    weights, axis = cache
    row_dot = np.sum(weights * dweights, axis=axis, keepdims=True)  # (..., 1)
    return weights * (dweights - row_dot)


# ---------------------------------------------------------------- attention


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
        model's shapes the checks and copies took 10-12% of a training step.
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
                       key_is_value: bool | str = False) -> tuple[Any, ...]:
    """Backward of :func:`attention_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, Dv)
        Same shape as the forward output (it is not broadcast).
    cache : AttentionCache
    check : bool
        False: the gradient is already checked (composite backwards).
    key_is_value : bool or "factors", keyword-only
        True: the forward got one array ``X`` as both ``key`` and ``value``
        (attention over raw items, as the kv-recall model's); its gradient
        is the sum of the two, returned in the ``dkey`` slot, computed as
        one product (see Notes). ``dvalue`` is then None. ``"factors"``: the
        same, with the product left to the caller: the ``dkey`` slot holds
        ``(left, right)``, shapes ``(..., 2T, S)`` and ``(..., 2T, D)``, with
        ``dX = swapaxes(left, -1, -2) @ right`` summed to ``key``'s shape
        where the query's leading dims broadcast (a caller that multiplies
        ``dX`` further may multiply a factor first: the kv-recall model
        folds its embedding tables' one-hot products onto ``left``).

    Returns
    -------
    dquery : ndarray, shape of ``query``
    dkey : ndarray, shape of ``key``
        With ``key_is_value=True``: ``dkey + dvalue``; with
        ``"factors"``: the pair ``(left, right)`` of that sum.
    dvalue : ndarray, shape of ``value``, or None with ``key_is_value`` set
    dscore_bias, dsinks : ndarray or None
        Only after a forward with a variant (:mod:`qkvnp.ops.variants`): the
        gradients of ``score_bias`` and ``sinks`` (None for one not given).

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...), or
        ``key_is_value`` is neither a bool nor a string.
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf;
        with ``key_is_value`` set, if the forward's key and value were not
        one array; if ``key_is_value`` is a string other than ``"factors"``.

    Notes
    -----
    With ``X`` as both key and value, :math:`O = \\tilde P X` and
    :math:`S = c\\,Q X^T`, so ``X`` receives both gradients of
    :func:`attention_forward`'s Notes:

    .. math:: \\bar X = c\\, \\bar S^T Q + \\tilde P^T \\bar O
              = \\begin{bmatrix} c\\, \\bar S \\\\ \\tilde P \\end{bmatrix}^T
                \\begin{bmatrix} Q \\\\ \\bar O \\end{bmatrix}

    one product whose inner dim is ``2T``, where the two gradients apart
    take two products of inner dim ``T`` and a sum: for one query row
    (``T = 1``) both are outer products that write the whole ``(S, D)``
    array, and the one product took 23 us against 72 for two and their sum
    (kv-recall's (64, 16, 64) items, float64).
    """
    if isinstance(key_is_value, (bool, np.bool_)):
        key_is_value = bool(key_is_value)
    elif not isinstance(key_is_value, str):
        raise TypeError("key_is_value must be a bool or 'factors', got "
                        f"{type(key_is_value).__name__}")
    elif key_is_value != "factors":
        raise ValueError(f"key_is_value must be a bool or 'factors', got {key_is_value!r}")
    if isinstance(cache, (VariantCache, VariantGroupedCache)):  # (dq, dk, dv, dscore_bias, dsinks)
        if key_is_value:
            raise ValueError("key_is_value needs a forward without score_bias, softcap, sinks "
                             "or window")
        return variant_attention_backward(dout, cache, check)
    if isinstance(cache, GroupedCache):  # the core's backward sums each group
        if key_is_value:
            raise ValueError(f"key_is_value={key_is_value!r} needs an ungrouped cache "
                             "(enable_gqa=False in the forward), got a grouped one")
        return grouped_backward(attention_backward, dout, cache, check_dout=check, check=False)
    if key_is_value and cache.key is not cache.value:
        raise ValueError(f"key_is_value={key_is_value!r} needs the forward's key and value to "
                         "be one array (the same object, passed as both), got two arrays")
    value, weights = cache.value, cache.weights
    # NOTE: value's leading dims may broadcast beyond the weights' (query, key) ones.
    lead = broadcast_shapes(weights.shape[:-2], value.shape[:-2])
    if check:
        dout = as_upstream_grad(dout, "dout", lead + (weights.shape[-2], value.shape[-1]),
                                weights.dtype)
    grads = _attention_backward(dout, cache, key_is_value)
    if key_is_value == "factors" or all(np.isfinite(g).all() for g in grads if g is not None):
        return grads
    # NOTE: an inf or NaN gradient of finite inputs means that a product
    # overflowed: once more with products that overflow only where the
    # exact result does (qkvnp.ops.overflow); what is still inf is so exactly
    with np.errstate(over="ignore", invalid="ignore"):
        return _attention_backward(dout, cache, key_is_value, careful=True)


def _attention_backward(dout, cache, key_is_value=False, careful=False):
    """:func:`attention_backward` of a ``dout`` already checked and cast.

    ``careful``: every product through :func:`qkvnp.ops.overflow.product`, and the
    softmax backward as ``P dP - P delta`` (no ``inf * 0`` where ``P = 0``).
    """
    query, key, value, weights, scale = cache[:5]
    matmul = product if careful else _product
    # O = P~ V with P~ = P, or P * Z / (1 - p) after dropout: dV = P~^T dO, dP = (dO V^T) * Z / (1 - p)
    kept = weights if cache.dropout_mask is None else dropped_weights(cache)  # P~, (..., T, S)
    if not key_is_value:  # else dV joins dK in one product below
        dvalue = matmul(np.swapaxes(kept, -1, -2), dout)  # (..., S, T) @ (..., T, Dv) -> (..., S, Dv)
    dweights = matmul(dout, np.swapaxes(value, -1, -2))  # (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
    if cache.dropout_mask is not None:
        dweights *= cache.dropout_mask
        dweights *= keep_scale(cache.dropout_p, dweights.dtype)
    if weights.shape != dweights.shape:
        weights = np.broadcast_to(weights, dweights.shape)  # (..., T, S) -> (lead, T, S)
    if careful:  # P dP - P delta: each term finite, unlike dP - delta
        dscores = weights * dweights - weights * np.sum(weights * dweights, axis=-1, keepdims=True)
    else:
        dscores = _softmax_backward(dweights, SoftmaxCache(weights, -1))  # (..., T, S)
    dquery = matmul(dscores, key, scale)  # (..., T, S) @ (..., S, D) -> (..., T, D)
    if key_is_value:  # dX = c dS^T Q + P~^T dO = [c dS; P~]^T [Q; dO] (Notes)
        dscores *= scale
        left = np.concatenate(np.broadcast_arrays(dscores, kept), axis=-2)  # (..., 2T, S)
        right = np.concatenate(np.broadcast_arrays(query, dout), axis=-2)  # (..., 2T, D)
        dquery = sum_to_shape(dquery, query.shape)
        if key_is_value == "factors":
            return dquery, (left, right), None
        dkey = matmul(np.swapaxes(left, -1, -2), right)  # (..., S, 2T) @ (..., 2T, D) -> (..., S, D)
        return dquery, sum_to_shape(dkey, key.shape), None
    dkey = matmul(np.swapaxes(dscores, -1, -2), query, scale)  # (..., S, T) @ (..., T, D) -> (..., S, D)
    return (
        sum_to_shape(dquery, query.shape),
        sum_to_shape(dkey, key.shape),
        sum_to_shape(dvalue, value.shape),
    )


def _product(a, b, factor=1.0):
    """``(a @ b) * factor``; a contraction of length 1 (one query row) as the outer products it is.

    NOTE: numpy's batched matmul takes a slow loop when the contracted axis has
    length 1: (64, 16, 1) @ (64, 1, 64) float32 took 88 us, einsum 18 us (same
    products, no sums).
    """
    out = np.einsum("...ik,...kj->...ij", a, b) if a.shape[-1] == 1 else a @ b
    if factor != 1.0:
        out *= factor  # in place: new arrays, whose allocation costs as much as the multiply
    return out


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


declare_complex_step(linear_forward, softmax_forward, attention_forward)  # see qkvnp._checks.complex_step_mode
