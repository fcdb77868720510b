"""The residual connection ``x + branch``, forward and backward.

Shape key: ``...`` any shape (x and branch alike, no broadcasting).
Derived in ``docs/derivations_gpt.md``; users reach it through
:mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np  # noqa: F401 (the doctests' np)

from .._checks import as_float_array, as_upstream_grad, declare_complex_step

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import FloatArray

__all__ = ["residual_add_forward", "residual_add_backward", "ResidualCache"]

ResidualCache = namedtuple("ResidualCache", "shape dtype")


def residual_add_forward(x: FloatArray, branch: FloatArray, *,
                         check: bool = True) -> tuple[FloatArray, ResidualCache]:
    """The residual connection ``out = x + branch`` (same shapes, no broadcasting).

    Parameters
    ----------
    x, branch : ndarray, shape (...)
    check : bool, keyword-only
        False: both are a composite's own finite arrays of one dtype and
        shape, already checked.

    Returns
    -------
    out : ndarray, shape (...)
    cache : ResidualCache

    Raises
    ------
    ValueError
        If the shapes differ.

    Notes
    -----
    Backward: both inputs receive :math:`\\bar y` unchanged, which is why a
    pre-LayerNorm block's input gradient is ``dout`` plus the branch's.

    Examples
    --------
    >>> out, cache = residual_add_forward(np.ones(2), np.arange(2.0))
    >>> residual_add_backward(np.array([3.0, 4.0]), cache)
    (array([3., 4.]), array([3., 4.]))
    """
    if check:
        x = as_float_array(x, "x")
        branch = as_float_array(branch, "branch")
        if x.shape != branch.shape:
            raise ValueError(f"branch must have x's shape {x.shape}, got shape {branch.shape}")
    out = x + branch
    return out, ResidualCache(out.shape, out.dtype)


def residual_add_backward(dout: Any, cache: Any, check: bool = True) -> Any:
    """Backward of :func:`residual_add_forward`: ``(dout, dout)``."""
    if check:
        dout = as_upstream_grad(dout, "dout", cache.shape, cache.dtype)
    return dout, dout


declare_complex_step(residual_add_forward)  # see qkvnp._checks.complex_step_mode
