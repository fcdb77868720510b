"""Fused softmax cross-entropy for real floating logits, forward and backward.

Shape key: ``...`` any leading dims (batch, positions), N their product, C
classes, n the rows of one chunk.

Replaces ``qkvnp.ops.losses.cross_entropy_probs``, the reference
(``scipy.special.log_softmax``, then the target's entry): the same value up
to rounding, in fewer passes: the row maximum, one shift, ``exp2`` with
``log2(e)`` folded in, row sums as a product with a column of ones, and
the logarithm of the ``N`` sums only, never of the ``(N, C)`` entries. It
returns the softmax itself, which the backward reads instead of taking
``exp`` again. :func:`qkvnp.losses.cross_entropy_forward` calls it for real
floating logits after checking them (their finiteness by chunks here,
``check_finite``); other logits (the gradient checker's
complex step) keep the reference path. Likewise
:func:`qkvnp.losses.cross_entropy_backward` calls
:func:`cross_entropy_backward_fused` for real floating probabilities
instead of the reference ``qkvnp.ops.losses.cross_entropy_backward``, with
the same formula and bits.

Both go through the rows by chunks small enough that a chunk's passes run
in cache (the ``loss_block_bytes`` setting), dealt over the worker threads
from ``min_parallel_entries`` on (:func:`qkvnp.kernels._runtime.run_elementwise`); each chunk
writes its own rows of a preallocated output. Every entry is computed by
the same elementwise operations whatever its chunk, and the row sums and
the loss's sum are each one call over all rows, so the results are the same
bits at any chunk size and thread count.
"""
from __future__ import annotations

import math

import numpy as np

from .._checks import not_finite
from ._runtime import get_block_sizes, row_slices, run_elementwise, single_threaded_blas
from .pointwise import row_buffers

__all__ = ["cross_entropy_probs_fused", "cross_entropy_backward_fused"]

_LOG2_E = 1.0 / math.log(2.0)


def cross_entropy_probs_fused(logits, targets, counted, count, check_finite=False):
    """The mean cross-entropy over the counted positions, and ``softmax(logits)``.

    Parameters
    ----------
    logits : ndarray, shape (..., C)
        Real floating (float32 or float64), finite (the caller's test, or this
        function's with ``check_finite``).
    targets : ndarray of int, shape (...)
        A class index in ``[0, C)`` at every position (the caller puts 0 at
        the uncounted ones).
    counted : ndarray of bool, shape (...)
        True = the position counts.
    count : int
        ``counted.sum()``; 0 gives the loss 0.
    check_finite : bool
        True: each chunk tests its rows finite before its passes, in cache and
        on its worker thread, and a NaN or inf raises ``ValueError`` naming
        ``logits`` (:func:`qkvnp._checks.not_finite`) once every chunk has ended.
        NOTE: measured faster than a whole-array ``isfinite`` before the
        passes, at one thread and two (benchmarks/NOTES.md).

    Returns
    -------
    loss : ndarray, shape ()
        ``-mean(log softmax(logits)[target])`` over the counted positions,
        of ``logits``' dtype.
    probs : ndarray, shape (..., C)
        ``softmax(logits)`` along the last axis, C order, of ``logits``' dtype.

    Notes
    -----
    With :math:`m` the row maximum and :math:`s = \\sum_j 2^{(z_j - m)\\log_2 e}`,
    :math:`\\log \\mathrm{softmax}(z)_y = (z_y - m) - \\log s` (scipy's
    formula), and :math:`\\mathrm{softmax}(z) = 2^{(z - m)\\log_2 e} / s`.

    The shift and ``exp2``, then the division by the sums, go by chunks of
    rows of about the ``loss_block_bytes`` setting
    (:data:`qkvnp.kernels.BLOCK_SIZE_DEFAULTS`), each chunk's passes in
    cache, on the worker threads when the work is large; the row sums are one
    product over all rows and the loss the sum of the ``N`` picked
    log-probabilities, taken once at the end: the same bits as whole-array
    passes, at any chunk size and thread count.

    NOTE: measured faster than ``log_softmax`` then ``exp``, forward and
    backward (a copy instead of an ``exp``); ``np.exp2`` faster than
    ``np.exp`` (benchmarks/NOTES.md).

    Examples
    --------
    >>> loss, probs = cross_entropy_probs_fused(np.zeros((2, 4)), np.array([0, 3]),
    ...                                         np.array([True, True]), 2)
    >>> bool(np.isclose(loss, np.log(4))), probs[0]
    (True, array([0.25, 0.25, 0.25, 0.25]))
    """
    C = logits.shape[-1]
    rows = logits.reshape(-1, C)  # (..., C) -> (N, C)
    flat_targets = targets.reshape(-1)  # (...) -> (N,)
    probs = np.empty(rows.shape, logits.dtype)  # (N, C), each chunk writes its rows
    picked = np.empty(rows.shape[0], logits.dtype)  # z_y - m, (N,)
    not_finite_rows = []  # the first rows of the chunks that hold a NaN or inf

    def shifted_exp(chunks):
        positions = np.arange(max(piece.stop - piece.start for piece in chunks))  # (n,)
        with np.errstate(under="ignore"), row_buffers(C):  # numpy's state is per thread
            for piece in chunks:
                if check_finite and not np.isfinite(rows[piece]).all():
                    not_finite_rows.append(piece.start)
                    continue
                _shifted_exp_rows(rows[piece], flat_targets[piece], probs[piece], picked[piece],
                                  positions[:piece.stop - piece.start])

    _run_chunks(shifted_exp, rows.shape, logits.itemsize)
    if not_finite_rows:
        raise not_finite("logits")
    ones = np.ones((C, 1), logits.dtype)
    # NOTE: one product over all rows, never by chunk: OpenBLAS's gemv sums the last
    # one to three rows it is given by another path, so that a row's bits changed with
    # the chunking; at one BLAS thread, whose threads spin after a call and slowed
    # the worker threads that run next by half (benchmarks/NOTES.md)
    with single_threaded_blas():
        sums = probs @ ones  # row sums, (N, C) @ (C, 1) -> (N, 1)

    def normalise(chunks):
        with row_buffers(C):
            for piece in chunks:
                probs[piece] /= sums[piece]  # softmax, (n, C)

    _run_chunks(normalise, rows.shape, logits.itemsize)
    picked -= np.log(sums[:, 0])  # log softmax(z)_y, (N,)
    # NOTE: no counted position -> loss 0 by definition, as the reference path.
    loss = -np.sum(picked, where=counted.reshape(-1)) / count if count else 0.0  # (N,) -> ()
    return np.asarray(loss, dtype=logits.dtype), probs.reshape(logits.shape)


