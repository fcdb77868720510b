"""The fused layer kernels of the fast and tiled paths (``impl="fast"`` and
``"tiled"``): projections, heads and output projection around either core.

Shape key: B batch (``batch`` any leading dims), H heads, T query length,
S key length, E embedding, D = E // H head dim, N = B*T (or B*S) rows,
``in`` the features of an input.

:func:`forward` / :func:`backward` compute what the reference layers of
:mod:`qkvnp.layers.reference` compute, with the same calling convention:
``forward(params, inputs, kind, num_heads, mask, is_causal, ...) ->
(out, weights, cache)`` and ``backward(dout, cache) -> (grads, dinputs)``.
What they do differently: one fused ``(N, in) @ (in, 3E)`` projection for
self-attention (one product per matrix where the rows are fewer than the
features: :func:`weights_apart`), heads as strided views of it, the core's output written
straight into the merged ``(N, E)`` layout, and the projections split over the same pinned worker threads as the
core (after a multi-threaded OpenBLAS call its idle threads spin and slowed
what followed). The path is chosen by :func:`qkvnp.kernels.choose_path`,
never here.

From ``batch_split_flops`` on (a setting of :mod:`qkvnp.kernels._runtime`)
the fast path splits the first batch dim over the worker threads instead
(:func:`forward` hands the call to :func:`split_forward`): each worker runs
this same forward, then this same backward, on its share of the batch, with
the projections, the core and the output projection all in the worker; the
caller joins the outputs and adds the shares' weight gradients. That is one
hand-off to the threads a forward and one a backward, where splitting each
matmul and core pass costs one each. NOTE: a hand-off costs more than a small
layer's matmul, inside a layer most of all (``benchmarks/NOTES.md``).

At the other end, a self-attention forward whose every step runs on one
thread in whole arrays (:func:`qkvnp.kernels.mha_small.applies`: the book's
and learners' sizes, up to about (8, 16, 32, 4)) is handed to
:mod:`qkvnp.kernels.mha_small` after the split test: the same math with a
fifth of this module's bookkeeping. Its cache, a ``SmallLayerCache``, comes back to
:func:`backward`, which hands it back there.
"""
import math
from collections import namedtuple

import numpy as np

from .._checks import (abs_max, as_upstream_grad, owned, projected_score_bound,
                       scores_may_overflow)
from ..ops.dropout import dense_keep, no_dropout, prepare_dropout
from ..functional import column_sums
from ..ops.gqa import split_head_axis
from ..ops.masks import additive_mask, causal_mask_offset, prepare_mask
from . import fast, mha_small, projections, tiled
from ._runtime import matmul, run, split_threads, threads_for
from .buffers import recycled_empty
from .projections import weights_apart

__all__ = ["forward", "backward", "split_forward", "FusedLayerCache", "SplitLayerCache", "CACHES",
           "PATHS", "ScoresMayOverflow", "projected_score_bound", "weights_apart"]

#: The cores this module runs a layer on.
PATHS = ("fast", "tiled")

FusedLayerCache = namedtuple(
    "FusedLayerCache",
    "path kind rows in_shapes W_in in_names scale core_cache batch T S H merged W_out "
    "out_proj has_bias out_shape has_out_bias H_kv blas_threads",
)
FusedLayerCache.__doc__ = """What :func:`backward` reads.

path : "fast" or "tiled", the core the forward ran.
kind : "self", "key_only" or "cross".
rows : tuple of the 2-D inputs ``(N, in)`` fed to each projection.
in_shapes : tuple of the shapes of those inputs before flattening.
W_in : per entry of ``rows``, the fused projection matrix actually used (the
    query part already multiplied by ``scale``), or, where the forward
    multiplied by the weights apart (:func:`weights_apart`), the tuple of
    copies of the parameters, unscaled (taken at the forward, as ``W_out``).
in_names : tuple, per projection, of the parameter stems it fuses
    (``("query", "key", "value")`` for self-attention).
scale : float, folded into the query projection (applied to the query's
    outputs and gradients where the weights multiplied apart).
core_cache : :class:`qkvnp.kernels.fast.FastAttentionCache` or
    :class:`qkvnp.kernels.tiled.TiledAttentionCache`, over the heads.
batch, T, S, H : leading dims, lengths and head count.
merged : (N, E) attention output with heads merged (input of ``W_out``).
W_out : (E, out_dim) or None, a copy of the parameter taken at the forward.
out_proj : bool, False for SelfAttention (no output projection, no head axis).
has_bias : bool, the input projections have biases.
out_shape : shape of the forward output ``(..., T, out_dim)``.
has_out_bias : bool, the output projection has ``b_out`` (the book's layer
    has it without input biases).
H_kv : key/value heads (``H`` but for grouped-query attention, where the
    core ran on ``(..., H_kv, G, T, D)`` queries; see :mod:`qkvnp.ops.gqa`).
blas_threads : bool, the projections may run on BLAS's own threads (the core
    runs serially both ways; :func:`qkvnp.kernels._runtime.matmul`).
"""


