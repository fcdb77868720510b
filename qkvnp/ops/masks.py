"""Attention masks: validation, the causal mask, and fill values from the dtype.

Shape key: T query length, S key length, ``...`` any leading (batch, head) dims.

Polarity (as PyTorch's ``scaled_dot_product_attention`` and JAX): a boolean mask
is True where a query **may attend** to a key. A float mask is **added** to the
scores (``0`` keeps a position, ``-inf`` removes it). Integer masks are refused:
``0/1`` arrays are ambiguous between the two conventions.

One rule for float masks, on every path: a float mask is used in the compute
dtype; a finite value that the cast would overflow (``-1e39`` for float32
scores) is refused with a ``ValueError`` naming the mask, never silently
turned into ``-inf``. A 0-d mask (or a Python bool) applies to every score.

The dense causal masks that the dense paths ask for on every call are kept
between calls, up to :data:`CAUSAL_CACHE_BYTES` in all: larger ones are
made per call and freed with it. The tiled path never makes one: it tests
whole blocks against the diagonal (:func:`causal_offset`).
"""
import os
import threading
import weakref
from collections import OrderedDict

import numpy as np

__all__ = ["causal_mask", "causal_offset", "check_is_causal", "prepare_mask", "float_mask",
           "fold_key_padding_mask", "additive_mask", "is_causal_additive", "causal_factors",
           "causal_mask_offset", "CAUSAL_ALIGNMENTS", "CAUSAL_CACHE_BYTES"]

#: What ``is_causal`` may be: no causal mask, top-left aligned (PyTorch's SDPA
#: ``is_causal=True``) or bottom-right aligned (PyTorch's ``causal_lower_right``).
CAUSAL_ALIGNMENTS = (False, True, "bottom_right")

#: Bytes of dense causal masks (boolean, additive and 0 / 1 factors) kept
#: between calls, all shapes and dtypes together, least recently used dropped
#: first. A mask larger than this is made anew on each call. 8 MiB holds a
#: float64 (512, 512) layer's three arrays, or a float32 (724, 724) one's.
CAUSAL_CACHE_BYTES = 8 << 20


def check_is_causal(is_causal):
    """``is_causal`` as ``False``, ``True`` (top-left) or ``"bottom_right"``; else raise.

    >>> check_is_causal(np.bool_(True)), check_is_causal("bottom_right")
    (True, 'bottom_right')
    """
    if isinstance(is_causal, (bool, np.bool_)):
        return bool(is_causal)
    if isinstance(is_causal, str) and is_causal == "bottom_right":
        return "bottom_right"
    raise TypeError(
        f"is_causal must be a bool (True: top-left aligned) or \"bottom_right\", got "
        f"{is_causal!r} ({type(is_causal).__name__})"
    )


def causal_offset(is_causal, T, S):
    """The diagonal of a causal mask: query ``i`` may attend key ``j`` iff ``j <= i + offset``.

    None without a causal mask, 0 top-left aligned, ``S - T`` bottom-right
    aligned (the last query sees every key: the alignment of decoding with a
    KV cache, where the ``T`` new queries are the last ``T`` of ``S`` keys).

    >>> causal_offset(True, 2, 5), causal_offset("bottom_right", 2, 5), causal_offset(False, 2, 5)
    (0, 3, None)
    """
    is_causal = check_is_causal(is_causal)
    if is_causal is False:
        return None
    return S - T if is_causal == "bottom_right" else 0


