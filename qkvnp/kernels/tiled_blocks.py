"""The blocks of the tiled core: masks, scores and the row passes of :mod:`qkvnp.kernels.tiled`.

Shape key: T query length, S key length, D head dim of queries and keys, Dv
head dim of values, ``...`` any leading (batch, head) dims; ``bq`` and ``bk``
the query and key block sizes.

:func:`forward_rows` runs the online softmax over key blocks for a share of
the query blocks (:func:`_bounded_rows` first, with a fixed shift per row),
:func:`backward_columns` the gradients for a share of the key blocks. The
equations, and what they are checked against, are in
:func:`qkvnp.kernels.tiled.attention_forward`'s docstring.
"""
import math
from collections import namedtuple

import numpy as np

from ..ops.dropout import block_keep, keep_scale
from ..functional import sum_to_shape

__all__ = ["Problem", "at_least_2d", "live_blocks", "causal_blocks", "no_overflow", "row_bounds",
           "forward_rows", "backward_columns"]

# Diagonal blocks of a causal mask are reused by their offset i0 - j0; the
# number of offsets is bounded by (bq + bk) / gcd(bq, bk), so cap the cache.
_CAUSAL_CACHE_SIZE = 8


def at_least_2d(mask):
    """View a mask with at least two dims, so that [..., rows, cols] slicing works."""
    if mask is None or mask.ndim >= 2:
        return mask
    return mask.reshape((1,) * (2 - mask.ndim) + mask.shape)  # (S,) -> (1, S)


def _mask_block(mask, i0, i1, j0, j1):
    """Rows i0:i1 and columns j0:j1 of a broadcastable mask (size-1 dims kept)."""
    rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
    return mask[..., rows, cols]  # (..., T or 1, S or 1) -> (..., bq or 1, bk or 1)


def live_blocks(bias, keep, causal, T, S, block_q, block_k):
    """Table of the block pairs that have at least one position not masked.

    ``causal`` is None or the causal offset (:func:`qkvnp.ops.masks.causal_offset`:
    query ``i`` may attend key ``j`` iff ``j <= i + causal``): a whole-block
    test (:func:`causal_blocks`), so that no ``(T, S)`` mask is ever made.
    """
    q_first = np.arange(0, T, block_q)  # (nq,)
    k_first = np.arange(0, S, block_k)  # (nk,)
    live = np.ones((len(q_first), len(k_first)), dtype=bool)  # (nq, nk)
    if causal is not None:
        live &= causal_blocks(q_first, np.minimum(q_first + block_q, T), k_first, causal)
    if keep is None and bias is None:
        return live
    for a, b in zip(*np.nonzero(live)):  # the user's mask, on the blocks still live
        i0, j0 = int(q_first[a]), int(k_first[b])
        i1, j1 = min(i0 + block_q, T), min(j0 + block_k, S)
        if keep is not None and not _mask_block(keep, i0, i1, j0, j1).any():
            live[a, b] = False
        elif bias is not None and np.isneginf(_mask_block(bias, i0, i1, j0, j1)).all():
            live[a, b] = False
    return live


def causal_blocks(q_first, q_end, k_first, offset):
    """``(nq, nk)``: True where some query of ``q_first[a]:q_end[a]`` may attend the key
    ``k_first[b]`` or a later one of its block, under the causal ``offset``.

    The block's first key is its earliest, and its last query sees the most:
    the pair is live iff ``k_first <= (q_end - 1) + offset``. (A band, each
    query seeing at most ``left`` keys back, would add ``k_last >= q_first +
    offset - left``.)
    """
    return k_first[None, :] <= (q_end - 1 + offset)[:, None]  # (1, nk), (nq, 1) -> (nq, nk)


def no_overflow(query, key, scale):
    """True when no score ``scale * q . k`` can overflow the dtype.

    Uses ``|q . k| <= D * max|q| * max|k|``; only when that bound comes near
    the dtype's largest value are the blocks checked and clipped.
    """
    if query.size == 0 or key.size == 0:
        return True
    big = float(np.finfo(query.dtype).max)
    amax_q = max(float(query.max()), -float(query.min()))  # Python floats: no overflow warning
    amax_k = max(float(key.max()), -float(key.min()))
    bound = query.shape[-1] * (amax_q * abs(scale)) * amax_k  # may be inf (scale may be < 0)
    return bound < big / 4


