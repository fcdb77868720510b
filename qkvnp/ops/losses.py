"""The reference losses (mean squared error, softmax cross-entropy) and accuracy.

Shape key: ``...`` any leading dims (batch, positions), C classes.

Users reach them through :mod:`qkvnp.losses`, which runs a real floating
cross-entropy through the fused passes of ``qkvnp.kernels.loss``
instead of :func:`cross_entropy_probs` and :func:`cross_entropy_backward`.

Each loss ``name`` has ``name_forward(inputs) -> (loss, cache)``, where
``loss`` is a 0-d ndarray of the compute dtype, and
``name_backward(dloss, cache) -> dinput``, the gradient of the (scalar)
upstream value ``dloss * loss`` with respect to the prediction. Targets are
constants: they get no gradient.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import as_float_array, as_upstream_grad, check_ndim

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import BoolArray, FloatArray, IntArray

__all__ = [
    "mse_forward",
    "mse_backward",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "accuracy",
    "cross_entropy_inputs",
    "check_dloss",
    "cross_entropy_probs",
    "MSECache",
    "CrossEntropyCache",
]

MSECache = namedtuple("MSECache", "diff")
# probs: softmax(logits), (..., C); targets with 0 at the uncounted positions
CrossEntropyCache = namedtuple("CrossEntropyCache", "probs targets counted count")


def check_dloss(dloss, dtype):
    """``dloss`` as a 0-d array of ``dtype``: a finite real scalar (a number, 0-d or size-1 array)."""
    arr = np.asarray(dloss)
    if arr.shape != () and arr.shape != (1,):
        raise ValueError(
            f"dloss must be a scalar (shape () like the loss), got shape {arr.shape}"
        )
    return as_upstream_grad(arr.reshape(()), "dloss", (), dtype)  # real, cast, finite


# ---------------------------------------------------------------- mse


def mse_forward(pred: FloatArray, target: FloatArray) -> tuple[FloatArray, MSECache]:
    """Mean squared error over all entries, ``mean((pred - target)**2)``.

    Parameters
    ----------
    pred : ndarray, shape (...)
        At least one entry.
    target : ndarray, same shape as ``pred``
        Not broadcast: a shape mismatch is an error, not a silent outer
        difference (the classic ``(N, 1)`` vs ``(N,)`` trap).

    Returns
    -------
    loss : ndarray, shape ()
        In the compute dtype of ``pred`` and ``target`` (float32 or float64).
    cache : MSECache

    Raises
    ------
    TypeError
        If an input is not real-valued.
    ValueError
        If the shapes differ, ``pred`` is empty, or an entry is NaN or inf.

    Notes
    -----
    Forward, with :math:`N` entries: :math:`L = \\frac1N \\sum_i (p_i - t_i)^2`.
    Backward: :math:`\\bar p = \\bar L \\cdot \\frac2N (p - t)`.
    Same value as ``torch.nn.functional.mse_loss`` (``reduction="mean"``).

    Examples
    --------
    >>> loss, cache = mse_forward(np.array([1.0, 2.0]), np.array([0.0, 0.0]))
    >>> loss
    array(2.5)
    >>> mse_backward(1.0, cache)
    array([1., 2.])
    """
    pred = as_float_array(pred, "pred")
    target = as_float_array(target, "target")
    if target.shape != pred.shape:
        raise ValueError(
            f"target must have the shape of pred {pred.shape} (it is not broadcast), "
            f"got shape {target.shape}"
        )
    if pred.size == 0:
        raise ValueError(f"pred must have at least one entry, got shape {pred.shape}")
    dtype = np.result_type(pred.dtype, target.dtype)
    diff = pred.astype(dtype, copy=False) - target.astype(dtype, copy=False)
    loss = np.mean(diff * diff)  # (...) -> ()
    return np.asarray(loss, dtype=dtype), MSECache(diff)


def mse_backward(dloss: float | FloatArray, cache: MSECache) -> FloatArray:
    """Backward of :func:`mse_forward`.

    Parameters
    ----------
    dloss : float or ndarray, shape ()
        Upstream gradient of the scalar loss (1.0 when the loss is the objective).
    cache : MSECache

    Returns
    -------
    dpred : ndarray, shape of ``pred``
        In the compute dtype.

    Raises
    ------
    TypeError
        If ``dloss`` is not a real number (complex, object...).
    ValueError
        If ``dloss`` is not a scalar, or is NaN or inf.
    """
    diff = cache.diff
    dloss = check_dloss(dloss, diff.dtype)
    return dloss * (2.0 / diff.size) * diff


# ---------------------------------------------------------------- cross-entropy


def _check_classification(logits, targets, ignore_index, mask, finite=True):
    """Validate the inputs of a classification loss or metric.

    Returns the float logits, the integer targets (counted entries checked to
    be in range) and the boolean ``counted`` array of the targets' shape.
    ``finite=False`` leaves the logits' NaN / inf test to the caller.
    """
    logits = as_float_array(logits, "logits", finite=finite)
    check_ndim(logits, "logits", 1, "(..., C)")
    num_classes = logits.shape[-1]
    if num_classes < 1:
        raise ValueError(f"logits must have shape (..., C) with C >= 1, got shape {logits.shape}")
    if targets is None:
        raise TypeError("targets must be an integer array of class indices, got None")
    targets = np.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(
            "targets must hold integer class indices (e.g. int64), got dtype "
            f"{targets.dtype}; for float labels use targets.astype(np.int64) after checking them"
        )
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape {logits.shape[:-1]} (logits' shape without the "
            f"class axis C={num_classes}), got shape {targets.shape}"
        )
    counted = np.ones(targets.shape, dtype=bool)
    if ignore_index is not None:
        if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
            ignore_index, (int, np.integer)
        ):
            raise TypeError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}")
        counted &= targets != ignore_index
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(
                f"mask must be bool (True = position counted), got dtype {mask.dtype}"
            )
        if mask.shape != targets.shape:
            raise ValueError(
                f"mask must have the shape of targets {targets.shape}, got shape {mask.shape}"
            )
        counted &= mask
    # NOTE: uncounted positions may hold any integer (padding, -100, ...).
    bad = counted & ((targets < 0) | (targets >= num_classes))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"targets must be class indices in [0, {num_classes}) (C={num_classes}) at "
            f"counted positions, got {int(targets[where])} at index {where}"
        )
    return logits, targets, counted


def cross_entropy_forward(logits: FloatArray, targets: IntArray, ignore_index: int | None = None,
                          mask: BoolArray | None = None) -> tuple[FloatArray, CrossEntropyCache]:
    """Softmax cross-entropy from logits, averaged over the counted positions.

    Parameters
    ----------
    logits : ndarray, shape (..., C)
        Unnormalised class scores, finite. Any magnitude: the row maximum is
        subtracted first (``scipy.special.log_softmax``).
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
    loss, probs = cross_entropy_probs(logits, safe_targets, counted, count)
    return loss, CrossEntropyCache(probs, safe_targets, counted, count)


