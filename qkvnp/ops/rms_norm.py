"""Root-mean-square normalisation over the last axis (RMSNorm, QK-norm), forward and backward.

Shape key: ``...`` any leading dims (B batch, T tokens; B, H, T for QK-norm),
E the normalised (last) axis: the embedding, or D the head dim for QK-norm.

The forward is analytic (``x * x``, no ``abs``): the gradient checker's
complex step runs it on complex arrays. Derived in
``docs/derivations_gpt.md``; users reach it through :mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, check_bool, check_eps,
                       compute_dtype, declare_complex_step)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["rms_norm_forward", "rms_norm_backward", "RMSNormCache"]

#: ``normalized`` x r (..., E), ``rstd`` r (..., 1), ``gain`` the factor applied, (E,):
#: ``weight``, or ``1 + weight`` with ``unit_offset``.
RMSNormCache = namedtuple("RMSNormCache", "normalized rstd gain")



def rms_norm_forward(x: FloatArray, weight: FloatArray, eps: float = 1e-06, *,
                     unit_offset: bool = False) -> tuple[FloatArray, RMSNormCache]:
    """RMS normalisation over the last axis: ``x / rms(x) * weight`` (or ``* (1 + weight)``).

    Parameters
    ----------
    x : ndarray, shape (..., E)
        For QK-norm, the queries or keys split into heads, ``(B, H, T, D)``
        (or ``(B, T, H, D)``): each head's vector is normalised on its own.
    weight : ndarray, shape (E,)
        The learned gain (``(D,)`` for QK-norm, shared by the heads).
    eps : float
        Added to the mean square. ``1e-6`` here, as Qwen3's and Gemma 3's
        ``rms_norm_eps``; Llama 2 and 3 use ``1e-5``, which must be passed.
    unit_offset : bool, keyword-only
        False: the gain is ``weight`` (Llama, Mistral, Mixtral, Qwen2, Qwen3,
        Qwen3-MoE, gpt-oss, T5, ``torch.nn.RMSNorm``). True: the gain is
        ``1 + weight`` (Gemma, Gemma 2 and Gemma 3, whose stored weights are
        centred on 0).

    Returns
    -------
    out : ndarray, shape (..., E)
    cache : RMSNormCache

    Raises
    ------
    ValueError
        If ``weight`` is not ``(E,)``, ``x`` is 0-d, ``eps <= 0`` or not
        finite, or an input holds NaN or inf.
    TypeError
        If an input does not hold real numbers, or ``unit_offset`` is not a bool.

    Notes
    -----
    Forward, per row of :math:`E` entries, with gain :math:`\\gamma = w`
    (or :math:`1 + w`):

    .. math:: r = \\left(\\frac1E \\sum_j x_j^2 + \\epsilon\\right)^{-1/2}, \\quad
              \\hat x = x\\, r, \\quad y = \\gamma \\odot \\hat x

    Backward, with :math:`g = \\gamma \\odot \\bar y` and :math:`\\langle\\cdot\\rangle`
    the mean over the row (derived in ``docs/derivations_gpt.md``):

    .. math:: \\bar x = r \\left(g - \\hat x \\langle g \\odot \\hat x \\rangle\\right), \\quad
              \\bar w = \\sum_{rows} \\bar y \\odot \\hat x

    LayerNorm's backward without its mean term (nothing is subtracted from
    :math:`x`); :math:`\\bar w` is the same in both conventions, as
    :math:`d\\gamma / dw = 1`.

    **QK-norm** (Qwen3's and Gemma 3's ``q_norm`` and ``k_norm``) is this op
    on the last axis of the queries and keys split into heads, before RoPE:
    ``rms_norm_forward(q, q_weight)`` with ``q (B, H, T, D)`` and
    ``q_weight (D,)``, and the same for ``k`` with its own weight.

    PyTorch: ``torch.nn.functional.rms_norm(x, (E,), weight, eps)`` is the
    ``unit_offset=False`` form (its default ``eps`` is the dtype's machine
    epsilon, not ``1e-6``). This op computes in the inputs' dtype (float16 in
    float32).

    NOTE: Hugging Face's ``LlamaRMSNorm`` (and Qwen3's, Mistral's...) casts
    the input to float32 *whatever its dtype*, float64 included, computes
    :math:`\\hat x` there, casts back and then multiplies by ``weight``;
    ``Gemma3RMSNorm`` computes in float32 too and multiplies by
    ``1 + weight`` before casting back. A float64 model of theirs is thus
    float32-accurate in its norms: a comparison to 1e-10 must patch that cast.

    Examples
    --------
    >>> out, cache = rms_norm_forward(np.array([[3.0, -4.0]]), np.ones(2), eps=1e-12)
    >>> np.round(out, 6)
    array([[ 0.848528, -1.131371]])
    >>> out, _ = rms_norm_forward(np.array([[3.0, -4.0]]), np.zeros(2), unit_offset=True)
    >>> np.round(out, 4)
    array([[ 0.8485, -1.1314]])
    >>> dx, dweight = rms_norm_backward(np.array([[1.0, 0.0]]), cache)
    >>> dx.shape, dweight.shape
    ((1, 2), (2,))
    """
    eps = check_eps(eps)
    unit_offset = check_bool(unit_offset, "unit_offset")
    weight = as_float_array(weight, "weight")
    if x is None:
        raise TypeError("x must be an array, got None")
    dtype = compute_dtype(np.asarray(x).dtype, weight.dtype, names=("x", "weight"))
    x = as_float_array(x, "x", dtype)
    weight = weight.astype(x.dtype, copy=False)
    if x.ndim < 1:
        raise ValueError(f"x must have shape (..., E), got shape {x.shape}")
    E = x.shape[-1]
    if weight.shape != (E,):
        raise ValueError(f"weight must have shape ({E},) to match x of shape {x.shape}, "
                         f"got shape {weight.shape}")
    # NOTE: x * x, not x ** 2 or abs(x) ** 2: analytic, so complex step works
    mean_square = (x * x).mean(axis=-1, keepdims=True)  # (..., E) -> (..., 1)
    rstd = 1.0 / np.sqrt(mean_square + eps)  # (..., 1)
    normalized = x * rstd  # (..., E)
    gain = weight + 1.0 if unit_offset else weight.copy()  # (E,): a copy either way
    out = normalized * gain  # (..., E)
    return out, RMSNormCache(normalized, rstd, gain)


def rms_norm_backward(dout: FloatArray, cache: RMSNormCache,
                      check: bool = True) -> tuple[FloatArray, FloatArray]:
    """Backward of :func:`rms_norm_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., E)
    cache : RMSNormCache
    check : bool
        False: ``dout`` is a composite's own gradient, already checked.

    Returns
    -------
    dx : ndarray, shape (..., E)
    dweight : ndarray, shape (E,)
        The gradient of ``weight`` (the same with or without ``unit_offset``).

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape or holds NaN or inf.
    """
    normalized, rstd, gain = cache
    if check:
        dout = as_upstream_grad(dout, "dout", normalized.shape, normalized.dtype)
    E = normalized.shape[-1]
    # in the forward pass this was: out = normalized * gain
    dweight = (dout * normalized).reshape(-1, E).sum(axis=0)  # (..., E) -> (R, E) -> (E,)
    g = dout * gain  # dL/d normalized, (..., E)
    # in the forward pass this was: normalized = x * rstd, rstd = (mean(x * x) + eps) ** -0.5
    rms_term = normalized * (g * normalized).mean(axis=-1, keepdims=True)  # (..., E)
    dx = rstd * (g - rms_term)  # (..., E)
    return dx, dweight


declare_complex_step(rms_norm_forward)  # see qkvnp._checks.complex_step_mode
