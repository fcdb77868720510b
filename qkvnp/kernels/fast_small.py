"""The fast core's whole-array passes: the alternative to its blocked passes for a problem that fits in cache.

Shape key: T query length, S key length, D head dim (of queries and keys),
Dv head dim of values, ``...`` any leading (batch, head) dims.

:func:`small_forward` and :func:`small_backward` compute what
:func:`qkvnp.kernels.fast.dense_forward` and ``dense_backward`` compute (the
math of :func:`qkvnp.functional.attention_forward` / ``attention_backward``),
for a whole problem run serially or for one worker's block whose scores fit
in ``row_block_bytes``. ``fast`` picks them (``_whole_array``, one row chunk);
they are the alternative to its blocked passes, ``fast._forward_rows`` and
``fast._backward_rows``, and differ from them in the algorithm, not only in
thresholds:

- the shift ``m = |q| max|k| + max(mask row)`` comes from einsum row norms,
  with no probe keys; a loose bound is caught by the row sums
  (:func:`_usable_sums`) and retried with the exact max;
- below :data:`LARGE_SCORES` the forward keeps the normalised weights ``P``
  (or skips the shift altogether), where the blocked passes always keep the
  numerators and ``1 / rowsum``;
- the backward takes ``delta = rowsum(P * dP)`` from the ``dP`` it has just
  computed (the blocked passes: ``rowsum(dO * O)``, a ``(T, Dv)`` product, and
  ``dP - delta`` from one augmented matmul), and ``dK = dS^T Q`` in one
  product (the blocked passes accumulate ``dK^T = Q^T dS`` over row chunks);
- no causal row chunks: the masked triangle is computed (and is 0).

NOTE: the blocked passes on these problems measured 2-3.5x slower, and
round differently (not bit for bit equal; benchmarks/NOTES.md).
The derivations are those of :mod:`qkvnp.kernels.fast` (``docs/derivations.md``).
"""
import functools

import numpy as np

from ..ops.masks import is_causal_additive
from .buffers import recycled_empty

__all__ = ["small_forward", "small_backward", "masked_exp", "mask_row_max", "LARGE_SCORES"]

#: Score blocks of at least this many entries take the variants that save passes
#: over (T, S) (exp2, einsum) at the price of a few more numpy calls; below it a
#: serial problem also keeps the normalised weights (``dense_forward``).
#: NOTE: 2**17 measured faster than 2**15, as fast as 2**18 and 2**19
#: (benchmarks/NOTES.md).
LARGE_SCORES = 1 << 17


#: Longest column the caches below keep: at most 64 + 16 columns of 4096
#: float64 entries (2.5 MiB) stay in the process. NOTE: bounded by entries
#: alone, decoding through the fast path (a new key length S at every step)
#: kept a column per length, 64 x S x 8 bytes (51 MiB at S = 100,000); a
#: longer column is made anew, little against the attention over its S keys.
CACHED_COLUMN = 4096


def _ones(n, dtype):
    """A read-only ``(n, 1)`` column of ones: ``x @ _ones`` sums the last axis of ``x``."""
    return _cached_ones(n, dtype) if n <= CACHED_COLUMN else _read_only(np.ones((n, 1), dtype))


def _zeros_column(n, dtype):
    """A read-only ``(n, 1)`` column of zeros."""
    return (_cached_zeros(n, dtype) if n <= CACHED_COLUMN
            else _read_only(np.zeros((n, 1), dtype)))


@functools.lru_cache(maxsize=64)
def _cached_ones(n, dtype):
    return _read_only(np.ones((n, 1), dtype))


@functools.lru_cache(maxsize=16)
def _cached_zeros(n, dtype):
    return _read_only(np.zeros((n, 1), dtype))


def _read_only(column):
    column.flags.writeable = False  # shared between calls: nobody writes into it
    return column


def mask_row_max(mask, dtype):
    """Largest finite entry of each row of the additive mask, 0 if none (broadcastable)."""
    if mask is None:
        return None
    if is_causal_additive(mask, dtype):
        # every top-left causal row may attend key 0; a bottom-right one too, or
        # none (T > S): 0 is the value given to rows with no finite entry
        return _zeros_column(mask.shape[0], np.dtype(dtype))
    finite = np.where(np.isneginf(mask), -np.inf, mask)
    row_max = finite.max(axis=-1, keepdims=True)  # (..., T, S) -> (..., T, 1)
    row_max[np.isneginf(row_max)] = 0
    return row_max.astype(dtype, copy=False)


