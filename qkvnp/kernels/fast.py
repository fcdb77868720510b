"""The fast dense attention core (``impl="fast"``): the math of
:mod:`qkvnp.functional`, tuned for the CPU.

Shape key: T query length, S key length, D head dim (of queries and keys),
Dv head dim of values, ``...`` any leading (batch, head) dims, G one block of
them, R the rows of a block.

Same semantics as :func:`qkvnp.functional.attention_forward` (masks, causal,
fully masked rows, validation errors), same results (float32 within 1e-5
and float64 within 1e-12 relative of the reference, the table of
:data:`qkvnp.kernels.PATH_TOLERANCES`), but written for speed. What it does
differently, each step measured:

- no scipy: the softmax is written in place into the score buffer, and it is
  **not normalised**: the cache keeps ``exp_scores = exp(S - m)`` and
  ``inv_sum = 1 / rowsum``; the division is applied to ``(T, Dv)`` and
  ``(T, D)`` operands instead of the ``(T, S)`` matrix (except for a small
  problem run serially, whose few scores are normalised: its ``(T, D)``
  operands are strided views of the layer's projections, slower to scale);
- ``m`` is not the row max but the bound ``|q| max|k| + max(mask row)``,
  known before the scores (no max pass: numpy's ``max`` along a short last
  axis is slow); a block whose largest exponential would fall below
  ``2**-24`` (subnormal exponentials are 100x slower and lose precision),
  with overflowed scores or fully masked rows takes the exact max, as the
  reference does;
- the scale ``1/sqrt(D)`` is folded into Q (a ``(T, D)`` product);
- a block of (batch, head) groups whose scores fit in ``row_block_bytes`` (a
  setting of :mod:`qkvnp.kernels._runtime`), which is nearly every block below
  L = 1448 in float32, runs in a few whole-array calls
  (:mod:`qkvnp.kernels.fast_small`): short-axis sums are
  matmuls with a column of ones, and from 128k scores on ``exp2`` (faster than
  ``exp``) runs on scores pre-multiplied by ``log2(e)``; the backward takes
  ``delta = rowsum(P * dP)`` from the ``dP`` it computed;
- larger blocks are processed by rows in chunks of about ``row_block_bytes``
  so that the elementwise passes run in cache: ``[q | -m] @ [k | 1]^T`` yields
  ``S - m`` in the matmul itself, ``E @ [v | 1]`` the output and the row sums
  together, a few probe keys check that the bound is within
  :data:`MAX_BOUND_GAP` bits of the max; the backward uses
  ``rowsum(P * dP) = rowsum(dO * O)`` (a ``(T, Dv)`` product), gets
  ``dP - delta`` from one matmul ``[dO | -delta] @ [V | 1]^T`` and computes
  ``dK^T = Q^T dS`` and ``dV^T = dO^T P`` (measured up to 1.5x faster than
  ``dS^T Q`` in float64);
- under the shared causal mask, the chunks have at most ``causal_row_block``
  rows, and every product and pass of a chunk runs on the keys its last row
  sees only: most of the masked triangle is neither computed nor written
  (the cache's ``chunk_rows`` says which numerators were left unwritten);
- results are written with ``out=`` into their final arrays (possibly
  strided views: numpy hands them to BLAS);
- the (batch, head) groups are split into blocks that the worker threads
  (``qkvnp.set_num_threads``) process concurrently with BLAS pinned to one
  thread (ufuncs and BLAS release the GIL), from ``min_parallel_flops`` on;
  smaller jobs, and every job when the BLAS thread count cannot be set (no
  OpenBLAS found), run in the calling thread, BLAS still at one thread.

:func:`dense_forward` / :func:`dense_backward` are the core on preallocated
buffers, for the layer kernels of :mod:`qkvnp.kernels.mha`. How their blocked
passes differ from the whole-array ones: :mod:`qkvnp.kernels.fast_small`.

Measurements (timings against PyTorch, the tuning sweeps, the recompute
experiment): ``benchmarks/RESULTS.md``.
"""
import math
from collections import namedtuple

import numpy as np

from .. import functional as F
from .._checks import (as_upstream_grad, check_attention_inputs, check_scale,
                       core_scores_may_overflow, owned, values_may_overflow)
from ..functional import sum_to_shape
from ..ops.dropout import dense_keep, keep_scale, prepare_dropout
from ..ops.gqa import GroupedCache, grouped_backward, grouped_forward, split_groups, ungroup_weights
from ..ops.masks import additive_mask, causal_factors, causal_mask_offset, prepare_mask
from ._runtime import blocks, get_block_sizes, row_slices, run, threads_for
from .buffers import recycled_empty
from .fast_small import LARGE_SCORES, mask_row_max, masked_exp, small_backward, small_forward

__all__ = [
    "attention_forward",
    "attention_backward",
    "attention_weights",
    "dense_forward",
    "dense_backward",
    "FastAttentionCache",
    "MAX_BOUND_GAP",
    "PROBE_KEYS",
]


