"""Tiled attention with the variants: a sliding window that skips blocks, soft-cap, ALiBi, sinks.

Shape key: T query length, S key length, D head dim of queries and keys, Dv
head dim of values, ``...`` any leading (batch, head) dims, H heads; ``bq``
and ``bk`` the query and key block sizes.

The alternative to the reference variants' core (:func:`qkvnp.functional.attention_forward`
with the options of :mod:`qkvnp.ops.variants`) for long sequences: an online
softmax over key blocks in the forward, the weights recomputed block by block
in the backward, never a ``(T, S)`` array (unless the caller passes a
``score_bias`` or mask of that size, which is sliced).

It differs from :mod:`qkvnp.kernels.tiled`, the plain tiled core, in the
algorithm, not only in thresholds: scores here take a bias, a cap and a sink,
so no bound of the row max is known before them, and every row runs the
rescaling online softmax (``tiled``, without a mask, first tries a bound
that needs no rescaling); key blocks are visited by band (:func:`band_key_range`, where
``tiled`` skips whole masked blocks); the backward shares query blocks among
the threads, each summing its own dK, dV (``tiled`` shares key blocks).
NOTE: plain attention through this core measured up to 4x slower than
``tiled``, and not bit for bit equal (benchmarks/NOTES.md).

What makes windows pay: query block ``[i0, i1)`` can only see keys
``[i0 + o - left, i1 - 1 + o + right]`` (``o`` the alignment's offset), so
only the keys of that band are visited (:func:`band_key_range`), by
default in one key block that starts where the band starts: time and memory
grow as ``T * (left + right + bq)``, not ``T * S``. ALiBi is
computed per block from its slopes (``-slope * |i + o - j|``), never as a
``(H, T, S)`` bias.

Forward per query block, with :math:`\\sigma` the sink (or no sink:
:math:`m = -\\infty`, :math:`\\ell = 0` to start):

.. math:: m \\leftarrow \\sigma, \\ \\ell \\leftarrow 1, \\ A \\leftarrow 0;\\quad
          \\text{per key block: } S = \\kappa \\tanh((cQK^T + B)/\\kappa) + M,\\
          m' = \\max(m, \\mathrm{rowmax}\\,S),\\ \\ell \\leftarrow e^{m - m'}\\ell +
          \\mathrm{rowsum}\\,e^{S - m'},\\ A \\leftarrow e^{m - m'}A + e^{S - m'}V

and :math:`O = A / \\ell`. The backward recomputes :math:`P = e^{S - m}/\\ell`
per block, with :math:`\\Delta = \\mathrm{rowsum}(\\bar O \\odot O)`
(:math:`= \\mathrm{rowsum}(P \\odot \\bar P)`, the sink having no value):
:math:`\\bar S = P \\odot (\\bar P - \\Delta)`, times :math:`1 - \\tanh^2`
under the cap; :math:`\\bar\\sigma = -\\sum_i \\pi_i \\Delta_i` with
:math:`\\pi_i = e^{\\sigma - m_i}/\\ell_i` (``docs/derivations_variants.md``).
"""
import functools
import math
from collections import namedtuple

import numpy as np

from .. import functional as F
from .._checks import (as_float_array, as_upstream_grad, check_attention_inputs, check_scale,
                       core_scores_may_overflow, owned)
from ..ops.dropout import block_keep, keep_scale, prepare_dropout
from ..ops.gqa import split_groups, split_head_axis, split_per_head
from ..ops.masks import causal_offset, check_is_causal, prepare_mask
from ..ops.variants import VariantCache, VariantGroupedCache, check_softcap, check_window
from ._runtime import check_block_pair, get_block_sizes, run, single_threaded_blas

__all__ = ["TiledVariantCache", "TiledVariantGroupedCache", "TILED_CACHES", "attention_forward",
           "attention_backward", "band_key_range"]