def causal_mask(T, S, bottom_right=False):
    """Boolean ``(T, S)`` mask where query ``i`` may attend to keys ``0..i``.

    Top-left aligned, as ``torch.nn.functional.scaled_dot_product_attention``:
    with ``S > T`` the last ``S - T`` keys are never visible to query 0.
    ``bottom_right=True`` aligns the last query with the last key instead
    (PyTorch's ``causal_lower_right``): query ``i`` attends keys
    ``0..i + S - T``, and with ``T > S`` the first ``T - S`` queries attend to
    nothing (fully masked rows: output 0).
    The array is read-only, and shared while it fits in
    :data:`CAUSAL_CACHE_BYTES`: the same ``(T, S)`` then returns the same
    array (a training loop asks for it on every step).

    >>> causal_mask(3, 3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    >>> causal_mask(2, 3, bottom_right=True).astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    return _causal_mask(T, S, S - T if bottom_right else 0)


class _Shared:
    """Read-only arrays by key, at most ``budget`` bytes of them, least recently used
    dropped first; a value larger than the budget is returned and not kept."""

    def __init__(self, budget):
        self.budget = budget
        self.values = OrderedDict()  # key -> (value, nbytes)
        self.nbytes = 0
        self.lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # a lock held by another thread at a fork
            os.register_at_fork(after_in_child=self._fresh_lock)

    def _fresh_lock(self):
        self.lock = threading.Lock()

    def get(self, key, make):
        with self.lock:
            hit = self.values.get(key)
            if hit is not None:
                self.values.move_to_end(key)
                return hit[0]
        value = make()  # outside the lock: others may read meanwhile
        nbytes = sum(a.nbytes for a in (value if isinstance(value, tuple) else (value,)))
        if nbytes <= self.budget:
            with self.lock:
                if key not in self.values:
                    self.values[key] = (value, nbytes)
                    self.nbytes += nbytes
                while self.nbytes > self.budget:
                    _, (_, dropped) = self.values.popitem(last=False)
                    self.nbytes -= dropped
        return value


_SHARED = _Shared(CAUSAL_CACHE_BYTES)
# Every causal mask made here, by id, for as long as it lives (kept or not):
# additive_mask recognises one by identity without a (T, S) comparison.
_CAUSAL_KEEPS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
_KEEP_OFFSETS: dict[int, int] = {}  # and the offset of its diagonal, until the mask dies


def _causal_mask(T, S, offset):
    """The read-only ``(T, S)`` mask ``j <= i + offset``, shared while it fits the budget."""
    return _SHARED.get(("keep", T, S, offset), lambda: _make_causal_mask(T, S, offset))


def _allowed(T, S, offset):
    """A fresh boolean ``(T, S)`` array, True where ``j <= i + offset``."""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + offset  # (1, S), (T, 1) -> (T, S)


def _make_causal_mask(T, S, offset):
    mask = _allowed(T, S, offset)
    mask.flags.writeable = False
    _CAUSAL_KEEPS[id(mask)] = mask
    _KEEP_OFFSETS[id(mask)] = offset
    weakref.finalize(mask, _KEEP_OFFSETS.pop, id(mask), None)
    return mask


def prepare_mask(attn_mask, is_causal, scores_shape, dtype, name="attn_mask"):
    """Split a user mask into an additive part and a boolean part.

    Parameters
    ----------
    attn_mask : None or ndarray of bool or float
        Broadcastable to ``scores_shape``.
    is_causal : bool or "bottom_right"
        If True (top-left) or ``"bottom_right"``, AND the causal mask of shape
        ``scores_shape[-2:]`` into ``keep`` (see :func:`causal_mask`).
    scores_shape : tuple of int
        ``(..., T, S)``.
    dtype : dtype
        Compute dtype of the scores; a float mask is cast to it.
    name : str
        Argument name for error messages.

    Returns
    -------
    bias : ndarray or None
        Float mask to add to the scores (may contain ``-inf``).
    keep : ndarray of bool or None
        True where attending is allowed; positions with False get ``-inf``
        after ``bias`` is added.

    Raises
    ------
    TypeError
        If the mask is neither bool nor float, or ``is_causal`` is not a bool
        or ``"bottom_right"``.
    ValueError
        If the mask does not broadcast to ``scores_shape`` or contains NaN/+inf.
    """
    offset = causal_offset(is_causal, *scores_shape[-2:])
    bias = keep = None
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.ndim < 2:  # NOTE: 0-d (or Python bool) and 1-d masks broadcast as (1, 1), (1, S)
            mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
        if mask.dtype == np.bool_:
            keep = mask
        else:
            bias = float_mask(mask, dtype, name)
        try:
            broadcast = np.broadcast_shapes(mask.shape, tuple(scores_shape))
        except ValueError:
            broadcast = None
        if broadcast != tuple(scores_shape):
            raise ValueError(
                f"{name} must broadcast to the scores' shape {tuple(scores_shape)} "
                f"(..., T, S), got shape {mask.shape}"
            )
    if offset is not None:
        causal = _causal_mask(*scores_shape[-2:], offset)
        keep = causal if keep is None else keep & causal
    return bias, keep


def float_mask(mask, dtype, name="attn_mask"):
    """A float (additive) mask checked and cast to the compute ``dtype``.

    Parameters
    ----------
    mask : ndarray
    dtype : dtype
        The compute dtype of the scores.
    name : str
        Argument name for error messages.

    Raises
    ------
    TypeError
        If ``mask`` is neither bool nor float (``0/1`` integers are ambiguous).
    ValueError
        If ``mask`` contains NaN or +inf, or a finite value that overflows
        ``dtype`` (``-1e39`` in float32 would silently become ``-inf``).

    >>> float_mask(np.array([0.0, -np.inf]), np.float32)
    array([  0., -inf], dtype=float32)
    """
    if mask.dtype.kind != "f":
        raise TypeError(
            f"{name} must be bool (True = may attend) or float (added to the "
            f"scores), got dtype {mask.dtype}; for a 0/1 array use "
            f"{name}.astype(bool)"
        )
    if np.isnan(mask).any() or np.isposinf(mask).any():
        raise ValueError(f"{name} (float, added to the scores) contains NaN or +inf")
    with np.errstate(over="ignore"):
        bias = mask.astype(dtype, copy=False)
    if bias is not mask:
        overflow = np.isinf(bias) & np.isfinite(mask)
        if overflow.any():
            where = tuple(int(i) for i in np.argwhere(overflow)[0])
            raise ValueError(
                f"{name} has values too large for the compute dtype {np.dtype(dtype)} "
                f"({float(mask[where]):g} at index {where}, dtype {mask.dtype}); use -inf to remove "
                "a position, or a finite value within range"
            )
    return bias


def fold_key_padding_mask(attn_mask, key_padding_mask, batch, num_heads, T, S, dtype):
    """One mask for a multi-head layer: ``attn_mask`` with the key padding folded in.

    Parameters
    ----------
    attn_mask : None or array_like of bool or float
        0-d, ``(T, S)``, ``(..., H or 1, T, S)``, or PyTorch's 3-D
        ``(B*H, T, S)`` (batch ``b``, head ``h`` at row ``b*H + h``) when
        ``batch`` is ``(B,)``.
    key_padding_mask : None or array_like of bool or float, shape (..., S)
        Bool: **True = a real token that may be attended** (PyTorch's
        ``nn.MultiheadAttention`` uses the opposite polarity, True = pad).
        Float: added to the scores (0 keeps, ``-inf`` removes), as PyTorch's.
    batch : tuple of int
        The leading dims ``...`` of the query.
    num_heads, T, S : int
    dtype : dtype
        Compute dtype (a float mask is checked and cast by :func:`float_mask`).

    Returns
    -------
    mask : ndarray or None
        Broadcastable to ``(..., H, T, S)``: bool, or float with ``-inf``
        where padding removes a key (a float mask is added, then the padding
        removes keys: ``-inf`` does both).

    Notes
    -----
    NOTE: a 3-D mask is ambiguous: ``(B*H, T, S)`` (PyTorch's
    ``nn.MultiheadAttention``) or ``(B, T, S)`` / ``(H, T, S)`` broadcast
    over the other axis. As PyTorch, the shape decides: with a batch of one
    dim ``(B,)``, a 3-D mask must have ``B*H`` rows and is read as
    ``(B, H, T, S)``; when ``H = 1`` or ``B = 1`` the readings coincide. Any
    other first dim is refused with the shapes to use instead. Without a
    batch dim, a 3-D mask is ``(H, T, S)``, as before (and as PyTorch's
    unbatched input).
    """
    scores_shape = batch + (num_heads, T, S)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.ndim == 3 and len(batch) == 1:
            attn_mask = _unfold_batch_heads(attn_mask, batch, num_heads, T, S)
        elif attn_mask.ndim not in (0, 2, len(scores_shape)):
            raise ValueError(
                f"attn_mask must have shape (T, S) = {(T, S)} or "
                f"{batch + ('H or 1', T, S)}, got shape {attn_mask.shape}"
            )
    if key_padding_mask is None:
        return attn_mask
    key_padding_mask = np.asarray(key_padding_mask)
    if key_padding_mask.dtype != np.bool_ and key_padding_mask.dtype.kind != "f":
        raise TypeError(
            "key_padding_mask must be bool (True = real token that may be attended; "
            "PyTorch's bool key_padding_mask has True = pad, pass ~mask) or float (added to "
            f"the scores: 0 keeps a key, -inf removes it), got dtype {key_padding_mask.dtype}"
        )
    if key_padding_mask.shape != batch + (S,):
        raise ValueError(
            f"key_padding_mask must have shape {batch + (S,)} (batch, S), "
            f"got shape {key_padding_mask.shape}"
        )
    if key_padding_mask.dtype != np.bool_:  # additive, as PyTorch's float masks
        padding = float_mask(key_padding_mask, dtype, "key_padding_mask")
        padding = padding.reshape(batch + (1, 1, S))  # (B, S) -> (B, 1, 1, S)
        if attn_mask is None:
            return padding
        if attn_mask.dtype == np.bool_:
            return np.where(attn_mask, padding, -np.inf)
        return float_mask(attn_mask, dtype) + padding  # -inf + finite stays -inf
    padding = key_padding_mask.reshape(batch + (1, 1, S))  # (B, S) -> (B, 1, 1, S)
    if attn_mask is None or attn_mask.dtype == np.bool_:
        return padding if attn_mask is None else attn_mask & padding
    return np.where(padding, float_mask(attn_mask, dtype), -np.inf)


def _unfold_batch_heads(attn_mask, batch, num_heads, T, S):
    """PyTorch's 3-D ``(B*H, T, S)`` mask as ``(B, H, T, S)`` (a view); else ``ValueError``."""
    (B,) = batch
    if attn_mask.shape != (B * num_heads, T, S):
        raise ValueError(
            f"a 3-D attn_mask must have shape (B*H, T, S) = {(B * num_heads, T, S)} "
            f"(PyTorch's nn.MultiheadAttention layout, batch b and head h at b*H + h), got "
            f"shape {attn_mask.shape}; for one mask per batch entry pass (B, 1, T, S), per "
            f"head (1, H, T, S) or (H, T, S)[None]"
        )
    return attn_mask.reshape(batch + (num_heads, T, S))  # (B*H, T, S) -> (B, H, T, S)


