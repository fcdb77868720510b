"""Position-dependent score biases: ALiBi's and T5's relative buckets.

Shape key: H heads, T query length, S key length, ``NB`` number of buckets.

Both are functions of the relative position ``j - i`` of key ``j`` and
query ``i``, added to the scores as ``score_bias`` of
:func:`qkvnp.functional.attention_forward`. With ``offset = S - T`` the query
``i`` stands at position ``i + S - T`` (the bottom-right alignment of
decoding with a KV cache, ``is_causal="bottom_right"``).
"""
from __future__ import annotations

import math

import numpy as np

from .._checks import check_int

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import ArrayLike, FloatArray, IntArray

__all__ = ["alibi_slopes", "alibi_bias", "relative_position_bucket", "relative_positions",
           "check_max_distance"]


def alibi_slopes(num_heads: int) -> FloatArray:
    """ALiBi's head slopes: the geometric sequence of Press et al. (2022).

    For ``n`` a power of two, head ``h`` (from 1) has slope ``2**(-8h/n)``.
    Otherwise, with ``m`` the largest power of two below ``n``: the ``m``
    slopes of ``m``, then every other slope of ``2m`` (the odd ones), the
    first ``n - m`` of them (the paper's code, ``get_slopes``).

    Parameters
    ----------
    num_heads : int

    Returns
    -------
    slopes : ndarray, shape (H,), float64

    Examples
    --------
    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> alibi_slopes(3).tolist()
    [0.0625, 0.00390625, 0.25]
    """
    num_heads = check_int(num_heads, "num_heads", 1)

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return np.array(power_of_two(num_heads))
    m = 2 ** int(math.floor(math.log2(num_heads)))
    return np.array(power_of_two(m) + power_of_two(2 * m)[0::2][:num_heads - m])


def relative_positions(T: Any, S: Any, offset: int = 0) -> Any:
    """``j - (i + offset)`` for query ``i`` and key ``j``, an int ``(T, S)`` array.

    >>> relative_positions(2, 3).tolist()
    [[0, 1, 2], [-1, 0, 1]]
    """
    T = check_int(T, "T", 0)
    S = check_int(S, "S", 0)
    return np.arange(S)[None, :] - (np.arange(T)[:, None] + int(offset))  # (T, S)


def alibi_bias(T: int, S: int, slopes: ArrayLike, offset: int = 0) -> FloatArray:
    """ALiBi's bias ``-slope_h * |i + offset - j|``, shape (H, T, S).

    Parameters
    ----------
    T, S : int
    slopes : array_like, shape (H,)
        From :func:`alibi_slopes`.
    offset : int
        ``S - T`` for the bottom-right alignment (decoding); 0 top-left.

    Returns
    -------
    bias : ndarray, shape (H, T, S)
        Zero on the (aligned) diagonal, more negative the farther a key is.
        For a causal model only ``j <= i`` counts, where this is the paper's
        ``-slope * (i - j)``; the distance is symmetric for a bidirectional one.

    Examples
    --------
    >>> alibi_bias(2, 2, [0.5]).tolist()
    [[[0.0, -0.5], [-0.5, 0.0]]]
    """
    slopes = np.asarray(slopes, dtype=np.float64)
    if slopes.ndim != 1:
        raise ValueError(f"slopes must have shape (H,), got shape {slopes.shape}")
    distance = np.abs(relative_positions(T, S, offset))  # (T, S)
    return slopes[:, None, None] * -distance  # (H,) -> (H, T, S); 0, not -0, on the diagonal


def check_max_distance(num_buckets: int, max_distance: int, bidirectional: bool = True,
                       where: str = "") -> int:
    """``max_distance`` if T5's log-spaced buckets fit it, else a ``ValueError`` naming it.

    With ``e`` the exact buckets (half of the buckets, of each side's half
    when bidirectional), distances from ``e`` on are bucketed by
    ``log(n / e) / log(max_distance / e)``: ``max_distance <= e`` makes that
    denominator 0 or negative, and the buckets NaN or negative (rows of
    ``rel_bias`` that belong to other distances). So ``max_distance`` must
    exceed ``max(e, 1)``.

    >>> check_max_distance(32, 128)
    128
    >>> check_max_distance(8, 2)
    Traceback (most recent call last):
    ...
    ValueError: max_distance must be greater than 2 for num_buckets=8 bidirectional (the distances below 2 have exact buckets; the log-spaced ones need room beyond them), got max_distance=2
    """
    half = num_buckets // 2 if bidirectional else num_buckets
    exact = max(half // 2, 1)
    if max_distance <= exact:
        kind = "bidirectional" if bidirectional else "unidirectional"
        raise ValueError(f"max_distance must be greater than {exact} for num_buckets={num_buckets} "
                         f"{kind}{where} (the distances below {exact} have exact buckets; the "
                         f"log-spaced ones need room beyond them), got max_distance={max_distance}")
    return max_distance


def relative_position_bucket(T: int, S: int, num_buckets: int = 32, max_distance: int = 128,
                             bidirectional: bool = True, *, offset: int = 0) -> IntArray:
    """T5's bucket of each relative position ``j - i``: an int ``(T, S)`` array in ``[0, num_buckets)``.

    Parameters
    ----------
    T, S : int
    num_buckets : int
        T5: 32. Bidirectional, half of them for keys after the query.
    max_distance : int
        Distances from here on share the last bucket. T5: 128. Must exceed
        the exact buckets' reach (:func:`check_max_distance`).
    bidirectional : bool
        True (T5's encoder) tells keys before and after apart; False (its
        decoder) gives every key after the query bucket 0.
    offset : int, keyword-only
        ``S - T`` in the bottom-right alignment.

    Returns
    -------
    buckets : ndarray of int64, shape (T, S)

    Raises
    ------
    ValueError
        If ``max_distance`` is too small for ``num_buckets``
        (:func:`check_max_distance`).

    Notes
    -----
    With ``n = -(j - i)``: bidirectional, ``num_buckets`` is halved and keys
    after the query (``n < 0``) add the half. Then, with ``e`` the exact
    half of the remaining buckets, distances ``|n| < e`` have their own
    bucket, and larger ones ``e + log(|n| / e) / log(max_distance / e) * (B - e)``
    (floored, capped at ``B - 1``): logarithmically wider buckets
    (``transformers``' ``T5Attention._relative_position_bucket``).

    Examples
    --------
    >>> relative_position_bucket(1, 6, num_buckets=8, max_distance=4).tolist()
    [[0, 5, 6, 7, 7, 7]]
    """
    num_buckets = check_int(num_buckets, "num_buckets", 2 if bidirectional else 1)
    max_distance = check_int(max_distance, "max_distance", 1)
    check_max_distance(num_buckets, max_distance, bidirectional)
    relative = relative_positions(T, S, offset)  # j - i, (T, S)
    n = -relative
    buckets = np.zeros(relative.shape, dtype=np.int64)
    if bidirectional:
        num_buckets //= 2
        buckets += (n < 0) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    exact = num_buckets // 2
    is_small = n < exact
    with np.errstate(divide="ignore"):  # log(0) where n = 0, which is_small covers
        large = exact + (np.log(np.maximum(n, 1) / max(exact, 1))
                         / math.log(max_distance / max(exact, 1))
                         * (num_buckets - exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)  # >= exact: max_distance > exact (checked)
    return buckets + np.where(is_small, n, large)
