"""A mixture of experts' router (top-k experts a token, their gate weights) and its balancing loss.

Shape key: N tokens (the leading dims of ``x`` flattened), E embedding,
X experts, k experts chosen a token.

The router is a linear map to one logit an expert, a top-k selection and the
gate weights the families define (``gating``). The selection is piecewise
constant in the logits: its derivative is zero wherever it is defined, so
the gradients flow through the gate weights alone, for the chosen set held
fixed; where a token's top-k set changes the forward jumps and has no
derivative (``docs/gradcheck.md`` shows what a gradient check there reports).
Derived in ``docs/derivations_gpt.md``; users reach the ops through
:mod:`qkvnp.functional`.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, check_bool, check_int, compute_dtype,
                       declare_complex_step)
from .linear import linear_backward, linear_forward
from .softmax import softmax
from .topk import topk_indices

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray, IntArray

__all__ = ["router_forward", "router_backward", "RouterCache", "ROUTER_GATINGS",
           "load_balancing_loss_forward", "load_balancing_loss_backward",
           "LoadBalancingLossCache", "check_router_sizes"]

#: The ``gating`` values of :func:`router_forward`.
ROUTER_GATINGS = ("softmax_topk", "topk_softmax")

RouterCache = namedtuple("RouterCache",
                         "linear x_shape logits probs indices gates gating norm_topk_prob")
LoadBalancingLossCache = namedtuple("LoadBalancingLossCache", "probs fraction")


def check_router_sizes(num_experts, k, k_name="k"):
    """``num_experts`` (X >= 1) and ``k`` (1 <= k <= X) as ints, refused by name otherwise."""
    num_experts = check_int(num_experts, "num_experts", 1)
    k = check_int(k, k_name, 1, num_experts, expected=f"in [1, num_experts={num_experts}]")
    return num_experts, k


def router_forward(x: FloatArray, W_router: FloatArray, k: int, gating: str = "softmax_topk", *,
                   norm_topk_prob: bool = False) -> tuple[IntArray, FloatArray, RouterCache]:
    """Route each token to its ``k`` best experts, with their gate weights.

    Parameters
    ----------
    x : ndarray, shape (..., E)
        Tokens; the leading dims are flattened into ``N`` rows.
    W_router : ndarray, shape (E, X)
        The router (``x @ W_router``; Hugging Face's ``gate.weight`` is its transpose).
    k : int
        Experts a token, ``1 <= k <= X``.
    gating : {"softmax_topk", "topk_softmax"}
        ``"softmax_topk"``: softmax over all ``X`` logits, then the ``k``
        largest probabilities (Qwen2-MoE, Qwen3-MoE). ``"topk_softmax"``:
        the ``k`` largest logits, then a softmax over those alone (Mixtral,
        gpt-oss, whose router also has a bias this op lacks).
    norm_topk_prob : bool, keyword-only
        ``"softmax_topk"`` only: divide the ``k`` probabilities by their sum
        (Qwen's ``norm_topk_prob``). This equals ``"topk_softmax"`` in exact
        arithmetic (Hugging Face's Mixtral computes it this way).

    Returns
    -------
    indices : ndarray of int64, shape (N, k)
        The chosen experts, largest first, ties as ``torch.topk`` on CPU
        orders them (``qkvnp.ops.topk``): the selection
        reads the probabilities for ``"softmax_topk"``, the logits for
        ``"topk_softmax"``, as Hugging Face's blocks do.
    gates : ndarray, shape (N, k)
        The gate weight of each chosen expert.
    cache : RouterCache

    Raises
    ------
    ValueError
        If ``W_router`` is not 2-D or does not match ``x``'s last axis, ``k``
        is not in ``[1, X]``, ``gating`` is unknown, or an input holds NaN or inf.
    TypeError
        If ``k`` is not an int, ``norm_topk_prob`` not a bool, or an input
        not real.

    Notes
    -----
    With :math:`s = x W` (logits), :math:`I` the chosen set, held fixed (the
    selection is piecewise constant: no gradient flows through it):

    softmax_topk: :math:`p = \\mathrm{softmax}(s)`, :math:`g_j = p_{I_j}`,
    renormalised :math:`g_j = p_{I_j} / \\sum_l p_{I_l}`.
    topk_softmax: :math:`g = \\mathrm{softmax}(s_I)`.

    Backward (:func:`router_backward`): with :math:`r = \\sum_l p_{I_l}`,
    renormalising gives :math:`\\bar p_{I_j} = (\\bar g_j - \\sum_l g_l \\bar g_l) / r`;
    the softmaxes give :math:`\\bar s = p \\odot (\\bar p - \\langle p, \\bar p\\rangle)`
    (over all X, with :math:`\\bar p` zero off the chosen set) and
    :math:`\\bar s_I = g \\odot (\\bar g - \\langle g, \\bar g\\rangle)` (zero
    off it); then :math:`\\bar x = \\bar s W^T`, :math:`\\bar W = x^T \\bar s`.

    Examples
    --------
    >>> x, W = np.array([[1.0, 0.0]]), np.array([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
    >>> indices, gates, cache = router_forward(x, W, 2, "topk_softmax")
    >>> indices, np.round(gates, 4)
    (array([[2, 1]]), array([[0.7311, 0.2689]]))
    """
    if gating not in ROUTER_GATINGS:
        raise ValueError(f"gating must be one of {ROUTER_GATINGS}, got {gating!r}")
    norm_topk_prob = check_bool(norm_topk_prob, "norm_topk_prob")
    W_router = as_float_array(W_router, "W_router")
    dtype = compute_dtype(np.asarray(x).dtype, W_router.dtype, names=("x", "W_router"))
    x = as_float_array(x, "x", dtype)
    if W_router.ndim != 2:
        raise ValueError(f"W_router must have shape (E, X), got shape {W_router.shape}")
    if x.ndim < 1 or x.shape[-1] != W_router.shape[0]:
        raise ValueError(f"x must have shape (..., {W_router.shape[0]}) to match W_router of "
                         f"shape {W_router.shape}, got shape {x.shape}")
    _, k = check_router_sizes(W_router.shape[1], k)
    x_rows = x.reshape(-1, x.shape[-1])  # (..., E) -> (N, E)
    logits, linear = linear_forward(x_rows, W_router.astype(dtype, copy=False))  # (N, X)
    indices, gates, probs = _gates_forward(logits, k, gating, norm_topk_prob)
    cache = RouterCache(linear, x.shape, logits, probs, indices, gates, gating, norm_topk_prob)
    return indices, gates, cache


def _gates_forward(logits, k, gating, norm_topk_prob):
    """The chosen experts and their gates from the logits ``(N, X)``."""
    if gating == "softmax_topk":
        probs = softmax(logits, axis=-1)  # (N, X)
        indices = topk_indices(probs, k)  # (N, X) -> (N, k)
        gates = np.take_along_axis(probs, indices, axis=-1)  # (N, X) -> (N, k)
        if norm_topk_prob:
            gates = gates / np.sum(gates, axis=-1, keepdims=True)
        return indices, gates, probs
    indices = topk_indices(logits, k)  # (N, X) -> (N, k)
    gates = softmax(np.take_along_axis(logits, indices, axis=-1), axis=-1)  # (N, k)
    return indices, gates, None


def router_backward(dgates: FloatArray, cache: RouterCache, dlogits: FloatArray | None = None,
                    check: bool = True) -> tuple[FloatArray, FloatArray]:
    """Backward of :func:`router_forward`, through the gate weights.

    Parameters
    ----------
    dgates : ndarray, shape (N, k)
    cache : RouterCache
    dlogits : ndarray, shape (N, X), optional
        A gradient reaching the logits directly (the load-balancing loss's,
        :func:`load_balancing_loss_backward`), added to the gates' before
        the product's backward. The logits are ``cache.logits``.
    check : bool
        False: the gradients are a composite's own, already checked.

    Returns
    -------
    dx : ndarray, shape of the forward's ``x``
    dW_router : ndarray, shape (E, X)

    Raises
    ------
    TypeError
        If a gradient does not hold real numbers.
    ValueError
        If a gradient has another shape or holds NaN or inf.
    """
    logits, gates = cache.logits, cache.gates
    if check:
        dgates = as_upstream_grad(dgates, "dgates", gates.shape, gates.dtype)
        if dlogits is not None:
            dlogits = as_upstream_grad(dlogits, "dlogits", logits.shape, logits.dtype)
    # in the forward this was: gates = take(probs, indices) [/ sum], or softmax(take(logits, indices))
    dscores = np.zeros(logits.shape, gates.dtype)  # (N, X): zero off the chosen set
    if cache.gating == "softmax_topk":
        if cache.norm_topk_prob:
            chosen = np.take_along_axis(cache.probs, cache.indices, axis=-1)  # (N, k)
            total = np.sum(chosen, axis=-1, keepdims=True)  # (N, 1)
            dgates = (dgates - np.sum(gates * dgates, axis=-1, keepdims=True)) / total
        np.put_along_axis(dscores, cache.indices, dgates, axis=-1)  # dprobs, (N, k) -> (N, X)
        probs = cache.probs
        dscores = probs * (dscores - np.sum(probs * dscores, axis=-1, keepdims=True))
    else:
        dselected = gates * (dgates - np.sum(gates * dgates, axis=-1, keepdims=True))  # (N, k)
        np.put_along_axis(dscores, cache.indices, dselected, axis=-1)  # (N, k) -> (N, X)
    if dlogits is not None:
        dscores = dscores + dlogits
    dx_rows, dW_router, _ = linear_backward(dscores, cache.linear, check=False)  # (N, E), (E, X)
    return dx_rows.reshape(cache.x_shape), dW_router


def load_balancing_loss_forward(router_logits: FloatArray,
                                k: int) -> tuple[FloatArray, LoadBalancingLossCache]:
    """The auxiliary load-balancing loss of Switch, Mixtral and Qwen-MoE.

    Parameters
    ----------
    router_logits : ndarray, shape (N, X)
        Router logits of ``N`` tokens (Hugging Face concatenates every
        layer's along ``N`` before calling its ``load_balancing_loss_func``;
        do the same to match it, and split the gradient back).
    k : int
        Experts a token, ``1 <= k <= X``.

    Returns
    -------
    loss : ndarray, shape ()
    cache : LoadBalancingLossCache

    Raises
    ------
    ValueError
        If ``router_logits`` is not 2-D or holds NaN or inf, or ``k`` is not in ``[1, X]``.
    TypeError
        If ``k`` is not an int or ``router_logits`` not real.

    Notes
    -----
    As transformers' ``load_balancing_loss_func`` without an attention mask:
    :math:`p = \\mathrm{softmax}(s)` per token, :math:`f_i` the number of
    tokens whose top-k (of ``p``) holds expert :math:`i`, over ``N`` (the
    :math:`f_i` sum to ``k``), :math:`P_i = \\tfrac1N \\sum_n p_{ni}`, and

    .. math:: L = X \\sum_i f_i P_i.

    :math:`f` is piecewise constant (a count): the gradient flows through
    :math:`P` alone, :math:`\\bar p_{ni} = \\bar L\\, X f_i / N`, then the
    softmax's closed form :math:`\\bar s = p \\odot (\\bar p - \\langle p, \\bar p\\rangle)`.

    Examples
    --------
    >>> loss, cache = load_balancing_loss_forward(np.zeros((4, 2)), 1)
    >>> float(loss)  # balanced: X * sum_i f_i P_i = 2 * (0.5 * 0.5 + 0.5 * 0.5)
    1.0
    """
    router_logits = as_float_array(router_logits, "router_logits")
    if router_logits.ndim != 2:
        raise ValueError(f"router_logits must have shape (N, X), got shape {router_logits.shape}")
    num_experts, k = check_router_sizes(router_logits.shape[1], k)
    probs = softmax(router_logits, axis=-1)  # (N, X)
    tokens = router_logits.shape[0]
    chosen = np.zeros(probs.shape, probs.real.dtype)  # (N, X), 1 where expert i is in the top k
    np.put_along_axis(chosen, topk_indices(probs, k), 1.0, axis=-1)
    fraction = chosen.mean(axis=0) if tokens else chosen.sum(axis=0)  # f, (N, X) -> (X,)
    mean_probs = probs.mean(axis=0) if tokens else probs.sum(axis=0)  # P, (N, X) -> (X,)
    loss = num_experts * np.sum(fraction * mean_probs)
    return np.asarray(loss), LoadBalancingLossCache(probs, fraction)


def load_balancing_loss_backward(dloss: FloatArray, cache: LoadBalancingLossCache,
                                 check: bool = True) -> FloatArray:
    """Backward of :func:`load_balancing_loss_forward`: ``drouter_logits (N, X)``.

    Parameters
    ----------
    dloss : float or ndarray, shape ()
        The loss's upstream gradient (its coefficient, ``router_aux_loss_coef``).
    cache : LoadBalancingLossCache
    check : bool
        False: ``dloss`` is already checked.

    Raises
    ------
    TypeError
        If ``dloss`` does not hold a real number.
    ValueError
        If ``dloss`` is not a scalar or is NaN or inf.
    """
    probs, fraction = cache
    if check:
        dloss = as_upstream_grad(dloss, "dloss", (), probs.dtype)
    tokens, num_experts = probs.shape
    # in the forward this was: loss = X * sum_i f_i * mean_n probs[n, i]  (f held fixed)
    dprobs = np.broadcast_to(dloss * num_experts * fraction / max(tokens, 1), probs.shape)
    return probs * (dprobs - np.sum(probs * dprobs, axis=-1, keepdims=True))  # (N, X)


declare_complex_step(router_forward, load_balancing_loss_forward)  # see qkvnp._checks.complex_step_mode