#: The softmax subtracts a cheap upper bound of each row max instead of the
#: max itself; a block whose bound may exceed the max by more than this many
#: bits (judged from :data:`PROBE_KEYS` sampled keys) takes the exact max.
MAX_BOUND_GAP = 24
PROBE_KEYS = 8

FastAttentionCache = namedtuple(
    "FastAttentionCache",
    "query key value exp_scores inv_sum out scale shapes dropout_mask dropout_p causal chunk_rows",
    defaults=(None, 0.0, None, None),
)
FastAttentionCache.__doc__ = """What :func:`attention_backward` reads.

query : (..., T, D) query already multiplied by ``scale``.
key, value : (..., S, D), (..., S, Dv) broadcast to the common leading dims.
exp_scores : (..., T, S) ``exp(S - m)``, unnormalised softmax numerators
    (0 at masked positions), ``m`` an upper bound of the row max (or the row
    max itself); the weights are ``exp_scores * inv_sum``. Or, when
    ``inv_sum`` is None, the weights themselves (see :func:`dense_forward`).
    Stored by causal chunks when ``chunk_rows`` is set (below): read it
    through :func:`attention_weights`.
inv_sum : (..., T, 1) ``1 / rowsum(exp_scores)``, 0 for a fully masked row; or None.
out : (..., T, Dv) the forward output.
scale : float.
shapes : the original shapes of query, key and value (for broadcast inputs).
dropout_mask : bool, broadcastable to (..., T, S), True = keep; None without dropout.
dropout_p : float, the drop probability (kept weights are scaled by 1 / (1 - p)).
causal : None, or the offset of the diagonal of a shared causal mask (query
    ``i`` sees keys ``j <= i + causal``: :func:`qkvnp.ops.masks.causal_mask_offset`).
chunk_rows : None when ``exp_scores`` is the plain ``(..., T, S)`` array. Else
    the forward went by causal row chunks of this many rows, and stored each
    chunk's numerators of the keys its rows see (:func:`_live_keys`)
    packed in the chunk's first ``R * live`` entries (:func:`_packed`); the
    rest of its rows is unwritten. The backward takes the same chunks, and
    :func:`attention_weights` unpacks them.
"""

# ---------------------------------------------------------------- core


def _exp_scores_careful(scores, query, key_t, mask):
    """Recompute a block's scores the reference way; return the row max.

    Used only for blocks with an overflowed score (inf, NaN) or a fully
    masked row: overflow is clipped to the dtype's largest finite value as in
    :func:`qkvnp.functional.attention_forward`, and a fully masked row gets
    max 0 so that ``exp(-inf - 0) = 0``.
    """
    big = np.finfo(scores.dtype).max
    np.matmul(query, key_t, out=scores)
    np.nan_to_num(scores, copy=False, nan=np.nan, posinf=big, neginf=-big)  # NaN stays NaN
    if mask is not None:
        scores += mask
        np.minimum(scores, big, out=scores)  # -inf stays -inf
    row_max = scores.max(axis=-1, keepdims=True)
    row_max[np.isneginf(row_max)] = 0  # NOTE: fully masked row -> weights 0, output 0
    return row_max


def _chunk_rows(T, S, itemsize, causal=None):
    """Rows of one chunk of a ``(G, T, S)`` block: about ``row_block_bytes`` per group.

    A chunk's scores stay in the CPU cache between the matmul that writes
    them and the elementwise passes that follow. Under a causal mask
    (``causal``: the offset of its diagonal) a chunk has at most
    ``causal_row_block`` rows: each chunk skips the keys that none of its
    rows sees (:func:`_live_keys`), so that smaller chunks skip more of the
    masked triangle. ``T``: one chunk.
    """
    sizes = get_block_sizes()
    rows = sizes["row_block_bytes"] // max(1, S * itemsize)
    if causal is not None:
        rows = min(rows, sizes["causal_row_block"])
    return T if rows >= T else min(T, max(rows, sizes["min_row_block"]))


def _row_slices(T, rows):
    """The chunks of ``rows`` rows of ``T``, as slices (``[slice(None)]``: one chunk)."""
    return [slice(None)] if rows >= T else row_slices(T, rows)


def _live_keys(rows, S, causal):
    """How many leading keys the rows ``rows`` (a slice) may see: ``S`` without a causal mask.

    Query ``i`` sees keys ``j <= i + causal``, so a chunk's last row sees
    the most: the keys before ``rows.stop + causal``. A chunk that sees no
    key at all (bottom-right aligned, ``T > S``) keeps them all, for the
    fully masked rows' careful path.
    """
    if causal is None or rows.stop is None:
        return S
    live = min(S, rows.stop + causal)
    return live if live > 0 else S


