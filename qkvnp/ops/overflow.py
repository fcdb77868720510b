"""Products near the float maximum: exact where the result fits, clipped where it does not.

Shape key: M rows of the left factor, K the contracted length, N columns of
the right factor, ``...`` any leading (batch, head) dims.

A matmul of finite inputs can overflow on the way to a finite result: with
``q = [1e308, 1e308]`` and ``k = [10, -9]`` the partial products are
``+inf`` and ``-inf`` while ``q . k = 1e308``. :func:`product` computes the
product as it always has, and recomputes only when that overflowed: the rows
of the left factor and the columns of the right one are scaled by powers of
two (exact in binary floating point) so that nothing overflows, and the
scale is given back to each entry of the result, where only an entry whose
exact value is beyond the dtype's range becomes ``inf``. :func:`clip_overflow`
then applies the documented clip to those.

The reference path (:mod:`qkvnp.functional`) runs its attention products
through here; the fast and tiled paths defer to it when their cheap screen
(:func:`qkvnp._checks.core_scores_may_overflow`) says that scores may come
near the float maximum, so every path gets these results there.
"""
import math

import numpy as np

__all__ = ["product", "clip_overflow", "check_projection"]


def product(a, b, factor=1.0, clip=False):
    """``factor * (a @ b)``, with no overflow that the exact result does not have.

    Parameters
    ----------
    a : ndarray, shape (..., M, K)
    b : ndarray, shape (..., K, N)
        Leading dims broadcast, as in ``a @ b``; one real or complex dtype.
    factor : float
        A Python float (the attention scale): a finite value of any size.
    clip : bool
        True: apply :func:`clip_overflow` to the result.

    Returns
    -------
    ndarray, shape (..., M, N)
        ``(a @ b) * factor`` exactly as numpy computes it when that is
        finite (the common case costs one ``isfinite`` pass). Otherwise its
        non-finite entries are recomputed from the inputs scaled by powers
        of two (below): an entry is ``+-inf`` only when its exact value is
        beyond the dtype's range, and NaN only when an input is NaN or inf.

    Notes
    -----
    A finite product met no overflow (``inf`` and NaN never turn finite
    again), so it is kept. For the rest, each row ``a_m`` is divided by
    ``2^alpha_m`` and each column ``b_n`` by ``2^beta_n``, with ``alpha_m =
    max(0, e(max|a_m|) - h)`` (``e(x)`` the binary exponent, ``2^{e-1} <= x <
    2^e``) and ``h`` such that ``K 2^h 2^h`` stays below the float maximum;
    then

    .. math:: (a b)_{mn} \\cdot c = \\mathrm{ldexp}\\big((a' b')_{mn} \\cdot
              m_c,\\ \\alpha_m + \\beta_n + e_c\\big), \\quad c = m_c 2^{e_c}

    ``a' b'`` cannot overflow, multiplying by the mantissa ``|m_c| < 1``
    neither, and ``ldexp`` is exact unless the result leaves the range. The
    scaling loses only the entries it pushes below the smallest subnormal:
    at most ``3 K 2^(alpha_m + beta_n)`` units of ``2^-1075`` (float64;
    ``2^-150`` in float32) per entry, far below the rounding error
    ``K eps sum_k |a_mk b_kn|`` of an entry that overflowed, whose terms
    sum to at least the float maximum.

    Examples
    --------
    >>> with np.errstate(over="ignore", invalid="ignore"):  # numpy warns of the first attempt
    ...     exact = product(np.array([[1e308, 1e308]]), np.array([[10.0], [-9.0]]))
    ...     clipped = product(np.array([[1e308]]), np.array([[10.0]]), clip=True)
    >>> exact, clipped
    (array([[1.e+308]]), array([[1.79769313e+308]]))
    """
    # NOTE: no np.errstate here (its cost is a sizeable share of a forward at
    # small shapes): numpy warns of an overflow, as it did before the rescue
    out = a @ b  # (..., M, K) @ (..., K, N) -> (..., M, N)
    if factor != 1.0:
        out *= factor  # in place: same values as (a @ b) * factor
    if np.isfinite(out).all():
        return out
    if out.dtype.kind == "f":
        out = np.where(np.isfinite(out), out, _rescaled(a, b, factor, out.dtype))
    return clip_overflow(out) if clip else out


def _rescaled(a, b, factor, dtype):
    """``factor * (a @ b)`` from power-of-two scaled rows and columns (:func:`product`'s Notes)."""
    info = np.finfo(dtype)
    contracted = max(a.shape[-1], 1)
    headroom = (info.maxexp - 2 - math.ceil(math.log2(contracted))) // 2  # h: K 4^h < max
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        a_exp = np.frexp(np.max(np.abs(a), axis=-1, keepdims=True, initial=0))[1]  # (..., M, 1)
        b_exp = np.frexp(np.max(np.abs(b), axis=-2, keepdims=True, initial=0))[1]  # (..., 1, N)
        a_shift = np.maximum(a_exp - headroom, 0)  # alpha, 0 for NaN/inf rows (frexp's 0)
        b_shift = np.maximum(b_exp - headroom, 0)  # beta
        scaled = np.ldexp(a, -a_shift) @ np.ldexp(b, -b_shift)  # (..., M, N), |.| < max / 4
        mantissa, exponent = math.frexp(factor)
        scaled *= dtype.type(mantissa)  # |mantissa| < 1: no overflow
        return np.ldexp(scaled, a_shift + b_shift + exponent).astype(dtype, copy=False)


def clip_overflow(scores):
    """``scores`` with ``+-inf`` replaced by the dtype's largest finite value, of that sign.

    The documented clip of overflowing attention scores: a score whose exact
    value is beyond the dtype's range counts as the largest finite one.
    NaN stays NaN: it comes only from a NaN or inf input (which the public
    functions refuse), and is never turned into a finite score.

    >>> clip_overflow(np.array([np.inf, -np.inf, np.nan, 1.0], np.float32))
    array([ 3.4028235e+38, -3.4028235e+38,            nan,  1.0000000e+00], dtype=float32)
    """
    if np.isfinite(scores).all():
        return scores
    big = np.finfo(scores.dtype).max
    return np.nan_to_num(scores, nan=np.nan, posinf=big, neginf=-big)


def check_projection(y, role):
    """Raise ``ValueError`` if the projection ``y`` of checked, finite inputs is not finite.

    ``x @ W_role (+ b_role)`` of finite ``x`` and weights holds inf (or NaN,
    ``inf - inf`` in a sum) only when a product or the sum overflowed: the
    message says so, where the core's check of its own inputs would blame
    ``query`` (or RoPE's ``x``), arrays the user never passed.

    >>> check_projection(np.ones(2), "query")
    >>> check_projection(np.array([1.0, np.inf]), "key")
    Traceback (most recent call last):
    ...
    ValueError: the key projection overflowed: x @ W_key (+ b_key) of finite inputs and weights exceeds the range of float64; scale the inputs or the weights down
    """
    if not np.isfinite(y).all():
        raise ValueError(f"the {role} projection overflowed: x @ W_{role} (+ b_{role}) of finite "
                         f"inputs and weights exceeds the range of {y.real.dtype}; scale the "
                         "inputs or the weights down")