TiledVariantCache = namedtuple(
    "TiledVariantCache",
    "query key value bias keep score_bias alibi softcap sinks window offset causal scale out "
    "row_max row_sum block_q block_k dropout score_bias_shape")
TiledVariantCache.__doc__ = """What :func:`attention_backward` reads: the inputs, the output, the row logsumexp in two parts.

bias, keep : the user mask's additive and boolean parts, as given (or None).
score_bias : as given (or None); alibi : slopes broadcastable to the leading dims (or None).
softcap, window, causal : the options; offset : query ``i`` stands at ``i + offset``.
sinks : as given (or None). row_max, row_sum : (..., T).
dropout : :class:`qkvnp.ops.dropout.Dropout` or None (each block's mask recomputed from it).
score_bias_shape : the caller's shape of ``score_bias`` (its gradient's shape), or None.
"""

_Grouped = namedtuple("_Grouped", "inner shapes out_shape grouped_out_shape dtype")


class TiledVariantGroupedCache(_Grouped):
    """The grouped-query form: the inner cache and the callers' shapes (``shapes`` as in :mod:`qkvnp.ops.variants`)."""

    __slots__ = ()


#: The caches of this core's own forward (not of a forward deferred to the reference).
TILED_CACHES = (TiledVariantCache, TiledVariantGroupedCache)


def band_key_range(i0, i1, S, offset, window, causal):
    """The keys ``[lo, hi)`` that some query of ``[i0, i1)`` may see under the window and causal mask."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    lo = 0 if left is None else max(0, i0 + offset - left)
    hi = S if right is None else min(S, i1 - 1 + offset + right + 1)
    return lo, max(lo, hi)


def _slice(mask, i0, i1, j0, j1):
    """Rows ``i0:i1``, columns ``j0:j1`` of a broadcastable array (size-1 dims kept)."""
    rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
    return mask[..., rows, cols]


def _at_least_2d(a):
    return a if a is None or a.ndim >= 2 else a.reshape((1,) * (2 - a.ndim) + a.shape)


def _block_scores(c, qs, i0, i1, j0, j1):
    """The scores of one block pair after bias, ALiBi, cap and masks, and the cap's tanh (or None)."""
    scores = qs @ np.swapaxes(c.key[..., j0:j1, :], -1, -2)  # (..., bq, D) @ (..., D, bk) -> (..., bq, bk)
    if c.score_bias is not None:  # an overflowed sum clipped, as a float mask's (reference)
        scores = _clipped_sum(scores, _slice(c.score_bias, i0, i1, j0, j1))
    if c.alibi is not None:
        distance = np.arange(j0, j1)[None, :] - (np.arange(i0, i1)[:, None] + c.offset)  # j - i, (bq, bk)
        scores = scores - c.alibi * np.abs(distance)  # slopes (..., 1, 1)
    capped = None
    if c.softcap is not None:
        capped = np.tanh(scores / c.softcap)
        scores = c.softcap * capped
    if c.bias is not None:
        scores = _clipped_sum(scores, _slice(c.bias, i0, i1, j0, j1))
    left, right = (None, None) if c.window is None else c.window
    if c.causal:
        right = 0 if right is None else min(right, 0)
    allowed = None
    # only a block that crosses an edge of the band needs its mask
    crosses_left = left is not None and j0 - (i1 - 1 + c.offset) < -left
    crosses_right = right is not None and (j1 - 1) - (i0 + c.offset) > right
    if crosses_left or crosses_right:
        allowed = _band_mask(i1 - i0, j1 - j0, j0 - i0 - c.offset, left if crosses_left else None,
                             right if crosses_right else None)
    if c.keep is not None:
        keep = _slice(c.keep, i0, i1, j0, j1)
        allowed = keep if allowed is None else allowed & keep
    if allowed is None:
        return scores, capped
    return np.where(allowed, scores, -np.inf), capped