def _packed(block, live):
    """A ``(..., R, live)`` view of the ``(..., R, S)`` rows ``block``, packed in their first ``R * live`` entries.

    A causal chunk's numerators are stored this way, its ``R`` rows of
    ``live`` keys one after the other: numpy's ufuncs ran about 2x slower on
    the strided view ``block[..., :live]`` (rows ``S`` apart) than on
    contiguous rows (benchmarks/NOTES.md). Rows that are not
    contiguous in memory get that strided view (every reader of a buffer
    makes the same choice from its strides).
    """
    item = block.itemsize
    if live == block.shape[-1] or block.strides[-2:] != (block.shape[-1] * item, item):
        return block[..., :live]
    return np.lib.stride_tricks.as_strided(block, block.shape[:-1] + (live,),
                                           block.strides[:-2] + (live * item, item))


def _augment(x, last, factor=None):
    """``[x * factor | last]``: a copy of ``x`` with one more column holding ``last``."""
    out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)  # (..., L, n) -> (..., L, n + 1)
    if factor is None:
        out[..., :-1] = x
    else:
        np.multiply(x, factor, out=out[..., :-1])
    out[..., -1:] = last
    return out


def _augment_t(x, last):
    """``[x | last]^T`` laid out contiguously: ``(..., L, n) -> (..., n + 1, L)``."""
    out = np.empty(x.shape[:-2] + (x.shape[-1] + 1, x.shape[-2]), x.dtype)  # (..., n + 1, L)
    out[..., :-1, :] = x.swapaxes(-1, -2)
    out[..., -1, :] = last
    return out


def _whole_array(threads, exp_scores):
    """Run a core pass serially in whole-array calls: one thread, and scores of one block.

    A larger problem on one thread (a worker's share of a layer's batch, or
    ``set_num_threads(1)``) still goes by blocks of ``fast_block_bytes``:
    whole-array passes over its scores would run out of cache and allocate
    temporaries of their size (the layer at (4, 512, 512, 8) split over two
    workers peaked at 126 MiB float32 instead of 90, 249 float64 instead of 168).
    """
    return threads == 1 and exp_scores.nbytes <= get_block_sizes()["fast_block_bytes"]


def dense_forward(query, key, value, mask, exp_scores, inv_sum, out, dropout_mask=None,
                  dropout_p=0.0):
    """Fill ``exp_scores``, ``inv_sum`` and ``out`` (all preallocated, full leading dims).

    ``query`` is already scaled; ``mask`` is None or an additive mask whose
    shape broadcasts to ``exp_scores``' (it is broadcast here). With a
    ``dropout_mask`` (bool, True = keep, broadcastable), ``out`` is
    ``r ((E * Z) V) / (1 - p)``: ``exp_scores`` and ``inv_sum`` stay those of
    the softmax before dropout.

    Returns ``(normalized, chunk_rows)``. ``normalized`` is True when
    ``exp_scores`` holds the weights ``P = E r`` themselves (a problem run
    serially with few scores, where normalising the contiguous ``(T, S)``
    scores costs less than scaling the strided ``(T, Dv)`` output and three
    ``(T, D)`` operands of the backward, measured); the cache then stores
    ``inv_sum=None``. False: numerators and ``inv_sum``. ``chunk_rows``: None,
    or the rows of the causal chunks whose unseen keys' numerators were left
    unwritten (:class:`FastAttentionCache`'s field of that name).
    """
    lead = exp_scores.shape[:-2]
    T, S = exp_scores.shape[-2:]
    if S == 0:  # NOTE: no key at all: every row is fully masked, output 0
        out[...] = 0
        inv_sum[...] = 0
        return False, None
    flops = 2 * math.prod(lead) * T * S * (query.shape[-1] + value.shape[-1] + 2)
    dtype = exp_scores.dtype
    mask_max = mask_row_max(mask, dtype)
    factors = causal_factors(mask, dtype)  # None, or the causal mask as 0 / 1: exp(S) * factors
    causal = causal_mask_offset(mask, dtype)  # None, or that mask's diagonal
    threads = threads_for(flops)
    drop = None
    if dropout_mask is not None:
        drop = (np.broadcast_to(dropout_mask, lead + (T, S)), keep_scale(dropout_p, dtype))
    normalize = exp_scores.size < LARGE_SCORES  # serial and few scores: keep P (see Returns)
    if _whole_array(threads, exp_scores) and small_forward(
            query, key, value, mask, mask_max, exp_scores, inv_sum, out, drop, normalize=normalize,
            factors=factors):
        return normalize, None
    chunks = _row_slices(T, _chunk_rows(T, S, exp_scores.itemsize, causal))
    log2e = dtype.type(np.log2(np.e))
    small_mask = small_mask_max = None
    if factors is not None:
        factors = np.broadcast_to(factors, lead + (T, S))
    if mask is not None:
        small_mask = np.broadcast_to(mask, lead + (T, S))
        small_mask_max = np.broadcast_to(mask_max, lead + (T, 1))
        # base-2 scores: exp(x) = exp2(x log2(e)) and exp2 is the faster ufunc;
        # the causal mask's 0 and -inf are their own base-2 values: no (T, S) pass
        mask = np.broadcast_to(mask if factors is not None else mask * log2e, lead + (T, S))
        mask_max = np.broadcast_to(mask_max * log2e, lead + (T, 1))
    # a few keys whose scores give a lower bound on each row max (key 0 is
    # visible under a causal mask and usually under key padding)
    probes = np.unique(np.linspace(0, S - 1, min(S, PROBE_KEYS)).astype(np.intp))

    def task(part):
        # NOTE: overflow is handled below (clipped as in the reference), so
        # numpy's overflow warnings of the matmul and the subtraction are noise.
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            for idx in part:
                k, v = key[idx], value[idx]  # (G, S, D), (G, S, Dv)
                if len(chunks) == 1 and small_forward(
                        query[idx], k, v, None if mask is None else small_mask[idx],
                        None if mask is None else small_mask_max[idx],
                        exp_scores[idx], inv_sum[idx], out[idx],
                        None if drop is None else (drop[0][idx], drop[1]),
                        factors=None if factors is None else factors[idx]):
                    continue  # the block fits in cache: whole-array calls
                key_aug_t = _augment_t(k, 1)  # (G, S, D) -> (G, D + 1, S)
                value_aug = _augment(v, 1)  # (G, S, Dv) -> (G, S, Dv + 1)
                key_norm = np.sqrt(np.max(np.sum(k * k, axis=-1), axis=-1))[..., None, None]  # (G, 1, 1)
                for rows in chunks:
                    block = idx + (Ellipsis, rows, slice(None))
                    _forward_rows(exp_scores[block], query[block], k, key_aug_t, key_norm, value_aug,
                                  None if mask is None else mask[block],
                                  None if mask is None else mask_max[block],
                                  inv_sum[block], out[block], probes, log2e,
                                  None if drop is None else (drop[0][block], drop[1]),
                                  None if factors is None else factors[block],
                                  _live_keys(rows, S, causal))

    run(task, blocks(lead, T * S * exp_scores.itemsize, threads), flops)
    return False, (chunks[0].stop if causal is not None and len(chunks) > 1 else None)


