"""The layers' math on the reference ops (``impl="reference"``), line for line.

Shape key: B batch (any leading dims), H heads, T query length, S key length,
E embedding, D = E // H head dim, ``in`` the features of an input.

The readable oracle of the layer kernels: every step is one op of
:mod:`qkvnp.functional`, and :func:`backward` calls the ops' backwards in
exact reverse order of :func:`forward`, one line for one line. Same calling
convention as :mod:`qkvnp.kernels.mha`: ``forward(params, inputs, kind,
num_heads, mask, is_causal, need_weights, out_proj) -> (out, weights, cache)``
and ``backward(dout, cache) -> (grads, dinputs)``.

``kind`` says which inputs fed which projection: ``"self"`` (``inputs =
(x,)`` feeds query, key and value), ``"key_only"`` (``(query, key)``, the key
input feeds key and value) or ``"cross"`` (``(query, key, value)``).
``out_proj=False`` is :class:`qkvnp.SelfAttention`: one head, no head axis,
no output projection.
"""
from collections import namedtuple

from .._checks import as_upstream_grad
from ..ops.overflow import check_projection
from .. import functional as F

__all__ = ["forward", "backward", "ReferenceLayerCache", "inputs_by_role"]

ReferenceLayerCache = namedtuple(
    "ReferenceLayerCache",
    "kind query_cache key_cache value_cache query_split key_split value_split "
    "attention_cache merge_cache out_cache out_shape",
)
ReferenceLayerCache.__doc__ = """What :func:`backward` reads: the caches of every op, by name.

kind : "self", "key_only" or "cross".
query_cache, key_cache, value_cache : :class:`qkvnp.functional.LinearCache`
    of the three input projections.
query_split, key_split, value_split : :class:`qkvnp.functional.HeadsCache`,
    or None without an output projection (a single head, no head axis).
attention_cache : :class:`qkvnp.functional.AttentionCache`.
merge_cache : :class:`qkvnp.functional.HeadsCache` or None.
out_cache : :class:`qkvnp.functional.LinearCache` of ``W_out``, or None.
out_shape : shape of the forward output.
"""


def inputs_by_role(inputs, kind):
    """``(query, key, value)`` inputs from the ``inputs`` tuple of ``kind``."""
    if kind == "self":
        return inputs[0], inputs[0], inputs[0]
    if kind == "key_only":
        return inputs[0], inputs[1], inputs[1]
    return inputs


def forward(params, inputs, kind, num_heads, mask, is_causal, need_weights=False, out_proj=True, *,
            dropout_p=0.0, rng=None, dropout_mask=None):
    """Attention layer forward on :mod:`qkvnp.functional`.

    Parameters
    ----------
    params : dict
        ``W_query, W_key, W_value`` ``(in, E)``, optional ``b_*`` ``(E,)``, and
        with ``out_proj`` also ``W_out (E, out_dim)`` (optional ``b_out``). ``W_key``
        and ``W_value`` of ``E_kv = H_kv * D < E`` columns (and ``b_key``,
        ``b_value`` of ``(E_kv,)``): grouped-query attention with ``H_kv``
        key/value heads.
    inputs : tuple of ndarray
        ``(x,)``, ``(query, key)`` or ``(query, key, value)`` by ``kind``,
        already cast to the parameters' dtype.
    kind : {"self", "key_only", "cross"}
    num_heads : int
    mask : ndarray or None
        bool (True = may attend) or float (added), broadcastable to the scores.
    is_causal : bool or "bottom_right"
    need_weights : bool
        Also return the attention weights ``(..., H, T, S)`` (``(..., T, S)``
        without ``out_proj``).
    out_proj : bool
    dropout_p, rng, dropout_mask
        Dropout on the attention weights, as in
        :func:`qkvnp.functional.attention_forward`.

    Returns
    -------
    out : ndarray, shape (..., T, out_dim)
    weights : ndarray or None
        After dropout.
    cache : ReferenceLayerCache
    """
    dropout = {"dropout_p": dropout_p, "rng": rng, "dropout_mask": dropout_mask}
    p = params
    query, key, value = inputs_by_role(inputs, kind)
    q, q_cache = F.linear_forward(query, p["W_query"], p.get("b_query"))  # (..., T, in) -> (..., T, E)
    k, k_cache = F.linear_forward(key, p["W_key"], p.get("b_key"))  # (..., S, in) -> (..., S, E)
    v, v_cache = F.linear_forward(value, p["W_value"], p.get("b_value"))  # (..., S, in) -> (..., S, E)
    for projected, role in ((q, "query"), (k, "key"), (v, "value")):
        check_projection(projected, role)  # an overflow named as such, not as a bad "query"
    if not out_proj:  # SelfAttention: one head, no head axis, no output projection
        out, attention_cache = F.attention_forward(q, k, v, mask, is_causal, **dropout)  # -> (..., T, E)
        cache = ReferenceLayerCache(kind, q_cache, k_cache, v_cache, None, None, None,
                                    attention_cache, None, None, out.shape)
        return out, F.dropped_weights(attention_cache) if need_weights else None, cache
    # grouped-query attention: W_key, W_value project to H_kv = E_kv / D heads
    num_kv_heads = num_heads * p["W_key"].shape[1] // p["W_query"].shape[1]
    q_heads, q_split = F.split_heads_forward(q, num_heads)  # (..., T, E) -> (..., H, T, D)
    k_heads, k_split = F.split_heads_forward(k, num_kv_heads)  # (..., S, E_kv) -> (..., H_kv, S, D)
    v_heads, v_split = F.split_heads_forward(v, num_kv_heads)  # (..., S, E_kv) -> (..., H_kv, S, D)
    # NOTE: the scale is 1/sqrt(head_dim). Popular attention tutorials divide by
    # sqrt(embed_size), a known bug that over-smooths the softmax.
    heads, attention_cache = F.attention_forward(q_heads, k_heads, v_heads, mask, is_causal,
                                                 enable_gqa=num_kv_heads != num_heads,
                                                 **dropout)  # -> (..., H, T, D)
    merged, merge_cache = F.merge_heads_forward(heads)  # (..., H, T, D) -> (..., T, E)
    out, out_cache = F.linear_forward(merged, p["W_out"], p.get("b_out"))  # (..., T, E) -> (..., T, E)
    cache = ReferenceLayerCache(kind, q_cache, k_cache, v_cache, q_split, k_split, v_split,
                                attention_cache, merge_cache, out_cache, out.shape)
    return out, F.dropped_weights(attention_cache) if need_weights else None, cache


