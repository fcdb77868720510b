"""Dropout: on the attention weights (arguments, and the masks every path shares) and on activations.

Shape key: T query length, S key length, ``...`` any leading (batch, head)
dims; ``R`` the flat rows ``prod(...) * T`` of the scores.

Dropout zeroes each weight (after the softmax) with probability ``p`` and
scales the kept ones by ``1 / (1 - p)``, as PyTorch and the book do, so that
the expected output is the output without dropout.

A mask is either given (``dropout_mask``: bool, True = keep, broadcastable
to ``(..., T, S)``, used as is, to replay a mask) or **drawn**. A drawn mask
is not drawn entry by entry from the Generator: one 64-bit ``key`` is drawn,
and the entry at flat position ``n = (row * S + column)`` of the
``(..., T, S)`` scores is kept when ``splitmix64(key + (n + 1) * gamma) >=
p * 2**64`` (Steele, Lea and Flood's SplitMix64, a counter-based generator:
any entry is computed from its position alone). So:

- the tiled path, which must not hold a ``(T, S)`` mask, recomputes each
  block's mask from the key in the forward and again in the backward, and
  gets the same mask whatever its block sizes, thread count or block order;
- every path (reference, fast, tiled) draws the **same** mask from the same
  Generator state: a layer gives the same result whichever path
  :func:`qkvnp.kernels.choose_path` picks.

NOTE: not numpy's Philox keyed by block: the tiled block sizes depend on the thread count, so a mask keyed by block
would change with it; Philox keyed by row would need one Generator object
per row of each block. SplitMix64's three multiply/xor-shift rounds are
vectorised numpy ``uint64`` passes over the block.

Dropout on activations (``nn.Dropout``, :func:`activation_dropout_forward`)
draws its mask entry by entry from the Generator (``rng.random(x.shape) >=
p``): no path recomputes it.
"""
from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, declare_complex_step, is_real_number,
                       make_rng)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import BoolArray, FloatArray

__all__ = [
    "Dropout",
    "check_dropout_p",
    "keep_scale",
    "no_dropout",
    "prepare_dropout",
    "draw_key",
    "keep_rows",
    "dense_keep",
    "block_keep",
    "spawn_generator",
    "activation_dropout_forward",
    "activation_dropout_backward",
    "ActivationDropoutCache",
]

Dropout = namedtuple("Dropout", "p key mask shape")
Dropout.__doc__ = """The dropout of one attention forward.

p : float in (0, 1), the drop probability; kept weights are scaled by 1 / (1 - p).
key : numpy.uint64 or None, the key of a drawn mask (see the module docstring).
mask : ndarray of bool or None, a given mask (True = keep), broadcastable to ``shape``.
shape : tuple, the scores' shape ``(..., T, S)``.
"""

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio, odd)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MOD = 1 << 64
_CHUNK_ELEMENTS = 1 << 16  # entries of uint64 temporaries per chunk of dense_keep


def check_dropout_p(dropout_p, name="dropout_p"):
    """``dropout_p`` as a float in ``[0, 1)``; 1 (drop everything) is refused.

    >>> check_dropout_p(0.1)
    0.1
    """
    if not is_real_number(dropout_p):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(dropout_p).__name__} "
                        f"{dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"{name} must be in [0, 1) (1 would drop every weight), got {dropout_p!r}")
    return p


def keep_scale(p, dtype):
    """The factor of the kept weights, ``1 / (1 - p)``, as a scalar of ``dtype``.

    In the weights' own dtype, as PyTorch's dropout scales (a Python float
    would be exact, but a float64 scalar would upcast float32 arrays).

    >>> scale = keep_scale(0.5, np.float32)
    >>> float(scale), scale.dtype
    (2.0, dtype('float32'))
    """
    return np.dtype(dtype).type(1.0 / (1.0 - p))


def draw_key(rng):
    """One 64-bit key from ``rng`` (a Generator, an int seed or None)."""
    return make_rng(rng).integers(0, _MOD, dtype=np.uint64)


def no_dropout(dropout_p, dropout_mask):
    """True for the forwards' default, no dropout: ``dropout_p`` the float 0.0 and no mask.

    The cheap test that needs no check (a few comparisons); anything else goes
    through :func:`prepare_dropout`'s checks, which may also find no dropout.
    """
    return dropout_mask is None and type(dropout_p) is float and dropout_p == 0.0


