"""Type aliases for the public signatures (``numpy.typing``), shared by every module.

The docstrings say what a parameter is (``ndarray, shape (B, T, E)``); the
hints say the same to a type checker: ``FloatArray`` where a docstring says
"ndarray" of floats, ``IntArray`` for token ids and indices, ``BoolArray``
for boolean masks, ``ArrayLike`` where anything ``np.asarray`` takes is
accepted. Shapes are not expressible here and stay in the docstrings.
"""
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

__all__ = ["ArrayLike", "DTypeLike", "NDArray", "FloatArray", "IntArray", "BoolArray", "Array"]

#: An ndarray of float32 or float64 (complex under the checker's complex step).
FloatArray = NDArray[np.floating]
#: An ndarray of integers (token ids, indices, positions).
IntArray = NDArray[np.integer]
#: An ndarray of booleans (masks: True means "may attend").
BoolArray = NDArray[np.bool_]
#: An ndarray of any dtype.
Array = NDArray[Any]