def _forward_rows(scores, q, k, key_aug_t, key_norm, value_aug, mask, mask_max, inv, o,
                  probes, log2e, drop=None, factors=None, live=None):
    """Forward of one block of rows: scores, softmax numerators, output.

    The row max is replaced by the bound ``m = |q| max|k| + max(mask row)``
    (Cauchy-Schwarz), known before the scores, so that ``(S - m) log2(e)``
    comes out of one matmul, ``[q log2(e) | -m log2(e)] @ [k | 1]^T``, and
    ``exp(S - m)`` is one ``exp2`` in place (``mask`` comes pre-multiplied by
    ``log2(e)``); likewise ``E @ [v | 1]`` gives the output and the row sums
    together.

    NOTE: the bound must not exceed the true row max by much: the
    exponentials would drift into the subnormal range, where ``exp2`` and the
    matmul were measured 100x slower. The scores of a few ``probes`` keys give
    a lower bound on the row max; a block where bound - probe max exceeds
    :data:`MAX_BOUND_GAP` bits, with overflowed scores or with a fully masked
    row is redone by the reference recipe (:func:`_exp_scores_careful`,
    with ``mask / log2(e)``), i.e. with the exact row max. With ``drop =
    (dropout_mask, 1 / (1 - p))`` the output is recomputed from the kept
    numerators (one more matmul: the row sums need them all). ``factors``:
    None, or a causal ``mask`` as 0 / 1 (:func:`qkvnp.ops.masks.causal_factors`),
    multiplied after ``exp2`` instead of adding the mask before it.

    ``live`` (a causal chunk's, :func:`_live_keys`): only the first ``live``
    keys are seen by any of the rows; the rest of their scores, whose
    numerators are 0, are neither computed nor written, and the chunk's
    scores are stored packed (:func:`_packed`). The bound's ``max|k|`` over
    all keys stays a bound.
    """
    if live is not None and live < scores.shape[-1]:
        scores, k, key_aug_t, value_aug = (_packed(scores, live), k[..., :live, :],
                                           key_aug_t[..., :live], value_aug[..., :live, :])
        mask = None if mask is None else mask[..., :live]
        factors = None if factors is None else factors[..., :live]
        drop = None if drop is None else (drop[0][..., :live], drop[1])
        probes = probes[probes < live]  # key 0 among them: live > 0
    bound = np.sqrt(np.sum(q * q, axis=-1, keepdims=True)) * key_norm  # (G, R, 1)
    if mask_max is not None:
        bound += mask_max
    out_aug = np.empty(o.shape[:-1] + (o.shape[-1] + 1,), o.dtype)  # (G, R, Dv + 1)
    bound *= log2e  # base 2 from here on
    query_aug = _augment(q, -bound, log2e)  # (G, R, D) -> (G, R, D + 1)
    probe_scores = query_aug[..., :-1] @ key_aug_t[..., :-1, probes]  # (G, R, D) @ (G, D, P) -> (G, R, P)
    if mask is not None:
        probe_scores += mask[..., probes]
    gap = bound - probe_scores.max(axis=-1, keepdims=True)  # >= bound - row max, (G, R, 1)
    careful = not (gap <= MAX_BOUND_GAP).all()  # also catches inf and NaN
    if not careful:
        np.matmul(query_aug, key_aug_t, out=scores)  # (S - m) log2 e: (G, R, D+1) @ (G, D+1, S) -> (G, R, S)
        masked_exp(scores, mask, factors, np.exp2)  # every score is at most m: exp2 <= 1
        np.matmul(scores, value_aug, out=out_aug)  # [E v | rowsum E]: (G, R, S) @ (G, S, Dv+1) -> (G, R, Dv+1)
        row_sum = out_aug[..., -1:]
        # NOTE: a row sum of 0 (every exponential underflowed) means the bound
        # was far above the row max after all: at scores of ~1e20 the fused
        # ``S - m`` carries a rounding error of eps * m, larger than the gap the
        # probes measured (found by the extreme-magnitude property test)
        careful = not (np.isfinite(row_sum).all() and (row_sum > 0).all())
    if careful:
        row_max = _exp_scores_careful(scores, q, k.swapaxes(-1, -2),
                                      None if mask is None else mask / log2e)
        scores -= row_max
        np.exp(scores, out=scores)
        np.matmul(scores, value_aug, out=out_aug)  # (G, R, S) @ (G, S, Dv+1) -> (G, R, Dv+1)
        row_sum = out_aug[..., -1:]
        dead = row_sum == 0
        row_sum[dead] = 1
        np.reciprocal(row_sum, out=inv)
        inv[dead] = 0
    else:
        np.reciprocal(row_sum, out=inv)
    if drop is None:
        np.multiply(out_aug[..., :-1], inv, out=o)  # (G, R, Dv)
    else:  # O = r ((E * Z) V) / (1 - p)
        np.matmul(scores * drop[0], value_aug[..., :-1], out=o)  # (G, R, S) @ (G, S, Dv) -> (G, R, Dv)
        o *= inv * drop[1]