def prepare_dropout(dropout_p, rng, dropout_mask, scores_shape, draw=True):
    """Check the dropout arguments of a forward; return a :class:`Dropout` or None.

    Parameters
    ----------
    dropout_p : float
        In ``[0, 1)``.
    rng : numpy.random.Generator or int or None
        Draws the mask's key (one draw) when ``dropout_p > 0`` and no mask
        is given; unused otherwise.
    dropout_mask : ndarray of bool, optional
        True = keep; broadcastable to ``scores_shape``; needs ``0 < dropout_p < 1``.
    scores_shape : tuple of int
        ``(..., T, S)``.
    draw : bool
        False: only check (``rng`` is not drawn from; the key is None).

    Returns
    -------
    Dropout or None
        None when ``dropout_p == 0`` (no dropout: the forward is exactly the
        one without, and ``rng`` is not touched).

    Raises
    ------
    TypeError
        ``dropout_p`` not a number, ``dropout_mask`` not boolean, ``rng`` not
        a Generator, an int or None.
    ValueError
        ``dropout_p`` outside ``[0, 1)``, a mask with ``dropout_p == 0``, a
        mask that does not broadcast to ``scores_shape``.
    """
    if no_dropout(dropout_p, dropout_mask):
        return None
    p = check_dropout_p(dropout_p)
    scores_shape = tuple(scores_shape)
    if dropout_mask is None:
        if p == 0.0:
            return None
        if not draw:
            make_rng(rng)  # checks its type
            return Dropout(p, None, None, scores_shape)
        return Dropout(p, draw_key(rng), None, scores_shape)
    mask = np.asarray(dropout_mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"dropout_mask must be a bool array (True = keep), got dtype {mask.dtype}")
    if p == 0.0:
        raise ValueError("dropout_mask needs 0 < dropout_p < 1 (the kept weights are scaled by "
                         "1 / (1 - dropout_p)), got dropout_p=0.0")
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)  # (S,) -> (1, S)
    try:
        broadcast = np.broadcast_shapes(mask.shape, scores_shape)
    except ValueError:
        broadcast = None
    if broadcast != scores_shape:
        raise ValueError(f"dropout_mask must broadcast to the scores' shape {scores_shape} "
                         f"(..., T, S), got shape {mask.shape}")
    return Dropout(p, None, mask, scores_shape)


def _threshold(p):
    """The uint64 below which an entry is dropped: ``round(p * 2**64)``."""
    return np.uint64(min(int(round(p * _MOD)), _MOD - 1))


def keep_rows(key, p, rows, columns, S):
    """Drawn mask entries at flat ``rows`` (of the ``(R, S)`` scores) and ``columns``.

    Parameters
    ----------
    key : numpy.uint64
    p : float
    rows : ndarray of int, shape (..., r, 1)
        Flat row indices ``row = g * T + t`` (``g`` the flat leading index).
    columns : ndarray of int, shape (c,)
    S : int
        Number of keys (the row length of the flat position).

    Returns
    -------
    ndarray of bool, shape (..., r, c)
        True = keep.
    """
    rows = np.asarray(rows, dtype=np.uint64)
    columns = np.asarray(columns, dtype=np.uint64)
    # state of position n: key + (n + 1) * gamma, with n = row * S + column (mod 2**64)
    base = rows * np.uint64((S * _GAMMA) % _MOD) + np.uint64((int(key) + _GAMMA) % _MOD)  # (..., r, 1)
    z = base + columns * np.uint64(_GAMMA)  # (..., r, 1) + (c,) -> (..., r, c)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z >= _threshold(p)