def _shifted_exp_rows(logits, targets, exp_shifted, picked, positions):
    """One chunk of :func:`cross_entropy_probs_fused`'s first pass, into its rows of the outputs.

    ``logits`` (n, C), ``targets`` (n,) and ``positions`` (``arange(n)``) are
    read; ``exp_shifted`` (n, C) gets ``exp(z - m)``, ``picked`` (n,) ``z_y - m``.
    """
    # NOTE: the row maximum read at argmax: measured faster than max
    top = logits[positions, logits.argmax(axis=1)]  # m, (n, C) -> (n,)
    np.subtract(logits, top[:, None], out=exp_shifted)  # z - m, (n, C), every entry <= 0
    picked[...] = exp_shifted[positions, targets]  # z_y - m, (n,)
    exp_shifted *= exp_shifted.dtype.type(_LOG2_E)
    np.exp2(exp_shifted, out=exp_shifted)  # exp(z - m), (n, C)


def cross_entropy_backward_fused(dloss, cache):
    """Backward of :func:`cross_entropy_probs_fused`: ``dloss * (probs - onehot) / count``.

    The reference ``qkvnp.ops.losses.cross_entropy_backward`` in one trip
    through memory: the same formula, the same bits.

    Parameters
    ----------
    dloss : ndarray, shape ()
        Checked by the caller (:func:`qkvnp.losses.cross_entropy_backward`,
        with the reference op's check): finite, of ``probs``' dtype.
    cache : qkvnp.ops.losses.CrossEntropyCache
        ``probs`` (..., C) real floating, ``targets`` (...) with 0 at the
        uncounted positions, ``counted`` (...), ``count``.

    Returns
    -------
    dlogits : ndarray, shape (..., C), C order
        ``dloss / count * (softmax(logits) - onehot(targets))`` on counted
        rows, 0 on the others (all zeros when no position is counted).

    Notes
    -----
    The reference copies ``probs``, subtracts 1 at the targets, then
    multiplies by ``dloss / count``. Here each chunk of rows multiplies
    ``probs`` into the output and writes ``(p_y - 1) \\cdot (dloss / count)``
    at the targets, the same two roundings in the same order.

    Examples
    --------
    >>> from qkvnp.ops.losses import CrossEntropyCache
    >>> cache = CrossEntropyCache(np.full((2, 2), 0.5), np.array([0, 1]),
    ...                           np.array([True, False]), 1)
    >>> cross_entropy_backward_fused(np.array(2.0), cache)
    array([[-1.,  1.],
           [ 0.,  0.]])
    """
    probs, targets, counted, count = cache
    if count == 0:
        return np.zeros_like(probs)
    C = probs.shape[-1]
    rows = probs.reshape(-1, C)  # (..., C) -> (N, C)
    flat_targets = targets.reshape(-1)  # (...) -> (N,)
    flat_counted = counted.reshape(-1)  # (...) -> (N,)
    scale = (dloss / count).astype(probs.dtype)  # dloss / n, ()
    dlogits = np.empty(rows.shape, probs.dtype)  # (N, C), each chunk writes its rows

    def task(chunks):
        for piece in chunks:
            out = dlogits[piece]  # (n, C), a view
            positions = np.arange(out.shape[0])  # (n,)
            np.multiply(rows[piece], scale, out=out)  # dloss / n * softmax, (n, C)
            # in the reference this was: rows[.., targets] -= 1, then dlogits *= scale
            picked = rows[piece][positions, flat_targets[piece]]  # p_y, (n,)
            out[positions, flat_targets[piece]] = (picked - 1) * scale  # softmax - onehot
            uncounted = ~flat_counted[piece]  # (n,)
            if uncounted.any():
                out[uncounted] = 0  # uncounted rows: 0

    _run_chunks(task, rows.shape, probs.itemsize)
    return dlogits.reshape(probs.shape)


def _run_chunks(task, shape, itemsize):
    """``task(chunks)`` over the rows of an ``(N, C)`` problem cut in chunks of rows.

    A chunk holds about ``loss_block_bytes`` (at least one row); the chunks
    go to the worker threads from ``min_parallel_entries`` on
    (:func:`qkvnp.kernels._runtime.run_elementwise`), else to the calling thread.
    """
    N, C = shape
    chunks = row_slices(N, get_block_sizes()["loss_block_bytes"] // max(1, C * itemsize))
    if chunks:  # none without rows
        run_elementwise(task, chunks, N * C)
