"""The input projections of the layer kernels (:mod:`qkvnp.kernels.mha`), forward and backward.

Shape key: N rows (batch and length flattened), ``in`` the features of an
input, E the query projection's width, E_kv the key's and value's.

The alternative to the reference layers' three products ``x W_q + b_q``,
``x W_k + b_k``, ``x W_v + b_v`` (:mod:`qkvnp.layers.reference`): the
matrices one input feeds are multiplied as one concatenation
``[c W_q, W_k, W_v]`` (``c = 1/sqrt(D)`` folded into the query's part), or,
with fewer rows than features, one at a time into the columns of one output
(:func:`weights_apart`). Backward: ``dW = x^T dy`` split into per-parameter
views, ``db`` the column sums, ``dx = dy W^T``.
"""
import numpy as np

from ..functional import column_sums
from ._runtime import matmul

__all__ = ["project_inputs", "backward_fused", "backward_apart", "column_views", "fused_weights",
           "weights_apart"]


def fused_weights(p, names, E, c):
    """The concatenated ``(in, sum of widths)`` matrix and bias of the projections ``names``,
    the query's part multiplied by ``c``."""
    W = np.concatenate([p["W_" + n] for n in names], axis=1)  # (in, sum of widths)
    b = np.concatenate([p["b_" + n] for n in names]) if "b_query" in p else None
    if names[0] == "query":
        W[:, :E] *= c
        if b is not None:
            b[:E] *= c
    return W, b


def project_inputs(p, inputs, groups, widths, c, blas):
    """The input projections: one fused product per input, or one per matrix (:func:`weights_apart`).

    Returns ``(rows, W_in, fused_outputs, projected)``: per input its ``(N, in)``
    rows, the matrix (or tuple of matrices) it was multiplied by and its
    ``(N, widths)`` output; and the ``(N, width)`` column views of those outputs,
    query, key, value in that order (the query's already multiplied by ``c``).
    """
    has_bias = "b_query" in p
    dtype = p["W_query"].dtype
    rows, W_in, projected, fused_outputs = [], [], [], []
    for x, names in zip(inputs, groups):
        x2d = x.reshape(-1, x.shape[-1])  # (..., L, in) -> (N, in)
        width = sum(widths[name] for name in names)
        y = np.empty((x2d.shape[0], width), dtype)  # (N, widths)
        columns = column_views(y, names, widths)  # (N, E) or (N, E_kv) views
        if weights_apart(*x2d.shape):
            # fewer rows than input features: one product per matrix, each
            # written into its columns of y, and the scale applied to the
            # query's N rows, not to W_query's `in` rows (see weights_apart)
            W = tuple(p["W_" + name].copy() for name in names)  # the cache's (_read_weights)
            for W_name, y_name in zip(W, columns):
                matmul(x2d, W_name, y_name, blas_threads=blas)  # (N, in) @ (in, width)
            if has_bias:
                for name, y_name in zip(names, columns):
                    y_name += p["b_" + name]
            if names[0] == "query":
                columns[0] *= c  # (x W_q + b_q) c
        else:
            W, b = fused_weights(p, names, widths["query"], c)
            matmul(x2d, W, y, blas_threads=blas)  # (N, in) @ (in, widths) -> (N, widths)
            if b is not None:
                y += b
        rows.append(x2d)
        W_in.append(W)
        fused_outputs.append(y)
        projected.extend(columns)
    return rows, W_in, fused_outputs, projected


def column_views(y, names, widths):
    """The ``(N, width)`` column views of a fused projection, one per name."""
    views, start = [], 0
    for name in names:
        views.append(y[:, start:start + widths[name]])
        start += widths[name]
    return views


def backward_fused(x2d, W, names, d, widths, scale, c, grads, dx):
    """The input projections' backward through the fused matrix ``W`` (the forward's
    ``[c W_q, W_k, W_v]``): ``dW = x^T d``, split into views per parameter (the
    query's multiplied by ``scale``), the biases' column sums, ``dx = d W^T``.
    Writes ``grads``; returns ``dx`` (N, in)."""
    E = widths["query"]
    dW = matmul(x2d.T, d, split="cols", blas_threads=c.blas_threads)  # (in, N) @ (N, widths)
    db = column_sums(d) if c.has_bias else None  # (N, widths) -> (widths,)
    if names[0] == "query":  # W' = scale * W_query: dW_query = scale dW'
        dW[:, :E] *= scale
        if db is not None:
            db[:E] *= scale
    start = 0
    for name in names:
        columns = slice(start, start + widths[name])
        start += widths[name]
        grads["W_" + name] = dW[:, columns]  # views of dW: the layer adds them into its grads
        if db is not None:
            grads["b_" + name] = db[columns]
    return matmul(d, W.T, dx, blas_threads=c.blas_threads)  # (N, widths) @ (widths, in)


def weights_apart(rows, features):
    """Whether a projection of ``rows`` inputs of ``features`` each multiplies by its
    matrices one at a time instead of by their concatenation.

    The fused matrix ``[c W_q, W_k, W_v]`` costs a copy of ``features x widths``
    entries and a pass scaling ``W_q`` on every call, where the product costs
    ``rows x features x widths`` multiply-adds. Apart, each product writes its
    columns of the output and the scale multiplies the query's ``rows x E``
    outputs (forward) and gradients (backward) instead. NOTE: measured, apart
    is faster below ``rows == features`` and fused from there on (three calls
    and narrower products), float32 and float64 (``benchmarks/NOTES.md``).
    """
    return rows < features


def backward_apart(x2d, W, names, d, widths, scale, c, grads, dx):
    """The input projections' backward when the forward multiplied by ``W``, a tuple
    of the unscaled matrices, one at a time (:func:`weights_apart`).

    ``d`` is the gradient of the projection outputs, the query's scaled:
    ``y_q = c (x W_q + b_q)``, so the query's columns are scaled by ``c`` first
    (in place: ``d`` is this backward's own), then each matrix gets
    ``dW = x^T d_name``, each bias the column sums, and ``dx`` the sum of the
    ``d_name W^T``. Writes ``grads``; returns ``dx`` (N, in).
    """
    columns = column_views(d, names, widths)  # (N, width) views of d
    if names[0] == "query":
        columns[0] *= scale  # gradient of x W_q + b_q
    db = column_sums(d) if c.has_bias else None  # (N, widths) -> (widths,)
    start = 0
    for name, d_name in zip(names, columns):
        # (in, N) @ (N, width) -> (in, width)
        grads["W_" + name] = matmul(x2d.T, d_name, split="cols", blas_threads=c.blas_threads)
        if db is not None:
            grads["b_" + name] = db[start:start + widths[name]]
        start += widths[name]
    dx = matmul(columns[0], W[0].T, dx, blas_threads=c.blas_threads)  # (N, width) @ (width, in)
    for W_name, d_name in zip(W[1:], columns[1:]):
        dx += matmul(d_name, W_name.T, blas_threads=c.blas_threads)
    return dx
