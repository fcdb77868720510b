"""The fused layer kernels of the fast and tiled paths (``impl="fast"`` and
``"tiled"``): projections, heads and output projection around either core.

Shape key: B batch (``batch`` any leading dims), H heads, T query length,
S key length, E embedding, D = E // H head dim, N = B*T (or B*S) rows,
``in`` the features of an input.

:func:`forward` / :func:`backward` compute what the reference layers of
:mod:`qkvnp.kernels.reference` compute, with the same calling convention:
``forward(params, inputs, kind, num_heads, mask, is_causal, ...) ->
(out, weights, cache)`` and ``backward(dout, cache) -> (grads, dinputs)``.
What they do differently: one fused ``(N, in) @ (in, 3E)`` projection for
self-attention, heads as strided views of it, the core's output written
straight into the merged ``(N, E)`` layout, buffers reused from the previous
call, and the projections split over the same pinned worker threads as the
core (after a multi-threaded OpenBLAS call its idle threads spin and slowed
what followed). The path is chosen by :func:`qkvnp.kernels.choose_path`,
never here.

From ``batch_split_flops`` on (a setting of :mod:`qkvnp.kernels._runtime`)
the fast path splits the first batch dim over the worker threads instead, and
each worker runs the whole layer on its share: its rows of the projections,
its (batch, head) groups of the core, its rows of the output projection; in
the backward also its partial weight gradients, which the caller adds. That
is one hand-off to the threads a forward and one a backward, where splitting
each matmul and core pass cost one per call (a hand-off costs 40-60 us on the
2-core VM): layer fwd+bwd at (64, 33, 64, 1) float32 went from 1.06-1.12x
PyTorch's time to about 0.7x (``benchmarks/RESULTS.md``).
"""
import math
from collections import namedtuple

import numpy as np

from .._checks import as_upstream_grad, owned
from ..dropout import dense_keep, prepare_dropout
from ..functional import column_sums
from ..gqa import split_head_axis
from ..masks import additive_mask, prepare_mask
from . import fast, tiled
from ._runtime import matmul, run, threads_for

__all__ = ["forward", "backward", "FusedLayerCache", "PATHS"]

#: The cores this module runs a layer on.
PATHS = ("fast", "tiled")

FusedLayerCache = namedtuple(
    "FusedLayerCache",
    "path kind rows in_shapes W_in in_names scale core_cache batch T S H merged W_out "
    "out_proj has_bias out_shape buffers has_out_bias H_kv shares",
)
FusedLayerCache.__doc__ = """What :func:`backward` reads.

path : "fast" or "tiled", the core the forward ran.
kind : "self", "key_only" or "cross".
rows : tuple of the 2-D inputs ``(N, in)`` fed to each projection.
in_shapes : tuple of the shapes of those inputs before flattening.
W_in : tuple of the fused projection matrices actually used (the query part
    already multiplied by ``scale``), one per entry of ``rows``.
in_names : tuple, per projection, of the parameter stems it fuses
    (``("query", "key", "value")`` for self-attention).
scale : float folded into the query projection.
core_cache : :class:`qkvnp.kernels.fast.FastAttentionCache` or
    :class:`qkvnp.kernels.tiled.TiledAttentionCache`, over the heads.
batch, T, S, H : leading dims, lengths and head count.
merged : (N, E) attention output with heads merged (input of ``W_out``).
W_out : (E, out_dim) or None.
out_proj : bool, False for SelfAttention (no output projection, no head axis).
has_bias : bool, the input projections have biases.
out_shape : shape of the forward output ``(..., T, out_dim)``.
buffers : dict of the large arrays above by name, offered for reuse to the
    next forward (``workspace=``).
has_out_bias : bool, the output projection has ``b_out`` (the book's layer
    has it without input biases).
H_kv : key/value heads (``H`` but for grouped-query attention, where the
    core ran on ``(..., H_kv, G, T, D)`` queries; see :mod:`qkvnp.gqa`).
shares : list of slices of the first batch dim the forward ran in, one per
    worker thread, or ``[slice(None)]`` (see :func:`_shares`); the backward
    splits the same way.
"""


