"""The gated feed-forward of today's open models, and its SiLU activation.

Shape key: ``...`` any leading dims (B batch, T tokens), E embedding, F the
hidden width (Hugging Face's ``intermediate_size``).

:class:`GatedFeedForward` is Llama's, Qwen's and Mistral's ``MLP`` (SwiGLU)
and Gemma's (GeGLU): three bias-free :class:`~qkvnp.Linear` named as
Hugging Face names them (``gate_proj``, ``up_proj``, ``down_proj``) and the
activation ``act_fn``. It is a :class:`Model` whose ``backward`` calls its
sub-layers' backwards in the reverse order of the forward, line for line;
the same math as one pure pair is
:func:`qkvnp.functional.gated_mlp_forward`.
"""
from __future__ import annotations

import numpy as np

from .. import functional as F
from .._checks import (as_float_array, check_int, check_last_dim, check_ndim, layer_dtype,
                       make_rng, owned)
from ..ops.gated_mlp import check_gated_mlp_activation
from ..kernels.pointwise import silu_backward_fused, silu_forward_fused
from .base import Layer, Model
from .basic import Linear
from .transformer import GELU

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike, FloatArray

__all__ = ["SiLU", "GatedFeedForward"]


class SiLU(Layer):
    """The SiLU activation ``x * sigmoid(x)`` (``nn.SiLU``; no parameters).

    Notes
    -----
    See :func:`qkvnp.functional.silu_forward` for the forward and the
    derived backward :math:`\\bar x = \\bar y\\,(s + x s (1 - s))`,
    :math:`s = \\sigma(x)`.

    Examples
    --------
    >>> silu = SiLU()
    >>> np.round(silu.forward(np.array([-1.0, 0.0, 1.0])), 4)
    array([-0.2689,  0.    ,  0.7311])
    >>> np.round(silu.backward(np.ones(3)), 4)
    array([0.0723, 0.5   , 0.9277])
    """

    supports_complex_step = True

    def __init__(self) -> None:
        self.params = {}
        self._cache = None
        self.zero_grad()

    def forward(self, x: Any, *, check: bool = True) -> Any:
        """SiLU of every entry of ``x``.

        ``check`` (keyword-only) is accepted as the other layers' is; the op
        checks ``x`` either way (one pass) and keeps its own copy.
        """
        if not check and x.dtype.kind == "f":
            # NOTE: the fused passes of qkvnp.kernels.pointwise for a composite's own
            # real array (measured: benchmarks/NOTES.md, "SiLU's fused passes")
            out, self._cache = silu_forward_fused(x)
            return out
        out, self._cache = F.silu_forward(x)
        return out

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Return ``dx = dout * silu'(x)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        cache = self._need_cache()
        if not check and dout.dtype.kind == "f" and cache.x.dtype.kind == "f":
            dx = silu_backward_fused(dout, cache)  # qkvnp.kernels.pointwise
        else:
            dx = F.silu_backward(dout, cache, check)
        self._release_cache(retain_cache)
        return dx


class GatedFeedForward(Model):
    """The gated MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, no biases.

    Parameters
    ----------
    emb_dim : int
        ``E`` (Hugging Face's ``hidden_size``).
    hidden_dim : int
        ``F`` (Hugging Face's ``intermediate_size``).
    activation : {"silu", "gelu_tanh"}, keyword-only
        ``"silu"``: SwiGLU (Llama, Qwen, Mistral; ``hidden_act="silu"``).
        ``"gelu_tanh"``: GeGLU (Gemma; ``hidden_act="gelu_pytorch_tanh"``).
    rng : numpy.random.Generator or int, keyword-only, optional
        Seed or Generator of the initial weights (a new unseeded Generator if
        None); ``gate_proj``, ``up_proj`` and ``down_proj`` draw from it in
        that order.
    dtype : float dtype, keyword-only
        Floating dtype of the parameters and the computation (float32 or float64).

    Attributes
    ----------
    params : dict
        ``gate_proj.W (E, F)``, ``up_proj.W (E, F)``, ``down_proj.W (F, E)``:
        Hugging Face's ``mlp.gate_proj.weight`` etc. (torch stores
        ``weight = W.T``).
    gate_proj, up_proj, down_proj : Linear
    act_fn : SiLU or GELU

    Notes
    -----
    Forward, with :math:`\\phi` the activation:
    :math:`y = (\\phi(x W_{gate}) \\odot x W_{up}) W_{down}`. The backward
    and its derivation: :func:`qkvnp.functional.gated_mlp_forward` and
    ``docs/derivations_gpt.md``. ``x`` feeds two projections: its gradient
    is the sum of both.

    Examples
    --------
    >>> mlp = GatedFeedForward(4, 6, rng=0)
    >>> list(mlp.params)
    ['gate_proj.W', 'up_proj.W', 'down_proj.W']
    >>> mlp.forward(np.ones((2, 3, 4))).shape
    (2, 3, 4)
    >>> mlp.backward(np.ones((2, 3, 4))).shape
    (2, 3, 4)
    """

    supports_complex_step = True

    def __init__(self, emb_dim: int, hidden_dim: int, *, activation: str = "silu",
                 rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        self.emb_dim = check_int(emb_dim, "emb_dim", 1)
        self.hidden_dim = check_int(hidden_dim, "hidden_dim", 1)
        self.activation = check_gated_mlp_activation(activation)
        self.dtype = layer_dtype(dtype)
        rng = make_rng(rng)
        self.gate_proj = Linear(self.emb_dim, self.hidden_dim, False, rng=rng, dtype=self.dtype)
        self.up_proj = Linear(self.emb_dim, self.hidden_dim, False, rng=rng, dtype=self.dtype)
        self.down_proj = Linear(self.hidden_dim, self.emb_dim, False, rng=rng, dtype=self.dtype)
        self.act_fn = SiLU() if self.activation == "silu" else GELU("tanh")
        self.zero_grad()

    _repr_fields = ("emb_dim", "hidden_dim", "activation", "dtype")

    def forward(self, x: Any, *, check: bool = True) -> Any:
        """``(..., E) -> (..., E)``.

        ``check=False`` (keyword-only): ``x`` is a composite's own finite
        array of the layer's dtype and shape, which it does not edit before
        the backward. Either way the hidden activations, the layer's own,
        are not checked again between the sub-layers.
        """
        if check:
            x_in = x
            x = as_float_array(x, "x", self.dtype)
            check_ndim(x, "x", 1, f"(..., {self.emb_dim})")
            check_last_dim(x, "x", self.emb_dim, f"(..., {self.emb_dim})")
            (x,) = owned((x,), (x_in,))  # one copy, read by both projections' backwards
        gate = self.gate_proj.forward(x, check=False)  # (..., E) -> (..., F)
        up = self.up_proj.forward(x, check=False)  # (..., E) -> (..., F)
        act = self.act_fn.forward(gate, check=False)  # (..., F)
        h = act * up  # (..., F)
        self._cache = (act, up)
        return self.down_proj.forward(h, check=False)  # (..., F) -> (..., E)

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Accumulate the three projections' gradients; return ``dx`` ``(..., E)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        act, up = self._need_cache()
        dh = self.down_proj.backward(dout, retain_cache, check=check)  # (..., E) -> (..., F)
        dact, dup = dh * up, dh * act  # h = act * up
        dgate = self.act_fn.backward(dact, retain_cache, check=False)  # (..., F)
        dx = self.up_proj.backward(dup, retain_cache, check=False)  # (..., F) -> (..., E)
        dx = dx + self.gate_proj.backward(dgate, retain_cache, check=False)  # x feeds both
        self._release_cache(retain_cache)
        return dx
