"""A multi-head attention layer with the variants of :mod:`qkvnp.ops.variants`, on the reference ops.

Shape key: B batch (any leading dims), H heads, K key/value heads, T query
length, S key length, E embedding, D = E // H head dim, NB relative buckets.

The layer of :mod:`qkvnp.layers.reference` with four more steps, each one
op of :mod:`qkvnp.functional` / :mod:`qkvnp.ops.variants`: RoPE on each head's
queries and keys after the projections, a position bias (ALiBi's fixed
slopes, or T5's learned ``rel_bias`` looked up by relative bucket) as the
attention's ``score_bias``, the learned ``sinks`` and the soft-cap and window
passed through. :func:`backward` runs the backwards in exact reverse order.
:mod:`qkvnp.layers.variant_decoding` runs such a layer's KV-cache decoding steps.
:func:`split_forward` runs a large batch as the fused layer does, one share
of the first batch dim per worker thread.
"""
from collections import namedtuple

import numpy as np

from .. import functional as F
from .._checks import as_upstream_grad
from ..ops.overflow import check_projection
from ..ops.masks import causal_offset, check_is_causal, prepare_mask
from ..ops.positions import alibi_bias, alibi_slopes, check_max_distance, relative_position_bucket
from ..ops.variants import check_window
from ..kernels import tiled_variants
from ..kernels._runtime import run, split_threads
from .reference import inputs_by_role

__all__ = ["VariantOptions", "VariantLayerCache", "SplitVariantCache", "active_variants",
           "check_options", "position_score_bias", "forward", "split_forward", "backward",
           "POSITION_BIASES"]

#: What a layer's ``position_bias`` may be.
POSITION_BIASES = (None, "alibi", "relative")

VariantOptions = namedtuple("VariantOptions", "rope rope_base rope_layout position_bias "
                                              "num_buckets max_distance sinks softcap window scale")
VariantOptions.__doc__ = """A layer's variant options (the constructor's, checked).

rope : bool; rope_base : float; rope_layout : "half" or "interleaved".
position_bias : None, "alibi" or "relative"; num_buckets, max_distance : T5's bucketing.
sinks : bool (a learned ``sinks`` parameter); softcap : float or None.
window : (left, right) or None.
scale : float or None, the score scale (None: ``1/sqrt(D)``).
"""

VariantLayerCache = namedtuple(
    "VariantLayerCache",
    "kind query_cache key_cache value_cache query_split key_split value_split query_rope "
    "key_rope buckets num_buckets attention_cache merge_cache out_cache out_shape")
VariantLayerCache.__doc__ = """What :func:`backward` reads, as :class:`qkvnp.layers.reference.ReferenceLayerCache`.

query_rope, key_rope : :class:`qkvnp.ops.variants.RopeCache`, or None without RoPE.
buckets : int ndarray (T, S) of the relative buckets, or None without ``rel_bias``.
num_buckets : int, the rows of ``rel_bias`` (or None).
"""


SplitVariantCache = namedtuple("SplitVariantCache", "kind shares caches out_shape")
SplitVariantCache.__doc__ = """What :func:`backward` reads after :func:`split_forward`.

kind : "self", "key_only" or "cross"; shares : slices of the first batch dim;
caches : one :class:`VariantLayerCache` per share.
"""


def active_variants(options):
    """The names of the variants ``options`` turns on, e.g. ``("rope", "softcap")``."""
    if options is None:
        return ()
    names = []
    if options.rope:
        names.append("rope")
    if options.position_bias is not None:
        names.append(f"position_bias={options.position_bias!r}")
    if options.sinks:
        names.append("sinks")
    if options.softcap is not None:
        names.append("softcap")
    if options.window is not None:
        names.append("window")
    if options.scale is not None:
        names.append("scale")
    return tuple(names)


def position_score_bias(params, options, num_heads, T, S, offset, causal, dtype):
    """The position bias ``(H, T, S)`` and the buckets it read (None but for ``rel_bias``).

    ``offset``: query ``i`` stands at ``i + offset``; ``causal``: T5's
    unidirectional buckets. ``(None, None)`` without a position bias.
    """
    if options.position_bias == "alibi":
        return alibi_bias(T, S, alibi_slopes(num_heads), offset).astype(dtype), None
    if options.position_bias == "relative":
        buckets = relative_position_bucket(T, S, options.num_buckets, options.max_distance,
                                           bidirectional=not causal, offset=offset)  # (T, S)
        return np.moveaxis(params["rel_bias"][buckets], -1, 0), buckets  # (T, S, H) -> (H, T, S)
    return None, None