def dense_backward(dout, cache, dquery, dkey, dvalue, dquery_scale):
    """Write the gradients into ``dquery``, ``dkey``, ``dvalue`` (preallocated).

    ``dout`` is already checked; ``cache`` is a :class:`FastAttentionCache`
    whose arrays all have the full leading dims. ``dquery`` receives
    ``dquery_scale * dS @ K``: pass the forward scale for the gradient of the
    unscaled query, 1 for the gradient of the scaled one.
    """
    query, key, value, exp_scores, inv_sum, out = cache[:6]
    causal = cache.causal
    lead = exp_scores.shape[:-2]
    T, S = exp_scores.shape[-2:]
    flops = 4 * math.prod(lead) * T * S * (query.shape[-1] + value.shape[-1] + 1)
    threads = threads_for(flops)
    drop = None
    if cache.dropout_mask is not None:
        drop = (np.broadcast_to(cache.dropout_mask, lead + (T, S)),
                keep_scale(cache.dropout_p, out.dtype))
    # NOTE: OpenBLAS's kernels may leave the FE_INVALID flag set on finite
    # operands, which numpy reports as "invalid value encountered in matmul"
    # (seen rarely, state-dependent: float32 (2, 5) @ (5, 1), the row sums of
    # small_backward). The inputs are checked finite: the flag is noise, as in
    # the forward. np.errstate is per thread, so the workers set it too (task).
    if cache.chunk_rows is None and _whole_array(threads, exp_scores):
        with np.errstate(invalid="ignore"):
            small_backward(dout, query, key, value, exp_scores, inv_sum, out, dquery, dkey, dvalue,
                           dquery_scale, drop)
        return
    if inv_sum is None:  # exp_scores holds the weights: E = P, r = 1
        inv_sum = np.ones(lead + (T, 1), exp_scores.dtype)
    # the forward's causal chunks if it left numerators unwritten; with every
    # one written (0 where masked), any chunks
    chunks = _row_slices(T, cache.chunk_rows or _chunk_rows(T, S, exp_scores.itemsize, causal))

    def task(part):
        with np.errstate(invalid="ignore"):  # in the worker thread (see the NOTE above)
            backward_blocks(part)

    def backward_blocks(part):
        scratch = partial = None
        for idx in part:
            k = key[idx]  # (G, S, D)
            if len(chunks) == 1:  # the block fits in cache: whole-array calls
                small_backward(dout[idx], query[idx], k, value[idx], exp_scores[idx], inv_sum[idx],
                               out[idx], dquery[idx], dkey[idx], dvalue[idx], dquery_scale,
                               None if drop is None else (drop[0][idx], drop[1]))
                continue
            value_aug_t = _augment_t(value[idx], 1)  # (G, S, Dv) -> (G, Dv + 1, S)
            # NOTE: dK^T = Q^T dS and dV^T = dO^T P measured faster than dS^T Q
            # and P^T dO (up to 1.5x in float64): accumulate the transposes.
            dk_t = np.empty(dkey[idx].swapaxes(-1, -2).shape, k.dtype)  # (G, D, S)
            dv_t = np.empty(dvalue[idx].swapaxes(-1, -2).shape, k.dtype)  # (G, Dv, S)
            for n, rows in enumerate(chunks):
                live = _live_keys(rows, S, causal)
                if n == 0 and live < S:  # the first chunk writes, the others add: 0 beyond its keys
                    dk_t[..., live:] = 0
                    dv_t[..., live:] = 0
                block = idx + (Ellipsis, rows, slice(None))
                weights_num = exp_scores[block]  # (G, R, S)
                R = weights_num.shape[-2]
                if scratch is None or scratch.shape[:-2] != weights_num.shape[:-2] or scratch.shape[-2] < R:
                    scratch = np.empty_like(weights_num)
                if n and (partial is None or partial[0].shape != dk_t.shape or partial[1].shape != dv_t.shape):
                    partial = np.empty_like(dk_t), np.empty_like(dv_t)
                _backward_rows(dout[block], out[block], query[block], k, value_aug_t, weights_num,
                               inv_sum[block], scratch[..., :R, :], dquery[block], dk_t, dv_t,
                               dquery_scale, None if n == 0 else partial,
                               None if drop is None else (drop[0][block], drop[1]), live)
            dkey[idx] = dk_t.swapaxes(-1, -2)  # (G, D, S) -> (G, S, D)
            dvalue[idx] = dv_t.swapaxes(-1, -2)  # (G, Dv, S) -> (G, S, Dv)

    run(task, blocks(lead, T * S * exp_scores.itemsize, threads), flops)


