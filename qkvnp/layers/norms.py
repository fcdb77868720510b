"""The RMSNorm layer of today's decoders (Llama, Qwen3, Gemma 3), also their QK-norm.

Shape key: ``...`` any leading dims (B batch, T tokens; B, H, T for QK-norm),
E the normalised last axis (D, the head dim, for QK-norm).

The layer calls :func:`qkvnp.functional.rms_norm_forward` and
:func:`qkvnp.functional.rms_norm_backward` (the math is in
``qkvnp.ops.rms_norm``). The book's :class:`qkvnp.LayerNorm` is in
``qkvnp.layers.transformer``.
"""
from __future__ import annotations

import numpy as np

from .. import functional as F
from .._checks import as_float_array, check_bool, check_eps, check_int, layer_dtype
from ..kernels.pointwise import rms_norm_backward_fused, rms_norm_forward_fused
from .base import Layer

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike

__all__ = ["RMSNorm"]


class RMSNorm(Layer):
    """Root-mean-square normalisation over the last axis, with a learned ``weight``.

    Parameters
    ----------
    dim : int
        ``E``, the size of the normalised last axis (the head dim ``D`` for
        QK-norm).
    eps : float
        Added to the mean square (``1e-6``, Qwen3's and Gemma 3's
        ``rms_norm_eps``; Llama 2 and 3 use ``1e-5``).
    unit_offset : bool, keyword-only
        False: the output is ``x / rms(x) * weight`` and ``weight`` starts at
        ones (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, T5,
        ``torch.nn.RMSNorm``). True: it is ``x / rms(x) * (1 + weight)`` and
        ``weight`` starts at zeros (Gemma, Gemma 2, Gemma 3), so that both
        start as the plain normalisation.
    dtype : float dtype, keyword-only
        Floating dtype of the parameter and the computation (float32 or float64).

    Attributes
    ----------
    params : dict
        ``weight (E,)``, the name Hugging Face's ``*RMSNorm`` modules and
        ``torch.nn.RMSNorm`` give it.
    grads : dict

    Notes
    -----
    See :func:`qkvnp.functional.rms_norm_forward` for the forward and the
    derived backward. As QK-norm (Qwen3's and Gemma 3's ``q_norm`` and
    ``k_norm``), ``RMSNorm(D)`` applies to the queries or keys split into
    heads, ``(B, H, T, D)``, before RoPE: one ``weight`` shared by the heads.

    Examples
    --------
    >>> norm = RMSNorm(4)
    >>> out = norm.forward(np.arange(8.0).reshape(2, 4))
    >>> np.round(np.sqrt((out * out).mean(axis=-1)), 6), out.shape
    (array([1., 1.]), (2, 4))
    >>> norm.backward(np.ones((2, 4))).shape, norm.grads["weight"].shape
    ((2, 4), (4,))
    """

    supports_complex_step = True

    def __init__(self, dim: int, eps: float = 1e-06, *, unit_offset: bool = False,
                 dtype: DTypeLike = np.float64) -> None:
        self.dim = check_int(dim, "dim", 1)
        self.eps = check_eps(eps)
        self.unit_offset = check_bool(unit_offset, "unit_offset")
        self.dtype = layer_dtype(dtype)
        initial = np.zeros if self.unit_offset else np.ones
        self.params = {"weight": initial(self.dim, self.dtype)}
        self._cache = None
        self.zero_grad()

    _repr_fields = ("dim", "eps", "unit_offset", "dtype")

    def forward(self, x: Any, *, check: bool = True) -> Any:
        """Normalise each row of ``x`` ``(..., E)``; return ``(..., E)``.

        ``check=False`` (keyword-only): ``x`` is a composite's own finite
        array of the layer's dtype, so its shape is not checked here (the op
        still refuses a mismatch).
        """
        if check:
            x = as_float_array(x, "x", self.dtype)
            if x.ndim < 1 or x.shape[-1] != self.dim:
                raise ValueError(f"x must have shape (..., {self.dim}), got shape {x.shape}")
        if not check and x.dtype.kind == "f" and x.dtype == self.dtype:
            # NOTE: the fused passes of qkvnp.kernels.pointwise for a composite's own
            # real array (measured: benchmarks/NOTES.md, "RMSNorm's fused passes")
            out, self._cache = rms_norm_forward_fused(x, self.params["weight"], self.eps,
                                                      self.unit_offset)
            return out
        out, self._cache = F.rms_norm_forward(x, self.params["weight"], self.eps,
                                              unit_offset=self.unit_offset)
        return out

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Accumulate ``dweight``; return ``dx`` ``(..., E)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        cache = self._need_cache()
        if not check and dout.dtype.kind == "f" and cache.normalized.dtype.kind == "f":
            dx, dweight = rms_norm_backward_fused(dout, cache)  # qkvnp.kernels.pointwise
        else:
            dx, dweight = F.rms_norm_backward(dout, cache, check)
        self._accumulate("weight", dweight)
        self._release_cache(retain_cache)
        return dx