def _block_scores(qs_block, k_block, i0, i1, j0, j1, bias, keep, causal, safe, scores, causal_cache):
    """Masked scores of one block pair, written into ``scores`` (..., bq, bk).

    Same steps as the reference: scores, clip overflow, add the float mask
    (clipped to the dtype's max), then every boolean mask sets ``-inf``
    (``causal``: None or the causal offset, as in :func:`live_blocks`).
    """
    if safe:
        np.matmul(qs_block, np.swapaxes(k_block, -1, -2), out=scores)  # (..., bq, D) @ (..., D, bk) -> (..., bq, bk)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is clipped just below
            np.matmul(qs_block, np.swapaxes(k_block, -1, -2), out=scores)  # (..., bq, D) @ (..., D, bk) -> (..., bq, bk)
        if not np.isfinite(scores).all():
            big = np.finfo(scores.dtype).max
            np.nan_to_num(scores, copy=False, nan=np.nan, posinf=big, neginf=-big)  # NaN stays NaN
    if bias is not None:
        with np.errstate(over="ignore"):
            np.add(scores, _mask_block(bias, i0, i1, j0, j1), out=scores)
        np.minimum(scores, np.finfo(scores.dtype).max, out=scores)  # -inf stays -inf
    if keep is not None:
        np.copyto(scores, -np.inf, where=~_mask_block(keep, i0, i1, j0, j1))
    if causal is not None and j1 - 1 > i0 + causal:  # the block crosses the diagonal
        shape = (i1 - i0, j1 - j0)
        key_ = (i0 + causal - j0, shape)
        above = causal_cache.get(key_)
        if above is None:
            # key j0 + c is after query i0 + r  <=>  c > r + i0 + causal - j0 (no int (bq, bk) temporary)
            above = np.arange(shape[1])[None, :] > np.arange(shape[0])[:, None] + key_[0]  # (1, bk), (bq, 1) -> (bq, bk)
            if len(causal_cache) < _CAUSAL_CACHE_SIZE:
                causal_cache[key_] = above
        np.copyto(scores, -np.inf, where=above)
    return scores


def _workspace(size, dtype):
    """A flat buffer; ``_view(buf, shape)`` gives contiguous views of its start."""
    return np.empty(size, dtype=dtype)


def _view(buf, shape):
    return buf[: math.prod(shape)].reshape(shape)


Problem = namedtuple(
    "Problem", "q k v bias keep causal safe scale block_q block_k live dropout bound",
    defaults=(None,),
)  # q, k, v broadcast to the common leading dims; scale of the compute dtype; causal offset;
# bound: None or (..., T, 1), each row's |scale| |q| max|k| (see _bounded_rows)

# A row whose sum of exp(S - bound) falls below this (a bound far above the
# row's max, or a fully masked row) is computed again with the exact running max.
_MIN_BOUNDED_SUM = 2.0 ** -24


def row_bounds(query, key, scale, lead, causal):
    """``|scale| |q_i| max_j |k_j|`` per query row, ``(..., T, 1)``: no score of row i exceeds it.

    Under a causal mask (``causal``: the offset) the max runs over the keys
    row i may attend, ``j <= i + causal``, so that a row's result still does
    not depend on the keys after it, to the bit.
    """
    T, S = query.shape[-2], key.shape[-2]
    with np.errstate(over="ignore", invalid="ignore"):  # inf: that row's sums fail, exact path
        q_norm = np.sqrt(np.einsum("...td,...td->...t", query, query))  # (..q, T)
        k_norm = np.sqrt(np.einsum("...sd,...sd->...s", key, key))  # (..k, S)
        if causal is None:
            k_max = k_norm.max(axis=-1, keepdims=True)  # (..k, 1)
        else:  # the largest norm among keys 0..i + causal; 0 for a row that sees none
            last = np.arange(T) + causal  # (T,), the last key each row may attend
            prefix_max = np.maximum.accumulate(k_norm, axis=-1)  # (..k, S)
            k_max = np.where(last >= 0, prefix_max[..., np.clip(last, 0, S - 1)], 0)  # (..k, T)
        bound = (abs(scale) * q_norm) * k_max  # (..., T)
    return np.broadcast_to(bound, lead + (T,))[..., None]  # (..., T, 1)