def _backward_rows(do, o, q, k, value_aug_t, weights_num, inv, dscores, dq, dk_t, dv_t, dq_scale,
                   partial, drop=None, live=None):
    """Backward of one block of rows; ``dk_t``, ``dv_t`` (transposed) are
    written (``partial`` is None) or accumulated through ``partial`` buffers.

    ``dP - delta`` comes out of one matmul: ``[dO | -delta] @ [V | 1]^T``;
    with ``drop = (Z, 1 / (1 - p))`` it is ``(dO V^T) * Z / (1 - p) - delta``
    (``delta = rowsum(dO * O)`` still: see ``docs/derivations.md``).
    ``live``: as in :func:`_forward_rows` (``weights_num`` and the scratch
    ``dscores`` packed); only the first ``live`` columns of ``dk_t`` and
    ``dv_t`` are written (or added to).
    """
    if live is not None and live < weights_num.shape[-1]:
        weights_num, dscores, k, value_aug_t = (_packed(weights_num, live), _packed(dscores, live),
                                                k[..., :live, :], value_aug_t[..., :live])
        dk_t, dv_t = dk_t[..., :live], dv_t[..., :live]
        if partial is not None:
            partial = partial[0][..., :live], partial[1][..., :live]
        drop = None if drop is None else (drop[0][..., :live], drop[1])
    delta = np.sum(do * o, axis=-1, keepdims=True)  # rowsum(P * dP) = rowsum(dO * O), (G, R, 1)
    dv_rows = dv_t if partial is None else partial[1]
    if drop is None:
        # dV^T = dO^T P = (dO / rowsum)^T E
        np.matmul((do * inv).swapaxes(-1, -2), weights_num, out=dv_rows)  # (G, Dv, R) @ (G, R, S) -> (G, Dv, S)
        dout_aug = _augment(do, -delta)  # (G, R, Dv) -> (G, R, Dv + 1)
        np.matmul(dout_aug, value_aug_t, out=dscores)  # dP - delta: (G, R, Dv+1) @ (G, Dv+1, S) -> (G, R, S)
    else:
        np.multiply(weights_num, drop[0], out=dscores)  # E * Z, (G, R, S)
        np.matmul((do * (inv * drop[1])).swapaxes(-1, -2), dscores, out=dv_rows)  # (G, Dv, R) @ (G, R, S) -> (G, Dv, S)
        np.matmul(do, value_aug_t[..., :-1, :], out=dscores)  # (G, R, Dv) @ (G, Dv, S) -> (G, R, S)
        dscores *= drop[0]
        dscores *= drop[1]
        dscores -= delta  # dP - delta
    dscores *= weights_num  # = rowsum * dS, with dS = P * (dP - delta)
    np.matmul(dscores, k, out=dq)  # (G, R, S) @ (G, S, D) -> (G, R, D)
    dq *= inv * dq_scale
    dk_rows = dk_t if partial is None else partial[0]
    np.matmul((q * inv).swapaxes(-1, -2), dscores, out=dk_rows)  # (G, D, R) @ (G, R, S) -> (G, D, S)
    if partial is not None:
        dv_t += dv_rows
        dk_t += dk_rows