def _clipped_sum(scores, bias):
    """``scores + bias``, ``+inf`` (an overflowed sum) clipped to the dtype's max; ``-inf`` stays."""
    with np.errstate(over="ignore"):
        scores = scores + bias
    return np.minimum(scores, np.finfo(scores.dtype).max, out=scores)


def _band_mask(rows, cols, first, left, right):
    """``-left <= j - i <= right`` with ``j - i = first + column - row``, shape (rows, cols), read-only.

    Every query block at the same place in the band has the same mask: the
    small ones are kept (at most 8 of 256 KiB, never written to).
    """
    if rows * cols <= 2 ** 18:
        return _kept_band_mask(rows, cols, first, left, right)
    return _new_band_mask(rows, cols, first, left, right)


@functools.lru_cache(maxsize=8)
def _kept_band_mask(rows, cols, first, left, right):
    return _new_band_mask(rows, cols, first, left, right)


def _new_band_mask(rows, cols, first, left, right):
    distance = first + np.arange(cols)[None, :] - np.arange(rows)[:, None]  # j - i, (bq, bk)
    allowed = np.ones((rows, cols), dtype=bool)
    if left is not None:
        allowed &= distance >= -left
    if right is not None:
        allowed &= distance <= right
    allowed.flags.writeable = False
    return allowed


def _shifted_exp(scores, shift):
    """``exp(scores - shift)``, in place in ``scores`` (fresh from :func:`_block_scores`) when it has the result's shape."""
    if np.broadcast_shapes(scores.shape, shift.shape) != scores.shape:
        return np.exp(scores - shift)
    scores -= shift
    return np.exp(scores, out=scores)


def _blocks(c, T, S):
    """``(a, i0, i1, [(j0, j1), ...])`` of every query block and the key blocks its band meets."""
    for i0 in range(0, T, c.block_q):
        i1 = min(i0 + c.block_q, T)
        lo, hi = band_key_range(i0, i1, S, c.offset, c.window, c.causal)
        yield i0, i1, [(j0, min(j0 + c.block_k, hi)) for j0 in range(lo, hi, c.block_k)]


