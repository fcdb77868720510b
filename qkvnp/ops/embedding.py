"""The embedding op: a row lookup and its backward (part of :mod:`qkvnp.functional`).

Shape key: ``...`` any index dims, ``num`` rows of the table, ``dim`` its width.

Kept out of :mod:`qkvnp.functional` only for that module's length; import it
from there (``qkvnp.functional.embedding_forward``).
"""
from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from .._checks import as_float_array, as_upstream_grad, check_indices, declare_complex_step, owned

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray, IntArray

__all__ = ["embedding_forward", "embedding_backward", "embedding_backward_factored",
           "EmbeddingCache"]

EmbeddingCache = namedtuple("EmbeddingCache", "indices weight_shape dtype")

#: Up to this many entries of a float64 ``dout``, :func:`embedding_backward`
#: sums with ``np.bincount``, beyond it with a sparse product (the two cross
#: near 8192 entries; measured in benchmarks/NOTES.md).
BINCOUNT_MAX_ENTRIES = 4096


def embedding_forward(indices: IntArray, weight: FloatArray) -> tuple[FloatArray, EmbeddingCache]:
    """Look up rows of ``weight``: ``out[...] = weight[indices[...]]``.

    Parameters
    ----------
    indices : ndarray of int, shape (...)
        Entries in ``[0, num)``; negative indices are refused (no wrap-around).
    weight : ndarray, shape (num, dim)

    Returns
    -------
    out : ndarray, shape (..., dim)
    cache : EmbeddingCache

    Raises
    ------
    TypeError
        If ``indices`` is not an integer array.
    ValueError
        If ``weight`` is not 2-D or an index is out of range.

    Notes
    -----
    Forward: :math:`Y_{\\dots} = W_{i_{\\dots}}` (a one-hot matrix times
    :math:`W`). Backward: :math:`\\bar W_r = \\sum_{\\dots : i_{\\dots} = r}
    \\bar Y_{\\dots}`: every occurrence of row :math:`r` adds its upstream
    gradient (unlike ``dW[indices] += dout``, which drops repeated indices).
    The indices get no gradient.

    Examples
    --------
    >>> out, cache = embedding_forward(np.array([2, 0, 2]), np.arange(6.0).reshape(3, 2))
    >>> out
    array([[4., 5.],
           [0., 1.],
           [4., 5.]])
    >>> embedding_backward(np.ones((3, 2)), cache)
    array([[1., 1.],
           [0., 0.],
           [2., 2.]])
    """
    weight = as_float_array(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"weight must have shape (num, dim), got shape {weight.shape}")
    (indices,) = owned((check_indices(indices, weight.shape[0]),), (indices,))
    # NOTE: take, not weight[indices]: the same rows (the indices are checked),
    # in about half the time at kv-recall's shapes
    out = weight.take(indices, axis=0)  # (...) -> (..., dim)
    return out, EmbeddingCache(indices, weight.shape, weight.dtype)


declare_complex_step(embedding_forward)  # see qkvnp._checks.complex_step_mode


def embedding_backward(dout: FloatArray, cache: EmbeddingCache, check: bool = True) -> FloatArray:
    """Backward of :func:`embedding_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., dim)
    cache : EmbeddingCache
    check : bool
        False: ``dout`` is a composite's own gradient, already of the
        output's shape and dtype and finite; it is not checked again
        (:func:`qkvnp.functional.linear_backward`'s ``check``).

    Returns
    -------
    dweight : ndarray, shape (num, dim)
        Rows never looked up are 0; repeated indices add up.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
    """
    from scipy.sparse import csc_array

    indices, weight_shape, dtype = cache
    if check:
        dout = as_upstream_grad(dout, "dout", indices.shape + (weight_shape[1],), dtype)
    num, dim = weight_shape
    ids = indices.reshape(-1)  # (...) -> (R,)
    if dout.dtype == np.float64 and dout.size <= BINCOUNT_MAX_ENTRIES:
        # np.bincount of each entry's (row, column) slot: the same sums in input
        # order, in float64 as bincount's own (so only for float64 douts), without
        # scipy.sparse's construction. NOTE: faster for small lookups (kv-recall's
        # query), where scipy's Python pays most; the sparse product wins beyond
        slots = (ids[:, None] * dim + np.arange(dim)).reshape(-1)  # (R dim,)
        dweight = np.bincount(slots, weights=dout.reshape(-1), minlength=num * dim)
        return dweight.reshape(num, dim).astype(dtype, copy=False)  # no entry: int zeros
    # The forward's one-hot matrix, transposed and stored sparse: column j
    # holds a single 1, in row ids[j]. Its product sums each row's positions
    # in input order, the sums of np.add.at(dW, indices, dout) to the bit.
    # NOTE: several times faster than np.add.at and than a bincount of (row,
    # column) slots at the kv-recall task's shapes
    onehot_T = csc_array((np.ones(ids.size, dout.dtype), ids, np.arange(ids.size + 1)),
                         shape=(num, ids.size))  # (num, R)
    dweight = onehot_T @ dout.reshape(-1, dim)  # (num, R) @ (R, dim) -> (num, dim)
    return dweight.astype(dtype, copy=False)