SplitLayerCache = namedtuple("SplitLayerCache", "path kind shares caches out_shape in_shapes")
SplitLayerCache.__doc__ = """What :func:`backward` reads after :func:`split_forward`.

path : "fast". kind : as :class:`FusedLayerCache`'s.
shares : tuple of slices of the first batch dim, one per worker thread.
caches : tuple of the shares' caches (:class:`FusedLayerCache`, or
    :class:`qkvnp.kernels.mha_small.SmallLayerCache` for a share that runs
    there).
out_shape : shape of the whole forward output ``(B, ..., T, out_dim)``.
in_shapes : tuple of the shapes of the whole inputs.
"""


#: Every cache :func:`forward` returns (:class:`qkvnp.kernels.mha_small.SmallLayerCache`
#: for a self-attention layer run serially in whole arrays).
CACHES = (FusedLayerCache, SplitLayerCache, mha_small.SmallLayerCache)


class ScoresMayOverflow(Exception):
    """Raised by :func:`forward` before its core runs: the projections bound the
    scores at or beyond ``sqrt(finfo.max)`` (:func:`qkvnp._checks.scores_may_overflow`).

    :func:`qkvnp.layers.dispatch.layer_forward` then runs the reference path, the only
    one that clips overflowing scores exactly (:func:`qkvnp.kernels.choose_path`
    says so in the dispatch). Nothing has been drawn from the dropout ``rng``
    unless ``dropout_mask`` is set: the mask the batch split drew, which the
    reference must then apply (it is the one it would draw itself).

    Attributes
    ----------
    bound : float
        The bound (:func:`projected_score_bound`), inf or NaN when a
        projection overflowed.
    dropout_mask : ndarray of bool or None
    value_bound : float
        ``max|v|`` of the value projection when it was computed (0.0 if
        not): values from ``sqrt(finfo.max)`` on take the reference path too.
    """

    def __init__(self, bound, dropout_mask=None, value_bound=0.0):
        super().__init__(f"scores may reach {bound:.3g}, values {value_bound:.3g}")
        self.bound = bound
        self.dropout_mask = dropout_mask
        self.value_bound = value_bound


def check_score_bound(whole_query, whole_key, query, key, head_dim, dtype, value=None,
                      values_apart=False):
    """Raise :class:`ScoresMayOverflow` when the projections bound the scores, or the values, at the limit.

    NOTE: first a looser bound, from the whole fused projections that hold
    the queries (``whole_query``) and the keys (``whole_key``), values
    included: contiguous reductions, where the query and key columns are
    strided views. Only a screen at the limit pays for the exact bound from
    ``query`` and ``key``, whose value the dispatch reports (measured
    several times faster: ``benchmarks/NOTES.md``). The same screen
    bounds ``max|value|`` (``D max|y|^2 < sqrt(max)`` gives ``max|y| <
    sqrt(max)``), except with ``values_apart`` (cross attention: the values
    have a projection of their own), which pays for one reduction of them.
    """
    bound = projected_score_bound(whole_query, whole_key, head_dim)
    if values_apart or scores_may_overflow(bound, dtype):
        value_bound = 0.0 if value is None else abs_max(value)
        if scores_may_overflow(bound, dtype):
            bound = projected_score_bound(query, key, head_dim)
        if scores_may_overflow(bound, dtype) or scores_may_overflow(value_bound, dtype):
            # before any draw from rng: the reference draws it
            raise ScoresMayOverflow(bound, value_bound=value_bound)