def _check_block_size(block_size, T, S, window=None, causal=False):
    """``(block_q, block_k)``; by default the ``tiled_block`` setting, smaller for a narrow window."""
    if block_size is None:
        block_q, block_k = get_block_sizes()["tiled_block"]
        left, right = (None, None) if window is None else window
        right = 0 if causal else right
        if left is not None and right is not None:
            # NOTE: one key block per query block, starting where its band
            # starts and as wide as the band (block_q + left + right keys):
            # fewer, larger products than aligned key blocks, and only the
            # band's two triangles computed and masked. Measured,
            # (1, 16384, 64) float32, window (255, 0), fwd+bwd, 2-core host
            # at load 2-3: (128, 383) 0.20-0.21 s, (64, 319) 0.23 s,
            # (256, 511) 0.23 s, the aligned (128, 64) 0.28-0.29 s
            width = left + right + 1
            if width <= 2 * block_k:
                block_q = min(block_q, 128)
                block_k = block_q + width - 1
            else:  # a wide band: key blocks of about a quarter of it
                block = 2 ** int(math.log2(width // 4))
                block_q, block_k = min(block_q, 2 * block), min(block_k, block)
    else:
        block_q, block_k = check_block_pair(block_size, "block_size")
    return max(1, min(block_q, T)), max(1, min(block_k, S))


def attention_forward(query, key, value, attn_mask=None, is_causal=False, scale=None, *,
                      score_bias=None, alibi_slopes=None, softcap=None, sinks=None, window=None,
                      block_size=None, dropout_p=0.0, rng=None, dropout_mask=None,
                      enable_gqa=False):
    """Attention with the variants by blocks (arguments of :func:`qkvnp.functional.attention_forward`).

    Parameters
    ----------
    alibi_slopes : array_like, shape (H,) or broadcastable to the leading dims, optional
        ALiBi's bias ``-slope * |i + offset - j|`` computed per block (no
        gradient: fixed slopes). Use :func:`qkvnp.ops.positions.alibi_slopes`.
    block_size : int or (int, int), optional
        Defaults to the ``tiled_block`` setting.

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    cache : TiledVariantCache (TiledVariantGroupedCache with grouped-query
        attention; the reference's :class:`qkvnp.ops.variants.VariantCache` when
        scores may overflow, whose exact clipping only the reference has)
    """
    softcap = check_softcap(softcap)
    window = check_window(window, is_causal)
    grouped = split_groups(query, key, value, attn_mask, enable_gqa)
    if grouped is not None:
        return _grouped_forward(grouped, is_causal, scale, score_bias, alibi_slopes, softcap, sinks,
                                window, block_size, dropout_p, rng, dropout_mask)
    query, key, value, lead = check_attention_inputs(query, key, value)
    scale = check_scale(scale, query.shape[-1])
    T, S = query.shape[-2], key.shape[-2]
    if core_scores_may_overflow(query, key, scale):  # NOTE: only the reference clips exactly
        return _reference_forward(query, key, value, attn_mask, is_causal, scale, score_bias,
                                  alibi_slopes, softcap, sinks, window, dropout_p, rng,
                                  dropout_mask)
    dtype = query.dtype
    bias, keep = prepare_mask(attn_mask, False, lead + (T, S), dtype)
    bias, keep = owned((bias, keep), (attn_mask, attn_mask))  # the backward re-reads them
    check_is_causal(is_causal)
    score_bias, score_bias_shape, alibi, sinks = _check_options(score_bias, alibi_slopes, sinks,
                                                                 lead, T, S, dtype)
    sinks_column = None if sinks is None else sinks[..., None, None]  # (..., 1, 1)
    dropout = prepare_dropout(dropout_p, rng, dropout_mask, lead + (T, S))
    offset = causal_offset(is_causal, T, S) or 0
    causal = check_is_causal(is_causal) is not False
    block_q, block_k = _check_block_size(block_size, T, S, window, causal)
    Dv = value.shape[-1]
    cache = TiledVariantCache(query.copy(), key.copy(), value.copy(), _at_least_2d(bias),
                              _at_least_2d(keep), score_bias, alibi, softcap, sinks, window,
                              offset, causal, scale, None, None, None, block_q, block_k, dropout,
                              score_bias_shape)
    out = np.zeros(lead + (T, Dv), dtype)  # (..., T, Dv)
    row_max = np.empty(lead + (T, 1), dtype)  # (..., T, 1)
    row_sum = np.empty(lead + (T, 1), dtype)  # (..., T, 1)
    v = np.broadcast_to(value, lead + (S, Dv))  # a view

    def rows(part):  # query blocks are independent: each task writes its own rows (of dq too)
        for i0, i1, key_blocks in part:
            _forward_rows(cache, v, sinks_column, i0, i1, key_blocks, out, row_max, row_sum)

    work = list(_blocks(cache, T, S))
    # NOTE: BLAS pinned to one thread: OpenBLAS's own threads on these small
    # block products made the forward 20x slower ((1, 4096, 64), window 256)
    with single_threaded_blas():
        run(rows, work, _flops(lead, work, query.shape[-1], Dv))
    if dropout is not None:
        out *= keep_scale(dropout.p, dtype)
    return out, cache._replace(out=out.copy(), row_max=row_max, row_sum=row_sum)


def _reference_forward(query, key, value, attn_mask, is_causal, scale, score_bias, alibi_slopes,
                       softcap, sinks, window, dropout_p, rng, dropout_mask):
    """The reference's forward, for scores that may overflow: ALiBi given to it as a
    ``(..., T, S)`` score bias (added to ``score_bias``), since it takes no slopes."""
    T, S = query.shape[-2], key.shape[-2]
    bias = None
    if alibi_slopes is not None:
        from ..ops.positions import alibi_bias

        offset = causal_offset(is_causal, T, S) or 0
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        bias = alibi_bias(T, S, slopes.reshape(-1), offset).reshape(
            slopes.shape + (T, S)).astype(query.dtype)
        bias = bias if score_bias is None else bias + score_bias
    with np.errstate(over="ignore"):
        return F.attention_forward(
            query, key, value, attn_mask, is_causal, scale,
            score_bias=score_bias if bias is None else bias, softcap=softcap, sinks=sinks,
            window=window, dropout_p=dropout_p, rng=rng, dropout_mask=dropout_mask)


def _check_options(score_bias, alibi_slopes, sinks, lead, T, S, dtype):
    """Check the variants' arrays against the scores ``lead + (T, S)``; return what the
    cache keeps: ``(score_bias, score_bias_shape, alibi, sinks)``.

    ``score_bias`` an owned copy, at least 2-D, and its caller's shape (None, None
    without one); ``alibi`` the slopes as ``(..., 1, 1)``; ``sinks`` an owned copy.
    """
    score_bias_shape = None
    if score_bias is not None:
        score_bias = as_float_array(score_bias, "score_bias", dtype)
        score_bias_shape = score_bias.shape
        _check_broadcasts(score_bias.shape, lead + (T, S), "score_bias", "(..., T, S)")
        score_bias = _at_least_2d(score_bias).copy()  # the cache owns it
    alibi = None
    if alibi_slopes is not None:
        alibi = as_float_array(alibi_slopes, "alibi_slopes", dtype)[..., None, None]
        _check_broadcasts(alibi.shape, lead + (T, S), "alibi_slopes", "(H,)")
    if sinks is not None:
        sinks = as_float_array(sinks, "sinks", dtype).copy()
        _check_broadcasts(sinks[..., None, None].shape, lead + (T, 1), "sinks", "(H,)")
    return score_bias, score_bias_shape, alibi, sinks


def _flops(lead, work, D, Dv):
    """The products' floating-point operations over the visited block pairs (for :func:`run`)."""
    pairs = sum((i1 - i0) * sum(j1 - j0 for j0, j1 in blocks) for i0, i1, blocks in work)
    return 2 * math.prod(lead) * pairs * (D + Dv)


def _forward_rows(c, v, sinks_column, i0, i1, key_blocks, out, row_max, row_sum):
    """The online softmax of query rows ``i0:i1`` over their key blocks (see the module docstring)."""
    lead, dtype = out.shape[:-2], out.dtype
    qs = c.query[..., i0:i1, :] * c.scale  # (..., bq, D), the scale folded into Q
    bq, Dv = i1 - i0, out.shape[-1]
    if sinks_column is None:
        m = np.full(lead + (bq, 1), -np.inf, dtype)
        total = np.zeros(lead + (bq, 1), dtype)
    else:  # the sink is one more logit of every row
        m = np.broadcast_to(sinks_column, lead + (bq, 1)).astype(dtype)
        total = np.ones(lead + (bq, 1), dtype)
    acc = np.zeros(lead + (bq, Dv), dtype)
    for j0, j1 in key_blocks:
        scores, _ = _block_scores(c, qs, i0, i1, j0, j1)  # (..., bq, bk)
        new_m = np.maximum(m, scores.max(axis=-1, keepdims=True))  # (..., bq, 1)
        shift = np.where(np.isneginf(new_m), 0, new_m)  # a row masked so far: no -inf - -inf
        weights = _shifted_exp(scores, shift)  # (..., bq, bk)
        rescale = np.exp(m - shift)
        total = rescale * total + weights.sum(axis=-1, keepdims=True)
        if c.dropout is not None:
            weights = weights * block_keep(c.dropout, i0, i1, j0, j1)
        acc = rescale * acc + weights @ v[..., j0:j1, :]  # (..., bq, bk) @ (..., bk, Dv) -> (..., bq, Dv)
        m = new_m
    out[..., i0:i1, :] = acc / np.where(total == 0, 1, total)
    row_max[..., i0:i1, :] = m
    row_sum[..., i0:i1, :] = total


def _check_broadcasts(shape, target, name, expected):
    try:
        ok = np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be {expected}, broadcasting to {tuple(target)}, got shape "
                         f"{shape}")


def _grouped_forward(grouped, is_causal, scale, score_bias, alibi_slopes, softcap, sinks, window,
                     block_size, dropout_p, rng, dropout_mask):
    """Grouped-query attention: split the head axis of every per-head argument as the query's."""
    H, (K, G) = grouped.num_heads, grouped.query.shape[-4:-2]

    bias_shape = None if score_bias is None else np.shape(score_bias)
    sinks_shape = None if sinks is None else np.shape(sinks)
    if score_bias is not None:
        score_bias = split_head_axis(np.asarray(score_bias), H, K, G)
    if dropout_mask is not None and np.ndim(dropout_mask) >= 3:
        dropout_mask = split_head_axis(np.asarray(dropout_mask), H, K, G)
    out, inner = attention_forward(
        grouped.query, grouped.key, grouped.value, grouped.attn_mask, is_causal, scale,
        score_bias=score_bias, alibi_slopes=None if alibi_slopes is None else split_per_head(alibi_slopes, H, K, G,
                                                                        "alibi_slopes"),
        softcap=softcap, sinks=None if sinks is None else split_per_head(sinks, H, K, G, "sinks"),
        window=window,
        block_size=block_size, dropout_p=dropout_p, rng=rng, dropout_mask=dropout_mask)
    out_shape = out.shape[:-4] + (H,) + out.shape[-2:]
    shapes = grouped.shapes + (bias_shape, sinks_shape)
    cls = VariantGroupedCache if isinstance(inner, VariantCache) else TiledVariantGroupedCache
    return out.reshape(out_shape), cls(inner, shapes, out_shape, out.shape, out.dtype)  # (..., K, G, T, Dv) -> (..., H, T, Dv)


def _backward_rows(c, k, v, dout, delta, shift, inv_sum, i0, i1, key_blocks, dq, dk, dv,
                   dscore_bias):
    """The gradients of query rows ``i0:i1``: their ``dq`` rows, added into ``dk``, ``dv``, ``dscore_bias``."""
    qs = c.query[..., i0:i1, :] * c.scale  # (..., bq, D)
    dout_block = dout[..., i0:i1, :]  # (..., bq, Dv)
    drop_scale = None if c.dropout is None else keep_scale(c.dropout.p, dout.dtype)
    for j0, j1 in key_blocks:
        scores, capped = _block_scores(c, qs, i0, i1, j0, j1)
        weights = _shifted_exp(scores, shift[..., i0:i1, :])  # P, (..., bq, bk)
        weights *= inv_sum[..., i0:i1, :]
        dweights = dout_block @ np.swapaxes(v[..., j0:j1, :], -1, -2)  # (..., bq, Dv) @ (..., Dv, bk) -> (..., bq, bk)
        kept = weights
        if c.dropout is not None:
            drop = block_keep(c.dropout, i0, i1, j0, j1) * drop_scale
            kept, dweights = weights * drop, dweights * drop
        dv[..., j0:j1, :] += np.swapaxes(kept, -1, -2) @ dout_block  # (..., bk, bq) @ (..., bq, Dv) -> (..., bk, Dv)
        dweights -= delta[..., i0:i1, :]  # fresh: in place
        dscores = np.multiply(weights, dweights, out=dweights)  # (..., bq, bk)
        if capped is not None:
            capped *= capped
            dscores *= np.subtract(1, capped, out=capped)
        if dscore_bias is not None:
            target = _slice(dscore_bias, i0, i1, j0, j1)
            target += F.sum_to_shape(dscores, target.shape)
        dq[..., i0:i1, :] += dscores @ k[..., j0:j1, :]  # (..., bq, bk) @ (..., bk, D) -> (..., bq, D)
        dk[..., j0:j1, :] += np.swapaxes(dscores, -1, -2) @ qs  # (..., bk, bq) @ (..., bq, D) -> (..., bk, D)


def attention_backward(dout, cache):
    """Backward of :func:`attention_forward`: ``(dquery, dkey, dvalue, dscore_bias, dsinks)``."""
    if isinstance(cache, (VariantCache, VariantGroupedCache)):  # deferred to the reference
        return F.attention_backward(dout, cache)
    if isinstance(cache, TiledVariantGroupedCache):
        dout = as_upstream_grad(dout, "dout", cache.out_shape, cache.dtype)
        grads = attention_backward(dout.reshape(cache.grouped_out_shape), cache.inner)
        return tuple(None if g is None else g.reshape(shape) for g, shape in zip(grads, cache.shapes))
    c = cache
    out = c.out
    dout = as_upstream_grad(dout, "dout", out.shape, out.dtype)
    lead, dtype = out.shape[:-2], out.dtype
    T, S, D, Dv = c.query.shape[-2], c.key.shape[-2], c.query.shape[-1], c.value.shape[-1]
    k = np.broadcast_to(c.key, lead + (S, D))  # views
    v = np.broadcast_to(c.value, lead + (S, Dv))
    delta = np.sum(dout * out, axis=-1, keepdims=True)  # (..., T, 1), rowsum(P * dP)
    shift = np.where(np.isneginf(c.row_max), 0, c.row_max)  # (..., T, 1)
    inv_sum = np.where(c.row_sum == 0, 0, 1 / np.where(c.row_sum == 0, 1, c.row_sum))  # (..., T, 1)
    dq = np.zeros(lead + (T, D), dtype)
    bias_shape = None if c.score_bias is None else c.score_bias.shape
    work = list(_blocks(c, T, S))
    sums = {}  # first work item -> (dk, dv, dscore_bias) of the task that ran it

    def new_sums():
        return (np.zeros(lead + (S, D), dtype), np.zeros(lead + (S, Dv), dtype),
                None if bias_shape is None else np.zeros(bias_shape, dtype))

    def columns(part):  # each task adds into its own dk, dv: summed below in a fixed order
        if not part:
            return
        sums[part[0][0]] = own = new_sums()
        for i0, i1, key_blocks in part:
            _backward_rows(c, k, v, dout, delta, shift, inv_sum, i0, i1, key_blocks, dq, *own)

    with single_threaded_blas():
        run(columns, work, 2 * _flops(lead, work, D, Dv))
    if not sums:  # no query rows
        sums[0] = new_sums()
    ordered = [sums.pop(first) for first in sorted(sums)]
    dk, dv, dscore_bias = ordered[0]
    for other in ordered[1:]:  # in place, in a fixed order: the result repeats bitwise
        for total, part in zip((dk, dv, dscore_bias), other):
            if total is not None:
                total += part
    del ordered
    dq *= c.scale
    dsinks = None
    if c.sinks is not None:  # the sink's share pi = e^(sink - m) / l, dsink = -sum pi * Delta
        share = np.exp(c.sinks[..., None, None] - shift) * inv_sum  # (..., T, 1)
        column = F.sum_to_shape(-share * delta, c.sinks.shape + (1, 1))
        dsinks = column.reshape(c.sinks.shape)
    if dscore_bias is not None:
        dscore_bias = dscore_bias.reshape(c.score_bias_shape)  # (1, S) -> (S,) for a 1-d bias
    return (F.sum_to_shape(dq, c.query.shape), F.sum_to_shape(dk, c.key.shape),
            F.sum_to_shape(dv, c.value.shape), dscore_bias, dsinks)
