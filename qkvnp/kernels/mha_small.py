"""The fused self-attention layer on a problem that runs serially in whole arrays.

Shape key: B batch (``batch`` any leading dims), H heads, T length, E
embedding, D = E // H head dim, N = B*T rows, ``in`` the input's features.

:func:`forward` / :func:`backward` compute what :func:`qkvnp.kernels.mha.forward`
and ``backward`` compute (the same fused ``(N, in) @ (in, 3E)`` projection with
the scale folded into its query part, the same core of
:mod:`qkvnp.kernels.fast_small`, the same score bound), for the case where
every step of a self-attention layer runs in the calling thread on whole
arrays (:func:`applies`): the book's (1, 6, 3, 1), tutorials' (8, 16, 32, 4), the
teacher task's (64, 8, 16, 2). There the general kernel's bookkeeping (a
loop over the fused projections, head views built one by one, the core's
own dispatch between whole arrays, blocks and threads, the projections'
thread choice) cost more than numpy's arithmetic (measured, benchmarks/NOTES.md).
Here the
three heads are one transposed view of the projection, the core is called
directly, and the cache is flat.

:func:`qkvnp.kernels.mha.forward` hands such a call here after its input
checks, and :func:`qkvnp.kernels.mha.backward` hands back a
:class:`SmallLayerCache`; nothing else calls this module.
"""
import math
from collections import namedtuple

import numpy as np

from .._checks import as_upstream_grad
from ..functional import column_sums
from ..ops.masks import additive_mask, causal_factors, prepare_mask
from ._runtime import get_block_sizes, threads_for
from .fast_small import LARGE_SCORES, mask_row_max, small_backward, small_forward

__all__ = ["applies", "forward", "backward", "project_output", "SmallLayerCache"]

SmallLayerCache = namedtuple(
    "SmallLayerCache",
    "path kind x2d in_shape W_in scale q k v weights out_heads merged W_out out_shape has_bias "
    "has_out_bias projected",
)
SmallLayerCache.__doc__ = """What :func:`backward` reads.

path, kind : "fast" and "self", as :class:`qkvnp.kernels.mha.FusedLayerCache`'s.
x2d : (N, in) input rows. in_shape : the input's shape ``(..., T, in)``.
W_in : (in, 3E) the fused ``[c W_query, W_key, W_value]`` the forward used.
scale : float, ``c = 1/sqrt(D)``, folded into the query columns.
q, k, v : (..., H, T, D) views of ``projected`` (``(..., T, D)`` without
    an output projection: SelfAttention has no head axis).
weights : (..., H, T, S) the softmax weights ``P`` (normalised in place).
out_heads : (..., H, T, D) view of ``merged``, the core's output.
merged : (N, E) the heads merged, input of ``W_out``.
W_out : (E, out_dim), or None for SelfAttention (no output projection); the
    forward's copy, not the parameter (:class:`qkvnp.layers.Layer`).
out_shape : shape of the forward output ``(..., T, out_dim)``.
has_bias, has_out_bias : bool, ``b_query/b_key/b_value`` and ``b_out`` exist.
projected : (N, 3E) the fused projection, this forward's own array.
"""