def embedding_backward_factored(left: FloatArray, right: FloatArray,
                                cache: EmbeddingCache) -> FloatArray:
    """Backward of :func:`embedding_forward` for a ``dout`` given as a product it never forms.

    Parameters
    ----------
    left : ndarray, shape (..., M, P)
    right : ndarray, shape (..., M, dim)
        ``dout = swapaxes(left, -1, -2) @ right``, shape ``(..., P, dim)``:
        the lookup's output shape, for indices of shape ``(..., P)``.
        ``qkvnp.kernels.kv_recall.items_backward_factors`` returns its
        items' gradient so (``M = 2T``). Both are
        a composite's own gradient factors: their values are not checked.
    cache : EmbeddingCache

    Returns
    -------
    dweight : ndarray, shape (num, dim)
        :func:`embedding_backward` of that ``dout``, to rounding.

    Raises
    ------
    ValueError
        If the shapes of ``left`` and ``right`` do not make the lookup's
        output shape.

    Notes
    -----
    With :math:`O` the one-hot matrix of one leading index's lookup
    (:math:`O_{pr} = 1` where :math:`i_p = r`), the table's gradient is

    .. math:: \\bar W = \\sum O^T \\bar Y = \\sum O^T L^T R = \\sum (L O)^T R

    (matrix products associate). :math:`L O`, shape ``(M, num)``, adds each
    entry of ``left`` into the column of its position's row: a
    ``np.bincount`` over all leading indices at once; one product
    ``(num, N M) @ (N M, dim)`` then sums them (``N`` leading indices).
    ``dout``, ``N P dim`` entries, is never written nor read back. The fold's
    product takes ``N M num dim`` multiply-adds in one BLAS call: it is used
    where that is at most ``dim`` of them for each entry of ``dout`` it
    avoids, ``M num <= P dim`` (kv-recall: M = 2, num = 64 against P = 16,
    dim = 64); otherwise
    ``dout`` is formed and :func:`embedding_backward` takes it (a vocabulary
    of thousands).

    Examples
    --------
    >>> _, cache = embedding_forward(np.array([[2, 0, 2]]), np.zeros((3, 2)))
    >>> left, right = np.array([[[1.0, 2.0, 3.0]]]), np.array([[[1.0, 10.0]]])
    >>> embedding_backward_factored(left, right, cache)
    array([[ 2., 20.],
           [ 0.,  0.],
           [ 4., 40.]])
    """
    indices, (num, dim), dtype = cache
    left, right = np.asarray(left), np.asarray(right)
    if (left.ndim != indices.ndim + 1 or left.shape[:-2] != indices.shape[:-1]
            or left.shape[-1] != indices.shape[-1]):
        raise ValueError(f"left must have shape (..., M, P) with (..., P) the indices' shape "
                         f"{indices.shape}, got shape {left.shape}")
    if right.shape != left.shape[:-1] + (dim,):
        raise ValueError(f"right must have shape {left.shape[:-1] + (dim,)} (left's (..., M) "
                         f"and the table's width {dim}), got shape {right.shape}")
    rows, positions = left.shape[-2], left.shape[-1]  # M, P
    if rows * num > positions * dim:  # the fold would cost more than the product it avoids
        dout = np.swapaxes(left, -1, -2) @ right  # (..., P, M) @ (..., M, dim) -> (..., P, dim)
        return embedding_backward(dout.astype(dtype, copy=False), cache, check=False)
    lead = math.prod(left.shape[:-2])  # N
    groups = lead * rows  # N M
    ids = indices.reshape(lead, 1, positions)  # (N, 1, P)
    slots = np.arange(groups, dtype=np.intp).reshape(lead, rows, 1) * num + ids  # (N, M, P)
    folded = np.bincount(slots.reshape(-1), weights=left.reshape(-1),
                         minlength=groups * num).reshape(groups, num)  # L O: (N M, num)
    folded = folded.astype(np.result_type(right.dtype, dtype), copy=False)
    dweight = folded.T @ right.reshape(groups, dim)  # (num, N M) @ (N M, dim) -> (num, dim)
    return dweight.astype(dtype, copy=False)