#: The parameter stems each fused input projection covers, by layer kind.
_GROUPS = {"self": (("query", "key", "value"),),
           "key_only": (("query",), ("key", "value")),
           "cross": (("query",), ("key",), ("value",))}


def _buffer(workspace, name, shape, dtype, buffers):
    """``workspace``'s buffer ``name`` if it has this shape and dtype, else a new one."""
    old = None if workspace is None else workspace.buffers.get(name)
    if old is None or old.shape != shape or old.dtype != dtype:
        old = np.empty(shape, dtype)
    buffers[name] = old
    return old


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
            need_weights=False, out_proj=True, block_size=None, workspace=None, *,
            dropout_p=0.0, rng=None, dropout_mask=None):
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
    workspace : FusedLayerCache, optional
        The cache of a previous forward **that will not be used again**: its
        large buffers (projections, softmax numerators, merged heads) are
        overwritten when their shapes match, which saves allocating and
        page-faulting them on every call (the layers pass their previous
        cache, which they drop first). Input errors (``ValueError``,
        ``TypeError``) are raised before anything is written into it.
    dropout_p, rng, dropout_mask
        Dropout on the attention weights, as in
        :func:`qkvnp.functional.attention_forward` (the same ``rng`` draws
        the same mask on every path).

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

    Notes
    -----
    Same math as the reference layers. For self-attention the three input
    projections run as one ``(N, in) @ (in, 3E)`` product with the matrix
    ``[c W_q, W_k, W_v]`` (``c = 1/sqrt(D)``, so the core gets Q already
    scaled); the matrix is concatenated on every call (``in * 3E`` copies,
    negligible next to the product), so in-place parameter updates are
    always seen. Heads are strided views of the projection output, and the
    core writes its output into the merged ``(N, E)`` layout.
    """
    if path not in PATHS or (path == "tiled" and need_weights):
        raise ValueError(f"path must be one of {PATHS} (fast for weights), got {path!r}")
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
    c = dtype.type(scale)
    has_bias = "b_query" in p
    lead = batch + (H,) if out_proj else batch  # SelfAttention: no head axis
    # NOTE: every check that can refuse the input runs here, before anything
    # is written into ``workspace``, so that a refused call leaves it intact.
    bias, keep = prepare_mask(mask, is_causal, lead + (T, S), dtype)
    # the tiled core draws (or slices) its own mask by blocks: only checked here
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, lead + (T, S), draw=path == "fast")

    def fused(names):
        W = np.concatenate([p["W_" + n] for n in names], axis=1)  # (in, sum of widths)
        b = np.concatenate([p["b_" + n] for n in names]) if has_bias else None
        if names[0] == "query":
            W[:, :E] *= c
            if b is not None:
                b[:E] *= c
        return W, b

    groups = _GROUPS[kind]
    rows, W_in, b_in, y_in, projected, buffers = [], [], [], [], [], {}
    for i, (x, names) in enumerate(zip(inputs, groups)):
        x2d = x.reshape(-1, x.shape[-1])  # (..., L, in) -> (N, in)
        W, b = fused(names)
        y = _buffer(workspace, f"projected{i}", (x2d.shape[0], W.shape[1]), dtype, buffers)
        rows.append(x2d)
        W_in.append(W)
        b_in.append(b)
        y_in.append(y)
        projected.extend(_columns(y, names, widths))  # (N, E) or (N, E_kv) views, filled below
    k = _heads(projected[1], batch, S, H_kv)  # (N, E_kv) -> (..., H_kv, S, D)
    v = _heads(projected[2], batch, S, H_kv)  # (N, E_kv) -> (..., H_kv, S, D)
    merged = _buffer(workspace, "merged", (projected[0].shape[0], E), dtype, buffers)  # (N, E)
    if H_kv != H:  # grouped-query attention: K/V broadcast over each group (qkvnp.gqa)
        G = H // H_kv
        lead = batch + (H_kv, G)
        q = _group_heads(projected[0], batch, T, H_kv, G)  # (N, E) -> (..., H_kv, G, T, D)
        k, v = k[..., None, :, :], v[..., None, :, :]  # (..., H_kv, 1, S, D): broadcast over G
        out_heads = _group_heads(merged, batch, T, H_kv, G)  # (..., H_kv, G, T, D) view of merged
        mask = None if mask is None else split_head_axis(np.asarray(mask), H, H_kv, G)
        if dropout_mask is not None:  # checked against (..., H, T, S) above
            dropout_mask = split_head_axis(np.asarray(dropout_mask), H, H_kv, G)
        bias, keep = (None if m is None else split_head_axis(m, H, H_kv, G) for m in (bias, keep))
    else:
        q = _heads(projected[0], batch, T, H)  # (N, E) -> (..., H, T, D)
        out_heads = _heads(merged, batch, T, H)  # (..., H, T, D) view of merged
    if not out_proj:  # SelfAttention: no head axis in the mask
        q, k, v, out_heads = _unheads(q), _unheads(k), _unheads(v), _unheads(out_heads)
    if out_proj:
        out_dim = p["W_out"].shape[1]
        y = np.empty((merged.shape[0], out_dim), dtype)  # (N, out_dim), the caller's output
    flops = (2 * sum(x2d.shape[0] * x2d.shape[1] * W.shape[1] for x2d, W in zip(rows, W_in))
             + 2 * math.prod(lead) * T * S * (q.shape[-1] + v.shape[-1])
             + (2 * merged.shape[0] * E * out_dim if out_proj else 0))
    shares = _shares(batch, flops, path)

    def project(share):  # the input projections of a share's rows
        for x2d, W, b, y_i in zip(rows, W_in, b_in, y_in):
            r = _share_rows(share, x2d.shape[0], batch)
            matmul(x2d[r], W, y_i[r])  # (n, in) @ (in, widths) -> (n, widths)
            if b is not None:
                y_i[r] += b

    def project_out(share):  # the output projection of a share's rows
        if out_proj:
            r = _share_rows(share, merged.shape[0], batch)
            matmul(merged[r], p["W_out"], y[r])  # (n, E) @ (E, out_dim) -> (n, out_dim)
            if "b_out" in p:
                y[r] += p["b_out"]

    if path == "tiled":
        project(shares[0])  # the tiled core shares its own blocks between the threads
        _, core_cache = tiled.attention_forward(q, k, v, mask, is_causal, scale=1.0,
                                                block_size=block_size, out=out_heads,
                                                dropout_p=dropout_p, rng=rng,
                                                dropout_mask=dropout_mask)
        project_out(shares[0])
        weights = None
    else:
        add = additive_mask(bias, keep, dtype)
        exp_scores = _buffer(workspace, "exp_scores", lead + (T, S), dtype, buffers)
        inv_sum = _buffer(workspace, "inv_sum", lead + (T, 1), dtype, buffers)
        drop_keep, drop_p = (None, 0.0) if dropout is None else (dense_keep(dropout), dropout.p)
        if drop_keep is not None:
            (drop_keep,) = owned((drop_keep,), (dropout_mask,))  # the cache owns what backward reads
        if H_kv != H:  # the dense core reads full leading dims: (..., H_kv, G, S, D) views
            k, v = np.broadcast_to(k, lead + k.shape[-2:]), np.broadcast_to(v, lead + v.shape[-2:])
            drop_keep = None if drop_keep is None else split_head_axis(drop_keep, H, H_kv, G)
        normalized = [False] * len(shares)

        def layer_share(work):  # one worker's share: the whole layer on its batch entries
            for n, share in work:
                project(share)
                normalized[n] = fast.dense_forward(
                    q[share], k[share], v[share], _share_of(add, share, lead), exp_scores[share],
                    inv_sum[share], out_heads[share], _share_of(drop_keep, share, lead), drop_p)
                project_out(share)

        _run_shares(layer_share, shares)
        if not all(normalized):  # a share kept numerators: the others' weights get r = 1
            for share, kept_weights in zip(shares, normalized):
                if kept_weights:
                    inv_sum[share] = 1
        core_cache = fast.FastAttentionCache(q, k, v, exp_scores,
                                             None if all(normalized) else inv_sum, out_heads, 1.0,
                                             (q.shape, k.shape, v.shape), drop_keep, drop_p)
        weights = fast.attention_weights(core_cache) if need_weights else None
        if weights is not None and H_kv != H:
            weights = weights.reshape(batch + (H, T, S))  # (..., H_kv, G, T, S) -> (..., H, T, S)
    if not out_proj:
        y = merged.copy()  # the caller may edit its output; the cache keeps merged
    out = y.reshape(batch + (T, y.shape[-1]))  # (N, out_dim) -> (..., T, out_dim)
    cache = FusedLayerCache(path, kind, tuple(rows), tuple(x.shape for x in inputs),
                            tuple(W_in), groups, scale, core_cache, batch, T, S, H, merged,
                            p["W_out"] if out_proj else None, out_proj, has_bias, out.shape,
                            buffers, "b_out" in p, H_kv, shares)
    return out, weights, cache


def _shares(batch, flops, path):
    """The batch shares a layer call runs in: slices of the first batch dim, or ``[slice(None)]``.

    One share per worker thread when the fast path's forward has at least
    ``batch_split_flops`` operations (:mod:`qkvnp.kernels._runtime`) and
    the first batch dim has an entry per thread; each worker then runs the
    whole layer (projections, core, output projection) on its entries.
    Otherwise one share, the whole call, in the calling thread (the core and
    the projections may still use the threads, each on its own).
    """
    if path != "fast" or not batch or batch[0] < 2:
        return [slice(None)]
    threads = min(threads_for(flops, "batch_split_flops"), batch[0])
    if threads < 2:
        return [slice(None)]
    bounds = [batch[0] * i // threads for i in range(threads + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _share_rows(share, n, batch):
    """The rows of ``(N, ...)`` 2-D rows that a share of the first batch dim covers."""
    if share == slice(None):
        return share
    per = n // batch[0]  # rows per entry of the first batch dim
    return slice(share.start * per, share.stop * per)


def _share_of(a, share, lead):
    """A share of an array broadcastable to ``lead + (T, S)``: sliced if it has the first dim."""
    if a is None or share == slice(None) or a.ndim < len(lead) + 2 or a.shape[0] == 1:
        return a  # broadcasts over the share as over the whole
    return a[share]


def _run_shares(task, shares):
    """``task([(n, share)])`` per share: on the worker threads when there are several."""
    work = list(enumerate(shares))
    if len(work) == 1:
        task(work)
    else:
        run(task, work)


def _columns(y, names, widths):
    """The ``(N, width)`` column views of a fused projection, one per name."""
    views, start = [], 0
    for name in names:
        views.append(y[:, start:start + widths[name]])
        start += widths[name]
    return views


def backward(dout, cache):
    """Backward of :func:`forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, out_dim)
        Same shape as the forward output (it is not broadcast); cast to the
        parameters' dtype.
    cache : FusedLayerCache

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
    c = cache
    batch, T, S, H, merged = c.batch, c.T, c.S, c.H, c.merged
    rows, groups, out_proj, shares = c.rows, c.in_names, c.out_proj, c.shares
    dtype = merged.dtype
    E = merged.shape[1]
    dy = as_upstream_grad(dout, "dout", c.out_shape, dtype)
    dy = dy.reshape(-1, c.out_shape[-1])  # (..., T, out_dim) -> (N, out_dim)
    dmerged = np.empty_like(merged) if out_proj else dy  # (N, E)
    H_kv = c.H_kv
    widths = {"query": E, "key": H_kv * (E // H), "value": H_kv * (E // H)}
    dprojected = [np.empty((x2d.shape[0], sum(widths[n] for n in names)), dtype)
                  for x2d, names in zip(rows, groups)]  # (N, widths) per projection
    dcols = [col for d, names in zip(dprojected, groups) for col in _columns(d, names, widths)]
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
    if not out_proj:
        dq, dk_heads, dv_heads, dheads = (_unheads(dq), _unheads(dk_heads), _unheads(dv_heads),
                                          _unheads(dheads))
    dx2d = [np.empty_like(x2d) for x2d in rows]  # (N, in) per input
    partial = [None] * len(shares)  # each share's own weight gradients, summed below

    def layer_share(work):  # one worker's share: the whole backward on its batch entries
        for n, share in work:
            partial[n] = _backward_share(c, share, dy, dmerged, dheads, dq, dk_heads, dv_heads,
                                         dk, dv, dprojected, dx2d)

    _run_shares(layer_share, shares)
    grads = partial[0]
    for more in partial[1:]:  # the shares' weight gradients add up
        for name, grad in more.items():
            grads[name] += grad
    scale = dtype.type(c.scale)
    for names in groups:  # W' = scale * W_query: dW_query = scale dW'
        if names[0] == "query":
            grads["W_query"] *= scale
            if c.has_bias:
                grads["b_query"] *= scale
    dinputs = tuple(dx.reshape(shape) for dx, shape in zip(dx2d, c.in_shapes))  # (..., L, in)
    return grads, dinputs


def _backward_share(c, share, dy, dmerged, dheads, dq, dk_heads, dv_heads, dk, dv, dprojected,
                    dx2d):
    """The backward of one batch share (:func:`_shares`): writes its rows of ``dmerged``,
    the head gradients, ``dprojected`` and ``dx2d``; returns its weight gradients."""
    batch, groups = c.batch, c.in_names
    grads = {}
    if c.out_proj:
        r = _share_rows(share, dy.shape[0], batch)
        # (E, n) @ (n, out_dim) -> (E, out_dim)
        grads["W_out"] = matmul(c.merged[r].T, dy[r], split="cols")
        if c.has_out_bias:
            grads["b_out"] = column_sums(dy[r])  # (n, out_dim) -> (out_dim,)
        matmul(dy[r], c.W_out.T, dmerged[r])  # (n, out_dim) @ (out_dim, E) -> (n, E)
    if c.path == "tiled":
        tiled.attention_backward(dheads, c.core_cache, grads_out=(dq, dk_heads, dv_heads),
                                 check=False)
    else:
        # gradient w.r.t. the *scaled* query: the scale lives in the fused W
        fast.dense_backward(dheads[share], _share_cache(c.core_cache, share), dq[share],
                            dk_heads[share], dv_heads[share], dq.dtype.type(1))
    if c.H_kv != c.H:  # a key/value head's gradient sums those of its G query heads
        np.sum(dk_heads[share], axis=-3, out=dk[share])  # (..., H_kv, G, S, D) -> (..., H_kv, S, D)
        np.sum(dv_heads[share], axis=-3, out=dv[share])
    E = c.merged.shape[1]
    widths = {"query": E, "key": c.H_kv * (E // c.H), "value": c.H_kv * (E // c.H)}
    for x2d, W, names, d, dx in zip(c.rows, c.W_in, groups, dprojected, dx2d):
        r = _share_rows(share, x2d.shape[0], batch)
        dW = matmul(x2d[r].T, d[r], split="cols")  # (in, n) @ (n, widths) -> (in, widths)
        db = column_sums(d[r]) if c.has_bias else None  # (n, widths) -> (widths,)
        start = 0
        for name in names:
            columns = slice(start, start + widths[name])
            start += widths[name]
            grads["W_" + name] = dW[:, columns]  # views of dW: the layer adds them into its grads
            if db is not None:
                grads["b_" + name] = db[columns]
        matmul(d[r], W.T, dx[r])  # (n, widths) @ (widths, in) -> (n, in)
    return grads


def _share_cache(core_cache, share):
    """The fast core's cache restricted to a batch share (views)."""
    if share == slice(None):
        return core_cache
    lead = core_cache.exp_scores.shape[:-2]
    return core_cache._replace(
        query=core_cache.query[share], key=core_cache.key[share], value=core_cache.value[share],
        exp_scores=core_cache.exp_scores[share],
        inv_sum=None if core_cache.inv_sum is None else core_cache.inv_sum[share],
        out=core_cache.out[share], dropout_mask=_share_of(core_cache.dropout_mask, share, lead))
