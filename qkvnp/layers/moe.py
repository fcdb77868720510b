"""A mixture-of-experts feed-forward: a linear router, top-k, and gated-MLP experts.

Shape key: B batch (any leading dims), T tokens, N = B T tokens flattened,
E embedding (``emb_dim``), F an expert's hidden width (``hidden_dim``),
X experts (``num_experts``), k experts a token (``top_k``), n_i the tokens
routed to expert i.

The router is :func:`qkvnp.functional.router_forward`; each expert is a
SwiGLU MLP run on the tokens routed to it alone, and the backward undoes the
forward line for line (``docs/derivations_gpt.md``).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .. import functional as F
from .._checks import as_float_array, as_upstream_grad, check_bool, check_int, layer_dtype, make_rng
from ..ops.moe import ROUTER_GATINGS, check_router_sizes
from .base import Layer

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike, FloatArray

__all__ = ["MoEFeedForward"]

MoECache = namedtuple("MoECache", "router routed x_shape")
# token (n_i,), slot (n_i,): the rows routed to the expert and where it sits among their k
RoutedTokens = namedtuple("RoutedTokens", "token slot y expert")
ExpertCache = namedtuple("ExpertCache", "gate_linear up_linear down_linear gate sigmoid up")

#: The ``activation`` values of :class:`MoEFeedForward`.
MOE_ACTIVATIONS = ("silu",)


class MoEFeedForward(Layer):
    """A sparse mixture of ``num_experts`` SwiGLU experts, ``top_k`` a token (Qwen3-MoE, Mixtral).

    Parameters
    ----------
    emb_dim : int
        ``E``.
    hidden_dim : int
        ``F``, each expert's hidden width (Qwen3-MoE's ``moe_intermediate_size``).
    num_experts : int
        ``X >= 1``.
    top_k : int
        ``k``, experts a token, ``1 <= k <= X``.
    gating : {"softmax_topk", "topk_softmax"}, keyword-only
        How the gate weights are made (:func:`qkvnp.functional.router_forward`):
        ``"softmax_topk"`` (Qwen2/3-MoE, the default) or ``"topk_softmax"`` (Mixtral).
    norm_topk_prob : bool, keyword-only
        With ``"softmax_topk"``: renormalise the ``k`` gates to sum 1
        (Qwen3-MoE's config default is False).
    activation : {"silu"}, keyword-only
        The experts' gate activation (SwiGLU's SiLU).
    rng : numpy.random.Generator or int, keyword-only, optional
        Source of the initial weights (a new unseeded Generator if None).
    dtype : float dtype, keyword-only
        float32 or float64.

    Attributes
    ----------
    params : dict
        ``router.W (E, X)``, and for each expert ``i``: ``experts.i.W_gate (E, F)``,
        ``experts.i.W_up (E, F)``, ``experts.i.W_down (F, E)``. Hugging
        Face's ``Qwen3MoeSparseMoeBlock`` names (each the transpose):
        ``gate.weight``, ``experts.i.gate_proj.weight``,
        ``experts.i.up_proj.weight``, ``experts.i.down_proj.weight``.
    grads : dict

    Notes
    -----
    For token :math:`n` with chosen experts :math:`I_n` and gates :math:`g_n`
    (the router), expert :math:`i`'s MLP
    :math:`y_i(x) = (\\mathrm{silu}(x W^{gate}_i) \\odot x W^{up}_i) W^{down}_i`, and

    .. math:: \\mathrm{out}_n = \\sum_j g_{nj}\\, y_{I_{nj}}(x_n).

    Only the chosen experts run: each gathers its tokens, runs on them and
    adds its weighted output back. Backward: :math:`\\bar g_{nj} = \\langle
    \\bar{\\mathrm{out}}_n, y_{I_{nj}}(x_n)\\rangle` feeds the router's
    backward; each expert's backward runs on :math:`g_{nj} \\bar{\\mathrm{out}}_n`
    of its own tokens, so an expert no token chose gets zero gradients; the
    input gradient is the sum of the experts' and the router's. The top-k
    selection is piecewise constant: no gradient flows through it.

    ``forward(x, return_router_logits=True)`` also returns the logits
    ``(N, X)``, and ``backward(dout, drouter_logits=...)`` takes their
    gradient: the load-balancing loss
    (:func:`qkvnp.functional.load_balancing_loss_forward`) plugs in there.

    Examples
    --------
    >>> moe = MoEFeedForward(4, 8, num_experts=3, top_k=2, rng=0)
    >>> moe.forward(np.ones((2, 5, 4))).shape
    (2, 5, 4)
    >>> moe.backward(np.ones((2, 5, 4))).shape
    (2, 5, 4)
    >>> sorted(moe.params)[:3]
    ['experts.0.W_down', 'experts.0.W_gate', 'experts.0.W_up']
    """

    supports_complex_step = True

    def __init__(self, emb_dim: int, hidden_dim: int, num_experts: int, top_k: int, *,
                 gating: str = "softmax_topk", norm_topk_prob: bool = False,
                 activation: str = "silu", rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        self.emb_dim = check_int(emb_dim, "emb_dim", 1)
        self.hidden_dim = check_int(hidden_dim, "hidden_dim", 1)
        self.num_experts, self.top_k = check_router_sizes(num_experts, top_k, "top_k")
        if gating not in ROUTER_GATINGS:
            raise ValueError(f"gating must be one of {ROUTER_GATINGS}, got {gating!r}")
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
        self.gating, self.activation = gating, activation
        self.norm_topk_prob = check_bool(norm_topk_prob, "norm_topk_prob")
        self.dtype = layer_dtype(dtype)
        rng = make_rng(rng)

        def uniform(fan_in, shape):  # nn.Linear's initialisation
            bound = 1.0 / np.sqrt(fan_in)
            return rng.uniform(-bound, bound, size=shape).astype(self.dtype)

        E, F_, X = self.emb_dim, self.hidden_dim, self.num_experts
        self.params = {"router.W": uniform(E, (E, X))}
        for i in range(X):
            self.params[f"experts.{i}.W_gate"] = uniform(E, (E, F_))
            self.params[f"experts.{i}.W_up"] = uniform(E, (E, F_))
            self.params[f"experts.{i}.W_down"] = uniform(F_, (F_, E))
        self._cache = None
        self.zero_grad()

    _repr_fields = ("emb_dim", "hidden_dim", "num_experts", "top_k", "gating", "norm_topk_prob",
                    "activation", "dtype")

    def _weights(self, check):
        """The parameters, checked (finite, the layer's dtype) unless ``check`` is False."""
        if not check:
            return self.params
        return {name: as_float_array(value, name, self.dtype) for name, value in self.params.items()}

    def forward(self, x: FloatArray, *, return_router_logits: bool = False,
                check: bool = True) -> Any:
        """``(..., E) -> (..., E)``: each token through its ``top_k`` experts.

        Parameters
        ----------
        x : ndarray, shape (..., E)
        return_router_logits : bool, keyword-only
            Also return the router's logits ``(N, X)`` (for the load-balancing loss).
        check : bool, keyword-only
            False: ``x`` is a composite's own finite array of the layer's
            dtype and shape, not checked again.

        Returns
        -------
        out : ndarray, shape (..., E)
        router_logits : ndarray, shape (N, X)
            With ``return_router_logits`` only.
        """
        if check:
            x = as_float_array(x, "x", self.dtype)
            if x.ndim < 1 or x.shape[-1] != self.emb_dim:
                raise ValueError(f"x must have shape (..., {self.emb_dim}), got shape {x.shape}")
        params = self._weights(check)
        x_rows = x.reshape(-1, self.emb_dim)  # (..., E) -> (N, E)
        indices, gates, router = F.router_forward(x_rows, params["router.W"], self.top_k,
                                                  self.gating, norm_topk_prob=self.norm_topk_prob)
        out = np.zeros(x_rows.shape, np.result_type(x_rows, *params.values()))  # (N, E)
        routed: list[RoutedTokens | None] = []  # by expert; None: no token chose it
        # NOTE: a plain loop over the experts is fast enough; measured in benchmarks/NOTES.md
        for i in range(self.num_experts):
            token, slot = np.nonzero(indices == i)  # (n_i,), (n_i,)
            if token.size == 0:  # NOTE: an expert no token chose does not run
                routed.append(None)
                continue
            # NOTE: the cache keeps copies of the weights the forward read (Layer)
            weights = [params[f"experts.{i}.{name}"].copy() for name in ("W_gate", "W_up", "W_down")]
            y, expert = _expert_forward(x_rows[token], *weights)  # (n_i, E) -> (n_i, E)
            out[token] += gates[token, slot][:, None] * y  # a token meets an expert at most once
            routed.append(RoutedTokens(token, slot, y, expert))
        self._cache = MoECache(router, routed, x.shape)
        out = out.reshape(x.shape)  # (N, E) -> (..., E)
        if return_router_logits:
            return out, router.logits.copy()
        return out

    def backward(self, dout: FloatArray, retain_cache: bool = False, *,
                 drouter_logits: FloatArray | None = None, check: bool = True) -> FloatArray:
        """Accumulate every gradient into ``grads``; return ``dx`` ``(..., E)``.

        Parameters
        ----------
        dout : ndarray, shape (..., E)
        retain_cache : bool
            Keep the cache for one more backward.
        drouter_logits : ndarray, shape (N, X), keyword-only, optional
            The gradient of a loss on the router's logits (the load-balancing loss).
        check : bool, keyword-only
            False: the gradients are a composite's own, already checked.
        """
        router, routed, x_shape = self._need_cache()
        gates = router.gates
        if check:
            dout = as_upstream_grad(dout, "dout", x_shape, self.dtype)
            if drouter_logits is not None:
                drouter_logits = as_upstream_grad(drouter_logits, "drouter_logits",
                                                  router.logits.shape, self.dtype)
        dout_rows = dout.reshape(-1, self.emb_dim)  # (..., E) -> (N, E)
        dx_rows = np.zeros(dout_rows.shape, dout_rows.dtype)  # (N, E)
        dgates = np.zeros(gates.shape, dout_rows.dtype)  # (N, k)
        expert_grads = {}
        for i, tokens in enumerate(routed):
            if tokens is None:
                continue
            token, slot = tokens.token, tokens.slot
            # in the forward this was: out[token] += gates[token, slot] * y
            dgates[token, slot] = np.sum(dout_rows[token] * tokens.y, axis=-1)  # (n_i, E) -> (n_i,)
            dy = gates[token, slot][:, None] * dout_rows[token]  # (n_i, E)
            dx_expert, *dweights = _expert_backward(dy, tokens.expert)
            dx_rows[token] += dx_expert
            for name, grad in zip(("W_gate", "W_up", "W_down"), dweights):
                expert_grads[f"experts.{i}.{name}"] = grad
        dx_router, dW_router = F.router_backward(dgates, router, drouter_logits, check=False)
        dx = (dx_rows + dx_router).reshape(x_shape)  # (N, E) -> (..., E); x fed the router and its experts
        self._accumulate("router.W", dW_router)
        for name, grad in expert_grads.items():
            self._accumulate(name, grad)
        self._release_cache(retain_cache)
        return dx


# NOTE: the expert's SwiGLU is written here with the linear op and a local SiLU;
# it is the gated MLP op of qkvnp.functional once that exists, and can call it then.
def _sigmoid(z):
    """The logistic function, real (scipy's ``expit``, no overflow) or complex (the complex step)."""
    if z.dtype.kind == "c":
        return 1.0 / (1.0 + np.exp(-z))
    from scipy.special import expit

    return expit(z)


def _expert_forward(x, W_gate, W_up, W_down):
    """One expert's SwiGLU ``(silu(x W_gate) * x W_up) W_down`` on its tokens ``(n, E)``."""
    gate, gate_linear = F.linear_forward(x, W_gate, check=False)  # (n, E) -> (n, F)
    up, up_linear = F.linear_forward(x, W_up, check=False)  # (n, E) -> (n, F)
    sigmoid = _sigmoid(gate)
    hidden = gate * sigmoid * up  # silu(gate) * up, (n, F)
    y, down_linear = F.linear_forward(hidden, W_down, check=False)  # (n, F) -> (n, E)
    return y, ExpertCache(gate_linear, up_linear, down_linear, gate, sigmoid, up)


def _expert_backward(dy, cache):
    """Backward of :func:`_expert_forward`: ``dx, dW_gate, dW_up, dW_down``."""
    gate, sigmoid, up = cache.gate, cache.sigmoid, cache.up
    dhidden, dW_down, _ = F.linear_backward(dy, cache.down_linear, check=False)  # (n, F)
    # in the forward this was: hidden = silu(gate) * up, silu(a) = a sigmoid(a)
    dup = dhidden * (gate * sigmoid)
    dgate = dhidden * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))  # silu'(a)
    dx_up, dW_up, _ = F.linear_backward(dup, cache.up_linear, check=False)  # (n, E)
    dx_gate, dW_gate, _ = F.linear_backward(dgate, cache.gate_linear, check=False)  # (n, E)
    return dx_gate + dx_up, dW_gate, dW_up, dW_down