def attention_forward(query, key, value, attn_mask=None, is_causal=False, scale=None, *,
                      dropout_p=0.0, rng=None, dropout_mask=None, enable_gqa=False, inference=False):
    """Scaled dot-product attention ``softmax(q k^T * scale + mask) v``, fast path.

    Same arguments, semantics and errors as
    :func:`qkvnp.functional.attention_forward`, dropout included (the same
    ``rng`` draws the same mask, :mod:`qkvnp.ops.dropout`).

    Parameters
    ----------
    query : ndarray, shape (..., T, D)
    key : ndarray, shape (..., S, D)
    value : ndarray, shape (..., S, Dv)
        Leading dims of the three broadcast against each other.
    attn_mask : ndarray of bool or float, optional
        Broadcastable to ``(..., T, S)``. Bool: True = may attend. Float: added.
    is_causal : bool or "bottom_right"
        Query ``i`` attends to keys ``0..i`` (True, top-left aligned) or
        ``0..i + S - T`` (``"bottom_right"``), combined with ``attn_mask`` as
        in the reference.
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    enable_gqa : bool, keyword-only
        Grouped-query attention, as in the reference: K/V are broadcast over
        each group of query heads, never repeated (:mod:`qkvnp.ops.gqa`).
    inference : bool, keyword-only
        True: no backward will read the cache (a KV-cache decoding step): nothing is copied for one.

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    cache : FastAttentionCache
        The softmax numerators and row sums rather than the weights; see
        :func:`attention_weights`. When the scores may come near the float
        maximum (``|scale| max|q| max|k| >= sqrt(finfo.max)``), the forward is
        the reference's and so is its cache
        (:class:`qkvnp.functional.AttentionCache`), which
        :func:`attention_backward` recognises.

    Raises
    ------
    ValueError
        On mismatched dims, a mask that does not broadcast, non-finite inputs.
    TypeError
        On a mask that is neither bool nor float.

    Notes
    -----
    Forward, with :math:`c` the scale and :math:`M` the additive mask
    (``-inf`` where a boolean mask forbids):

    .. math:: \\tilde Q = cQ,\\quad S = \\tilde Q K^T + M,\\quad
              E = e^{S - m},\\quad r = 1/\\mathrm{rowsum}(E),\\quad
              O = r \\odot (E V)

    where :math:`m \\ge \\max_{row} S` is the bound
    :math:`|\\tilde q|\\,\\max_j |k_j| + \\max_{row} M` (or the row max itself
    when that bound is loose; the weights do not depend on :math:`m`).

    Backward, with :math:`P = r \\odot E` and
    :math:`\\delta = \\mathrm{rowsum}(P \\odot \\bar P) = \\mathrm{rowsum}(\\bar O \\odot O)`:

    .. math:: \\bar V = E^T (r \\odot \\bar O),\\quad
              G = E \\odot (\\bar O V^T - \\delta),\\quad
              \\bar Q = c\\, r \\odot (G K),\\quad \\bar K = G^T (r \\odot \\tilde Q)

    (:math:`G = \\bar S / r`, the softmax backward of the reference times the
    row sum). A fully masked row has :math:`E = 0` and :math:`r = 0`: output
    0 and no gradient; so does every row when there is no key at all
    (``S = 0``, where the reference raises). Scores that may come near the
    float maximum, and values there, go to the reference (the cheap screens
    :func:`qkvnp._checks.core_scores_may_overflow` and
    :func:`qkvnp._checks.values_may_overflow`), which computes them exactly
    and clips only what overflows exactly.

    Large score buffers are recycled between calls once nothing refers to
    them (the ``recycle_bytes`` setting).

    Examples
    --------
    >>> out, cache = attention_forward(np.ones((2, 4)), np.ones((1, 4)), np.array([[3., 5.]]))
    >>> out
    array([[3., 5.],
           [3., 5.]])
    >>> [g.shape for g in attention_backward(np.ones((2, 2)), cache)]
    [(2, 4), (1, 4), (1, 2)]
    """
    grouped = split_groups(query, key, value, attn_mask, enable_gqa)
    if grouped is not None:  # K < H key/value heads: broadcast over each group
        return grouped_forward(attention_forward, grouped, is_causal, scale, dropout_p=dropout_p,
                               rng=rng, dropout_mask=dropout_mask, inference=inference)
    originals = (query, key, value)
    query, key, value, lead = check_attention_inputs(query, key, value)
    scale = check_scale(scale, query.shape[-1])
    if core_scores_may_overflow(query, key, scale) or values_may_overflow(value):
        # NOTE: scores or values near the float maximum: the reference's exact clipping
        # (its cache type tells attention_backward which backward to run)
        with np.errstate(over="ignore", invalid="ignore"):  # recomputed exactly, then clipped
            return F.attention_forward(*originals, attn_mask, is_causal, scale, dropout_p=dropout_p,
                                       rng=rng, dropout_mask=dropout_mask)
    (T, D), (S, Dv), dtype = query.shape[-2:], value.shape[-2:], query.dtype
    bias, keep = prepare_mask(attn_mask, is_causal, lead + (T, S), dtype)
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, lead + (T, S))
    drop_keep, drop_p = (None, 0.0) if dropout is None else (dense_keep(dropout), dropout.p)
    mask = additive_mask(bias, keep, dtype)
    scaled_query = np.empty(lead + (T, D), dtype)
    np.multiply(query, dtype.type(scale), out=scaled_query)  # (..., T, D), broadcast
    kept = (key, value, drop_keep)  # the cache owns what backward reads (none with inference)
    key, value, drop_keep = kept if inference else owned(kept, originals + (dropout_mask,))
    key_b = np.broadcast_to(key, lead + (S, D))
    value_b = np.broadcast_to(value, lead + (S, Dv))
    exp_scores = recycled_empty(lead + (T, S), dtype)
    inv_sum = np.empty(lead + (T, 1), dtype)
    out = np.empty(lead + (T, Dv), dtype)
    normalized, chunk_rows = dense_forward(scaled_query, key_b, value_b, mask, exp_scores,
                                           inv_sum, out, drop_keep, drop_p)
    # NOTE: the cache keeps its own copy of out (a (T, Dv) copy): a caller
    # editing the returned array in place must not change the gradients.
    cache = FastAttentionCache(scaled_query, key_b, value_b, exp_scores,
                               None if normalized else inv_sum, out if inference else out.copy(),
                               scale, (query.shape, key.shape, value.shape), drop_keep, drop_p,
                               causal_mask_offset(mask, dtype), chunk_rows)
    return out, cache