def forward(params, inputs, kind, num_heads, mask, is_causal, options, need_weights=False, *,
            dropout_p=0.0, rng=None, dropout_mask=None, path="reference", out_proj=True):
    """The layer's forward (same arguments as :func:`qkvnp.layers.reference.forward`, plus ``options``).

    ``path="tiled"`` runs the attention core of :mod:`qkvnp.kernels.tiled_variants`
    (ALiBi from its slopes, never a ``(H, T, S)`` bias); the rest is the same ops.
    ``out_proj=False`` is :class:`qkvnp.SelfAttention`: one head (given a head
    axis of 1 here, so that ``sinks (1,)`` and ``rel_bias (NB, 1)`` read as
    for H = 1), no output projection; masks and weights without a head axis.

    Returns
    -------
    out : ndarray, shape (..., T, out_dim)
    weights : ndarray (..., H, T, S) after dropout, or None
    cache : VariantLayerCache
    """
    p = params
    query, key, value = inputs_by_role(inputs, kind)
    T, S = query.shape[-2], key.shape[-2]
    offset = causal_offset(is_causal, T, S) or 0
    causal = check_is_causal(is_causal) is not False
    window = check_window(options.window, is_causal)
    q, q_cache = F.linear_forward(query, p["W_query"], p.get("b_query"))  # (..., T, in) -> (..., T, E)
    k, k_cache = F.linear_forward(key, p["W_key"], p.get("b_key"))  # (..., S, in) -> (..., S, E_kv)
    v, v_cache = F.linear_forward(value, p["W_value"], p.get("b_value"))  # (..., S, in) -> (..., S, E_kv)
    for projected, role in ((q, "query"), (k, "key"), (v, "value")):
        check_projection(projected, role)  # an overflow named as such, not as RoPE's "x"
    num_kv_heads = num_heads * p["W_key"].shape[1] // p["W_query"].shape[1]
    q_heads, q_split = F.split_heads_forward(q, num_heads)  # (..., T, E) -> (..., H, T, D)
    k_heads, k_split = F.split_heads_forward(k, num_kv_heads)  # (..., S, E_kv) -> (..., K, S, D)
    v_heads, v_split = F.split_heads_forward(v, num_kv_heads)  # (..., S, E_kv) -> (..., K, S, D)
    q_rope = k_rope = None
    if options.rope:  # query i stands at i + offset, in is_causal's alignment
        rope = {"base": options.rope_base, "layout": options.rope_layout}
        q_heads, q_rope = F.rope_forward(q_heads, np.arange(T) + offset, **rope)  # (..., H, T, D)
        k_heads, k_rope = F.rope_forward(k_heads, np.arange(S), **rope)  # (..., K, S, D)
    if not out_proj:  # SelfAttention's masks have no head axis: give them one of 1
        mask, dropout_mask = (None if a is None or np.ndim(a) < 3 else np.asarray(a)[..., None, :, :]
                              for a in (mask, dropout_mask))  # (..., T, S) -> (..., 1, T, S)
    dropout = {"dropout_p": dropout_p, "rng": rng, "dropout_mask": dropout_mask}
    if path == "tiled":  # the variants of qkvnp.kernels.TILED_VARIANTS only
        slopes = alibi_slopes(num_heads) if options.position_bias == "alibi" else None
        buckets = None
        heads, attention_cache = tiled_variants.attention_forward(
            q_heads, k_heads, v_heads, mask, is_causal, enable_gqa=num_kv_heads != num_heads,
            alibi_slopes=slopes, softcap=options.softcap, sinks=p.get("sinks"), window=window,
            scale=options.scale, **dropout)  # -> (..., H, T, D)
    else:
        score_bias, buckets = position_score_bias(p, options, num_heads, T, S, offset, causal,
                                                  q.dtype)
        heads, attention_cache = F.attention_forward(
            q_heads, k_heads, v_heads, mask, is_causal, enable_gqa=num_kv_heads != num_heads,
            score_bias=score_bias, softcap=options.softcap, sinks=p.get("sinks"),
            window=window, scale=options.scale, **dropout)  # -> (..., H, T, D)
    merged, merge_cache = F.merge_heads_forward(heads)  # (..., H, T, D) -> (..., T, E)
    out, out_cache = merged, None  # SelfAttention: no output projection
    if out_proj:
        out, out_cache = F.linear_forward(merged, p["W_out"], p.get("b_out"))  # (..., T, E) -> (..., T, out)
    cache = VariantLayerCache(kind, q_cache, k_cache, v_cache, q_split, k_split, v_split, q_rope,
                              k_rope, buckets, options.num_buckets if buckets is not None else None,
                              attention_cache, merge_cache, out_cache, out.shape)
    weights = F.dropped_weights(attention_cache) if need_weights and path != "tiled" else None
    if weights is not None and not out_proj:
        weights = weights[..., 0, :, :]  # (..., 1, T, S) -> (..., T, S)
    return out, weights, cache