def additive_mask(bias, keep, dtype):
    """One additive mask: ``bias`` where allowed, ``-inf`` where ``keep`` forbids.

    The causal masks of :func:`causal_mask` (either alignment) give read-only
    0 / ``-inf`` arrays, shared as those are, which :func:`is_causal_additive`
    recognises.
    """
    if keep is None:
        return bias
    if bias is None and _CAUSAL_KEEPS.get(id(keep)) is keep:  # a causal mask of this module
        T, S = keep.shape
        return _causal_arrays(T, S, _KEEP_OFFSETS[id(keep)], np.dtype(dtype))[0]
    return np.where(keep, 0 if bias is None else bias, -np.inf).astype(dtype, copy=False)


def _causal_arrays(T, S, offset, dtype):
    """The causal mask in ``dtype`` as 0 / -inf and as its 0 / 1 factors, read-only,
    shared while they fit the budget."""
    return _SHARED.get(("arrays", T, S, offset, dtype),
                       lambda: _make_causal_arrays(T, S, offset, dtype))


def _make_causal_arrays(T, S, offset, dtype):
    allowed = _allowed(T, S, offset)
    mask = np.where(allowed, dtype.type(0), dtype.type(-np.inf))  # in dtype: one pass
    factors = allowed.astype(dtype)
    for a in (mask, factors):
        a.flags.writeable = False
    _CAUSAL_ADDITIVES[id(mask)] = mask
    _CAUSAL_FACTORS[id(mask)] = factors  # alive as long as the mask
    _CAUSAL_OFFSETS[id(mask)] = offset
    weakref.finalize(mask, _forget_additive, id(mask))
    return mask, factors


