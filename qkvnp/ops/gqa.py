"""Grouped-query and multi-query attention (``enable_gqa=True``) as broadcasting.

Shape key: ``...`` any leading (batch) dims, H query heads, K key/value heads
(``H_kv``), G = H / K query heads per key/value head, T query length, S key
length, D head dim of queries and keys, Dv head dim of values.

Query head ``h`` uses key/value head ``h // G``: PyTorch's
``repeat_interleave`` order (``enable_gqa=True`` of
``F.scaled_dot_product_attention``). No path repeats K and V ``G`` times:
the query's head axis is split into ``(K, G)`` (a view) and the keys and
values get a size-1 group axis, which broadcasting stretches::

    query (..., H, T, D)  -> (..., K, G, T, D)
    key   (..., K, S, D)  -> (..., K, 1, S, D)
    value (..., K, S, Dv) -> (..., K, 1, S, Dv)
    mask  (..., H, T, S)  -> (..., K, G, T, S)   (head axis of 1: (..., 1, 1, T, S))

Every attention core already broadcasts its leading dims and sums the
gradient of a broadcast input over the dims it was stretched along
(:func:`qkvnp.functional.sum_to_shape`): that sum is the backward's sum over
each group, :math:`\\bar K_j = \\sum_{h:\\, h // G = j} \\bar K^{(h)}`
(``docs/derivations.md``).
"""
from collections import namedtuple

import numpy as np

from .._checks import as_upstream_grad

__all__ = ["GroupedCache", "split_groups", "split_head_axis", "split_per_head", "grouped_forward",
           "grouped_backward", "ungroup_weights"]


class GroupedCache(namedtuple("GroupedCache", "inner shapes out_shape grouped_out_shape dtype")):
    """The cache of a grouped-query forward.

    inner : the cache of the core that ran on the grouped (broadcast) arrays.
    shapes : the caller's shapes of query, key and value.
    out_shape : shape of the returned output ``(..., H, T, Dv)``.
    grouped_out_shape : the core's output shape ``(..., K, G, T, Dv)``.
    dtype : the compute dtype.
    weights : ``(..., H, T, S)``, a view of the inner cache's weights (the
        reference's; the fast core's are :func:`qkvnp.kernels.fast.attention_weights`).
    dropout_mask, dropout_p : the inner cache's, the mask with its head axes
        merged back, ``(..., H or 1, T, S)`` (or None).
    """

    __slots__ = ()

    @property
    def weights(self):
        return ungroup_weights(self.inner.weights, self)

    @property
    def dropout_mask(self):
        mask = self.inner.dropout_mask
        if mask is None or mask.ndim < 4:
            return mask
        return mask.reshape(mask.shape[:-4] + (-1,) + mask.shape[-2:])  # (..., K, G, T, S) -> (..., H, T, S)

    @property
    def dropout_p(self):
        return self.inner.dropout_p

_Grouped = namedtuple("_Grouped", "query key value attn_mask shapes num_heads")


def _heads(shape):
    """Head count of an array with a head axis at -3, or None without one."""
    return shape[-3] if len(shape) >= 3 else None


def split_groups(query, key, value, attn_mask, enable_gqa):
    """The grouped arrays of a grouped-query call, or None when none is needed.

    Parameters
    ----------
    query : array_like, shape (..., H, T, D)
    key : array_like, shape (..., K, S, D)
    value : array_like, shape (..., K, S, Dv)
    attn_mask : None or array_like, broadcastable to ``(..., H, T, S)``
    enable_gqa : bool
        False: head counts must broadcast as usual (a single key/value head
        does); a key/value head count that divides the query's raises a
        ``ValueError`` that points to ``enable_gqa=True``.

    Returns
    -------
    None, or a named tuple of the grouped ``query, key, value, attn_mask``
    (views), the callers' ``shapes`` and ``num_heads`` (H).

    Raises
    ------
    TypeError
        If ``enable_gqa`` is not a bool.
    ValueError
        If a key/value head count does not divide the query's, or key and
        value have different head counts that both differ from 1 and H.
    """
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    q_shape, k_shape, v_shape = (np.shape(a) for a in (query, key, value))
    if q_shape[:-2] == k_shape[:-2] == v_shape[:-2]:
        return None  # the same leading dims: nothing to group (the common case, first)
    H = _heads(q_shape)
    if H is None or H == 1:
        return None  # no query head axis to group: plain broadcasting
    counts = {name: _heads(shape) for name, shape in (("key", k_shape), ("value", v_shape))}
    grouped = {name: n for name, n in counts.items() if n not in (None, 1, H)}
    if not grouped:
        return None
    if not enable_gqa:
        name, n = next(iter(grouped.items()))
        hint = (" (pass enable_gqa=True for grouped-query attention: query head h uses "
                f"{name} head h // {H // n})") if H % n == 0 else ""
        raise ValueError(
            f"{name} has {n} heads (axis -3) and query has {H}: they must be equal, or the "
            f"{name} must have 1 head{hint}; got query {q_shape} and {name} "
            f"{k_shape if name == 'key' else v_shape}"
        )
    K = max(grouped.values())
    for name, n in grouped.items():
        if H % n or n != K:
            raise ValueError(
                f"enable_gqa=True needs the key/value head count (axis -3) to divide the "
                f"query's {H} and key and value to agree (or have 1 or {H} heads), got query "
                f"{q_shape}, key {k_shape}, value {v_shape}"
            )
    G = H // K
    mask = None if attn_mask is None else np.asarray(attn_mask)
    if mask is not None and mask.ndim >= 3 and mask.shape[-3] not in (1, H):
        raise ValueError(
            f"attn_mask must broadcast to the scores' shape (..., {H}, T, S) (query heads), "
            f"got shape {mask.shape}"
        )
    return _Grouped(split_head_axis(query, H, K, G), split_head_axis(key, H, K, G),
                    split_head_axis(value, H, K, G),
                    None if mask is None else split_head_axis(mask, H, K, G),
                    (q_shape, k_shape, v_shape), H)