def _batch_shares(params, inputs, num_heads, out_proj, need_weights, dropout_p, dropout_mask):
    """Slices of the first batch dim, one per worker thread, or one slice: the whole batch.

    As the fused layer's (:mod:`qkvnp.kernels.mha`): several when the
    forward's operations reach the ``batch_split_flops`` setting, never in
    a worker thread. One slice with dropout (its mask is drawn whole), with
    weights requested, for :class:`qkvnp.SelfAttention`, or when the inputs
    do not all have the same first batch dim.
    """
    query, key = inputs[0], inputs[-1]
    whole = (slice(None),)
    if (not out_proj or need_weights or dropout_p or dropout_mask is not None or query.ndim < 3
            or any(x.ndim != query.ndim or x.shape[0] != query.shape[0] for x in inputs)):
        return whole
    W_query = params["W_query"]
    N, N_kv = query.size // query.shape[-1], key.size // key.shape[-1]  # rows
    T, S, D = query.shape[-2], key.shape[-2], W_query.shape[1] // num_heads
    core = 4 * (N // T) * num_heads * T * S * D
    flops = (2 * N * W_query.size + 2 * N_kv * (params["W_key"].size + params["W_value"].size)
             + core + 2 * N * params["W_out"].size)
    weight = 1.5 if W_query.itemsize == 8 else 1.0  # float64 (see batch_split_flops)
    first = query.shape[0]
    threads = min(split_threads(flops * weight, core * weight), first)
    if threads < 2:
        return whole
    bounds = [first * i // threads for i in range(threads + 1)]
    return tuple(slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))


def split_forward(params, inputs, kind, num_heads, mask, is_causal, options, need_weights=False,
                  *, dropout_p=0.0, rng=None, dropout_mask=None, path="reference", out_proj=True):
    """:func:`forward`, one share of the first batch dim per worker thread when it pays.

    Same arguments and returns as :func:`forward` (the cache a
    :class:`SplitVariantCache` when split). The variants act along T and S
    and per head, never across the batch: each share is the same layer on
    its rows. The mask is checked whole before any work.
    """
    shares = _batch_shares(params, inputs, num_heads, out_proj, need_weights, dropout_p,
                           dropout_mask)
    if len(shares) == 1:
        return forward(params, inputs, kind, num_heads, mask, is_causal, options, need_weights,
                       dropout_p=dropout_p, rng=rng, dropout_mask=dropout_mask, path=path,
                       out_proj=out_proj)
    query = inputs[0]
    T, S = query.shape[-2], inputs[-1].shape[-2]
    scores_shape = query.shape[:-2] + (num_heads, T, S)
    prepare_mask(mask, is_causal, scores_shape, params["W_query"].dtype)  # refuses before work
    sliced = mask is not None and np.ndim(mask) == len(scores_shape) and np.shape(mask)[0] != 1
    results = [None] * len(shares)

    def task(work):
        for i, share in work:
            results[i] = forward(params, tuple(x[share] for x in inputs), kind, num_heads,
                                 np.asarray(mask)[share] if sliced else mask, is_causal, options,
                                 path=path)

    run(task, list(enumerate(shares)))
    out = np.concatenate([result[0] for result in results])  # (B_i, ..., T, out) -> (B, ..., T, out)
    return out, None, SplitVariantCache(kind, shares, tuple(result[2] for result in results),
                                        out.shape)


def backward(dout, cache):
    """Backward of :func:`forward`: the ops' backwards in reverse order.

    Returns
    -------
    grads : dict
        Every parameter the forward used, ``sinks`` and ``rel_bias`` included.
    dinputs : tuple of ndarray
        As :func:`qkvnp.layers.reference.backward`.
    """
    if isinstance(cache, SplitVariantCache):
        return _split_backward(dout, cache)
    c = cache
    dout = as_upstream_grad(dout, "dout", c.out_shape, c.query_cache.W.dtype)
    grads = {}
    dmerged = dout  # SelfAttention: no output projection
    if c.out_cache is not None:
        dmerged, grads["W_out"], grads["b_out"] = F.linear_backward(dout, c.out_cache, check=False)
    dheads = F.merge_heads_backward(dmerged, c.merge_cache, check=False)
    if isinstance(c.attention_cache, tiled_variants.TILED_CACHES):
        dattention = tiled_variants.attention_backward(dheads, c.attention_cache)
    else:
        dattention = F.attention_backward(dheads, c.attention_cache, check=False)
    # (dq, dk, dv), and (dscore_bias, dsinks) when the forward had a variant of its own
    dattention += (None,) * (5 - len(dattention))
    dq_heads, dk_heads, dv_heads, dscore_bias, grads["sinks"] = dattention
    if c.buckets is not None:  # rel_bias[bucket(i, j), h] fed score (h, i, j): a scatter-add
        drel = np.zeros((c.num_buckets, dscore_bias.shape[0]), dscore_bias.dtype)  # (NB, H)
        np.add.at(drel, c.buckets, np.moveaxis(dscore_bias, 0, -1))  # (T, S, H) into (NB, H)
        grads["rel_bias"] = drel
    if c.key_rope is not None:
        dk_heads = F.rope_backward(dk_heads, c.key_rope)
        dq_heads = F.rope_backward(dq_heads, c.query_rope)
    dv = F.split_heads_backward(dv_heads, c.value_split, check=False)
    dk = F.split_heads_backward(dk_heads, c.key_split, check=False)
    dq = F.split_heads_backward(dq_heads, c.query_split, check=False)
    dvalue, grads["W_value"], grads["b_value"] = F.linear_backward(dv, c.value_cache, check=False)
    dkey, grads["W_key"], grads["b_key"] = F.linear_backward(dk, c.key_cache, check=False)
    dquery, grads["W_query"], grads["b_query"] = F.linear_backward(dq, c.query_cache, check=False)
    grads = {name: grad for name, grad in grads.items() if grad is not None}
    if c.kind == "self":
        return grads, (dquery + dkey + dvalue,)  # x feeds query, key and value
    if c.kind == "key_only":
        return grads, (dquery, dkey + dvalue)
    return grads, (dquery, dkey, dvalue)


def _split_backward(dout, cache):
    """:func:`backward` after :func:`split_forward`: each share's in its worker thread."""
    dout = as_upstream_grad(dout, "dout", cache.out_shape, cache.caches[0].query_cache.W.dtype)
    results = [None] * len(cache.shares)

    def task(work):
        for i, share in work:
            results[i] = backward(dout[share], cache.caches[i])

    run(task, list(enumerate(cache.shares)))
    grads = dict(results[0][0])
    for more, _ in results[1:]:  # the parameters' gradients of the shares add up, in order
        for name, grad in more.items():
            grads[name] = grads[name] + grad
    dinputs = tuple(np.concatenate(parts) for parts in zip(*(result[1] for result in results)))
    return grads, dinputs


def check_options(num_heads, head_dim, *, rope=False, rope_base=10000.0, rope_layout="half",
                  position_bias=None, num_buckets=32, max_distance=128, sinks=False,
                  softcap=None, window=None, scale=None):
    """A layer's variant options checked, as :class:`VariantOptions` (None when none is on).

    Raises ``TypeError``/``ValueError`` naming the option: an odd head dim
    with ``rope``, an unknown ``position_bias`` or ``rope_layout``, a bad
    ``softcap`` or ``window``, a ``max_distance`` within ``num_buckets // 2``
    with ``position_bias="relative"`` (its log-spaced buckets need more), a
    ``scale`` that is not a positive finite number (None, or ``1/sqrt(D)``
    itself: the default).
    """
    from .._checks import check_int, check_scale, is_real_number
    from ..ops.variants import ROPE_LAYOUTS, check_softcap

    for name, flag in (("rope", rope), ("sinks", sinks)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r} ({type(flag).__name__})")
    if rope and head_dim % 2:
        raise ValueError(f"rope=True rotates pairs of each head's entries: the head dim "
                         f"embed_dim // num_heads must be even, got {head_dim}")
    if not isinstance(rope_layout, str) or rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {rope_layout!r}")
    if not is_real_number(rope_base) or not (rope_base > 0 and np.isfinite(rope_base)):
        raise ValueError(f"rope_base must be a positive finite number, got {rope_base!r}")
    if position_bias is not None and (not isinstance(position_bias, str)
                                      or position_bias not in POSITION_BIASES):
        raise ValueError(f"position_bias must be one of {POSITION_BIASES}, got {position_bias!r}")
    num_buckets = check_int(num_buckets, "num_buckets", 2)
    max_distance = check_int(max_distance, "max_distance", 1)
    if position_bias == "relative":  # a layer may be called causally: unidirectional buckets
        check_max_distance(num_buckets, max_distance, bidirectional=False,
                           where=" (position_bias='relative': a causal call's buckets)")
    if scale is not None:
        if not is_real_number(scale):
            raise TypeError(f"scale must be None (1/sqrt(head_dim)) or a positive number, got "
                            f"{type(scale).__name__} {scale!r}")
        if not (scale > 0 and np.isfinite(scale)):
            raise ValueError(f"scale must be None (1/sqrt(head_dim)) or a positive finite "
                             f"number, got {scale!r}")
        # NOTE: 1/sqrt(D) given is the default, bit for bit (Gemma's query_pre_attn_scalar
        # is often D): it keeps the fast path, which folds that very number into W_query
        scale = None if float(scale) == check_scale(None, head_dim) else float(scale)
    options = VariantOptions(bool(rope), float(rope_base), rope_layout, position_bias,
                             num_buckets, max_distance, bool(sinks), check_softcap(softcap),
                             check_window(window), scale)
    return options if active_variants(options) else None