def _key_block_scores(problem, a, i0, i1, qs, scores_buf, causal_cache):
    """For each live key block of query block ``a``: ``(j0, j1, scores)``, the masked scores (..., bq, bk)."""
    k, bias, keep, causal, safe = problem.k, problem.bias, problem.keep, problem.causal, problem.safe
    lead, bq, S, block_k = qs.shape[:-2], i1 - i0, k.shape[-2], problem.block_k
    for b, j0 in enumerate(range(0, S, block_k)):
        if problem.live[a, b]:
            j1 = min(j0 + block_k, S)
            yield j0, j1, _block_scores(qs, k[..., j0:j1, :], i0, i1, j0, j1, bias, keep, causal, safe,
                                        _view(scores_buf, lead + (bq, j1 - j0)), causal_cache)


def _bounded_rows(problem, i0, i1, a, qs, acc, row_maxes, row_sums, buffers):
    """Rows ``i0:i1`` of the forward with each row's bound as a fixed shift; False if unusable.

    With :math:`b_i \\ge \\max_j S_{ij}` (Cauchy-Schwarz, :func:`row_bounds`),
    :math:`\\tilde P = e^{S - b}` never exceeds 1 and needs no running max:
    each key block adds :math:`\\tilde P V_j` and :math:`\\mathrm{rowsum}\\,\\tilde P`,
    and nothing is rescaled. That saves the row max, the rescaling of the
    accumulator and its exponentials (measured, benchmarks/NOTES.md). The
    cache then holds :math:`b` as ``row_max``: :math:`b + \\log \\ell` is the
    row's logsumexp as well. Returns False (the caller redoes the rows with
    the exact running max) when a row sum is below 2**-24: the bound was so
    far above that row's max that its terms lost precision in the subnormals,
    or the row is fully masked.
    """
    v, dropout = problem.v, problem.dropout
    scores_buf, pv_buf, ones_k, block_sum, causal_cache = buffers
    lead = acc.shape[:-2]
    bq, Dv = acc.shape[-2:]
    shift = problem.bound[..., i0:i1, :]  # (..., bq, 1)
    row_sum = np.zeros(lead + (bq, 1), dtype=acc.dtype)  # (..., bq, 1)
    acc[...] = 0
    for j0, j1, scores in _key_block_scores(problem, a, i0, i1, qs, scores_buf, causal_cache):
        np.subtract(scores, shift, out=scores)
        np.exp(scores, out=scores)  # (..., bq, bk), at most 1
        row_sum += np.matmul(scores, ones_k[: j1 - j0], out=block_sum[..., :bq, :])  # (..., bq, bk) @ (bk, 1) -> (..., bq, 1)
        if dropout is not None:  # the row sum counts every weight, the output the kept ones
            np.multiply(scores, block_keep(dropout, i0, i1, j0, j1), out=scores)
        acc += np.matmul(scores, v[..., j0:j1, :], out=_view(pv_buf, lead + (bq, Dv)))  # (..., bq, bk) @ (..., bk, Dv) -> (..., bq, Dv)
    if not row_sum.min() >= _MIN_BOUNDED_SUM:  # NaN fails too
        return False
    np.divide(acc, row_sum, out=acc)  # (..., bq, Dv)
    if dropout is not None:
        acc *= keep_scale(dropout.p, acc.dtype)
    row_maxes[..., i0:i1] = shift[..., 0]  # (..., bq, 1) -> (..., bq)
    row_sums[..., i0:i1] = row_sum[..., 0]  # (..., bq, 1) -> (..., bq)
    return True