def dense_keep(dropout):
    """The whole mask ``(..., T, S)`` of ``dropout`` (bool, True = keep).

    A given mask is returned as given (broadcastable, not broadcast); a
    drawn one is computed in chunks of rows, so its ``uint64`` temporaries
    stay small.
    """
    if dropout.mask is not None:
        return dropout.mask
    shape = dropout.shape
    S = shape[-1]
    R = math.prod(shape[:-1])
    keep = np.empty((R, S), dtype=bool)  # (R, S)
    step = max(1, _CHUNK_ELEMENTS // max(1, S))
    columns = np.arange(S)
    for start in range(0, R, step):
        stop = min(start + step, R)
        keep[start:stop] = keep_rows(dropout.key, dropout.p, np.arange(start, stop)[:, None],
                                     columns, S)
    return keep.reshape(shape)  # (R, S) -> (..., T, S)


def block_keep(dropout, i0, i1, j0, j1):
    """Rows ``i0:i1`` and columns ``j0:j1`` of the mask, for every leading index.

    Returns a bool array broadcastable to ``(..., i1 - i0, j1 - j0)``: a
    slice of a given mask (size-1 dims kept), or the drawn entries of that
    block, computed from the key (the same as :func:`dense_keep`'s).
    """
    if dropout.mask is not None:
        mask = dropout.mask
        rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
        cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
        return mask[..., rows, cols]  # (..., T or 1, S or 1) -> (..., bq or 1, bk or 1)
    lead = dropout.shape[:-2]
    T, S = dropout.shape[-2:]
    starts = (np.arange(math.prod(lead)) * T).reshape(lead + (1, 1))  # (..., 1, 1) first row of each g
    rows = starts + np.arange(i0, i1)[:, None]  # (..., bq, 1)
    return keep_rows(dropout.key, dropout.p, rows, np.arange(j0, j1), S)  # (..., bq, bk)


def spawn_generator(rng):
    """A child Generator of ``rng`` that does not consume ``rng``'s draws.

    ``Generator.spawn`` (numpy >= 1.25) where it exists, else the same
    child from the seed sequence (numpy 1.24). So a layer built from a
    shared Generator leaves the draws of the layers built after it unchanged.
    """
    if hasattr(rng, "spawn"):
        return rng.spawn(1)[0]
    bit_generator = rng.bit_generator
    seed_seq = getattr(bit_generator, "seed_seq", None) or getattr(bit_generator, "_seed_seq")
    return np.random.Generator(type(bit_generator)(seed_seq.spawn(1)[0]))


# ---------------------------------------------------------------- on activations

ActivationDropoutCache = namedtuple("ActivationDropoutCache", "mask scale shape dtype")


def activation_dropout_forward(x: FloatArray, p: float, *,
                               rng: np.random.Generator | int | None = None,
                               mask: BoolArray | None = None,
                               check: bool = True) -> tuple[FloatArray, ActivationDropoutCache]:
    """Dropout on activations (``nn.Dropout``): zero entries, scale the rest by ``1/(1-p)``.

    Parameters
    ----------
    x : ndarray, shape (...)
    p : float
        Drop probability in ``[0, 1)``. 0: the identity (nothing is drawn).
    rng : numpy.random.Generator or int, keyword-only, optional
        Draws the mask (``rng.random(x.shape) >= p``) when none is given.
    mask : ndarray of bool, keyword-only, optional
        True = keep, broadcastable to ``x.shape``: replays a mask (needs
        ``0 < p < 1``).
    check : bool, keyword-only
        False: ``x`` is a composite's own finite array, already checked.

    Returns
    -------
    out : ndarray, shape (...)
    cache : ActivationDropoutCache

    Raises
    ------
    TypeError
        If ``mask`` is not boolean or ``p`` not a number.
    ValueError
        If ``p`` is outside ``[0, 1)``, a mask comes with ``p = 0``, or the
        mask does not broadcast to ``x``.

    Notes
    -----
    Forward :math:`y = x \\odot m / (1 - p)`, backward
    :math:`\\bar x = \\bar y \\odot m / (1 - p)`.

    Examples
    --------
    >>> out, cache = activation_dropout_forward(np.ones(4), 0.5, mask=np.array([1, 0, 1, 0], bool))
    >>> out
    array([2., 0., 2., 0.])
    """
    p = check_dropout_p(p, "p")
    if check:
        x = as_float_array(x, "x")
    if mask is None and p == 0.0:
        return x, ActivationDropoutCache(None, None, x.shape, x.dtype)
    if mask is None:
        mask = make_rng(rng).random(x.shape) >= p  # (...)
    else:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array (True = keep), got dtype {mask.dtype}")
        if p == 0.0:
            raise ValueError("mask needs 0 < p < 1 (kept entries are scaled by 1 / (1 - p)), "
                             "got p=0.0")
        try:
            broadcast = np.broadcast_shapes(mask.shape, x.shape)
        except ValueError:
            broadcast = None
        if broadcast != x.shape:
            raise ValueError(f"mask must broadcast to x's shape {x.shape}, got shape {mask.shape}")
        mask = mask.copy()
    scale = x.real.dtype.type(1.0 / (1.0 - p))
    out = x * mask * scale  # (...)
    return out, ActivationDropoutCache(mask, scale, x.shape, x.dtype)


def activation_dropout_backward(dout: FloatArray, cache: ActivationDropoutCache,
                                check: bool = True) -> FloatArray:
    """Backward of :func:`activation_dropout_forward`: ``dout * mask / (1 - p)``.

    Parameters
    ----------
    dout : ndarray, shape (...)
    cache : ActivationDropoutCache
    check : bool
        False: ``dout`` is a composite's own gradient, already checked.

    Returns
    -------
    dx : ndarray, shape (...)
    """
    mask, scale, shape, dtype = cache
    if check:
        dout = as_upstream_grad(dout, "dout", shape, dtype)
    if mask is None:
        return dout
    return dout * mask * scale


declare_complex_step(activation_dropout_forward)  # see qkvnp._checks.complex_step_mode
