"""Low-rank adapters on a frozen Linear: :class:`LoRALinear`, :func:`apply_lora`, :func:`merge_lora`.

Shape key: N input features, M output features, r rank, R rows (the leading
dims of ``x`` flattened).

LoRA (Hu et al.; peft's ``LoraLayer``): ``y = x W + b + (alpha / r) x A B``
with ``W``, ``b`` frozen and only ``A (N, r)``, ``B (r, M)`` trained. ``B``
starts at zero, so an adapted model computes what it did before.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import (as_float_array, as_upstream_grad, check_int, check_last_dim, check_ndim,
                       make_rng, owned)
from .base import Layer, Model
from .basic import Linear

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Sequence
    from .._typing import FloatArray

__all__ = ["LoRALinear", "LoRACache", "apply_lora", "merge_lora", "adapted_layers",
           "adapter_params", "adapter_grads"]

#: What :meth:`LoRALinear.backward` reads: the rows of ``x``, the frozen ``W``, the
#: adapters as the forward read them, ``h = x A`` and the output's shape.
LoRACache = namedtuple("LoRACache", "x2d W A B h out_shape")


class LoRALinear(Layer):
    """A frozen :class:`~qkvnp.Linear` plus a trainable low-rank update ``(alpha / r) x A B``.

    Parameters
    ----------
    base : Linear
        The frozen layer; kept as ``self.base``, its ``W`` and ``b`` never
        get a gradient nor a step (they are not in ``params``).
    rank : int
        ``r >= 1``.
    alpha : float, keyword-only, optional
        The update's scale is ``alpha / rank`` (peft's ``lora_alpha``);
        default ``rank`` (scale 1).
    rng : numpy.random.Generator or int, keyword-only, optional
        Source of ``A``'s initial values.

    Attributes
    ----------
    params, grads : dict
        ``A (N, r)`` and ``B (r, M)`` only.
    scale : float
        ``alpha / rank``.

    Notes
    -----
    ``A`` starts as peft's ``kaiming_uniform_(a=sqrt(5))`` of its
    ``(r, N)`` weight, uniform in :math:`[-1/\\sqrt N, 1/\\sqrt N]`; ``B``
    at zero. Forward, with :math:`s = \\alpha / r` and :math:`h = XA`:

    .. math:: Y = XW + b + s\\, h B

    Backward (``docs/derivations_gpt.md``, "LoRA"):
    :math:`\\bar h = s \\bar Y B^T`, :math:`\\bar B = s\\, h^T \\bar Y`,
    :math:`\\bar A = X^T \\bar h`, :math:`\\bar X = \\bar Y W^T + \\bar h A^T`.
    No :math:`\\bar W` is computed.

    Examples
    --------
    >>> base = Linear(4, 3, rng=0)
    >>> lora = LoRALinear(base, 2, alpha=4.0, rng=1)
    >>> x = np.ones((5, 4))
    >>> bool(np.array_equal(lora.forward(x), base.forward(x)))  # B = 0
    True
    >>> sorted(lora.params), lora.backward(np.ones((5, 3))).shape
    (['A', 'B'], (5, 4))
    """

    supports_complex_step = True  # its products run on complex (qkvnp.gradcheck)

    def __init__(self, base: Linear, rank: int, *, alpha: float | None = None,
                 rng: np.random.Generator | int | None = None) -> None:
        if not isinstance(base, Linear):
            raise TypeError(f"base must be a qkvnp Linear, got {type(base).__name__}")
        self.base = base
        self.rank = check_int(rank, "rank", 1)
        if alpha is None:
            alpha = float(self.rank)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)) \
                or not np.isfinite(alpha) or alpha == 0:
            raise ValueError(f"alpha must be a finite nonzero real number, got {alpha!r}")
        self.alpha = float(alpha)
        self.scale = self.alpha / self.rank
        self.dtype = base.dtype
        N, M = base.in_features, base.out_features
        bound = 1.0 / np.sqrt(N)
        self.params = {"A": make_rng(rng).uniform(-bound, bound, size=(N, self.rank)).astype(self.dtype),
                       "B": np.zeros((self.rank, M), self.dtype)}
        self._cache = None
        self.zero_grad()

    _repr_fields = ("in_features", "out_features", "rank", "alpha")

    @property
    def in_features(self) -> int:
        """``N``."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """``M``."""
        return self.base.out_features

    def forward(self, x: FloatArray, *, check: bool = True) -> FloatArray:
        """``x W + b + (alpha / r) (x A) B`` over the last axis.

        Parameters
        ----------
        x : ndarray, shape (..., N)
        check : bool, keyword-only
            False: ``x`` is a composite's own checked array (:class:`~qkvnp.Linear`'s).

        Returns
        -------
        out : ndarray, shape (..., M)
        """
        N, M = self.in_features, self.out_features
        if check:
            x_in = x
            x = as_float_array(x, "x", self.dtype)
            check_ndim(x, "x", 1, f"(..., {N})")
            check_last_dim(x, "x", N, f"(..., {N})")
            (x,) = owned((x,), (x_in,))
        # NOTE: copies of what the backward reads (Layer: a later step changes the next forward)
        W, A, B = self.base.params["W"].copy(), self.params["A"].copy(), self.params["B"].copy()
        x2d = x.reshape(-1, N)  # (..., N) -> (R, N)
        h = x2d @ A  # (R, N) -> (R, r)
        out = x2d @ W + self.scale * (h @ B)  # (R, M)
        if self.base.bias:
            out = out + self.base.params["b"]
        out_shape = x.shape[:-1] + (M,)
        self._cache = LoRACache(x2d, W, A, B, h, out_shape)
        return out.reshape(out_shape)  # (R, M) -> (..., M)

    def backward(self, dout: FloatArray, retain_cache: bool = False, *,
                 check: bool = True) -> FloatArray:
        """Accumulate ``dA`` and ``dB`` into ``grads``; return ``dx`` (no ``dW``, ``db``).

        Parameters
        ----------
        dout : ndarray, shape (..., M)
        retain_cache : bool
            Keep the cache for one more backward.
        check : bool, keyword-only
            False: ``dout`` is already checked.

        Returns
        -------
        dx : ndarray, shape (..., N)
        """
        c = self._need_cache()
        if check:
            dout = as_upstream_grad(dout, "dout", c.out_shape, self.dtype)
        dout2d = dout.reshape(-1, self.out_features)  # (..., M) -> (R, M)
        # in the forward this was: out = x W + s h B, h = x A
        dh = self.scale * (dout2d @ c.B.T)  # (R, M) -> (R, r)
        dB = self.scale * (c.h.T @ dout2d)  # (r, M)
        dA = c.x2d.T @ dh  # (N, r)
        dx = dout2d @ c.W.T + dh @ c.A.T  # (R, N)
        self._accumulate("A", dA)
        self._accumulate("B", dB)
        self._release_cache(retain_cache)
        return dx.reshape(c.out_shape[:-1] + (self.in_features,))

    def effective_params(self) -> dict[str, FloatArray]:
        """``{"W": W + (alpha / r) A B, "b": b}``: the merged weights, new arrays (decoding reads them)."""
        merged = {"W": self.base.params["W"] + self.scale * (self.params["A"] @ self.params["B"])}
        if self.base.bias:
            merged["b"] = self.base.params["b"].copy()
        return merged

    def merge(self) -> Linear:
        """A plain :class:`~qkvnp.Linear` computing the same map: ``W + (alpha / r) A B``, ``b``."""
        merged = Linear(self.in_features, self.out_features, self.base.bias, rng=0,
                        dtype=self.dtype)
        merged.load_state_dict(self.effective_params())
        return merged


def _linear_sublayers(model):
    """``(dotted name, parent model, attribute, layer)`` of every sub-layer of ``model``."""
    found = []
    for prefix, layer in model.__dict__.get("_layers", {}).items():
        found.append((prefix, model, prefix, layer))
        if isinstance(layer, Model):
            found.extend((f"{prefix}.{name}", parent, attribute, sub)
                         for name, parent, attribute, sub in _linear_sublayers(layer))
    return found


def _matches(name, target):
    return name == target or name.endswith("." + target)


def apply_lora(model: Model, targets: Sequence[str], rank: int, *, alpha: float | None = None,
               rng: np.random.Generator | int | None = None) -> list[str]:
    """Replace each :class:`~qkvnp.Linear` sub-layer named by ``targets`` by a :class:`LoRALinear`.

    Parameters
    ----------
    model : Model
        Edited in place; its ``params`` then hold the adapters' ``A``, ``B``
        (e.g. ``"trf_blocks.0.ff.layers.0.A"``) and no longer the frozen
        weights (still at ``layer.base``). The layers not adapted keep their
        parameters in ``params``: build the optimizer on
        :func:`adapter_params` (and step it with :func:`adapter_grads`) to
        train the adapters alone, after this call.
    targets : sequence of str
        Dotted names, or their last parts: ``"q_proj"`` matches every
        ``"...q_proj"``, ``"ff.layers.0"`` every block's first feed-forward
        layer, ``"out_head"`` a GPT's head.
    rank : int
    alpha : float, keyword-only, optional
        As :class:`LoRALinear`'s (default ``rank``).
    rng : numpy.random.Generator or int, keyword-only, optional
        Draws every adapter's ``A`` in turn.

    Returns
    -------
    list of str
        The dotted names adapted.

    Raises
    ------
    ValueError
        If a target names no :class:`~qkvnp.Linear` (the message lists the
        model's Linear names), or ``targets`` is empty.
    TypeError
        If ``model`` is not a :class:`~qkvnp.Model` or ``targets`` not strings.
    """
    if not isinstance(model, Model):
        raise TypeError(f"model must be a qkvnp Model, got {type(model).__name__}")
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if not targets or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"targets must be a non-empty sequence of str, got {targets!r}")
    linears = [entry for entry in _linear_sublayers(model) if isinstance(entry[3], Linear)]
    unmatched = [t for t in targets if not any(_matches(entry[0], t) for entry in linears)]
    if unmatched:
        raise ValueError(f"targets {unmatched} name no Linear sub-layer of the model; its Linear "
                         f"sub-layers are {[entry[0] for entry in linears]}")
    generator = make_rng(rng)
    done = []
    for name, parent, attribute, layer in linears:
        if any(_matches(name, t) for t in targets):
            setattr(parent, attribute, LoRALinear(layer, rank, alpha=alpha, rng=generator))
            done.append(name)
    model.zero_grad()
    return done


def merge_lora(model: Model) -> list[str]:
    """Put back a merged :class:`~qkvnp.Linear` for each :class:`LoRALinear` of ``model``, in place.

    Parameters
    ----------
    model : Model

    Returns
    -------
    list of str
        The dotted names merged (empty if none).
    """
    if not isinstance(model, Model):
        raise TypeError(f"model must be a qkvnp Model, got {type(model).__name__}")
    done = []
    for name, parent, attribute, layer in _linear_sublayers(model):
        if isinstance(layer, LoRALinear):
            setattr(parent, attribute, layer.merge())
            done.append(name)
    model.zero_grad()
    return done


def adapted_layers(model: Model) -> list[str]:
    """The dotted names of ``model``'s :class:`LoRALinear` layers (empty if none).

    What a writer of another library's weights refuses until :func:`merge_lora`.

    >>> from qkvnp import GPTModel
    >>> adapted_layers(GPTModel(16, 8, 8, 2, 1, rng=0))
    []
    """
    return [name for name, layer in model.named_layers() if isinstance(layer, LoRALinear)]


def _adapters(model, kind):
    """``kind`` ("params" or "grads") of every :class:`LoRALinear` of ``model``, by dotted name."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a qkvnp Model, got {type(model).__name__}")
    found = {}
    for name, _, _, layer in _linear_sublayers(model):
        if isinstance(layer, LoRALinear):
            found.update((f"{name}.{key}", value) for key, value in getattr(layer, kind).items())
    if not found:
        raise ValueError("model has no LoRALinear layer: call apply_lora(model, targets, rank) "
                         "first")
    return found


def adapter_params(model: Model) -> dict[str, FloatArray]:
    """The adapters' ``A`` and ``B`` of every :class:`LoRALinear` of ``model``, by dotted name.

    The very arrays of ``model.params`` (an optimizer built on this dict
    updates the model), and only these: the layers :func:`apply_lora` did not
    adapt, embeddings and norms included, stay as they are.

    Raises
    ------
    ValueError
        If ``model`` holds no :class:`LoRALinear`.

    Examples
    --------
    >>> from qkvnp import GPTModel
    >>> model = GPTModel(16, 8, 8, 2, 1, rng=0)
    >>> _ = apply_lora(model, ["out_head"], rank=2, rng=0)
    >>> sorted(adapter_params(model))
    ['out_head.A', 'out_head.B']
    """
    return _adapters(model, "params")


def adapter_grads(model: Model) -> dict[str, FloatArray]:
    """The gradients of :func:`adapter_params`' arrays, under the same names (read after a backward)."""
    return _adapters(model, "grads")