def forward_rows(problem, part, out, row_maxes, row_sums):
    """Online softmax for the query blocks ``part`` (pairs ``(a, i0)``).

    Writes rows ``i0:i0+bq`` of ``out``, ``row_maxes`` and ``row_sums``.
    """
    q, k, v, bias, keep, causal, safe, scale, block_q, block_k, live, dropout, bound = problem
    lead = out.shape[:-2]
    T, Dv = out.shape[-2:]
    dtype = out.dtype
    lead_size = math.prod(lead)
    scores_buf = _workspace(lead_size * block_q * block_k, dtype)
    pv_buf = _workspace(lead_size * block_q * Dv, dtype)
    causal_cache = {}
    masked = bias is not None or keep is not None or causal is not None
    ones_k = np.ones((block_k, 1), dtype)  # row sums as matmuls: measured 4x faster than sum()
    block_sum = np.empty(lead + (block_q, 1), dtype)
    # NOTE: one failed bounded block means bounds far above the row maxes (sharp
    # attention), which the next blocks most likely share: they go straight to
    # the running max (trying every block measured slower, benchmarks/NOTES.md).
    bounded = bound is not None
    for a, i0 in part:
        i1 = min(i0 + block_q, T)
        bq = i1 - i0
        qs = q[..., i0:i1, :] if scale == 1 else q[..., i0:i1, :] * scale  # (..., bq, D), the scale folded into Q
        acc = out[..., i0:i1, :]  # (..., bq, Dv), the accumulator lives in the output
        if bounded:
            if _bounded_rows(problem, i0, i1, a, qs, acc, row_maxes, row_sums,
                             (scores_buf, pv_buf, ones_k, block_sum, causal_cache)):
                continue
            bounded = False
        row_max = np.full(lead + (bq, 1), -np.inf, dtype=dtype)  # (..., bq, 1)
        row_sum = np.zeros(lead + (bq, 1), dtype=dtype)  # (..., bq, 1)
        acc[...] = 0
        for j0, j1, scores in _key_block_scores(problem, a, i0, i1, qs, scores_buf, causal_cache):
            new_max = np.maximum(row_max, scores.max(axis=-1, keepdims=True))  # (..., bq, 1)
            shift = new_max
            if masked:
                # NOTE: a row masked so far has max -inf: shift by 0 instead, so
                # that no -inf - (-inf) = NaN arises (its weights are exp(-inf) = 0).
                shift = np.where(np.isneginf(new_max), 0, new_max)  # (..., bq, 1)
            with np.errstate(over="ignore"):  # -max - (+max) overflows to -inf: weight 0
                np.subtract(scores, shift, out=scores)
                np.exp(scores, out=scores)  # (..., bq, bk), unnormalized weights
                rescale = np.exp(row_max - shift)  # (..., bq, 1); 0 while the row had no weight
            row_sum *= rescale
            row_sum += np.matmul(scores, ones_k[: j1 - j0], out=block_sum[..., :bq, :])  # (..., bq, bk) @ (bk, 1) -> (..., bq, 1)
            acc *= rescale
            if dropout is not None:  # the row sum counts every weight, the output the kept ones
                np.multiply(scores, block_keep(dropout, i0, i1, j0, j1), out=scores)
            acc += np.matmul(scores, v[..., j0:j1, :], out=_view(pv_buf, lead + (bq, Dv)))  # (..., bq, bk) @ (..., bk, Dv) -> (..., bq, Dv)
            row_max = new_max
        dead = row_sum == 0  # (..., bq, 1): fully masked rows (acc is 0 there)
        np.divide(acc, np.where(dead, 1, row_sum), out=acc)  # (..., bq, Dv)
        if dropout is not None:
            acc *= keep_scale(dropout.p, dtype)
        row_maxes[..., i0:i1] = row_max[..., 0]  # (..., bq, 1) -> (..., bq)
        row_sums[..., i0:i1] = row_sum[..., 0]  # (..., bq, 1) -> (..., bq)