def applies(params, x, num_heads, out_proj):
    """Whether a fast self-attention forward of ``x`` without dropout runs here.

    Keys and values of every head (no grouped-query attention), and every
    step on one thread in whole arrays. Each condition is one the general
    kernel tests on its own, so the two run the same steps: the projections below
    ``blas_thread_flops`` (never on BLAS's threads), the core's backward
    below ``min_parallel_flops`` (never on the worker threads), its scores
    fewer than :data:`qkvnp.kernels.fast_small.LARGE_SCORES` and within
    ``fast_block_bytes`` (whole arrays, weights normalised in place).
    """
    W_query = params["W_query"]
    N, E = x.size // x.shape[-1], W_query.shape[1]
    T = x.shape[-2]
    H = num_heads if out_proj else 1
    scores = (N // T if T else 0) * H * T * T
    sizes = get_block_sizes()
    return (params["W_key"].shape[1] == E
            and 2 * N * x.shape[-1] * 3 * E < sizes["blas_thread_flops"]
            and scores < LARGE_SCORES and scores * W_query.itemsize <= sizes["fast_block_bytes"]
            and threads_for(4 * scores * (2 * (E // num_heads) + 1)) == 1)  # as mha's `blas`


def _head_views(rows, batch, T, H, parts, out_proj):
    """``(N, parts*E)`` rows as ``parts`` head arrays ``(..., H, T, D)`` (``(..., T, E)``
    without ``out_proj``), views with no copy."""
    n = len(batch)
    if not out_proj:  # (N, parts*E) -> (..., T, parts, E) -> (parts, ..., T, E)
        heads = rows.reshape(batch + (T, parts, -1))
        return heads.transpose((n + 1,) + tuple(range(n)) + (n, n + 2))
    # (N, parts*E) -> (..., T, parts, H, D) -> (parts, ..., H, T, D)
    heads = rows.reshape(batch + (T, parts, H, -1))
    return heads.transpose((n + 1,) + tuple(range(n)) + (n + 2, n, n + 3))


def forward(params, x, num_heads, mask, is_causal, need_weights, out_proj, out, check_bound):
    """Self-attention forward on one thread: ``(out, weights, SmallLayerCache)``, or None.

    Parameters
    ----------
    params, num_heads, mask, is_causal, need_weights, out_proj, out
        As :func:`qkvnp.kernels.mha.forward`'s (``params["W_out"]`` the
        forward's copy, kept by the cache).
    x : ndarray, shape (..., T, in)
        Checked by the layer.
    check_bound : callable
        :func:`qkvnp.kernels.mha.check_score_bound`, which raises
        :class:`qkvnp.kernels.mha.ScoresMayOverflow` when the scores of the
        projections may overflow (passed in: this module is ``mha``'s).

    Returns
    -------
    None when the core could not normalise the rows from its bounds (a
    shift far above a row's max): the general kernel then takes the exact
    row max, as the reference does.
    """
    p = params
    batch, T = x.shape[:-2], x.shape[-2]
    W_query = p["W_query"]
    E, dtype = W_query.shape[1], W_query.dtype
    H = num_heads if out_proj else 1
    scale = 1.0 / math.sqrt(E // num_heads)
    scores_shape = batch + (H,) * out_proj + (T, T)  # (..., H, T, S), S = T
    bias, keep = prepare_mask(mask, is_causal, scores_shape, dtype)  # before any work
    x2d = x.reshape(-1, x.shape[-1])  # (..., T, in) -> (N, in)
    W = np.concatenate((W_query, p["W_key"], p["W_value"]), axis=1)  # (in, 3E)
    W[:, :E] *= dtype.type(scale)
    # NOTE: fresh arrays, this call's own (never an earlier cache's buffers)
    projected = x2d @ W  # (N, in) @ (in, 3E) -> (N, 3E)
    merged = np.empty((x2d.shape[0], E), dtype)  # (N, E)
    weights = np.empty(scores_shape, dtype)
    has_bias = "b_query" in p
    if has_bias:
        b = np.concatenate((p["b_query"], p["b_key"], p["b_value"]))  # (3E,)
        b[:E] *= dtype.type(scale)
        projected += b
    q, k, v = _head_views(projected, batch, T, H, 3, out_proj)
    check_bound(projected, projected, q, k, E // num_heads, dtype, v)
    (out_heads,) = _head_views(merged, batch, T, H, 1, out_proj)
    mask = additive_mask(bias, keep, dtype)
    inv_sum = np.empty(weights.shape[:-1] + (1,), dtype)  # (..., H, T, 1)
    if not small_forward(q, k, v, mask, mask_row_max(mask, dtype), weights, inv_sum, out_heads,
                         normalize=True, factors=causal_factors(mask, dtype)):
        return None
    out = project_output(merged, p, out_proj, out, batch + (T,), np.matmul)
    cache = SmallLayerCache("fast", "self", x2d, x.shape, W, scale, q, k, v, weights, out_heads,
                            merged, p["W_out"] if out_proj else None, out.shape, has_bias,
                            "b_out" in p, projected)
    return out, (weights.copy() if need_weights else None), cache


def project_output(merged, params, out_proj, out, lead, product):
    """The layer's output from the merged heads: ``merged @ W_out + b_out``, or ``merged``.

    Parameters
    ----------
    merged : ndarray, shape (N, E)
    params : dict
        ``W_out (E, out_dim)`` and optional ``b_out`` when ``out_proj``.
    out_proj : bool
        False for SelfAttention: the output is a copy of ``merged`` (the
        cache keeps ``merged``, the caller may edit its output).
    out : ndarray, shape (..., T, out_dim), or None
        Written and returned when given (a share's rows of the whole output).
    lead : tuple
        ``(..., T)``, the output's shape before ``out_dim``.
    product : callable
        ``product(a, b, out)`` computes ``a @ b`` into ``out`` (None: a new
        array): ``np.matmul``, or the general kernel's threaded matmul.

    Returns
    -------
    ndarray, shape (..., T, out_dim)
    """
    y = None if out is None else out.reshape(-1, out.shape[-1])  # (..., T, out_dim) -> (N, out_dim)
    if out_proj:
        y = product(merged, params["W_out"], y)  # (N, E) @ (E, out_dim) -> (N, out_dim)
        if "b_out" in params:
            y += params["b_out"]
    elif y is None:
        y = merged.copy()
    else:
        y[...] = merged
    return y.reshape(lead + (y.shape[-1],))  # (N, out_dim) -> (..., T, out_dim)


def backward(dout, cache, dinputs_out=None, check=True):
    """Backward of :func:`forward`: ``(grads, (dx,))``, as :func:`qkvnp.kernels.mha.backward`
    (``check=False``: ``dout`` is already checked and cast).

    With ``dO`` the output's gradient and ``Y = O W_out + b_out``:
    ``dW_out = O^T dY``, ``db_out = 1^T dY``, ``dO = dY W_out^T``; the core's
    backward (:func:`qkvnp.kernels.fast_small.small_backward`) gives the
    gradients of the scaled queries, the keys and the values, written into
    their columns of one ``(N, 3E)`` array ``dP``; then ``dW = x^T dP`` and
    ``dx = dP W^T`` for the fused ``W``, whose query columns carry the scale
    ``c``: ``dW_query = c (x^T dP)[:, :E]`` (``db_query`` likewise).
    """
    c = cache
    merged = c.merged
    dtype = merged.dtype
    N, E = merged.shape
    dy = as_upstream_grad(dout, "dout", c.out_shape, dtype) if check else dout
    dy = dy.reshape(N, c.out_shape[-1])  # (..., T, out_dim) -> (N, out_dim)
    grads = {}
    if c.W_out is not None:
        grads["W_out"] = merged.T @ dy  # (E, N) @ (N, out_dim) -> (E, out_dim)
        if c.has_out_bias:
            grads["b_out"] = column_sums(dy)  # (N, out_dim) -> (out_dim,)
        dmerged = dy @ c.W_out.T  # (N, out_dim) @ (out_dim, E) -> (N, E)
    else:
        dmerged = dy
    batch, T = c.in_shape[:-2], c.in_shape[-2]
    out_proj = c.W_out is not None
    H = c.q.shape[-3] if out_proj else 1
    dprojected = np.empty((N, 3 * E), dtype)  # (N, 3E): dq (scaled query), dk, dv columns
    dq, dk, dv = _head_views(dprojected, batch, T, H, 3, out_proj)
    (dheads,) = _head_views(dmerged, batch, T, H, 1, out_proj)
    with np.errstate(invalid="ignore"):  # see qkvnp.kernels.fast.dense_backward's NOTE
        small_backward(dheads, c.q, c.k, c.v, c.weights, None, c.out_heads, dq, dk, dv, 1)
    scale = dtype.type(c.scale)
    dW = c.x2d.T @ dprojected  # (in, N) @ (N, 3E) -> (in, 3E)
    dW[:, :E] *= scale  # W' = c W_query: dW_query = c dW'
    grads["W_query"], grads["W_key"], grads["W_value"] = dW[:, :E], dW[:, E:2 * E], dW[:, 2 * E:]
    if c.has_bias:
        db = column_sums(dprojected)  # (N, 3E) -> (3E,)
        db[:E] *= scale
        grads["b_query"], grads["b_key"], grads["b_value"] = db[:E], db[E:2 * E], db[2 * E:]
    dx = None if dinputs_out is None else dinputs_out[0].reshape(c.x2d.shape)
    dx = np.matmul(dprojected, c.W_in.T, out=dx)  # (N, 3E) @ (3E, in) -> (N, in)
    return grads, (dx.reshape(c.in_shape),)
