"""The adjoints of broadcasting: sums that bring a gradient back to its input's shape.

Shape key: ``...`` any leading dims, M features. Kept apart from
:mod:`qkvnp.functional` (which exports both) for that module's length.
"""
from __future__ import annotations

import numpy as np

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray


__all__ = ["sum_to_shape", "column_sums"]


def sum_to_shape(grad: FloatArray, shape: tuple[int, ...]) -> FloatArray:
    """Sum ``grad`` over the axes that broadcasting added or stretched.

    The adjoint of broadcasting ``x`` of ``shape`` up to ``grad.shape``.

    >>> sum_to_shape(np.ones((2, 3, 4)), (3, 1)).ravel().tolist()
    [8.0, 8.0, 8.0]
    """
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


def column_sums(rows: FloatArray) -> FloatArray:
    """``rows.sum(axis=0)`` of a 2-D array, as the product ``ones @ rows``.

    A bias gradient: BLAS's matrix-vector product measured several times
    faster than numpy's reduction down the rows (benchmarks/NOTES.md),
    and closer in float32.

    >>> column_sums(np.arange(6.0).reshape(3, 2))
    array([6., 9.])
    """
    return np.ones(rows.shape[0], rows.dtype) @ rows  # (rows,) @ (rows, M) -> (M,)
