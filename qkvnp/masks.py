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
"""
import functools

import numpy as np

__all__ = ["causal_mask", "prepare_mask", "float_mask", "fold_key_padding_mask"]


@functools.lru_cache(maxsize=16)
def causal_mask(T, S):
    """Boolean ``(T, S)`` mask where query ``i`` may attend to keys ``0..i``.

    Top-left aligned, as ``torch.nn.functional.scaled_dot_product_attention``:
    with ``S > T`` the last ``S - T`` keys are never visible to query 0.
    The array is read-only and shared: the same ``(T, S)`` returns the same
    array (a training loop asks for it on every step).

    >>> causal_mask(3, 3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    mask = np.tril(np.ones((T, S), dtype=bool))
    mask.flags.writeable = False
    return mask


def prepare_mask(attn_mask, is_causal, scores_shape, dtype, name="attn_mask"):
    """Split a user mask into an additive part and a boolean part.

    Parameters
    ----------
    attn_mask : None or ndarray of bool or float
        Broadcastable to ``scores_shape``.
    is_causal : bool
        If True, AND the causal mask of shape ``scores_shape[-2:]`` into ``keep``.
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
        If the mask is neither bool nor float, or ``is_causal`` is not a bool.
    ValueError
        If the mask does not broadcast to ``scores_shape`` or contains NaN/+inf.
    """
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
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
    if is_causal:
        causal = causal_mask(*scores_shape[-2:])
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
        0-d, ``(T, S)`` or ``(..., H or 1, T, S)``.
    key_padding_mask : None or array_like of bool, shape (..., S)
        **True = a real token that may be attended** (PyTorch's
        ``nn.MultiheadAttention`` uses the opposite polarity).
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
    """
    scores_shape = batch + (num_heads, T, S)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.ndim not in (0, 2, len(scores_shape)):
            raise ValueError(
                f"attn_mask must have shape (T, S) = {(T, S)} or "
                f"{batch + ('H or 1', T, S)}, got shape {attn_mask.shape}"
            )
    if key_padding_mask is None:
        return attn_mask
    key_padding_mask = np.asarray(key_padding_mask)
    if key_padding_mask.dtype != np.bool_:
        raise TypeError(
            "key_padding_mask must be bool (True = real token that may be attended), "
            f"got dtype {key_padding_mask.dtype}"
        )
    if key_padding_mask.shape != batch + (S,):
        raise ValueError(
            f"key_padding_mask must have shape {batch + (S,)} (batch, S), "
            f"got shape {key_padding_mask.shape}"
        )
    padding = key_padding_mask.reshape(batch + (1, 1, S))  # (B, S) -> (B, 1, 1, S)
    if attn_mask is None or attn_mask.dtype == np.bool_:
        return padding if attn_mask is None else attn_mask & padding
    return np.where(padding, float_mask(attn_mask, dtype), -np.inf)