def attention_backward(dout, cache):
    """Backward of :func:`attention_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, Dv)
        Same shape as the forward output (it is not broadcast).
    cache : FastAttentionCache

    Returns
    -------
    dquery, dkey, dvalue : ndarray
        Shapes of the forward's ``query``, ``key`` and ``value``.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
    """
    if isinstance(cache, GroupedCache):  # the core's backward sums each group
        return grouped_backward(attention_backward, dout, cache)
    if isinstance(cache, F.AttentionCache):  # a forward deferred to the reference
        with np.errstate(over="ignore", invalid="ignore"):  # recomputed exactly
            return F.attention_backward(dout, cache)
    query, key, value, exp_scores, inv_sum, out, scale, shapes = cache[:8]
    dout = as_upstream_grad(dout, "dout", out.shape, out.dtype)  # no copy if already out.dtype
    dquery = np.empty(query.shape, out.dtype)
    dkey = np.empty(key.shape, out.dtype)
    dvalue = np.empty(value.shape, out.dtype)
    dense_backward(dout, cache, dquery, dkey, dvalue, out.dtype.type(scale))
    return (sum_to_shape(dquery, shapes[0]), sum_to_shape(dkey, shapes[1]),
            sum_to_shape(dvalue, shapes[2]))


def attention_weights(cache):
    """The attention weights ``(..., T, S)`` of a forward (a new array), after dropout.

    >>> _, cache = attention_forward(np.zeros((1, 2)), np.zeros((2, 2)), np.ones((2, 1)))
    >>> attention_weights(cache)
    array([[0.5, 0.5]])
    """
    if isinstance(cache, GroupedCache):  # (..., K, G, T, S) -> (..., H, T, S)
        return ungroup_weights(attention_weights(cache.inner), cache)
    if isinstance(cache, F.AttentionCache):  # a forward deferred to the reference
        return F.dropped_weights(cache)
    if cache.chunk_rows is not None:  # causal chunks, packed: unpack, zeros beyond their keys
        T, S = cache.exp_scores.shape[-2:]
        weights = np.zeros(cache.exp_scores.shape, cache.exp_scores.dtype)  # (..., T, S)
        for rows in _row_slices(T, cache.chunk_rows):
            live = _live_keys(rows, S, cache.causal)
            weights[..., rows, :live] = _packed(cache.exp_scores[..., rows, :], live)
        weights *= cache.inv_sum
    else:
        weights = (cache.exp_scores.copy() if cache.inv_sum is None  # (..., T, S)
                   else cache.exp_scores * cache.inv_sum)
    if cache.dropout_mask is not None:
        weights *= cache.dropout_mask
        weights *= keep_scale(cache.dropout_p, weights.dtype)
    return weights