def cross_entropy_inputs(logits: FloatArray, targets: IntArray, ignore_index: int | None,
                         mask: BoolArray | None,
                         finite: bool = True) -> tuple[FloatArray, IntArray, BoolArray, int]:
    """The checked inputs of :func:`cross_entropy_forward`.

    ``finite=False`` leaves the logits' NaN / inf test to the caller (the
    fused loss makes it by chunks, each in cache: ``qkvnp.kernels.loss``).

    Returns
    -------
    logits : ndarray, shape (..., C), float
    targets : ndarray of int, shape (...)
        0 at the uncounted positions (which may hold -100 etc.).
    counted : ndarray of bool, shape (...)
    count : int
        ``counted.sum()``.
    """
    logits, targets, counted = _check_classification(logits, targets, ignore_index, mask, finite)
    safe_targets = np.where(counted, targets, 0)  # uncounted rows may hold -100 etc.
    return logits, safe_targets, counted, int(counted.sum())


def cross_entropy_probs(logits: FloatArray, targets: IntArray, counted: BoolArray,
                        count: int) -> tuple[FloatArray, FloatArray]:
    """The mean cross-entropy over the counted positions, and ``softmax(logits)``.

    The inputs are those of :func:`cross_entropy_inputs`. The loss is
    ``-mean(log_softmax(logits)[target])`` through ``scipy.special.log_softmax``
    (any float or complex logits); ``qkvnp.kernels.loss.cross_entropy_probs_fused``
    is the same for real floating logits in fewer passes.

    Returns
    -------
    loss : ndarray, shape (), of ``logits``' dtype
    probs : ndarray, shape (..., C), C order
    """
    from scipy.special import log_softmax

    log_probs = log_softmax(logits, axis=-1)  # (..., C), every entry <= 0
    # NOTE: each position's row indexed directly: np.take_along_axis's index
    # building took a fifth of the loss in a kv-recall step
    rows = log_probs.reshape(-1, log_probs.shape[-1])  # (..., C) -> (n, C)
    picked = rows[np.arange(rows.shape[0]), targets.reshape(-1)]  # (n,)
    picked = picked.reshape(targets.shape)  # (...)
    # NOTE: no counted position -> loss 0 by definition (torch returns NaN = 0/0).
    loss = -np.sum(picked, where=counted) / count if count else 0.0  # (...) -> ()
    probs = np.exp(log_probs, order="C")  # softmax, (..., C), read by the backward
    return np.asarray(loss, dtype=logits.dtype), probs


