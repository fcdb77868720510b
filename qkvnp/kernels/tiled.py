"""Tiled (FlashAttention-style) attention whose memory grows linearly in length.

Shape key: T query length, S key length, D head dim of queries and keys, Dv
head dim of values, ``...`` any leading (batch, head) dims; ``bq`` and ``bk``
the query and key block sizes.

Same semantics as :func:`qkvnp.functional.attention_forward` /
:func:`~qkvnp.functional.attention_backward` (the reference path, which is the
oracle of ``tests/test_tiled.py``), but the ``(..., T, S)`` weights are never
built: the forward runs an online softmax over key blocks and keeps only the
output and the row logsumexp (as row max and row sum), and the backward
recomputes the weights block by block. Every temporary is ``(..., bq, bk)``-sized, so for a fixed block size
the extra memory does not grow with the sequence length. This module checks
the inputs, sizes the blocks and shares them among the threads; the passes
over each block are in :mod:`qkvnp.kernels.tiled_blocks`.

The alternative to the reference core (:func:`qkvnp.functional.attention_forward`)
and to the dense fast core (:mod:`qkvnp.kernels.fast`) where the ``(T, S)``
weights would not fit. The variants (window, soft-cap, ALiBi, sinks, score
bias) have their own tiled core, :mod:`qkvnp.kernels.tiled_variants`, which
differs in the algorithm: here, without a mask, a cheap bound of each row
max lets the rows skip the online rescaling, masked blocks are skipped whole,
and the backward shares key blocks among the threads.

The ``(..., bq, bk)`` blocks are shared among the worker threads of
:mod:`qkvnp.kernels._runtime` (``qkvnp.set_num_threads``): query blocks in
the forward, key blocks in the backward. Its default block size is the
``tiled_block`` setting (``qkvnp.kernels.set_block_sizes``). Measurements
(memory, wall time against the reference and the fast core, the block-size
sweep): ``benchmarks/RESULTS.md``.
"""
import math
from collections import namedtuple

import numpy as np

from .. import functional as F
from .._checks import (as_upstream_grad, check_attention_inputs, check_scale,
                       core_scores_may_overflow, owned, values_may_overflow)
from ..functional import sum_to_shape
from ..ops.dropout import dense_keep, prepare_dropout
from ..ops.gqa import GroupedCache, grouped_backward, grouped_forward, split_groups
from ..ops.masks import causal_offset, check_is_causal, prepare_mask
from ._runtime import check_block_pair, get_block_sizes, get_num_threads, run
from .tiled_blocks import (Problem, at_least_2d, backward_columns, forward_rows, live_blocks,
                           no_overflow, row_bounds)

__all__ = ["attention_forward", "attention_backward", "TiledAttentionCache"]

# A (..., bq, bk) block of the default size holds at most about this many
# scores: with many (batch, head) pairs the default blocks shrink so that the
# per-block temporaries stay around a MiB. NOTE: 1 << 18 measured faster than
# 1 << 20 and with a smaller peak but in one case (benchmarks/NOTES.md).
_BLOCK_ELEMENTS = 1 << 18
_MIN_DEFAULT_BLOCK = 32

class TiledAttentionCache(namedtuple(
        "TiledAttentionCache",
        "query key value bias keep is_causal scale out row_max row_sum block_q block_k live safe "
        "dropout", defaults=(None,))):
    """What :func:`attention_backward` reads.

query, key, value : the (cast) inputs, with their own shapes
bias, keep : the additive and boolean parts of the user's mask (or None),
    as given, never broadcast to ``(..., T, S)``
is_causal, scale : as in the forward
out : ndarray, shape (..., T, Dv), the forward output
row_max, row_sum : ndarray, shape (..., T), the row logsumexp of the scores
    in two parts, ``logsumexp = row_max + log(row_sum)``: ``row_max`` is the
    shift of the row's exponentials, its max or, without a float or boolean
    mask, the bound ``|scale| |q| max|k|`` above it (:mod:`.tiled_blocks`); a
    fully masked row has ``row_max = -inf`` and ``row_sum = 0``
block_q, block_k : block sizes
live : ndarray of bool, shape (ceil(T/bq), ceil(S/bk)), False for block
    pairs that are entirely masked (skipped in both passes)
safe : bool, True when no score can overflow (no clipping check needed)
dropout : :class:`qkvnp.ops.dropout.Dropout` or None: a drawn mask is kept as its
    key, and each block's mask is recomputed from it (never ``(T, S)``)
"""

    __slots__ = ()

    @property
    def dropout_mask(self):
        """The dense dropout mask ``(..., T, S)`` (bool, True = keep), built on request; or None."""
        return None if self.dropout is None else dense_keep(self.dropout)

    @property
    def dropout_p(self):
        """The drop probability (0.0 without dropout)."""
        return 0.0 if self.dropout is None else self.dropout.p


