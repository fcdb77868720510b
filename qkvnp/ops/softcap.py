"""The soft-cap ``cap * tanh(x / cap)`` (Gemma 2's and Gemma 3's final logits), forward and backward.

Shape key: ``...`` any shape (elementwise), e.g. logits (B, T, V).

The same bounded squash that the attention core applies to its scores
(``softcap`` of :func:`qkvnp.ops.variants.variant_attention_forward`, which
checks its cap with the same :func:`qkvnp.ops.variants.check_softcap`); here
as an op of its own, for a model's output logits. ``tanh`` is analytic, so
the gradient checker's complex step runs through it. Derived in
``docs/derivations_gpt.md`` ("Final-logit soft-cap").
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import as_float_array, as_upstream_grad, declare_complex_step
from .variants import check_softcap

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["softcap_forward", "softcap_backward", "SoftcapCache"]

SoftcapCache = namedtuple("SoftcapCache", "capped")
SoftcapCache.__doc__ = """What :func:`softcap_backward` reads.

capped : ndarray, shape (...), ``tanh(x / cap)``, in (-1, 1).
"""


def softcap_forward(x: FloatArray, cap: float) -> tuple[FloatArray, SoftcapCache]:
    """Soft-cap ``cap * tanh(x / cap)``: about ``x`` near zero, bounded in ``(-cap, cap)``.

    Parameters
    ----------
    x : ndarray, shape (...)
        Logits, say (B, T, V).
    cap : float
        Positive and finite (Gemma 2's ``final_logit_softcapping`` 30.0).

    Returns
    -------
    out : ndarray, shape (...)
    cache : SoftcapCache

    Raises
    ------
    TypeError
        If ``cap`` is not a number (None included) or ``x`` is not real.
    ValueError
        If ``cap`` is not positive and finite, or ``x`` holds NaN or inf.

    Notes
    -----
    With :math:`t = \\tanh(x / c)`:

    .. math:: y = c\\, t, \\qquad \\frac{dy}{dx} = c \\cdot \\frac1c (1 - t^2) = 1 - t^2,

    so the backward is :math:`\\bar x = \\bar y\\,(1 - t^2)`, elementwise,
    from the cached :math:`t`. :math:`y'(0) = 1` (small logits pass
    unchanged) and :math:`y \\to \\pm c` far out.

    Examples
    --------
    >>> out, cache = softcap_forward(np.array([0.0, 30.0, -1e6]), 30.0)
    >>> np.round(out, 4).tolist()
    [0.0, 22.8478, -30.0]
    >>> np.round(softcap_backward(np.ones(3), cache), 4).tolist()
    [1.0, 0.42, 0.0]
    """
    cap = check_softcap(cap, "cap", allow_none=False)
    x = as_float_array(x, "x")
    capped = np.tanh(x / cap)  # (...), in (-1, 1)
    return cap * capped, SoftcapCache(capped)


def softcap_backward(dout: FloatArray, cache: SoftcapCache) -> FloatArray:
    """Backward of :func:`softcap_forward`: ``dx = dout * (1 - tanh(x / cap)**2)``.

    Parameters
    ----------
    dout : ndarray, shape (...)
        The gradient of the output.
    cache : SoftcapCache

    Returns
    -------
    dx : ndarray, shape (...)

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape or holds NaN or inf.
    """
    capped = cache.capped
    dout = as_upstream_grad(dout, "dout", capped.shape, capped.dtype)
    # in the forward pass this was: out = cap * tanh(x / cap); d tanh(u) = (1 - tanh^2 u) du
    return dout * (1 - capped * capped)


declare_complex_step(softcap_forward)  # see qkvnp._checks.complex_step_mode