def cross_entropy_backward(dloss: float | FloatArray, cache: CrossEntropyCache) -> FloatArray:
    """Backward of :func:`cross_entropy_forward`.

    Parameters
    ----------
    dloss : float or ndarray, shape ()
    cache : CrossEntropyCache

    Returns
    -------
    dlogits : ndarray, shape (..., C)
        ``dloss * (softmax(logits) - onehot(targets)) / n`` on counted rows,
        0 on the others (all zeros when no position is counted).

    Raises
    ------
    TypeError
        If ``dloss`` is not a real number (complex, object...).
    ValueError
        If ``dloss`` is not a scalar, or is NaN or inf.
    """
    probs, targets, counted, count = cache
    dloss = check_dloss(dloss, probs.dtype)
    if count == 0:
        return np.zeros_like(probs)
    dlogits = probs.copy(order="C")  # softmax, (..., C), C order: rows below is a view
    rows = dlogits.reshape(-1, dlogits.shape[-1])  # (..., C) -> (n, C), a view
    rows[np.arange(rows.shape[0]), targets.reshape(-1)] -= 1  # softmax - onehot
    dlogits *= (dloss / count).astype(dlogits.dtype)
    if count < counted.size:
        dlogits[~counted] = 0  # uncounted rows: 0
    return dlogits


def accuracy(logits: FloatArray, targets: IntArray, ignore_index: int | None = None,
             mask: BoolArray | None = None) -> float:
    """Fraction of counted positions whose largest logit is the target class.

    Parameters
    ----------
    logits : ndarray, shape (..., C)
    targets : ndarray of int, shape (...)
    ignore_index : int, optional
    mask : ndarray of bool, shape (...), optional
        Same meaning as in :func:`cross_entropy_forward`.

    Returns
    -------
    float
        In ``[0, 1]``; ``nan`` when no position is counted (an accuracy over
        nothing is undefined; unlike the loss, it is never a gradient source).
        Ties in the logits go to the lowest class index (``np.argmax``).

    Examples
    --------
    >>> accuracy(np.array([[2.0, 1.0], [0.0, 3.0], [5.0, 0.0]]), np.array([0, 0, 1]), mask=np.array([True, True, False]))
    0.5
    """
    logits, targets, counted = _check_classification(logits, targets, ignore_index, mask)
    count = int(counted.sum())
    if count == 0:
        return float("nan")
    hits = (np.argmax(logits, axis=-1) == targets) & counted  # (..., C) -> (...)
    return float(hits.sum()) / count
