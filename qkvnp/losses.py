"""Losses as pairs of pure functions, like :mod:`qkvnp.functional`.

Shape key: ``...`` any leading dims (batch, positions), C classes.

Each loss ``name`` has ``name_forward(inputs) -> (loss, cache)``, where
``loss`` is a 0-d ndarray of the compute dtype, and
``name_backward(dloss, cache) -> dinput``, the gradient of the (scalar)
upstream value ``dloss * loss`` with respect to the prediction. Targets are
constants: they get no gradient.

The reference ops are in ``qkvnp.ops.losses``; this module is their
public entry, and picks the fused passes of ``qkvnp.kernels.loss`` for
the cross-entropy of real floating logits, forward and backward.
"""
from __future__ import annotations

import numpy as np

from ._checks import not_finite
from .ops import losses as _reference
from .ops.losses import (CrossEntropyCache, MSECache, accuracy, check_dloss, cross_entropy_inputs,
                         cross_entropy_probs, mse_backward, mse_forward)

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
    # the reference op's docstring, below: one text for both
    logits, safe_targets, counted, count = cross_entropy_inputs(logits, targets, ignore_index,
                                                                mask, finite=False)
    if logits.dtype.kind == "f":
        # NOTE: real floating logits take the fused passes of qkvnp.kernels.loss
        # (the same loss up to rounding, and the softmax for the backward), which
        # test each chunk finite in cache, before its passes; others (the gradient
        # checker's complex step) the reference's
        from .kernels.loss import cross_entropy_probs_fused

        loss, probs = cross_entropy_probs_fused(logits, safe_targets, counted, count,
                                                check_finite=True)
    else:
        if not np.isfinite(logits).all():
            raise not_finite("logits")
        loss, probs = cross_entropy_probs(logits, safe_targets, counted, count)
    return loss, CrossEntropyCache(probs, safe_targets, counted, count)


def cross_entropy_backward(dloss: float | FloatArray, cache: CrossEntropyCache) -> FloatArray:
    # the reference op's docstring, below: one text for both
    probs = cache.probs
    if probs.dtype.kind != "f":  # the gradient checker's complex step: the reference's path
        return _reference.cross_entropy_backward(dloss, cache)
    # NOTE: real floating probabilities take the fused pass of qkvnp.kernels.loss
    # (the reference's formula and bits), after the reference op's own check of dloss
    from .kernels.loss import cross_entropy_backward_fused

    return cross_entropy_backward_fused(check_dloss(dloss, probs.dtype), cache)


# NOTE: the reference ops' docstrings (arguments, results, errors, the formula
# and its derived backward), which this entry keeps; only the path differs
if _reference.cross_entropy_forward.__doc__:  # None under python -OO
    cross_entropy_forward.__doc__ = _reference.cross_entropy_forward.__doc__.replace(
        "subtracted first (``scipy.special.log_softmax``).",
        "subtracted first (real floating logits take the fused passes of\n"
        "        ``qkvnp.kernels.loss``, others ``scipy.special.log_softmax``).")
    cross_entropy_backward.__doc__ = _reference.cross_entropy_backward.__doc__