def small_forward(query, key, value, mask, mask_max, exp_scores, inv_sum, out, drop=None,
                  normalize=False, factors=None):
    """``dense_forward`` of a problem too small to share, in a few whole-array calls.

    The same math and cache (numerators ``exp(S - m)``, ``1 / rowsum``; or,
    with ``normalize``, the weights themselves), with ``m`` a bound of each
    row's max instead of the max itself, and none of the machinery that pays
    off on large problems (blocks, row chunks in cache, probe keys): at
    (B, L, E, H) = (8, 16, 32, 4) that machinery cost more numpy calls than
    the math. Row sums are matmuls with a column of ones (NOTE: numpy's
    ``max``/``sum`` along a short last axis measured several times slower
    than ``@ ones``, and the exact row max slower than the bound below;
    benchmarks/NOTES.md).

    With ``normalize`` the first try takes ``m = 0``, no shift at all: the
    weights ``P = E / rowsum(E)`` do not depend on ``m``, and exponentials of
    unshifted scores are as exact as shifted ones as long as every row sum
    stays within :func:`_usable_sums`' range (a row sum below ``2**-24``, or
    one whose reciprocal leaves the normal floats, takes the shifted second
    try). That saves the bound's two row-norm passes. Without ``normalize`` the
    numerators are kept for the backward and must stay at most 1: the
    shift is always applied. The bound there, and in the second try, is
    ``m = |q| max|k| + max(mask row)``, the row norms from einsum's dot
    products.

    When the shifted try's bound was too far above a row's max (its largest
    exponential below ``2**-24``, where the terms would lose precision in
    the subnormals), a third try takes the exact row max, as the reference
    does (then every live row's sum is at least 1). Returns False, having
    written nothing final, only when a score overflowed: the blocked path
    then decides. NOTE: the loose bound is common once the weights have
    trained: the book's GPT at (V, C, E, H, L, B) = (256, 64, 64, 4, 2, 8),
    AdamW lr 4e-4 on random tokens, hit it in 202 of 901 attention forwards
    over 400 steps (the blocked path it fell back to cost about a tenth of a
    step). ``drop``: None or ``(dropout_mask, 1 / (1 - p))``,
    applied to the output only. ``normalize``: leave the weights ``P = E r``
    in ``exp_scores``. ``factors``: None, or a causal ``mask`` as 0 / 1
    (:func:`qkvnp.ops.masks.causal_factors`), multiplied after the exponential
    instead of adding the mask before it (``exp(-inf)`` is numpy's slow path).
    """
    dtype = exp_scores.dtype
    ones_s = _ones(exp_scores.shape[-1], dtype)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        usable = False  # NOTE: None is usable too (_usable_sums): test `is False`
        if normalize:  # m = 0: E = exp(S)
            np.matmul(query, key.swapaxes(-1, -2), out=exp_scores)  # (..., T, D) @ (..., D, S) -> (..., T, S)
            masked_exp(exp_scores, mask, factors, np.exp)
            np.matmul(exp_scores, ones_s, out=inv_sum)  # row sums, (..., T, S) @ (S, 1) -> (..., T, 1)
            usable = _usable_sums(inv_sum, mask, shifted=False)
        if usable is False:
            _shifted_exp(query, key, mask, mask_max, exp_scores, factors)
            np.matmul(exp_scores, ones_s, out=inv_sum)  # row sums, (..., T, S) @ (S, 1) -> (..., T, 1)
            usable = _usable_sums(inv_sum, mask, shifted=True)
        if usable is False:  # the bound too loose (or an overflow): the exact row max
            _exact_shifted_exp(query, key, mask, exp_scores)
            np.matmul(exp_scores, ones_s, out=inv_sum)  # row sums, (..., T, S) @ (S, 1) -> (..., T, 1)
            usable = _usable_sums(inv_sum, mask, shifted=True)
            if usable is False:
                return False
    if usable is None:  # fully masked rows (sum 0) among them: weights 0, output 0
        live = inv_sum != 0
        inv_sum[~live] = 1
        np.reciprocal(inv_sum, out=inv_sum)
        inv_sum[~live] = 0
    else:
        np.reciprocal(inv_sum, out=inv_sum)
    if normalize:  # O = P V, or (P * Z) V / (1 - p)
        exp_scores *= inv_sum  # P, (..., T, S)
        weights = exp_scores if drop is None else exp_scores * drop[0] * drop[1]
        np.matmul(weights, value, out=out)  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
    elif drop is None:
        np.matmul(exp_scores, value, out=out)  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
        out *= inv_sum
    else:  # O = r ((E * Z) V) / (1 - p)
        np.matmul(exp_scores * drop[0], value, out=out)  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
        out *= inv_sum * drop[1]
    return True


