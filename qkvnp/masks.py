"""Attention masks: validation, the causal mask, and fill values from the dtype.

Shape key: T query length, S key length, ``...`` any leading (batch, head) dims.

Polarity (as PyTorch's ``scaled_dot_product_attention`` and JAX): a boolean mask
is True where a query **may attend** to a key. A float mask is **added** to the
scores (``0`` keeps a position, ``-inf`` removes it). Integer masks are refused:
``0/1`` arrays are ambiguous between the two conventions.
"""
import numpy as np

__all__ = ["causal_mask", "prepare_mask"]


def causal_mask(T, S):
    """Boolean ``(T, S)`` mask where query ``i`` may attend to keys ``0..i``.

    Top-left aligned, as ``torch.nn.functional.scaled_dot_product_attention``:
    with ``S > T`` the last ``S - T`` keys are never visible to query 0.

    >>> causal_mask(3, 3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    return np.tril(np.ones((T, S), dtype=bool))


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
        if mask.dtype == np.bool_:
            keep = mask
        elif mask.dtype.kind == "f":
            if np.isnan(mask).any() or np.isposinf(mask).any():
                raise ValueError(f"{name} (float, added to the scores) contains NaN or +inf")
            bias = mask.astype(dtype, copy=False)
        else:
            raise TypeError(
                f"{name} must be bool (True = may attend) or float (added to the "
                f"scores), got dtype {mask.dtype}; for a 0/1 array use "
                f"{name}.astype(bool)"
            )
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