def _check_block_size(block_size, T, S, lead_size):
    """Return ``(block_q, block_k)``, both at least 1 and at most ``T``, ``S``."""
    if block_size is None:
        block_q, block_k = get_block_sizes()["tiled_block"]
        # NOTE: with many (batch, head) pairs a block is lead_size * bq * bk
        # scores; halve the blocks until that stays near _BLOCK_ELEMENTS.
        while lead_size * block_q * block_k > _BLOCK_ELEMENTS and max(block_q, block_k) > _MIN_DEFAULT_BLOCK:
            if block_k >= block_q:
                block_k //= 2
            else:
                block_q //= 2
        # NOTE: the forward shares the query blocks and the backward the key
        # blocks among the threads. A single block would run in the calling
        # thread on OpenBLAS's own threads, whose tiny matmuls are slow and
        # whose idle threads then spin and slow whatever runs next: give every
        # thread a block (measured several times faster, benchmarks/NOTES.md).
        threads = get_num_threads()
        block_q = min(block_q, max(_MIN_DEFAULT_BLOCK, -(-T // threads)))
        block_k = min(block_k, max(_MIN_DEFAULT_BLOCK, -(-S // threads)))
    else:
        block_q, block_k = check_block_pair(block_size, "block_size")
    return max(1, min(block_q, T)), max(1, min(block_k, S))


def attention_forward(query, key, value, attn_mask=None, is_causal=False, scale=None, block_size=None,
                      out=None, *, dropout_p=0.0, rng=None, dropout_mask=None, enable_gqa=False):
    """Scaled dot-product attention computed by blocks, without the ``(T, S)`` weights.

    Parameters
    ----------
    query : ndarray, shape (..., T, D)
    key : ndarray, shape (..., S, D)
    value : ndarray, shape (..., S, Dv)
        Leading dims of the three broadcast against each other.
    attn_mask : ndarray of bool or float, optional
        Broadcastable to ``(..., T, S)``. Bool: True = may attend. Float: added
        to the scores. Give size-1 dims where the mask does not vary (e.g. a
        key-padding mask of shape ``(B, 1, 1, S)``): it is then sliced per
        block and never expanded to ``(..., T, S)``.
    is_causal : bool or "bottom_right"
        Query ``i`` attends to keys ``0..i`` (True, top-left aligned) or
        ``0..i + S - T`` (``"bottom_right"``). Blocks entirely above the
        diagonal are skipped, in both alignments. The float mask is added
        first, then every boolean mask removes the positions it forbids.
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    block_size : int or (int, int), optional
        ``(block_q, block_k)``; an int sets both. Defaults to
        the ``tiled_block`` setting, halved while ``prod(...) * bq * bk`` exceeds
        about a million scores, and at most ``ceil(T / threads)`` by
        ``ceil(S / threads)`` (but not below 32) so that every one of
        ``qkvnp.get_num_threads()`` threads gets a block. Clipped to ``T`` and
        ``S``.
    out : ndarray, shape (..., T, Dv), optional
        Array (possibly a strided view) to write the output into, of the
        inputs' dtype; the cache then refers to it. A layer passes a view of
        its merged-heads buffer and so saves a copy.
    dropout_p, rng, dropout_mask
        As in :func:`qkvnp.functional.attention_forward` (the same ``rng``
        draws the same mask). A drawn mask is never built: the cache keeps its
        key and each block's mask is recomputed from it, the same whatever
        the block sizes and threads; ``cache.dropout_mask`` builds the dense
        mask on request. A given mask is referenced, sliced per block.
    enable_gqa : bool, keyword-only
        Grouped-query attention, as in the reference: K/V are broadcast over
        each group of query heads, never repeated (:mod:`qkvnp.ops.gqa`).

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    cache : TiledAttentionCache
        The inputs, ``out``, the row logsumexp as ``row_max`` and ``row_sum``
        ``(..., T)`` and a small table
        of live block pairs: no array of ``(T, S)`` size except a full mask
        the caller passed (which is referenced, not copied).
        When the scores may come near the float maximum (``|scale| max|q|
        max|k| >= sqrt(finfo.max)``), the forward is the reference's, and so is
        its cache (:class:`qkvnp.functional.AttentionCache`), which
        :func:`attention_backward` recognises.

    Raises
    ------
    ValueError
        On mismatched dims, a mask that does not broadcast, non-finite inputs,
        a non-positive block size.
    TypeError
        On a mask that is neither bool nor float, a non-bool ``is_causal``, a
        non-integer block size.

    Notes
    -----
    With :math:`c` the scale, the scores of query block :math:`i` and key
    block :math:`j` are :math:`S_{ij} = (c\\,Q_i) K_j^T + M_{ij}`. The forward
    keeps, per query row, a running max :math:`m`, a running sum :math:`\\ell`
    and an accumulator :math:`A`, and for each live key block:

    .. math:: m' = \\max(m, \\mathrm{rowmax}\\,S_{ij}), \\quad
              \\tilde P = e^{S_{ij} - m'}, \\quad \\alpha = e^{m - m'},
    .. math:: \\ell \\leftarrow \\alpha \\ell + \\mathrm{rowsum}\\,\\tilde P, \\quad
              A \\leftarrow \\alpha A + \\tilde P V_j, \\quad m \\leftarrow m'

    and at the end :math:`O_i = A / \\ell`. Without a float or boolean mask a
    query block first takes a fixed shift instead of the running max, each
    row's bound :math:`|c|\\,\\|q_i\\| \\max_j \\|k_j\\|` (over the keys it may
    attend), so that :math:`\\alpha = 1` and no max is taken; a row whose sum
    falls below ``2**-24`` (a bound far above its max) sends the block back to
    the running max. This is exactly
    :math:`\\mathrm{softmax}(S) V`: every :math:`\\tilde P` computed against
    an older max is rescaled by :math:`\\alpha` when the max grows. The only
    per-row statistic cached is the row logsumexp :math:`m + \\log \\ell`, kept
    as its two parts :math:`m` and :math:`\\ell`.

    NOTE: not as one number :math:`L = m + \\log \\ell` as FlashAttention
    does: when :math:`|m|` is huge (clipped scores near the dtype's max)
    :math:`m + \\log \\ell` rounds to :math:`m` and :math:`e^{S - L}` would
    no longer sum to 1 (two tied scores would each get weight 1), and for
    :math:`|m| \\sim 10^4` it already costs digits against the reference.

    The backward (:func:`attention_backward`) recomputes the weights block
    by block, :math:`P_{ij} = e^{S_{ij} - m_i} / \\ell_i`, and with
    :math:`\\Delta = \\mathrm{rowsum}(\\bar O \\odot O)`, which equals the
    reference's :math:`\\mathrm{rowsum}(P \\odot \\bar P)` because
    :math:`\\sum_j P_j (\\bar O \\cdot v_j) = \\bar O \\cdot O`:

    .. math:: \\bar V_j = \\sum_i P_{ij}^T \\bar O_i, \\quad
              \\bar P_{ij} = \\bar O_i V_j^T, \\quad
              \\bar S_{ij} = P_{ij} \\odot (\\bar P_{ij} - \\Delta_i),
    .. math:: \\bar Q_i = c \\sum_j \\bar S_{ij} K_j, \\quad
              \\bar K_j = \\sum_i \\bar S_{ij}^T (c\\,Q_i)

    where the division by :math:`\\ell_i` is applied to the rows of
    :math:`\\bar O_i` and :math:`\\Delta_i` (``(bq, Dv)`` work) rather than to
    each ``(bq, bk)`` block: :math:`\\bar S_{ij} = e^{S_{ij} - m_i} \\odot
    ((\\bar O_i / \\ell_i) V_j^T - \\Delta_i / \\ell_i)`.

    NOTE: a fully masked row (all its scores ``-inf``) has :math:`m = -\\infty`
    and :math:`\\ell = 0`; the running max is replaced by 0 in the exponents so
    no ``-inf - (-inf)`` arises; its output is 0, its :math:`1/\\ell` is taken
    as 0, so the recomputed weights are 0 and no gradient flows through it,
    as in the reference. With no keys at all (``S = 0``) every row is
    fully masked and the output is 0.

    Scores that may come near the float maximum, and values there, go to
    the reference path, which computes them exactly and clips only what
    overflows exactly (:func:`qkvnp.functional.attention_forward`).

    Threads: the query blocks of the forward and the key blocks of the
    backward are shared between ``qkvnp.get_num_threads()`` Python threads
    with BLAS pinned to one thread (``qkvnp.set_num_threads(1)`` runs them
    in the calling thread, BLAS still at one thread). Each
    thread has its own block temporaries, and each thread beyond the first
    sums ``dquery`` in its own query-sized array; those partial sums are added
    in a fixed order, so results repeat bitwise for a given thread count.

    Examples
    --------
    One key: every query returns that key's value.

    >>> out, cache = attention_forward(np.ones((2, 4)), np.ones((1, 4)), np.array([[3., 5.]]))
    >>> out
    array([[3., 5.],
           [3., 5.]])

    It agrees with the reference path, for any block size:

    >>> from qkvnp import functional
    >>> x = np.random.default_rng(0).standard_normal((2, 7, 4))
    >>> tiled, _ = attention_forward(x, x, x, is_causal=True, block_size=(3, 2))
    >>> reference, _ = functional.attention_forward(x, x, x, is_causal=True)
    >>> bool(np.allclose(tiled, reference, rtol=1e-12, atol=1e-12))
    True
    """
    grouped = split_groups(query, key, value, attn_mask, enable_gqa)
    if grouped is not None:  # K < H key/value heads: broadcast over each group
        result, cache = grouped_forward(attention_forward, grouped, is_causal, scale,
                                        block_size=block_size, dropout_p=dropout_p, rng=rng,
                                        dropout_mask=dropout_mask)
        return _write_out(result, out), cache
    originals = (query, key, value, attn_mask)
    query, key, value, lead = check_attention_inputs(query, key, value)
    scale = check_scale(scale, query.shape[-1])
    dropout_args = {"dropout_p": dropout_p, "rng": rng, "dropout_mask": dropout_mask}
    if core_scores_may_overflow(query, key, scale) or values_may_overflow(value):
        # NOTE: scores or values near the float maximum: the reference's exact clipping
        return _reference_forward(originals, is_causal, scale, block_size, out, dropout_args)
    T, D = query.shape[-2:]
    S, Dv = value.shape[-2:]
    dtype = query.dtype
    # NOTE: the causal mask is applied per block (never built as (T, S)), so
    # prepare_mask only validates and splits the user's mask.
    is_causal = check_is_causal(is_causal)
    bias, keep = prepare_mask(attn_mask, False, lead + (T, S), dtype)
    bias, keep = at_least_2d(bias), at_least_2d(keep)
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, lead + (T, S))
    # NOTE: the backward re-reads the inputs and the masks: the cache owns them
    query, key, value, bias, keep = owned((query, key, value, bias, keep), originals)
    if dropout is not None and dropout.mask is not None:
        dropout = dropout._replace(mask=owned((dropout.mask,), (dropout_mask,))[0])
    causal = causal_offset(is_causal, T, S)
    lead_size = math.prod(lead)
    block_q, block_k = _check_block_size(block_size, T, S, lead_size)
    live = live_blocks(bias, keep, causal, T, S, block_q, block_k)  # (nq, nk)
    safe = no_overflow(query, key, scale)

    q = np.broadcast_to(query, lead + (T, D))  # (..q, T, D) -> (..., T, D), a view
    k = np.broadcast_to(key, lead + (S, D))  # (..k, S, D) -> (..., S, D), a view
    v = np.broadcast_to(value, lead + (S, Dv))  # (..v, S, Dv) -> (..., S, Dv), a view
    returned_out = out is None
    if out is None:
        out = np.empty(lead + (T, Dv), dtype=dtype)  # (..., T, Dv)
    elif not isinstance(out, np.ndarray) or out.shape != lead + (T, Dv) or out.dtype != dtype:
        raise ValueError(
            f"out must be an ndarray of shape {lead + (T, Dv)} and dtype {dtype}, got "
            f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}".rstrip()
        )
    row_maxes = np.empty(lead + (T,), dtype=dtype)  # (..., T)
    row_sums = np.empty(lead + (T,), dtype=dtype)  # (..., T)
    # NOTE: a float mask may raise the scores above the bound, and a boolean one
    # would make masked keys' norms count: both keep the exact running max
    bounded = safe and bias is None and keep is None and S > 0
    bound = row_bounds(query, key, scale, lead, causal) if bounded else None
    problem = Problem(q, k, v, bias, keep, causal, safe, dtype.type(scale),
                       block_q, block_k, live, dropout, bound)
    # query blocks are independent: threads share them, each writing its own rows
    flops = 2 * math.prod(lead) * T * S * (D + Dv)
    run(lambda part: _quiet_blas(forward_rows, problem, part, out, row_maxes, row_sums),
        list(enumerate(range(0, T, block_q))), flops)
    cache = TiledAttentionCache(
        query, key, value, bias, keep, is_causal, scale, out, row_maxes, row_sums,
        block_q, block_k, live, safe, dropout,
    )
    # the backward reads out: a caller editing the returned array must not change it
    return (out.copy() if returned_out else out), cache


def _quiet_blas(blocks, *args):
    """``blocks(*args)`` with numpy's invalid-value report off, in the thread that runs it.

    NOTE: OpenBLAS's kernels may leave the FE_INVALID flag set on finite
    operands, which numpy reports as "invalid value encountered in matmul"
    (seen rarely, float32, in this path's row sums ``scores @ ones``; as in
    qkvnp.kernels.fast.dense_backward). The inputs are checked finite and
    the blocks test their sums explicitly (a NaN fails ``>=``): the flag is
    noise. np.errstate is per thread, so each worker sets it for its share.
    """
    with np.errstate(invalid="ignore"):
        return blocks(*args)


def _reference_forward(originals, is_causal, scale, block_size, out, dropout_args):
    """The reference forward, for scores near the float maximum, with this path's checks."""
    query, key, value, attn_mask = originals
    check_is_causal(is_causal)
    with np.errstate(over="ignore", invalid="ignore"):  # recomputed exactly, then clipped
        result, cache = F.attention_forward(query, key, value, attn_mask, is_causal, scale,
                                            **dropout_args)
    lead = cache.weights.shape[:-2]
    _check_block_size(block_size, cache.weights.shape[-2], cache.weights.shape[-1],
                      math.prod(lead))
    return _write_out(result, out), cache


def _write_out(result, out):
    """``result``, or ``out`` holding it when the caller gave ``out``."""
    if out is None:
        return result
    if not isinstance(out, np.ndarray) or out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"out must be an ndarray of shape {result.shape} and dtype "
                         f"{result.dtype}, got {getattr(out, 'shape', type(out).__name__)}")
    out[...] = result
    return out


def _check_grads_out(grads_out, lead, inputs, dtype):
    """Validate ``attention_backward``'s ``grads_out`` (exact shapes, no broadcasting)."""
    if not isinstance(grads_out, (tuple, list)) or len(grads_out) != 3:
        raise TypeError("grads_out must be a tuple (dquery, dkey, dvalue) of arrays")
    for name, grad, x in zip(("dquery", "dkey", "dvalue"), grads_out, inputs):
        expected = lead + x.shape[-2:]
        if not isinstance(grad, np.ndarray) or grad.shape != expected or grad.dtype != dtype:
            raise ValueError(
                f"grads_out's {name} must be an ndarray of shape {expected} and dtype {dtype}, "
                f"got {getattr(grad, 'shape', type(grad).__name__)} "
                f"{getattr(grad, 'dtype', '')}".rstrip()
            )
    return grads_out


def attention_backward(dout, cache, grads_out=None, check=True):
    """Backward of :func:`attention_forward`, recomputing the weights by blocks.

    Parameters
    ----------
    dout : ndarray, shape (..., T, Dv)
        Same shape as the forward output (it is not broadcast).
    cache : TiledAttentionCache
    grads_out : tuple of 3 ndarray, optional
        ``(dquery, dkey, dvalue)`` to write into instead of allocating (they
        may be strided views), with the shapes and dtype of ``query``, ``key``
        and ``value``, which must then have ``dout``'s leading dims (no
        broadcasting). A layer passes the slices of its fused projection
        gradient and so saves a copy of all three.

    Returns
    -------
    dquery : ndarray, shape of ``query``
    dkey : ndarray, shape of ``key``
    dvalue : ndarray, shape of ``value``

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...), or
        ``grads_out`` is not a tuple of three arrays.
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf,
        or an array of ``grads_out`` has the wrong shape or dtype.

    Notes
    -----
    The equations are in :func:`attention_forward`. Loops run over key blocks
    outside and query blocks inside, so the gradients of a key block are
    summed in ``(..., bk, D)`` accumulators and written once; ``dquery`` is
    accumulated in place. Temporaries are ``(..., bq, bk)``, ``(..., bq, D)``
    and ``(..., bk, D)`` blocks, plus :math:`\\Delta` of shape ``(..., T)``.

    Examples
    --------
    >>> from qkvnp import functional
    >>> rng = np.random.default_rng(1)
    >>> q, k, v, g = (rng.standard_normal(s) for s in [(5, 3), (6, 3), (6, 2), (5, 2)])
    >>> tiled = attention_backward(g, attention_forward(q, k, v, block_size=2)[1])
    >>> reference = functional.attention_backward(g, functional.attention_forward(q, k, v)[1])
    >>> all(np.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(tiled, reference))
    True
    """
    if isinstance(cache, (F.AttentionCache, GroupedCache)):  # reference, or grouped heads
        with np.errstate(over="ignore", invalid="ignore"):  # recomputed exactly
            if isinstance(cache, GroupedCache):  # the core's backward sums each group
                grads = grouped_backward(attention_backward, dout, cache)
            else:  # a forward deferred to the reference
                grads = F.attention_backward(dout, cache, check=check)
        if grads_out is None:
            return grads
        for target, grad in zip(grads_out, grads):
            target[...] = grad
        return tuple(grads_out)
    out = cache.out
    if check:
        dout = as_upstream_grad(dout, "dout", out.shape, out.dtype)  # no copy if already out.dtype
    return _attention_backward(dout, cache, grads_out)


def _attention_backward(dout, cache, grads_out=None):
    """:func:`attention_backward` of a ``dout`` already checked and cast."""
    (query, key, value, bias, keep, is_causal, scale, out, row_max, row_sum,
     block_q, block_k, live, safe, dropout) = cache
    dtype = out.dtype
    lead = out.shape[:-2]
    T, D = query.shape[-2:]
    S, Dv = value.shape[-2:]

    q = np.broadcast_to(query, lead + (T, D))  # (..q, T, D) -> (..., T, D), a view
    k = np.broadcast_to(key, lead + (S, D))  # (..k, S, D) -> (..., S, D), a view
    v = np.broadcast_to(value, lead + (S, Dv))  # (..v, S, Dv) -> (..., S, Dv), a view
    delta = np.einsum("...td,...td->...t", dout, out)[..., None]  # (..., T, Dv) -> (..., T, 1)
    # P = exp(S - m) / l: the 1/l goes into dO and Delta (per row, (..., bq, Dv))
    # instead of a pass over each (..., bq, bk) block.
    shift = np.where(np.isneginf(row_max), 0, row_max)[..., None]  # (..., T) -> (..., T, 1)
    with np.errstate(divide="ignore"):
        inv_sum = np.where(row_sum == 0, 0, 1 / row_sum)[..., None]  # (..., T) -> (..., T, 1)
    delta *= inv_sum  # (..., T, 1)
    # dquery sums over key blocks; a query broadcast over the leading dims
    # needs a full-size accumulator, reduced at the end.
    if grads_out is None:
        dq = np.zeros(lead + (T, D), dtype=dtype)  # (..., T, D)
        dkey = np.zeros(key.shape, dtype=dtype)
        dvalue = np.zeros(value.shape, dtype=dtype)
    else:
        dq, dkey, dvalue = _check_grads_out(grads_out, lead, (query, key, value), dtype)
        for grad in grads_out:
            grad[...] = 0
    problem = Problem(q, k, v, bias, keep, causal_offset(is_causal, T, S), safe, dtype.type(scale),
                       block_q, block_k, live, dropout)
    blocks = list(enumerate(range(0, S, block_k)))
    # NOTE: key blocks are independent but for dquery, their sum over key
    # blocks. A thread given a share of the key blocks other than the first
    # adds into its own dquery accumulator (one query-sized array per extra
    # thread), summed below in a fixed order: the result does not depend on
    # which thread finishes first.
    partials = {}

    def task(part):
        if part and part[0] != blocks[0]:
            partials[part[0][0]] = own = np.zeros_like(dq)
        else:
            own = dq
        _quiet_blas(backward_columns, problem, part, dout, shift, inv_sum, delta, own, dkey,
                    dvalue)

    run(task, blocks, 4 * math.prod(lead) * T * S * (D + Dv))
    for first in sorted(partials):
        dq += partials.pop(first)
    dq *= dtype.type(scale)
    dquery = sum_to_shape(dq, query.shape)  # (..., T, D) -> (..q, T, D)
    return dquery, dkey, dvalue