def backward(dout, cache):
    """Backward of :func:`forward`: the ops' backwards in reverse order.

    Parameters
    ----------
    dout : ndarray, shape (..., T, out_dim)
        Same shape as the forward output (not broadcast); cast to the
        parameters' dtype. Checked here once; the ops below get
        ``check=False`` for the gradients computed from it.
    cache : ReferenceLayerCache

    Returns
    -------
    grads : dict
        Gradient of every parameter the forward used (``W_*``, and ``b_*``
        when the forward had biases).
    dinputs : tuple of ndarray
        Gradient of each entry of the forward's ``inputs``: an input that fed
        several projections gets the sum of their gradients.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` has another shape or holds NaN or inf.
    """
    c = cache
    dout = as_upstream_grad(dout, "dout", c.out_shape, c.attention_cache.weights.dtype)
    grads = {}
    if c.out_cache is None:  # SelfAttention
        dq, dk, dv = F.attention_backward(dout, c.attention_cache, check=False)
    else:
        dmerged, grads["W_out"], grads["b_out"] = F.linear_backward(dout, c.out_cache, check=False)
        dheads = F.merge_heads_backward(dmerged, c.merge_cache, check=False)
        dq_heads, dk_heads, dv_heads = F.attention_backward(dheads, c.attention_cache, check=False)
        dv = F.split_heads_backward(dv_heads, c.value_split, check=False)
        dk = F.split_heads_backward(dk_heads, c.key_split, check=False)
        dq = F.split_heads_backward(dq_heads, c.query_split, check=False)
    dvalue, grads["W_value"], grads["b_value"] = F.linear_backward(dv, c.value_cache, check=False)
    dkey, grads["W_key"], grads["b_key"] = F.linear_backward(dk, c.key_cache, check=False)
    # NOTE: db_key is 0 in exact arithmetic (q . b_key is the same for every
    # key of a query's row, and softmax ignores a constant added to a row);
    # computed, it is round-off, ~1e-16 of the other gradients. Not forced to 0,
    # so that a gradient check still sees what the backward really computes.
    dquery, grads["W_query"], grads["b_query"] = F.linear_backward(dq, c.query_cache, check=False)
    grads = {name: grad for name, grad in grads.items() if grad is not None}  # no biases: no b_*
    if c.kind == "self":
        return grads, (dquery + dkey + dvalue,)  # x feeds query, key and value
    if c.kind == "key_only":
        return grads, (dquery, dkey + dvalue)  # the key input fed both key and value
    return grads, (dquery, dkey, dvalue)