def backward_columns(problem, part, dout, shift, inv_sum, delta, dq, dkey, dvalue):
    """Gradients for the key blocks ``part`` (pairs ``(b, j0)``).

    Writes rows ``j0:j0+bk`` of ``dkey`` and ``dvalue`` and adds into ``dq``
    (full leading dims, owned by this call).
    """
    q, k, v, bias, keep, causal, safe, scale, block_q, block_k, live, dropout, _ = problem
    lead = dout.shape[:-2]
    T, Dv = dout.shape[-2:]
    S, D = k.shape[-2:]
    dtype = dout.dtype
    lead_size = math.prod(lead)
    scores_buf = _workspace(lead_size * block_q * block_k, dtype)
    dweights_buf = _workspace(lead_size * block_q * block_k, dtype)
    small_buf = _workspace(lead_size * max(block_q, block_k) * max(D, Dv), dtype)
    qs_buf = _workspace(lead_size * block_q * D, dtype)
    dout_buf = _workspace(lead_size * block_q * Dv, dtype)
    causal_cache = {}
    for b, j0 in part:
        j1 = min(j0 + block_k, S)
        bk = j1 - j0
        k_block = k[..., j0:j1, :]  # (..., bk, D)
        v_block = v[..., j0:j1, :]  # (..., bk, Dv)
        dk_block = np.zeros(lead + (bk, D), dtype=dtype)  # (..., bk, D)
        dv_block = np.zeros(lead + (bk, Dv), dtype=dtype)  # (..., bk, Dv)
        for a, i0 in enumerate(range(0, T, block_q)):
            if not live[a, b]:
                continue
            i1 = min(i0 + block_q, T)
            bq = i1 - i0
            qs = q[..., i0:i1, :]  # (..., bq, D)
            if scale != 1:  # the layers fold the scale into W_query
                qs = np.multiply(qs, scale, out=_view(qs_buf, lead + (bq, D)))  # scaled Q
            weights = _block_scores(
                qs, k_block, i0, i1, j0, j1, bias, keep, causal, safe,
                _view(scores_buf, lead + (bq, bk)), causal_cache,
            )  # (..., bq, bk)
            with np.errstate(over="ignore"):  # -max - (+max) overflows to -inf: weight 0
                np.subtract(weights, shift[..., i0:i1, :], out=weights)
            np.exp(weights, out=weights)  # (..., bq, bk), l * P = exp(S - m); 0 on masked rows
            dout_block = np.multiply(dout[..., i0:i1, :], inv_sum[..., i0:i1, :],
                                     out=_view(dout_buf, lead + (bq, Dv)))  # (..., bq, Dv), dO / l
            if dropout is None:
                kept = weights
            else:  # the same block mask as the forward's, recomputed; Z / (1 - p) goes into dO
                drop_keep = block_keep(dropout, i0, i1, j0, j1)  # (..., bq, bk)
                kept = np.multiply(weights, drop_keep, out=_view(dweights_buf, lead + (bq, bk)))
                dout_block *= keep_scale(dropout.p, dtype)
            dv_block += np.matmul(np.swapaxes(kept, -1, -2), dout_block,
                                  out=_view(small_buf, lead + (bk, Dv)))  # (..., bk, bq) @ (..., bq, Dv) -> (..., bk, Dv)
            dscores = np.matmul(dout_block, np.swapaxes(v_block, -1, -2),
                                out=_view(dweights_buf, lead + (bq, bk)))  # (..., bq, Dv) @ (..., Dv, bk) -> (..., bq, bk)
            if dropout is not None:
                np.multiply(dscores, drop_keep, out=dscores)  # dP = (dO V^T) Z / (1 - p), over l
            np.subtract(dscores, delta[..., i0:i1, :], out=dscores)
            np.multiply(dscores, weights, out=dscores)  # (..., bq, bk), dS = l P * (dP - Delta) / l
            dq[..., i0:i1, :] += np.matmul(dscores, k_block, out=_view(small_buf, lead + (bq, D)))  # (..., bq, bk) @ (..., bk, D) -> (..., bq, D)
            dk_block += np.matmul(np.swapaxes(dscores, -1, -2), qs,
                                  out=_view(small_buf, lead + (bk, D)))  # (..., bk, bq) @ (..., bq, D) -> (..., bk, D)
        dkey[..., j0:j1, :] = sum_to_shape(dk_block, dkey.shape[:-2] + (bk, D))  # (..., bk, D) -> (..k, bk, D)
        dvalue[..., j0:j1, :] = sum_to_shape(dv_block, dvalue.shape[:-2] + (bk, Dv))  # (..., bk, Dv) -> (..v, bk, Dv)