#: The parameter stems each fused input projection covers, by layer kind.
_GROUPS = {"self": (("query", "key", "value"),),
           "key_only": (("query",), ("key", "value")),
           "cross": (("query",), ("key",), ("value",))}


def _read_weights(params, out_proj):
    """``params`` with ``W_out`` copied: the weights a forward reads by reference.

    NOTE: a backward differentiates the forward as it ran
    (:class:`qkvnp.layers.Layer`): what its cache keeps of the parameters is
    this copy (or the fused matrix made from them), so that an optimizer
    step, ``load_state_dict`` or an in-place write between the forward and
    the backward changes neither. The copy is also what the forward
    multiplies by, so forward and backward see the same weights.
    """
    if not out_proj:
        return params
    read = dict(params)
    read["W_out"] = params["W_out"].copy()
    return read


def _heads(x2d, batch, T, H):
    """View ``(N, H*D)`` rows as heads: ``(N, E) -> (..., H, T, D)``, no copy."""
    E = x2d.shape[-1]
    heads = x2d.reshape(batch + (T, H, E // H))  # (N, E) -> (..., T, H, D)
    return heads.swapaxes(-2, -3)  # (..., T, H, D) -> (..., H, T, D)


def _group_heads(x2d, batch, T, K, G):
    """View ``(N, H*D)`` rows as grouped heads: ``(N, E) -> (..., K, G, T, D)``, no copy."""
    E = x2d.shape[-1]
    heads = x2d.reshape(batch + (T, K, G, E // (K * G)))  # (N, E) -> (..., T, K, G, D)
    return np.moveaxis(heads, -4, -2)  # (..., T, K, G, D) -> (..., K, G, T, D)


def _unheads(x):
    """Drop the head axis of a single-head layer: ``(..., 1, T, D) -> (..., T, D)``."""
    return x[..., 0, :, :]


def forward(params, inputs, kind, num_heads, mask, is_causal, path="fast",
            need_weights=False, out_proj=True, block_size=None, *,
            dropout_p=0.0, rng=None, dropout_mask=None, out=None):
    """Attention layer forward on the fast or tiled core.

    Parameters
    ----------
    params : dict
        ``W_query, W_key, W_value`` (``(in, E)``, ``in`` the width of the
        input each projects), optional ``b_query, b_key, b_value`` (``(E,)``),
        and with ``out_proj`` also ``W_out (E, out_dim)`` (optional ``b_out``).
    inputs : tuple of ndarray
        ``(x,)`` for self-attention (``x`` is ``(..., T, in)``), ``(query, key)``
        for ``kind="key_only"`` (value = key), ``(query, key, value)`` for cross.
    kind : {"self", "key_only", "cross"}
    num_heads : int
    mask : ndarray or None
        bool or float, broadcastable to ``(..., H, T, S)`` (or ``(..., T, S)``
        when ``out_proj`` is False and ``num_heads == 1``).
    is_causal : bool
    path : {"fast", "tiled"}
    need_weights : bool
        Also return the weights ``(..., H, T, S)``; only the fast core has them.
    out_proj : bool
        False for :class:`qkvnp.layers.SelfAttention` (no output projection,
        a single head, no head axis).
    block_size : int, optional
        Passed to the tiled core.
    dropout_p, rng, dropout_mask
        Dropout on the attention weights, as in
        :func:`qkvnp.functional.attention_forward` (the same ``rng`` draws
        the same mask on every path).
    out : ndarray, shape (..., T, out_dim), optional
        C-contiguous, of the parameters' dtype: written with the output and
        returned (the batch split passes each share's rows of the whole output).

    Returns
    -------
    out : ndarray, shape (..., T, out_dim)
        ``out_dim = E`` without ``out_proj``.
    weights : ndarray or None
        After dropout.
    cache : FusedLayerCache

    Raises
    ------
    ValueError
        If ``path`` is not one of :data:`PATHS`, or is "tiled" with
        ``need_weights`` (:func:`qkvnp.kernels.choose_path` never asks that).
    ScoresMayOverflow
        After the projections, before the core and before any draw from
        ``rng``, when they bound the scores at or beyond ``sqrt(finfo.max)``:
        the caller runs the reference path (:func:`qkvnp.layers.dispatch.layer_forward`).

    Notes
    -----
    Same math as the reference layers. For self-attention the three input
    projections run as one ``(N, in) @ (in, 3E)`` product with the matrix
    ``[c W_q, W_k, W_v]`` (``c = 1/sqrt(D)``, so the core gets Q already
    scaled); the matrix is concatenated on every call (``in * 3E`` copies,
    small next to the product's ``N * in * 3E`` from ``N >= in`` rows), so
    in-place parameter updates are always seen. With fewer rows than input
    features the copy would cost more than the product: each matrix then
    multiplies on its own into its columns of the output, and the scale
    multiplies the query's outputs (:func:`weights_apart`). Heads are strided
    views of the projection output, and the core writes its output into the
    merged ``(N, E)`` layout.
    """
    if path not in PATHS or (path == "tiled" and need_weights):
        raise ValueError(f"path must be one of {PATHS} (fast for weights), got {path!r}")
    if path == "fast" and inputs[0].ndim > 2 and inputs[0].shape[0] > 1:
        shares = _batch_shares(params, inputs, num_heads, out_proj)
        if len(shares) > 1:
            return split_forward(shares, params, inputs, kind, num_heads, mask, is_causal,
                                 need_weights, out_proj, dropout_p=dropout_p, rng=rng,
                                 dropout_mask=dropout_mask)
    # NOTE: from here on everything is written into fresh arrays this call
    # owns: nothing of an earlier call's cache is reused, so a late refusal
    # (ScoresMayOverflow, then the reference's ValueError) or another thread's
    # call can change no other cache.
    params = _read_weights(params, out_proj)
    if (kind == "self" and path == "fast" and no_dropout(dropout_p, dropout_mask)
            and mha_small.applies(params, inputs[0], num_heads, out_proj)):
        result = mha_small.forward(params, inputs[0], num_heads, mask, is_causal, need_weights,
                                   out_proj, out, check_score_bound)
        if result is not None:  # None: the whole-array core refused its bounds
            return result
    p = params
    query = inputs[0]
    batch, T = query.shape[:-2], query.shape[-2]
    S = inputs[1].shape[-2] if kind != "self" else T
    E, E_kv = p["W_query"].shape[1], p["W_key"].shape[1]
    H = num_heads
    D = E // H
    H_kv = E_kv // D  # < H: grouped-query attention (W_key, W_value have H_kv heads)
    widths = {"query": E, "key": E_kv, "value": E_kv}
    scale = 1.0 / math.sqrt(D)
    dtype = p["W_query"].dtype
    lead = batch + (H,) if out_proj else batch  # SelfAttention: no head axis
    # NOTE: every check that can refuse the input runs here, before any work.
    # NOTE: the tiled core tests its blocks against the diagonal itself: no (T, S) causal mask
    bias, keep = prepare_mask(mask, is_causal if path != "tiled" else False, lead + (T, S), dtype)
    # only checked here: a drawn mask is drawn after the score bound below
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, lead + (T, S), draw=False)
    groups = _GROUPS[kind]
    # NOTE: the projections go to BLAS's own threads only where the core runs
    # serially, forward and backward (its backward, the larger pass, below the
    # pool's threshold): their spinning threads slowed a pooled core
    blas = path == "fast" and threads_for(4 * math.prod(lead) * T * S * (2 * D + 1)) == 1
    rows, W_in, fused_outputs, projected = projections.project_inputs(
        p, inputs, groups, widths, dtype.type(scale), blas)
    keys_output = next(y for y, names in zip(fused_outputs, groups) if "key" in names)
    check_score_bound(fused_outputs[0], keys_output, projected[0], projected[1], D, dtype,
                      projected[2], values_apart=kind == "cross")
    if path == "fast" and dropout is not None and dropout.mask is None:
        # the tiled core draws its own mask by blocks
        dropout = prepare_dropout(dropout_p, rng, None, lead + (T, S))
    merged = np.empty((projected[0].shape[0], E), dtype)  # (N, E)
    heads = _head_views(projected, merged, batch, T, S, H, H_kv, out_proj,
                        (mask, dropout_mask, bias, keep))
    if path == "tiled":
        _, core_cache = tiled.attention_forward(heads.q, heads.k, heads.v, heads.mask, is_causal,
                                                scale=1.0, block_size=block_size,
                                                out=heads.out, dropout_p=dropout_p, rng=rng,
                                                dropout_mask=heads.dropout_mask)
        weights = None
    else:
        core_cache, weights = _dense_core(heads, dropout, need_weights, H, dtype)
        if weights is not None and H_kv != H:
            weights = weights.reshape(batch + (H, T, S))  # (..., H_kv, G, T, S) -> (..., H, T, S)
    out = mha_small.project_output(merged, p, out_proj, out, batch + (T,),
                                   lambda a, b, y: matmul(a, b, y, blas_threads=blas))
    cache = FusedLayerCache(path, kind, tuple(rows), tuple(x.shape for x in inputs),
                            tuple(W_in), groups, scale, core_cache, batch, T, S, H, merged,
                            p["W_out"] if out_proj else None, out_proj, "b_query" in p, out.shape,
                            "b_out" in p, H_kv, blas)
    return out, weights, cache


_HeadViews = namedtuple("_HeadViews", "q k v out lead mask dropout_mask bias keep G")
_HeadViews.__doc__ = """The core's operands as head views of the projections (:func:`_head_views`).

q, k, v, out : views of the projected columns and of ``merged``.
lead : the core's leading dims; mask, dropout_mask, bias, keep : split per group
    under grouped-query attention; G : queries per key/value head (1 without it).
"""


def _head_views(projected, merged, batch, T, S, H, H_kv, out_proj, masks):
    """View the projected ``(N, width)`` columns and ``merged`` as the core's heads, no copy.

    ``(..., H, T, D)``; ``(..., H_kv, G, T, D)`` queries over ``(..., H_kv, 1, S, D)``
    keys and values under grouped-query attention (:mod:`qkvnp.ops.gqa`, its
    ``masks = (mask, dropout_mask, bias, keep)`` split alike); no head axis
    without ``out_proj``.
    """
    mask, dropout_mask, bias, keep = masks
    k = _heads(projected[1], batch, S, H_kv)  # (N, E_kv) -> (..., H_kv, S, D)
    v = _heads(projected[2], batch, S, H_kv)  # (N, E_kv) -> (..., H_kv, S, D)
    G = H // H_kv
    if H_kv != H:  # grouped-query attention: K/V broadcast over each group (qkvnp.ops.gqa)
        lead = batch + (H_kv, G)
        q = _group_heads(projected[0], batch, T, H_kv, G)  # (N, E) -> (..., H_kv, G, T, D)
        k, v = k[..., None, :, :], v[..., None, :, :]  # (..., H_kv, 1, S, D): broadcast over G
        out_heads = _group_heads(merged, batch, T, H_kv, G)  # (..., H_kv, G, T, D) view of merged
        mask = None if mask is None else split_head_axis(np.asarray(mask), H, H_kv, G)
        if dropout_mask is not None:  # checked against (..., H, T, S) above
            dropout_mask = split_head_axis(np.asarray(dropout_mask), H, H_kv, G)
        bias, keep = (None if m is None else split_head_axis(m, H, H_kv, G) for m in (bias, keep))
    else:
        lead = batch + (H,) if out_proj else batch
        q = _heads(projected[0], batch, T, H)  # (N, E) -> (..., H, T, D)
        out_heads = _heads(merged, batch, T, H)  # (..., H, T, D) view of merged
    if not out_proj:  # SelfAttention: no head axis in the mask
        q, k, v, out_heads = _unheads(q), _unheads(k), _unheads(v), _unheads(out_heads)
    return _HeadViews(q, k, v, out_heads, lead, mask, dropout_mask, bias, keep, G)


def _dense_core(heads, dropout, need_weights, H, dtype):
    """The fast core on the head views, its output written into ``heads.out``.

    Returns ``(core_cache, weights)``: a :class:`qkvnp.kernels.fast.FastAttentionCache`
    and the weights ``(..., T, S)`` (``(..., H_kv, G, T, S)`` under grouped-query
    attention) or None.
    """
    q, k, v, out_heads, lead = heads.q, heads.k, heads.v, heads.out, heads.lead
    T, S = q.shape[-2], k.shape[-2]
    add = additive_mask(heads.bias, heads.keep, dtype)
    exp_scores = recycled_empty(lead + (T, S), dtype)  # a pool's buffer no array refers to
    inv_sum = np.empty(lead + (T, 1), dtype)
    drop_keep, drop_p = (None, 0.0) if dropout is None else (dense_keep(dropout), dropout.p)
    if drop_keep is not None:
        # the cache owns what backward reads
        (drop_keep,) = owned((drop_keep,), (heads.dropout_mask,))
    if heads.G != 1:  # the dense core reads full leading dims: (..., H_kv, G, S, D) views
        k, v = np.broadcast_to(k, lead + k.shape[-2:]), np.broadcast_to(v, lead + v.shape[-2:])
        H_kv = H // heads.G
        drop_keep = None if drop_keep is None else split_head_axis(drop_keep, H, H_kv, heads.G)
    normalized, chunk_rows = fast.dense_forward(q, k, v, add, exp_scores, inv_sum, out_heads,
                                                drop_keep, drop_p)
    core_cache = fast.FastAttentionCache(q, k, v, exp_scores,
                                         None if normalized else inv_sum, out_heads, 1.0,
                                         (q.shape, k.shape, v.shape), drop_keep, drop_p,
                                         causal_mask_offset(add, dtype), chunk_rows)
    weights = fast.attention_weights(core_cache) if need_weights else None
    return core_cache, weights


def backward(dout, cache, dinputs_out=None, check=True):
    """Backward of :func:`forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, out_dim)
        Same shape as the forward output (it is not broadcast); cast to the
        parameters' dtype.
    cache : FusedLayerCache
    dinputs_out : tuple of ndarray, optional
        One C-contiguous array per input, of its shape and the parameters'
        dtype: written with the input gradients and returned (the batch
        split passes each share's rows of the whole gradients).
    check : bool
        False: ``dout`` is already checked and of the parameters' dtype (a
        share of the batch split, whose caller checked the whole ``dout``).

    Returns
    -------
    grads : dict
        Gradient of every parameter the forward used (``W_*``, ``b_*``).
    dinputs : tuple of ndarray
        Gradient of each entry of the forward's ``inputs``.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
        This is the only check of ``dout`` on the layers' fast and tiled
        paths: the layers pass theirs straight here.
    """
    if isinstance(cache, SplitLayerCache):
        return _split_backward(dout, cache)
    if isinstance(cache, mha_small.SmallLayerCache):
        return mha_small.backward(dout, cache, dinputs_out, check)
    c = cache
    dtype = c.merged.dtype
    E = c.merged.shape[1]
    dy = as_upstream_grad(dout, "dout", c.out_shape, dtype) if check else dout
    dy = dy.reshape(-1, c.out_shape[-1])  # (..., T, out_dim) -> (N, out_dim)
    grads = {}
    if c.out_proj:
        # in the forward this was: out = merged @ W_out + b_out
        # (E, N) @ (N, out_dim) -> (E, out_dim)
        grads["W_out"] = matmul(c.merged.T, dy, split="cols", blas_threads=c.blas_threads)
        if c.has_out_bias:
            grads["b_out"] = column_sums(dy)  # (N, out_dim) -> (out_dim,)
        dmerged = matmul(dy, c.W_out.T, blas_threads=c.blas_threads)  # (N, out_dim) @ (out_dim, E)
    else:
        dmerged = dy
    widths = {"query": E, "key": c.H_kv * (E // c.H), "value": c.H_kv * (E // c.H)}
    dprojected = [np.empty((x2d.shape[0], sum(widths[n] for n in names)), dtype)
                  for x2d, names in zip(c.rows, c.in_names)]  # (N, widths) per projection
    dcols = [col for d, names in zip(dprojected, c.in_names)
             for col in projections.column_views(d, names, widths)]  # query, key, value
    _core_backward(c, dmerged, dcols)
    dinputs = []
    for x2d, shape, W, names, d in zip(c.rows, c.in_shapes, c.W_in, c.in_names, dprojected):
        dx = None if dinputs_out is None else dinputs_out[len(dinputs)].reshape(x2d.shape)
        # the forward's weights apart (weights_apart) or fused
        step = projections.backward_apart if isinstance(W, tuple) else projections.backward_fused
        dx = step(x2d, W, names, d, widths, dtype.type(c.scale), c, grads, dx)
        dinputs.append(dx.reshape(shape))  # (N, in) -> (..., L, in)
    return grads, tuple(dinputs)


def _core_backward(c, dmerged, dcols):
    """The core's backward from ``dmerged`` (N, E) into ``dcols``, the ``(N, width)``
    query, key and value columns of the projections' gradients (the query's is the
    gradient of the *scaled* query: the scale lives in the projection)."""
    batch, T, S, H, H_kv = c.batch, c.T, c.S, c.H, c.H_kv
    dtype = dmerged.dtype
    dk = _heads(dcols[1], batch, S, H_kv)  # (N, E_kv) -> (..., H_kv, S, D)
    dv = _heads(dcols[2], batch, S, H_kv)  # (N, E_kv) -> (..., H_kv, S, D)
    if H_kv != H:  # grouped-query attention: the core gives each query head's dK, dV
        G = H // H_kv
        dq = _group_heads(dcols[0], batch, T, H_kv, G)  # (N, E) -> (..., H_kv, G, T, D)
        dheads = _group_heads(dmerged, batch, T, H_kv, G)  # (N, E) -> (..., H_kv, G, T, D)
        dk_heads = np.empty(batch + (H_kv, G) + dk.shape[-2:], dtype)  # (..., H_kv, G, S, D)
        dv_heads = np.empty(batch + (H_kv, G) + dv.shape[-2:], dtype)  # (..., H_kv, G, S, D)
    else:
        dq = _heads(dcols[0], batch, T, H)  # (N, E) -> (..., H, T, D)
        dheads = _heads(dmerged, batch, T, H)  # (N, E) -> (..., H, T, D)
        dk_heads, dv_heads = dk, dv
    if not c.out_proj:
        dq, dk_heads, dv_heads, dheads = (_unheads(dq), _unheads(dk_heads), _unheads(dv_heads),
                                          _unheads(dheads))
    if c.path == "tiled":
        tiled.attention_backward(dheads, c.core_cache, grads_out=(dq, dk_heads, dv_heads),
                                 check=False)
    else:
        fast.dense_backward(dheads, c.core_cache, dq, dk_heads, dv_heads, dtype.type(1))
    if H_kv != H:  # a key/value head's gradient sums those of its G query heads
        np.sum(dk_heads, axis=-3, out=dk)  # (..., H_kv, G, S, D) -> (..., H_kv, S, D)
        np.sum(dv_heads, axis=-3, out=dv)


def _batch_shares(params, inputs, num_heads, out_proj):
    """Slices of the first batch dim, one per worker thread, or one slice: the whole batch.

    Several when the forward's operations (projections, core, output
    projection; a float64 operation counts 1.5 times, see the setting) reach
    the ``batch_split_flops`` setting of
    :mod:`qkvnp.kernels._runtime`, and never in a worker thread.
    """
    query, key = inputs[0], inputs[-1]
    W_query, W_key = params["W_query"], params["W_key"]
    N, N_kv = query.size // query.shape[-1], key.size // key.shape[-1]  # rows
    E = W_query.shape[1]
    H = num_heads if out_proj else 1
    D = E // num_heads if out_proj else E
    T, S = query.shape[-2], key.shape[-2]
    core = 4 * (N // T) * H * T * S * D
    flops = (2 * N * W_query.size + 2 * N_kv * (W_key.size + params["W_value"].size)
             + core + (2 * N * params["W_out"].size if out_proj else 0))
    first = query.shape[0]
    weight = 1.5 if W_query.itemsize == 8 else 1.0  # float64 (see batch_split_flops)
    threads = min(split_threads(flops * weight, core * weight), first)
    bounds = [first * i // threads for i in range(threads + 1)]
    return tuple(slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))


def _share_of(a, share, full_ndim):
    """A share of an array that broadcasts to ``full_ndim`` dims: sliced if it has the first."""
    if a is None or np.ndim(a) < full_ndim or np.shape(a)[0] == 1:
        return a  # broadcasts over the share as over the whole batch
    return np.asarray(a)[share]


def split_forward(shares, params, inputs, kind, num_heads, mask, is_causal, need_weights=False,
                  out_proj=True, *, dropout_p=0.0, rng=None, dropout_mask=None):
    """:func:`forward` on the fast path, one share of the first batch dim per worker thread.

    Same arguments as :func:`forward` (``path="fast"``), and ``shares``, the
    slices of the first batch dim. The masks are checked whole, before any
    work; a drawn dropout mask is drawn whole (the same one an unsplit call
    draws from the same ``rng``) and each share replays its part. Returns
    ``(out, weights, cache)`` with a :class:`SplitLayerCache`.
    """
    query = inputs[0]
    batch, T, S = query.shape[:-2], query.shape[-2], inputs[-1].shape[-2]
    dtype = params["W_query"].dtype
    scores_shape = batch + ((num_heads,) if out_proj else ()) + (T, S)
    prepare_mask(mask, is_causal, scores_shape, dtype)  # refuses a bad mask before any work
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, scores_shape)
    if dropout is not None and dropout_mask is None:
        dropout_mask = dense_keep(dropout)  # drawn once, for the whole batch
    full_ndim = len(scores_shape)
    results = [None] * len(shares)
    out_dim = (params["W_out"] if out_proj else params["W_query"]).shape[1]
    out = np.empty(batch + (T, out_dim), dtype)  # each share writes its rows: no concatenation

    def task(work):
        for i, share in work:
            results[i] = forward(params, tuple(x[share] for x in inputs), kind, num_heads,
                                 _share_of(mask, share, full_ndim), is_causal, "fast",
                                 need_weights, out_proj,
                                 dropout_p=dropout_p if dropout is not None else 0.0,
                                 dropout_mask=_share_of(dropout_mask, share, full_ndim),
                                 out=out[share])

    try:
        run(task, list(enumerate(shares)))
    except ScoresMayOverflow as overflow:  # the reference must apply the mask drawn above
        raise ScoresMayOverflow(overflow.bound, dropout_mask, overflow.value_bound) from None
    weights = np.concatenate([result[1] for result in results]) if need_weights else None
    caches = tuple(result[2] for result in results)
    return out, weights, SplitLayerCache("fast", kind, shares, caches, out.shape,
                                         tuple(x.shape for x in inputs))


def _split_backward(dout, cache):
    """:func:`backward` after :func:`split_forward`: each share's in its worker thread."""
    dtype = cache.caches[0].merged.dtype
    dy = as_upstream_grad(dout, "dout", cache.out_shape, dtype)  # (B, ..., T, out_dim)
    results = [None] * len(cache.shares)
    dinputs = tuple(np.empty(shape, dtype) for shape in cache.in_shapes)

    def task(work):
        for i, share in work:
            results[i] = backward(dy[share], cache.caches[i], tuple(d[share] for d in dinputs),
                                  check=False)  # dy is checked: once, whole

    run(task, list(enumerate(cache.shares)))
    grads = results[0][0]
    for more, _ in results[1:]:  # the weight gradients of the shares add up
        for name, grad in more.items():
            grads[name] += grad
    return grads, dinputs  # each share wrote its rows