def masked_exp(scores, mask, factors, exp):
    """``exp(scores + mask)`` in place, or ``exp(scores) * factors`` (see ``small_forward``).

    ``exp`` is ``np.exp``, or ``np.exp2`` on base-2 scores (and mask).

    A masked score that overflows there gives ``inf * 0 = NaN``: its row sum
    is then not usable and the caller shifts, after which no score exceeds 0.
    """
    if factors is not None:
        exp(scores, out=scores)
        scores *= factors
        return
    if mask is not None:
        scores += mask
    exp(scores, out=scores)


def _shifted_exp(query, key, mask, mask_max, exp_scores, factors=None):
    """Fill ``exp_scores`` with ``exp(S + mask - m)``, ``m = |q| max|k| + max(mask row)``."""
    dtype = exp_scores.dtype
    # NOTE: einsum's row dot products measured 1.3-1.9x faster than
    # (k * k) @ ones on the strided head views of the layer's projections
    key_norm = np.sqrt(np.einsum("...sd,...sd->...s", key, key).max(axis=-1))  # (..., S, D) -> (...)
    bound = np.sqrt(np.einsum("...td,...td->...t", query, query)[..., None])  # |q|, (..., T, 1)
    bound *= key_norm[..., None, None]  # |q| max|k|
    if mask is not None:
        bound = bound + mask_max
    if exp_scores.size < LARGE_SCORES:  # few scores: fewest calls
        np.matmul(query, key.swapaxes(-1, -2), out=exp_scores)  # (..., T, D) @ (..., D, S) -> (..., T, S)
        if factors is None and mask is not None:
            exp_scores += mask
        exp_scores -= bound
        masked_exp(exp_scores, None, factors, np.exp)
    else:
        # base-2 scores: exp(x) = exp2(x log2(e)), and exp2 measured 2.2x faster
        # than exp in float32 (1.2x in float64); log2(e) goes into the (T, D) query
        log2e = dtype.type(np.log2(np.e))
        np.matmul(query * log2e, key.swapaxes(-1, -2), out=exp_scores)  # (..., T, D) @ (..., D, S) -> (..., T, S)
        if factors is None and mask is not None:
            exp_scores += mask if is_causal_additive(mask, dtype) else mask * log2e  # 0/-inf: as is
        exp_scores -= bound * log2e
        masked_exp(exp_scores, None, factors, np.exp2)


def _exact_shifted_exp(query, key, mask, exp_scores):
    """Fill ``exp_scores`` with ``exp(S + mask - max_row(S + mask))`` (a fully masked row: 0s).

    A score that overflowed gives an ``inf`` max and NaN there: the row sums
    are then not usable (:func:`_usable_sums`).
    """
    np.matmul(query, key.swapaxes(-1, -2), out=exp_scores)  # (..., T, D) @ (..., D, S) -> (..., T, S)
    if mask is not None:  # NOTE: the additive mask even where factors exist: same -inf entries
        exp_scores += mask
    row_max = exp_scores.max(axis=-1, keepdims=True)  # (..., T, S) -> (..., T, 1)
    row_max[np.isneginf(row_max)] = 0  # fully masked rows: exp(-inf) = 0 stays 0
    exp_scores -= row_max
    np.exp(exp_scores, out=exp_scores)


_MOST_SUMS: dict[np.dtype, float] = {}  # dtype -> 2**-24 / finfo(dtype).tiny, the largest unshifted row sum


