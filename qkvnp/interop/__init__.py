"""Weights in and out of other libraries' layouts, never importing them.

One module a peer: :mod:`qkvnp.interop.pytorch` for PyTorch's modules and
the book's (:func:`from_torch`, :func:`to_torch`). Every name is
re-exported here: ``from qkvnp.interop import from_torch``.
"""
from __future__ import annotations

from .pytorch import LAYOUTS, from_torch, to_torch

__all__ = ["LAYOUTS", "from_torch", "to_torch"]
