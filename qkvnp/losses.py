"""Losses as pairs of pure functions, like :mod:`qkvnp.functional`.

Shape key: ``...`` any leading dims (batch, positions), C classes.

Each loss ``name`` has ``name_forward(inputs) -> (loss, cache)``, where
``loss`` is a 0-d ndarray of the compute dtype, and
``name_backward(dloss, cache) -> dinput``, the gradient of the (scalar)
upstream value ``dloss * loss`` with respect to the prediction. Targets are
constants: they get no gradient.

The reference ops are in ``qkvnp.ops.losses``; this module is their
public entry, and picks the fused passes of ``qkvnp.kernels.loss`` for
the cross-entropy of real floating logits.
"""
from __future__ import annotations

import numpy as np  # noqa: F401 (the doctests' np)

from .ops.losses import (CrossEntropyCache, MSECache, accuracy, cross_entropy_backward,
                         cross_entropy_inputs, cross_entropy_probs, mse_backward, mse_forward)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from ._typing import BoolArray, FloatArray, IntArray

__all__ = [
    "mse_forward",
    "mse_backward",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "accuracy",
    "MSECache",
    "CrossEntropyCache",
]


def cross_entropy_forward(logits: FloatArray, targets: IntArray, ignore_index: int | None = None,
                          mask: BoolArray | None = None) -> tuple[FloatArray, CrossEntropyCache]:
    """Softmax cross-entropy from logits, averaged over the counted positions.

    Parameters
    ----------
    logits : ndarray, shape (..., C)
        Unnormalised class scores, finite. Any magnitude: the row maximum is
        subtracted first (real floating logits take the fused passes of
        ``qkvnp.kernels.loss``, others ``scipy.special.log_softmax``).
    targets : ndarray of int, shape (...)
        Class indices in ``[0, C)`` at every counted position.
    ignore_index : int, optional
        Positions whose target equals it are not counted (PyTorch's
        ``ignore_index``, e.g. ``-100`` for padding).
    mask : ndarray of bool, shape (...), optional
        True = counted. Combined with ``ignore_index`` by AND.

    Returns
    -------
    loss : ndarray, shape ()
        Mean of ``-log softmax(logits)[target]`` over the counted positions,
        in the compute dtype of ``logits``. With no counted position the loss
        is 0 (and the gradient is 0): no NaN, no warning.
    cache : CrossEntropyCache

    Raises
    ------
    TypeError
        If ``targets`` is not an integer array, ``mask`` not bool, or
        ``ignore_index`` not an int.
    ValueError
        On shape mismatches, non-finite logits, or a counted target outside
        ``[0, C)``.

    Notes
    -----
    Forward, with :math:`\\mathcal{N}` the counted positions and
    :math:`n = |\\mathcal{N}|`:

    .. math:: L = -\\frac1n \\sum_{i \\in \\mathcal{N}} \\log
              \\mathrm{softmax}(z_i)_{y_i}, \\quad
              \\log\\mathrm{softmax}(z)_c = z_c - \\max z - \\log\\textstyle\\sum_j e^{z_j - \\max z}

    Backward: differentiating :math:`-z_{y} + \\log\\sum_j e^{z_j}` gives

    .. math:: \\bar z_i = \\frac{\\bar L}{n} (\\mathrm{softmax}(z_i) - e_{y_i})
              \\ \\text{for } i \\in \\mathcal{N}, \\qquad \\bar z_i = 0 \\text{ otherwise.}

    Same value as ``torch.nn.functional.cross_entropy`` with
    ``reduction="mean"`` and ``ignore_index`` (logits moved to the last axis).

    Examples
    --------
    Uniform logits give ``log C``; the ignored position does not count:

    >>> logits = np.zeros((3, 4))
    >>> loss, cache = cross_entropy_forward(logits, np.array([0, 3, -100]), ignore_index=-100)
    >>> bool(np.isclose(loss, np.log(4)))
    True
    >>> cross_entropy_backward(1.0, cache)
    array([[-0.375,  0.125,  0.125,  0.125],
           [ 0.125,  0.125,  0.125, -0.375],
           [ 0.   ,  0.   ,  0.   ,  0.   ]])
    """
    logits, safe_targets, counted, count = cross_entropy_inputs(logits, targets, ignore_index,
                                                                mask)
    probs_of = cross_entropy_probs
    if logits.dtype.kind == "f":
        # NOTE: real floating logits take the fused passes of qkvnp.kernels.loss
        # (the same loss up to rounding, and the softmax for the backward);
        # others (the gradient checker's complex step) the reference's
        from .kernels.loss import cross_entropy_probs_fused

        probs_of = cross_entropy_probs_fused
    loss, probs = probs_of(logits, safe_targets, counted, count)
    return loss, CrossEntropyCache(probs, safe_targets, counted, count)