def _forget_additive(key):
    _CAUSAL_FACTORS.pop(key, None)
    _CAUSAL_OFFSETS.pop(key, None)


# The arrays :func:`_causal_arrays` made, by the additive mask's id, for as
# long as that mask lives.
_CAUSAL_ADDITIVES: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
_CAUSAL_FACTORS: dict[int, np.ndarray] = {}
_CAUSAL_OFFSETS: dict[int, int] = {}  # and the offset of its diagonal (causal_offset)


def is_causal_additive(mask, dtype):
    """True for a shared causal mask of :func:`additive_mask` (0 / -inf, either alignment)."""
    return _CAUSAL_ADDITIVES.get(id(mask)) is mask and mask.dtype == np.dtype(dtype)


def causal_mask_offset(mask, dtype):
    """:func:`causal_offset` of a shared causal mask of :func:`additive_mask`; None for any other mask.

    Query ``i`` of such a mask sees keys ``j <= i + offset`` only: the fast
    core skips the keys that no row of a row chunk sees.
    """
    if mask is None or not is_causal_additive(mask, dtype):
        return None
    return _CAUSAL_OFFSETS.get(id(mask))


def causal_factors(mask, dtype):
    """The 0 / 1 factors of a shared causal mask of :func:`additive_mask`; None for any other mask.

    ``exp(S) * factors`` equals ``exp(S + mask)`` for finite scores ``S``, and
    costs less: numpy's ``exp`` and ``exp2`` take a slow path on ``-inf``
    (several times slower on causal scores; measured in
    benchmarks/NOTES.md), so the fast kernels
    exponentiate the unmasked scores and multiply by the factors, one pass
    each, as adding the mask was.
    """
    if mask is None or not is_causal_additive(mask, dtype):
        return None
    return _CAUSAL_FACTORS.get(id(mask))