def split_head_axis(x, H, K, G):
    """Give ``x`` the ``(K, G)`` head axes: ``(..., n, L, d) -> (..., K or 1, G or 1, L, d)``."""
    x = np.asarray(x)
    if x.ndim < 3:
        return x  # no head axis: broadcasts over both
    n = x.shape[-3]
    if n == H:
        return x.reshape(x.shape[:-3] + (K, G) + x.shape[-2:])  # (..., H, L, d) -> (..., K, G, L, d)
    if n == K:
        return x[..., None, :, :]  # (..., K, L, d) -> (..., K, 1, L, d)
    return x[..., None, :, :, :]  # (..., 1, L, d) -> (..., 1, 1, L, d)


def split_per_head(x, H, K, G, name):
    """Give a per-head argument (``sinks``, ALiBi's slopes) the ``(K, G)`` head axes.

    Its last axis is the head axis, before which its leading (batch) dims
    stand: ``(..., H) -> (..., K, G)`` and ``(..., 1) -> (..., 1, 1)``, so
    that a batch axis stays a batch axis and does not meet the ``K`` axis of
    the grouped scores ``(..., K, G, T, S)``. A scalar is returned as is.

    Raises
    ------
    ValueError
        If the last axis is neither ``H`` nor 1.

    >>> split_per_head(np.zeros((2, 1)), 4, 2, 2, "sinks").shape
    (2, 1, 1)
    """
    x = np.asarray(x)
    if x.ndim == 0:
        return x
    if x.shape[-1] not in (1, H):
        raise ValueError(f"{name} must have shape ({H},) (one per query head) or broadcast to "
                         f"(..., {H}), got shape {x.shape}")
    heads = (K, G) if x.shape[-1] == H else (1, 1)
    return x.reshape(x.shape[:-1] + heads)  # (..., H) -> (..., K, G); (..., 1) -> (..., 1, 1)


def grouped_forward(core_forward, grouped, is_causal, scale, **options):
    """Run ``core_forward`` on the grouped arrays; merge the head axes of the output.

    ``options`` go to ``core_forward``; a ``dropout_mask`` of ``(..., H, T, S)``
    gets the head axes of the scores.

    Returns
    -------
    out : ndarray, shape (..., H, T, Dv)
    cache : GroupedCache
    """
    drop = options.get("dropout_mask")
    if drop is not None and np.ndim(drop) >= 3:
        H, (K, G) = grouped.num_heads, grouped.query.shape[-4:-2]
        if np.shape(drop)[-3] not in (1, H):
            raise ValueError(f"dropout_mask must broadcast to the weights' shape (..., {H}, T, S) "
                             f"(query heads), got shape {np.shape(drop)}")
        options["dropout_mask"] = split_head_axis(np.asarray(drop), H, K, G)
    out, inner = core_forward(grouped.query, grouped.key, grouped.value, grouped.attn_mask,
                              is_causal, scale, **options)
    out_shape = out.shape[:-4] + (grouped.num_heads,) + out.shape[-2:]
    grouped_out_shape = out.shape
    return (out.reshape(out_shape),  # (..., K, G, T, Dv) -> (..., H, T, Dv)
            GroupedCache(inner, grouped.shapes, out_shape, grouped_out_shape, out.dtype))


def grouped_backward(core_backward, dout, cache, check_dout=True, **options):
    """Backward of :func:`grouped_forward`: the core's, with the caller's shapes.

    ``dout`` is checked against the output's shape ``(..., H, T, Dv)``
    (unless ``check_dout`` is False: a composite's gradient, already
    checked); the core sums the gradients of keys and values over each group
    (they were broadcast along it).
    """
    if check_dout:
        dout = as_upstream_grad(dout, "dout", cache.out_shape, cache.dtype)
    grads = core_backward(dout.reshape(cache.grouped_out_shape), cache.inner, **options)
    # (..., K, G, T, D) -> (..., H, T, D); (..., K, 1, S, D) -> (..., K, S, D)
    return tuple(g.reshape(shape) for g, shape in zip(grads, cache.shapes))


def ungroup_weights(weights, cache):
    """``(..., K, G, T, S)`` weights of a grouped forward as ``(..., H, T, S)``."""
    H = cache.out_shape[-3]
    return weights.reshape(weights.shape[:-4] + (H,) + weights.shape[-2:])