def _usable_sums(row_sums, mask, shifted):
    """Whether every row sum of the exponentials can be normalised: True, False or None.

    A row sum is usable from ``2**-24`` on (below, the bound was so far above
    the row's max that its terms lost precision in the subnormals); without
    the shift (``shifted=False``) also at most ``2**-24 / tiny``, so that
    its reciprocal, and every weight, stays a normal float (scores up to
    about 70 in float32, 690 in float64). NaN (a score that overflowed) is
    never usable. None: usable but for rows that the mask removes entirely
    (row sum 0, weights 0). The common case is two reductions (the extremes;
    NaN fails them), cheaper than the row-by-row test that follows them.
    """
    tiny = 2.0 ** -24
    most = _MOST_SUMS.get(row_sums.dtype)
    if most is None:
        most = _MOST_SUMS[row_sums.dtype] = tiny / float(np.finfo(row_sums.dtype).tiny)
    if row_sums.size == 0 or (row_sums.min() >= tiny and (shifted or row_sums.max() <= most)):
        return True
    live = row_sums >= tiny
    if not shifted:
        live &= row_sums <= most
    dead = None if mask is None else np.isneginf(mask).all(axis=-1, keepdims=True)
    if dead is None or not (live | (dead & (row_sums == 0))).all():
        return False
    return None


def small_backward(dout, query, key, value, exp_scores, inv_sum, out, dquery, dkey, dvalue,
                   dquery_scale, drop=None):
    """``dense_backward`` of a problem too small to share, in whole-array calls.

    With :math:`E` the numerators and :math:`r = 1/\\mathrm{rowsum}(E)`:
    :math:`\\bar V = E^T (r \\bar O)`, :math:`G = E \\odot (\\bar P - \\delta)` with
    :math:`\\bar P = \\bar O V^T` and :math:`\\delta = r\\,\\mathrm{rowsum}(E \\odot \\bar P)`,
    :math:`\\bar Q = c\\, r \\odot (G K)`, :math:`\\bar K = G^T (r \\odot Q)`.
    With ``drop = (Z, 1 / (1 - p))``: :math:`\\bar V = (E \\odot Z)^T (r \\bar O) / (1 - p)`
    and :math:`\\bar P = (\\bar O V^T) \\odot Z / (1 - p)`, the rest unchanged.
    ``inv_sum`` None: ``exp_scores`` holds ``P`` (``dense_forward``), i.e. ``r = 1``.
    """
    if exp_scores.shape[-1] == 0:  # no key: nothing attended, no gradient
        dquery[...] = 0
        return

    def times_r(x):  # r x, (..., T, n)
        return x if inv_sum is None else x * inv_sum

    dscores = recycled_empty(exp_scores.shape, exp_scores.dtype)  # no page faults for a new (T, S)
    if drop is None:
        np.matmul(exp_scores.swapaxes(-1, -2), times_r(dout), out=dvalue)  # (..., S, T) @ (..., T, Dv)
        np.matmul(dout, value.swapaxes(-1, -2), out=dscores)  # dP: (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
    else:
        np.multiply(exp_scores, drop[0], out=dscores)  # E * Z, (..., T, S)
        np.matmul(dscores.swapaxes(-1, -2), times_r(dout * drop[1]), out=dvalue)  # (..., S, T) @ (..., T, Dv)
        np.matmul(dout, value.swapaxes(-1, -2), out=dscores)  # (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
        dscores *= drop[0]
        dscores *= drop[1]  # dP = (dO V^T) * Z / (1 - p)
    # NOTE: delta = rowsum(P * dP) from the dP just computed, not rowsum(dO * O):
    # on a saturated row dP - delta cancels, and the two must carry the same
    # rounding (a float32 W_key gradient whose exact value is ~0: rowsum(dO * O)
    # gave 5.7e-6 error, this 1.2e-6; the reference 6.2e-6). Small rows make
    # the (T, S) pass cheap; the blocked path keeps rowsum(dO * O).
    if exp_scores.size < LARGE_SCORES:  # few scores: fewest calls (einsum has a fixed cost)
        dscores *= exp_scores  # E * dP
        delta = times_r(dscores @ _ones(dscores.shape[-1], dscores.dtype))  # rowsum(P * dP), (..., T, 1)
        dscores -= exp_scores * delta  # = rowsum * dS = E * (dP - delta)
    else:
        delta = times_r(np.einsum("...ts,...ts->...t", exp_scores, dscores)[..., None])  # (..., T, 1)
        dscores -= delta
        dscores *= exp_scores  # = rowsum * dS = E * (dP - delta)
    np.matmul(dscores, key, out=dquery)  # (..., T, S) @ (..., S, D) -> (..., T, D)
    if inv_sum is not None:
        dquery *= inv_sum if dquery_scale == 1 else inv_sum * dquery_scale
    elif dquery_scale != 1:
        dquery *= dquery_scale
    np.matmul(dscores.swapaxes(-1, -2), times_r(query), out=dkey)  # (..., S, T) @ (..., T, D)
