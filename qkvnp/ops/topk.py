"""The k largest entries of each row, in the order ``torch.topk`` gives on CPU, ties included.

Shape key: N rows, X entries a row (experts, for a router), k chosen.

Not differentiable (the indices are integers; the selection is piecewise
constant in the values). Among distinct values the order is the obvious one,
largest first. Among equal values ``torch.topk`` on CPU follows no simple
rule: it copies a row into ``(value, index)`` pairs and runs libstdc++'s
``std::nth_element`` then ``std::sort`` on the first ``k - 1`` (or
``std::partial_sort`` when ``64 k <= X``), none of them stable. For
``[1, 2, 2, 0, 2, 1]`` it returns ``[2]`` at ``k = 1``, ``[2, 4]`` at
``k = 2`` and ``[2, 4, 1]`` at ``k = 3``. :func:`topk_indices` replays those
algorithms, step for step, on the rows that hold a tie (the others take one
``argsort``), so that a router built on it picks the experts PyTorch picks.
(CUDA's ``topk`` resolves ties otherwise; it is not replayed.)
"""
from __future__ import annotations

import numpy as np

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray, IntArray

__all__ = ["topk_indices"]

_SORT_THRESHOLD = 16  # libstdc++'s _S_threshold: std::sort's insertion-sort size


def topk_indices(values: FloatArray, k: int) -> IntArray:
    """Indices of the ``k`` largest entries of each row, as ``torch.topk(values, k).indices`` on CPU.

    Parameters
    ----------
    values : ndarray, shape (N, X)
        Real and finite (the real part is read under the gradient checker's
        complex step: the selection does not depend on the step).
    k : int
        ``1 <= k <= X`` (checked by the caller).

    Returns
    -------
    indices : ndarray of int64, shape (N, k)
        Largest first; equal values in ``torch.topk``'s CPU order (module
        docstring).

    Examples
    --------
    >>> topk_indices(np.array([[1.0, 2.0, 2.0, 0.0, 2.0, 1.0]]), 3)
    array([[2, 4, 1]])
    """
    values = np.asarray(values).real
    order = np.argsort(-values, axis=-1, kind="stable")  # (N, X), largest first
    indices = order[:, :k].copy()  # (N, X) -> (N, k)
    ranked = np.take_along_axis(values, order, axis=-1)  # (N, X)
    # NOTE: a row's answer depends on the algorithm only if two equal values are both
    # in the top k, or straddle its edge: replay torch's algorithm on those rows alone
    tied = np.any(ranked[:, 1:min(k + 1, values.shape[1])] == ranked[:, :min(k, values.shape[1] - 1)],
                  axis=-1)
    for row in np.flatnonzero(tied):
        indices[row] = _torch_cpu_topk_row(values[row].tolist(), k)
    return indices


def _torch_cpu_topk_row(row, k):
    """One row through torch's CPU ``topk_impl_loop`` (largest, sorted)."""
    queue = [(value, j) for j, value in enumerate(row)]
    size = len(queue)
    if k * 64 <= size:
        _partial_sort(queue, 0, k, size)
    else:
        _nth_element(queue, 0, k - 1, size)
        _sort(queue, 0, k - 1)
    return [j for _, j in queue[:k]]


def _comp(x, y):
    """torch's comparator for ``largest=True``: ``x`` goes before ``y`` (no NaN here)."""
    return x[0] > y[0]


def _lg(n):
    return n.bit_length() - 1


def _insertion_sort(a, first, last):
    for i in range(first + 1, last):
        value = a[i]
        if _comp(value, a[first]):
            a[first + 1:i + 1] = a[first:i]
            a[first] = value
        else:
            _unguarded_linear_insert(a, i)


def _unguarded_linear_insert(a, last):
    value = a[last]
    while _comp(value, a[last - 1]):
        a[last] = a[last - 1]
        last -= 1
    a[last] = value


def _move_median_to_first(a, result, x, y, z):
    if _comp(a[x], a[y]):
        if _comp(a[y], a[z]):
            pick = y
        elif _comp(a[x], a[z]):
            pick = z
        else:
            pick = x
    elif _comp(a[x], a[z]):
        pick = x
    elif _comp(a[y], a[z]):
        pick = z
    else:
        pick = y
    a[result], a[pick] = a[pick], a[result]


def _unguarded_partition_pivot(a, first, last):
    mid = first + (last - first) // 2
    _move_median_to_first(a, first, first + 1, mid, last - 1)
    pivot, lo, hi = a[first], first + 1, last
    while True:
        while _comp(a[lo], pivot):
            lo += 1
        hi -= 1
        while _comp(pivot, a[hi]):
            hi -= 1
        if not lo < hi:
            return lo
        a[lo], a[hi] = a[hi], a[lo]
        lo += 1


def _push_heap(a, base, hole, top, value):
    parent = (hole - 1) // 2
    while hole > top and _comp(a[base + parent], value):
        a[base + hole] = a[base + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[base + hole] = value


def _adjust_heap(a, base, hole, length, value):
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if _comp(a[base + second], a[base + second - 1]):
            second -= 1
        a[base + hole] = a[base + second]
        hole = second
    if length % 2 == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        a[base + hole] = a[base + second - 1]
        hole = second - 1
    _push_heap(a, base, hole, top, value)


def _heap_select(a, first, middle, last):
    length = middle - first
    if length >= 2:  # std::make_heap
        for parent in range((length - 2) // 2, -1, -1):
            _adjust_heap(a, first, parent, length, a[first + parent])
    for i in range(middle, last):
        if _comp(a[i], a[first]):  # std::__pop_heap(first, middle, i)
            value, a[i] = a[i], a[first]
            _adjust_heap(a, first, 0, length, value)


def _partial_sort(a, first, middle, last):
    _heap_select(a, first, middle, last)
    while middle - first > 1:  # std::sort_heap
        middle -= 1
        value, a[middle] = a[middle], a[first]
        _adjust_heap(a, first, 0, middle - first, value)


def _nth_element(a, first, nth, last):
    if first == last or nth == last:
        return
    depth = 2 * _lg(last - first)
    while last - first > 3:
        if depth == 0:
            _heap_select(a, first, nth + 1, last)
            a[first], a[nth] = a[nth], a[first]
            return
        depth -= 1
        cut = _unguarded_partition_pivot(a, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(a, first, last)


def _sort(a, first, last):
    if first == last:
        return
    _introsort_loop(a, first, last, 2 * _lg(last - first))
    if last - first > _SORT_THRESHOLD:
        _insertion_sort(a, first, first + _SORT_THRESHOLD)
        for i in range(first + _SORT_THRESHOLD, last):
            _unguarded_linear_insert(a, i)
    else:
        _insertion_sort(a, first, last)


def _introsort_loop(a, first, last, depth):
    while last - first > _SORT_THRESHOLD:
        if depth == 0:
            _partial_sort(a, first, last, last)
            return
        depth -= 1
        cut = _unguarded_partition_pivot(a, first, last)
        _introsort_loop(a, cut, last, depth)
        last = cut
