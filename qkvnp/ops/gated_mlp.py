"""The gated MLP ``(act(x W_gate) * (x W_up)) W_down``, forward and backward.

Shape key: ``...`` any leading dims (B batch, T tokens), E embedding, F the
hidden width (Hugging Face's ``intermediate_size``).

SwiGLU (``activation="silu"``: Llama, Qwen, Mistral) and GeGLU
(``activation="gelu_tanh"``: Gemma's ``gelu_pytorch_tanh``), without biases,
as those families have them. Composed of :mod:`qkvnp.ops.linear`,
:mod:`qkvnp.ops.silu` and :mod:`qkvnp.ops.gelu`: the backward calls their
backwards in the reverse order of the forward. Derived in
``docs/derivations_gpt.md``; users reach it through :mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, check_ndim, compute_dtype,
                       declare_complex_step, owned)
from .gelu import GeluCache, gelu_backward, gelu_forward
from .linear import linear_backward, linear_forward
from .silu import SiluCache, silu_backward, silu_forward

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["gated_mlp_forward", "gated_mlp_backward", "GatedMLPCache",
           "GATED_MLP_ACTIVATIONS", "check_gated_mlp_activation"]

#: The ``activation`` values of :func:`gated_mlp_forward`: SwiGLU's and GeGLU's
#: (Hugging Face's ``hidden_act`` ``"silu"`` and ``"gelu_pytorch_tanh"``).
GATED_MLP_ACTIVATIONS = ("silu", "gelu_tanh")

GatedMLPCache = namedtuple("GatedMLPCache",
                           "gate_cache up_cache act_cache down_cache act up activation")


def check_gated_mlp_activation(activation):
    """``activation`` if it is one of :data:`GATED_MLP_ACTIVATIONS`, else ``ValueError``."""
    if not isinstance(activation, str) or activation not in GATED_MLP_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATED_MLP_ACTIVATIONS}, got "
                         f"{activation!r}")
    return activation


def _gated_mlp_inputs(x, W_gate, W_up, W_down):
    """The four inputs of :func:`gated_mlp_forward` checked and cast to their compute dtype."""
    names = ("x", "W_gate", "W_up", "W_down")
    arrays = [np.asarray(a) if a is not None else a for a in (x, W_gate, W_up, W_down)]
    for a, name in zip(arrays, names):
        if a is None:
            raise TypeError(f"{name} must be an array, got None")
    dtype = compute_dtype(*(a.dtype for a in arrays), names=names)
    x, W_gate, W_up, W_down = (as_float_array(a, name, dtype) for a, name in zip(arrays, names))
    if W_gate.ndim != 2:
        raise ValueError(f"W_gate must have shape (E, F), got shape {W_gate.shape}")
    E, F = W_gate.shape
    if W_up.shape != (E, F):
        raise ValueError(f"W_up must have W_gate's shape ({E}, {F}), got shape {W_up.shape}")
    if W_down.shape != (F, E):
        raise ValueError(f"W_down must have shape ({F}, {E}) (W_gate's transposed), got "
                         f"shape {W_down.shape}")
    check_ndim(x, "x", 1, f"(..., {E})")
    if x.shape[-1] != E:
        raise ValueError(f"x must have shape (..., {E}) to match W_gate of shape {W_gate.shape}, "
                         f"got shape {x.shape}")
    return x, W_gate, W_up, W_down


def gated_mlp_forward(x: FloatArray, W_gate: FloatArray, W_up: FloatArray, W_down: FloatArray,
                      activation: str = "silu") -> tuple[FloatArray, GatedMLPCache]:
    """The gated MLP of Llama, Qwen, Mistral (SwiGLU) and Gemma (GeGLU), without biases.

    Parameters
    ----------
    x : ndarray, shape (..., E)
    W_gate : ndarray, shape (E, F)
        The ``x @ W`` convention: Hugging Face's ``mlp.gate_proj.weight`` is ``W_gate.T``.
    W_up : ndarray, shape (E, F)
        ``mlp.up_proj.weight.T``.
    W_down : ndarray, shape (F, E)
        ``mlp.down_proj.weight.T``.
    activation : {"silu", "gelu_tanh"}
        The gate's activation: ``"silu"`` (SwiGLU) or the tanh-approximated
        GELU (GeGLU, Hugging Face's ``gelu_pytorch_tanh``).

    Returns
    -------
    out : ndarray, shape (..., E)
    cache : GatedMLPCache

    Raises
    ------
    ValueError
        If ``activation`` is unknown, the shapes do not match (the message
        names the argument, the expected and the received shape), or an
        input holds NaN or inf.
    TypeError
        If an input is None, does not hold real numbers, or is wider than
        float64.

    Notes
    -----
    Forward, with :math:`\\phi` the activation and :math:`\\odot` the
    elementwise product:

    .. math:: g = x W_{gate}, \\quad u = x W_{up}, \\quad a = \\phi(g), \\quad
              h = a \\odot u, \\quad y = h W_{down}

    Backward, leading dims flattened into rows (derived in
    ``docs/derivations_gpt.md``):

    .. math:: \\bar h = \\bar y W_{down}^T, \\quad \\bar W_{down} = h^T \\bar y, \\quad
              \\bar a = \\bar h \\odot u, \\quad \\bar u = \\bar h \\odot a, \\quad
              \\bar g = \\bar a \\odot \\phi'(g),

    .. math:: \\bar W_{up} = x^T \\bar u, \\quad \\bar W_{gate} = x^T \\bar g, \\quad
              \\bar x = \\bar u W_{up}^T + \\bar g W_{gate}^T

    (``x`` feeds two products: its gradient is the sum of both).

    Examples
    --------
    >>> x = np.ones((2, 3))
    >>> out, cache = gated_mlp_forward(x, np.eye(3, 4), np.ones((3, 4)), np.ones((4, 3)))
    >>> out.shape
    (2, 3)
    >>> [g.shape for g in gated_mlp_backward(np.ones((2, 3)), cache)]
    [(2, 3), (3, 4), (3, 4), (4, 3)]
    """
    activation = check_gated_mlp_activation(activation)
    x_in, W_in = x, (W_gate, W_up, W_down)
    x, W_gate, W_up, W_down = _gated_mlp_inputs(x, W_gate, W_up, W_down)
    # the caches own what the backward reads: one copy of each caller's array
    x, W_gate, W_up, W_down = owned((x, W_gate, W_up, W_down), (x_in,) + W_in)
    gate, gate_cache = linear_forward(x, W_gate, check=False)  # (..., E) -> (..., F)
    up, up_cache = linear_forward(x, W_up, check=False)  # (..., E) -> (..., F)
    act_cache: SiluCache | GeluCache
    if activation == "silu":
        act, act_cache = silu_forward(gate)  # (..., F)
    else:
        act, act_cache = gelu_forward(gate, "tanh")  # (..., F)
    h = act * up  # (..., F)
    out, down_cache = linear_forward(h, W_down, check=False)  # (..., F) -> (..., E)
    return out, GatedMLPCache(gate_cache, up_cache, act_cache, down_cache, act, up, activation)


def gated_mlp_backward(
        dout: FloatArray, cache: GatedMLPCache,
        check: bool = True) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """Backward of :func:`gated_mlp_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., E)
    cache : GatedMLPCache
    check : bool
        False: ``dout`` is a composite's own gradient, already checked.

    Returns
    -------
    dx : ndarray, shape (..., E)
    dW_gate : ndarray, shape (E, F)
    dW_up : ndarray, shape (E, F)
    dW_down : ndarray, shape (F, E)

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers.
    ValueError
        If ``dout`` is not of the output's shape (no broadcasting) or holds
        NaN or inf.
    """
    x, W_down = cache.gate_cache.x, cache.down_cache.W
    if check:
        dout = as_upstream_grad(dout, "dout", x.shape, W_down.dtype)
    # in the forward pass this was: out = h W_down
    dh, dW_down, _ = linear_backward(dout, cache.down_cache, check=False)  # (..., E) -> (..., F)
    # h = act * up
    dact, dup = dh * cache.up, dh * cache.act  # (..., F)
    # act = silu(gate) or gelu_tanh(gate)
    if cache.activation == "silu":
        dgate = silu_backward(dact, cache.act_cache, check=False)  # (..., F)
    else:
        dgate = gelu_backward(dact, cache.act_cache, check=False)  # (..., F)
    # up = x W_up
    dx_up, dW_up, _ = linear_backward(dup, cache.up_cache, check=False)  # (..., F) -> (..., E)
    # gate = x W_gate
    dx_gate, dW_gate, _ = linear_backward(dgate, cache.gate_cache, check=False)
    dx = dx_gate + dx_up  # x feeds both products
    return dx, dW_gate, dW_up, dW_down


declare_complex_step(gated_mlp_forward)  # see qkvnp._checks.complex_step_mode
