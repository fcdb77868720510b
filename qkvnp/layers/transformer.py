"""The layers of the book's transformer block: LayerNorm, GELU, Dropout, FeedForward, the block.

Shape key: B batch (any leading dims), T tokens, E embedding (the book's
``emb_dim``), F the feed-forward's hidden width (``4 E`` by default), H heads.

Each layer calls its ops of :mod:`qkvnp.functional` (the math is in
``qkvnp.ops.layer_norm``, ``qkvnp.ops.gelu``, ``qkvnp.ops.dropout`` and
``qkvnp.ops.residual``); the composites (:class:`FeedForward`,
:class:`TransformerBlock`, :class:`Sequential`) are :class:`Model` s whose
``backward`` calls their sub-layers' backwards in the reverse order of the
forward, line for line.
"""
from __future__ import annotations


import numpy as np

from .. import functional as F
from .._checks import (as_float_array, check_bool, check_eps, check_int, check_last_dim,
                       check_ndim, layer_dtype, make_rng)
from .transaction import journal_generator
from ..ops.dropout import check_dropout_p, spawn_generator
from ..kernels import num_threads
from ..kernels.pointwise import (gelu_tanh_backward_fused, gelu_tanh_forward_fused,
                                 gelu_tanh_reference_cache, layer_norm_backward_fused,
                                 layer_norm_forward_fused)
from ..ops.gelu import GELU_APPROXIMATIONS
from .attention import MultiHeadAttention
from .base import Layer, Model
from .basic import Linear

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike, FloatArray

__all__ = ["LayerNorm", "GELU", "Dropout", "Sequential", "FeedForward", "TransformerBlock"]


class LayerNorm(Layer):
    """Layer normalisation over the last axis, with the book's ``scale`` and ``shift``.

    Parameters
    ----------
    dim : int
        ``E``, the size of the normalised last axis (the book's ``emb_dim``).
    eps : float
        Added to the biased variance (``1e-5``, the book's and PyTorch's).
    dtype : float dtype, keyword-only
        Floating dtype of the parameters and the computation (float32 or float64).

    Attributes
    ----------
    params : dict
        ``scale (E,)`` (ones) and ``shift (E,)`` (zeros): PyTorch's
        ``nn.LayerNorm`` calls them ``weight`` and ``bias``.
    grads : dict

    Notes
    -----
    See :func:`qkvnp.functional.layer_norm_forward` for the forward and the
    derived backward.

    Examples
    --------
    >>> norm = LayerNorm(4)
    >>> out = norm.forward(np.arange(8.0).reshape(2, 4))
    >>> np.round(out.mean(axis=-1), 12), out.shape
    (array([0., 0.]), (2, 4))
    >>> norm.backward(np.ones((2, 4))).shape
    (2, 4)
    """

    supports_complex_step = True

    def __init__(self, dim: int, eps: float = 1e-05, *,
                 dtype: DTypeLike = np.float64) -> None:
        self.dim = check_int(dim, "dim", 1)
        self.eps = check_eps(eps)
        self.dtype = layer_dtype(dtype)
        self.params = {"scale": np.ones(self.dim, self.dtype),
                       "shift": np.zeros(self.dim, self.dtype)}
        self._cache = None
        self.zero_grad()

    _repr_fields = ("dim", "eps", "dtype")

    def forward(self, x: Any, *, check: bool = True) -> Any:
        """Normalise each row of ``x`` ``(..., E)``; return ``(..., E)``.

        ``check=False`` (keyword-only): ``x`` is a composite's own finite
        array of the layer's dtype and shape, not checked again.
        """
        if check:
            x = as_float_array(x, "x", self.dtype)
            if x.ndim < 1 or x.shape[-1] != self.dim:
                raise ValueError(f"x must have shape (..., {self.dim}), got shape {x.shape}")
        scale, shift = self.params["scale"], self.params["shift"]
        if x.dtype.kind == "f" and x.dtype == scale.dtype == shift.dtype:
            # NOTE: the fused passes of qkvnp.kernels.pointwise for real input; the
            # reference op for the rest (the gradient checker's complex step)
            scale = as_float_array(scale, "scale")  # finite (it is not a copy)
            shift = as_float_array(shift, "shift")
            out, self._cache = layer_norm_forward_fused(x, scale, shift, self.eps)
            return out
        out, self._cache = F.layer_norm_forward(x, scale, shift, self.eps)
        return out

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Accumulate ``dscale`` and ``dshift``; return ``dx`` ``(..., E)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        cache = self._need_cache()
        if check or cache.normalized.dtype.kind != "f":
            dx, dscale, dshift = F.layer_norm_backward(dout, cache, check)
        else:
            dx, dscale, dshift = layer_norm_backward_fused(dout, cache)
        self._accumulate("scale", dscale)
        self._accumulate("shift", dshift)
        self._release_cache(retain_cache)
        return dx


class GELU(Layer):
    """The GELU activation (no parameters).

    Parameters
    ----------
    approximate : {"tanh", "none"}
        ``"tanh"``, the default here, is the book's ``GELU`` and GPT-2's;
        ``"none"`` is the exact erf form. NOTE: PyTorch's ``nn.GELU()``
        defaults to ``"none"``; the book's own class is the tanh one.

    Examples
    --------
    >>> gelu = GELU()
    >>> np.round(gelu.forward(np.array([-1.0, 0.0, 1.0])), 4)
    array([-0.1588,  0.    ,  0.8412])
    """

    supports_complex_step = True

    def __init__(self, approximate: str = "tanh") -> None:
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got "
                             f"{approximate!r}")
        self.approximate = approximate
        self.params = {}
        self._cache = None
        self.zero_grad()

    _repr_fields = ("approximate",)

    def forward(self, x: Any, *, check: bool = True) -> Any:
        """GELU of every entry of ``x``.

        ``check=False`` (keyword-only): ``x`` is a composite's own finite
        real array, which it does not edit before the backward; it is
        neither checked nor copied (the cache keeps it).
        """
        if not check and self.approximate == "tanh" and x.dtype.kind == "f":
            out, self._cache = gelu_tanh_forward_fused(x)  # qkvnp.kernels.pointwise
            return out
        out, self._cache = F.gelu_forward(x, self.approximate)
        return out

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Return ``dx = dout * gelu'(x)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        cache = self._need_cache()
        if check or cache.approximate != "tanh" or cache.x.dtype.kind != "f":
            if cache.approximate == "tanh":  # the fused forward's cache holds s, not t
                cache = gelu_tanh_reference_cache(cache)
            dx = F.gelu_backward(dout, cache, check)
        else:
            dx = gelu_tanh_backward_fused(dout, cache)
        self._release_cache(retain_cache)
        return dx


class Dropout(Layer):
    """Dropout on activations (``nn.Dropout``): drawn in training mode, replayable always.

    Parameters
    ----------
    p : float
        Drop probability in ``[0, 1)``; kept entries are scaled by ``1/(1-p)``.
    rng : numpy.random.Generator or int, keyword-only, optional
        The layer's own ``dropout_rng`` is spawned from it (not drawn from).

    Notes
    -----
    ``forward(x, mask=m)`` applies the given bool mask (True = keep) in
    either mode, so that a run with dropout can be replayed against another
    library's; without a mask, training mode draws ``rng.random(x.shape) >= p``
    and evaluation mode is the identity.

    Examples
    --------
    >>> drop = Dropout(0.5, rng=0)
    >>> drop.forward(np.ones(4), mask=np.array([True, False, True, True]))
    array([2., 0., 2., 2.])
    >>> drop.eval().forward(np.ones(2))
    array([1., 1.])
    """

    supports_complex_step = True

    def __init__(self, p: float = 0.5, *, rng: np.random.Generator | int | None = None) -> None:
        self.p = check_dropout_p(p, "p")
        self.dropout_rng = spawn_generator(make_rng(rng))
        self.params = {}
        self._cache = None
        self.zero_grad()

    _repr_fields = ("p",)

    def generators(self) -> Any:
        """``{"dropout_rng": the Generator that draws the masks}``."""
        return {"dropout_rng": self.dropout_rng}

    def forward(self, x: Any, *, mask: Any = None,
                rng: np.random.Generator | int | None = None, check: bool = True) -> Any:
        """Drop entries of ``x`` (a given ``mask``, or one drawn in training mode).

        ``check=False`` (keyword-only): ``x`` is a composite's own finite
        array, not checked again.
        """
        if mask is None and (not self.training or self.p == 0.0):
            out, self._cache = F.activation_dropout_forward(x, 0.0, check=check)
            return out
        if mask is not None and self.p == 0.0:
            raise ValueError("mask needs a Dropout built with 0 < p < 1, this one has p=0.0")
        rng = self.dropout_rng if rng is None else rng
        if mask is None:
            journal_generator(rng)  # a refused model call puts its state back
        out, self._cache = F.activation_dropout_forward(x, self.p, rng=rng, mask=mask,
                                                        check=check)
        return out

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Return ``dout`` masked and scaled as the forward was.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        cache = self._need_cache()
        dx = F.activation_dropout_backward(dout, cache, check)
        self._release_cache(retain_cache)
        return dx


class Sequential(Model):
    """Layers applied in order, registered as ``"0"``, ``"1"``, ... (``nn.Sequential``).

    Parameters
    ----------
    layers : sequence of Layer
        The layers, called in order; their parameters are named by index (``0.W``).

    Examples
    --------
    >>> seq = Sequential([Linear(3, 4, rng=0), GELU(), Linear(4, 2, rng=1)])
    >>> list(seq.params)
    ['0.W', '0.b', '2.W', '2.b']
    >>> seq.forward(np.ones((5, 3))).shape
    (5, 2)
    >>> seq.backward(np.ones((5, 2))).shape
    (5, 3)
    """

    supports_complex_step = True

    def __init__(self, layers: Any) -> None:
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layers[{i}] must be a qkvnp Layer, got {type(layer).__name__}")
            setattr(self, str(i), layer)
        self._count = len(layers)
        self.zero_grad()

    def __len__(self):
        return self._count

    def __getitem__(self, index):
        return getattr(self, str(range(self._count)[index]))

    def __iter__(self):
        return (self[i] for i in range(self._count))

    def forward(self, x: Any) -> Any:
        """Each layer's forward, in order."""
        for layer in self:
            x = layer.forward(x)
        return x

    def backward(self, dout: Any, retain_cache: bool = False) -> Any:
        """Each layer's backward, in reverse order."""
        for layer in reversed(list(self)):
            dout = layer.backward(dout, retain_cache)
        return dout


class FeedForward(Model):
    """The book's feed-forward: ``Linear(E, F) -> GELU -> Linear(F, E)``.

    Parameters
    ----------
    emb_dim : int
        ``E``.
    hidden_dim : int, optional
        ``F``; default ``4 * emb_dim`` (the book's).
    rng : numpy.random.Generator or int, keyword-only, optional
        Seed or Generator of the initial weights (a new unseeded Generator if None).
    dtype : float dtype, keyword-only
        Floating dtype of the parameters and the computation (float32 or float64).
    approximate : {"tanh", "none"}, keyword-only
        The GELU's (see :class:`GELU`).

    Attributes
    ----------
    params : dict
        ``layers.0.W (E, F)``, ``layers.0.b (F,)``, ``layers.2.W (F, E)``,
        ``layers.2.b (E,)``: the book's ``ff.layers.0`` / ``ff.layers.2``
        (torch stores ``weight = W.T``).

    Examples
    --------
    >>> ff = FeedForward(4, rng=0)
    >>> ff.forward(np.ones((2, 3, 4))).shape
    (2, 3, 4)
    >>> ff.params["layers.0.W"].shape
    (4, 16)
    """

    supports_complex_step = True

    def __init__(self, emb_dim: int, hidden_dim: int | None = None, *,
                 rng: np.random.Generator | int | None = None, dtype: DTypeLike = np.float64,
                 approximate: str = "tanh") -> None:
        self.emb_dim = check_int(emb_dim, "emb_dim", 1)
        self.hidden_dim = 4 * self.emb_dim if hidden_dim is None else check_int(hidden_dim,
                                                                                "hidden_dim", 1)
        rng = make_rng(rng)
        self.layers = Sequential([
            Linear(self.emb_dim, self.hidden_dim, rng=rng, dtype=dtype),
            GELU(approximate),
            Linear(self.hidden_dim, self.emb_dim, rng=rng, dtype=dtype),
        ])
        self.zero_grad()

    def forward(self, x: Any, *, check: bool = True) -> Any:
        """``(..., E) -> (..., E)``.

        ``check=False`` (keyword-only): ``x`` is a composite's own finite
        array of the layer's dtype and shape, which it does not edit before
        the backward. Either way the hidden activations, the layer's own,
        are not checked again between the sub-layers.
        """
        first, gelu, second = self.layers
        h = first.forward(x, check=check)  # (..., E) -> (..., F)
        h = gelu.forward(h, check=False)
        return second.forward(h, check=False)  # (..., F) -> (..., E)

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Accumulate the linears' gradients; return ``dx`` ``(..., E)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked.
        """
        first, gelu, second = self.layers
        dh = second.backward(dout, retain_cache, check=check)  # (..., E) -> (..., F)
        dh = gelu.backward(dh, retain_cache, check=False)
        return first.backward(dh, retain_cache, check=False)  # (..., F) -> (..., E)


# Forward operations of a block's attention (projections and core) below which
# it runs in the calling thread, its projections still on OpenBLAS's threads as
# the feed-forward's. NOTE: the kernels split a lone layer's batch over their
# worker threads from ``batch_split_flops`` on, which pays for the layer alone;
# in a block, the threads OpenBLAS spun up for the feed-forward's products are
# still spinning, and the split lost on the book's GPT (benchmarks/NOTES.md).
# Above it: not measured in a block; the kernels decide as for a lone layer.
_SERIAL_ATTENTION_FLOPS = 1 << 29


class _NoChange:
    """A context manager that changes nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_CHANGE = _NoChange()


class TransformerBlock(Model):
    """The book's pre-LayerNorm transformer block, with causal multi-head attention.

    Parameters
    ----------
    emb_dim : int
        ``E``.
    num_heads : int
        ``H``, a divisor of ``E``.
    dropout : float
        The book's ``drop_rate``: on the attention weights and on each
        branch before its residual add (training mode).
    qkv_bias : bool
        Biases of the query, key and value projections (the output
        projection always has one, as the book's ``out_proj``).
    hidden_dim : int, keyword-only, optional
        The feed-forward's width (default ``4 E``).
    rng, dtype, impl : keyword-only
        As :class:`~qkvnp.MultiHeadAttention`'s.
    approximate : {"tanh", "none"}, keyword-only
        The GELU's.
    num_kv_heads : int, keyword-only, optional
        Grouped-query attention (see :class:`~qkvnp.MultiHeadAttention`).
    rope, rope_base, rope_layout, position_bias, num_buckets, max_distance, sinks, softcap, window, scale : keyword-only
        The attention variants, as :class:`~qkvnp.MultiHeadAttention`'s
        (``docs/variants.md``): e.g. ``rope=True`` rotates queries and keys
        (with a :class:`~qkvnp.KVCache` the positions continue),
        ``window=(left, 0)`` makes the attention a causal sliding window.
        All off by default: the book's block.

    Attributes
    ----------
    att : MultiHeadAttention
    ff : FeedForward
    norm1, norm2 : LayerNorm
    drop_shortcut1, drop_shortcut2 : Dropout
        The book's one ``drop_shortcut``, used twice, is two layers here
        (a layer keeps the cache of its last call only).

    Notes
    -----
    Forward (the book's ``TransformerBlock``):

    .. math:: h = x + \\mathrm{drop}(\\mathrm{att}(\\mathrm{norm}_1(x))), \\qquad
              y = h + \\mathrm{drop}(\\mathrm{ff}(\\mathrm{norm}_2(h)))

    Backward: a residual add passes its gradient to both inputs, so
    :math:`\\bar h = \\bar y + \\mathrm{norm}_2'^T \\mathrm{ff}'^T \\mathrm{drop}'^T \\bar y`
    and :math:`\\bar x = \\bar h + \\mathrm{norm}_1'^T \\mathrm{att}'^T
    \\mathrm{drop}'^T \\bar h`.

    Examples
    --------
    >>> block = TransformerBlock(8, 2, rng=0)
    >>> x = np.random.default_rng(0).normal(size=(2, 5, 8))
    >>> block.forward(x).shape
    (2, 5, 8)
    >>> block.backward(np.ones((2, 5, 8))).shape
    (2, 5, 8)
    """

    supports_complex_step = True  # on the reference path (qkvnp.gradcheck)

    def __init__(self, emb_dim: int, num_heads: int, dropout: float = 0.0, qkv_bias: bool = False,
                 *, hidden_dim: int | None = None, rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64, impl: str = "auto", approximate: str = "tanh",
                 num_kv_heads: int | None = None, rope: bool = False,
                 rope_base: float = 10000.0, rope_layout: str = "half",
                 position_bias: str | None = None, num_buckets: int = 32,
                 max_distance: int = 128, sinks: bool = False, softcap: float | None = None,
                 window: tuple[int | None, int | None] | None = None,
                 scale: float | None = None) -> None:
        self.qkv_bias = check_bool(qkv_bias, "qkv_bias")
        rng = make_rng(rng)
        self.att = MultiHeadAttention(emb_dim, num_heads, rng=rng, dtype=dtype, impl=impl,
                                      qkv_bias=qkv_bias, out_bias=True, dropout=dropout,
                                      num_kv_heads=num_kv_heads, rope=rope, rope_base=rope_base,
                                      rope_layout=rope_layout, position_bias=position_bias,
                                      num_buckets=num_buckets, max_distance=max_distance,
                                      sinks=sinks, softcap=softcap, window=window,
                                      scale=scale)
        self.ff = FeedForward(emb_dim, hidden_dim, rng=rng, dtype=dtype, approximate=approximate)
        self.norm1 = LayerNorm(emb_dim, dtype=dtype)
        self.norm2 = LayerNorm(emb_dim, dtype=dtype)
        self.drop_shortcut1 = Dropout(dropout, rng=rng)
        self.drop_shortcut2 = Dropout(dropout, rng=rng)
        self.emb_dim, self.num_heads = self.att.embed_dim, self.att.num_heads
        self.dropout, self.dtype = self.att.dropout, self.att.dtype
        self.zero_grad()

    @property
    def impl(self) -> Any:
        """The attention's path (:mod:`qkvnp.kernels`); assignable."""
        return self.att.impl

    @impl.setter
    def impl(self, value: Any) -> None:
        self.att.impl = value

    def forward(self, x: FloatArray, *, dropout_masks: dict[str, Any] | None = None,
                check: bool = True) -> Any:
        """The block on ``x`` ``(..., T, E)``; return ``(..., T, E)``.

        Parameters
        ----------
        x : ndarray, shape (..., T, E)
        dropout_masks : dict, keyword-only, optional
            Masks to replay (bool, True = keep) by sub-layer name:
            ``"att"`` ``(..., H, T, T)`` for the attention weights,
            ``"drop_shortcut1"`` and ``"drop_shortcut2"`` ``(..., T, E)``.
            Missing names are drawn (training mode) or not applied.
        check : bool, keyword-only
            False: ``x`` is a composite's own finite array of the block's
            dtype and shape (the previous block's output), which it does not
            edit before the backward.

        Raises
        ------
        ValueError
            If ``x`` is not finite or of the wrong shape, or the output is
            not finite (a parameter holding NaN or inf, an overflow).

        Notes
        -----
        The activations between the sub-layers are the block's own and are
        not checked again; the output is checked once instead.
        """
        masks = _check_mask_names(dropout_masks, ("att", "drop_shortcut1", "drop_shortcut2"))
        if check:
            x = as_float_array(x, "x", self.dtype)
            check_ndim(x, "x", 2, f"(..., T, {self.emb_dim})")
            check_last_dim(x, "x", self.emb_dim, f"(..., T, {self.emb_dim})")
        h = self.norm1.forward(x, check=False)  # (..., T, E)
        with self._attention_threads(h):
            h = self.att.forward(h, is_causal=True, dropout_mask=masks.get("att"))  # (..., T, E)
        h = self.drop_shortcut1.forward(h, mask=masks.get("drop_shortcut1"), check=False)
        x, residual1 = F.residual_add_forward(x, h, check=False)  # (..., T, E)
        h = self.norm2.forward(x, check=False)
        h = self.ff.forward(h, check=False)  # (..., T, E) -> (..., T, 4E) -> (..., T, E)
        h = self.drop_shortcut2.forward(h, mask=masks.get("drop_shortcut2"), check=False)
        out, residual2 = F.residual_add_forward(x, h, check=False)
        if not np.isfinite(out).all():
            raise ValueError("TransformerBlock's output contains NaN or inf: a parameter holds "
                             "NaN or inf, or the activations overflowed")
        self._cache = (residual1, residual2)
        return out

    def backward(self, dout: Any, retain_cache: bool = False, *, check: bool = True) -> Any:
        """Accumulate every sub-layer's gradients; return ``dx`` ``(..., T, E)``.

        ``check=False`` (keyword-only): ``dout`` is a composite's own
        gradient, already checked (the next block's ``dx``). The gradients
        between the sub-layers are not checked again; ``dx`` is checked
        finite once instead.
        """
        residual1, residual2 = self._need_cache()
        dx, dh = F.residual_add_backward(dout, residual2, check=check)
        dh = self.drop_shortcut2.backward(dh, retain_cache, check=False)
        dh = self.ff.backward(dh, retain_cache, check=False)
        dx = dx + self.norm2.backward(dh, retain_cache, check=False)
        dx, dh = F.residual_add_backward(dx, residual1, check=False)
        dh = self.drop_shortcut1.backward(dh, retain_cache, check=False)
        with self._attention_threads(dh):
            dh = self.att.backward(dh, retain_cache)
        dx = dx + self.norm1.backward(dh, retain_cache, check=False)
        if not np.isfinite(dx).all():
            raise ValueError("TransformerBlock's input gradient contains NaN or inf: the "
                             "gradients overflowed")
        self._release_cache(retain_cache)
        return dx

    def _attention_threads(self, x):
        """The attention's worker threads in this block: :func:`qkvnp.num_threads` (1) for a
        layer below ``_SERIAL_ATTENTION_FLOPS``, else a no-op (the kernels' own choice)."""
        rows, E = x.size // x.shape[-1], self.emb_dim
        T = x.shape[-2]
        flops = 8 * rows * E * E + 4 * rows * T * E  # projections + core, forward
        return num_threads(1) if flops < _SERIAL_ATTENTION_FLOPS else _NO_CHANGE

    def decode(self, x: Any, kv_cache: Any) -> Any:
        """One inference step on the new tokens ``x`` ``(..., T, E)`` through ``kv_cache``.

        Runs the pure ops on the parameters (no layer cache is touched but
        the attention's, which then refuses a backward) and no dropout: the
        fused passes of ``qkvnp.kernels.pointwise`` for real input, as
        :meth:`forward`. ``x`` is checked once on the way in, the output on
        the way out (``ValueError`` if not finite), not what lies between.
        """
        x = as_float_array(x, "x", self.dtype)
        check_ndim(x, "x", 2, f"(..., T, {self.emb_dim})")
        check_last_dim(x, "x", self.emb_dim, f"(..., T, {self.emb_dim})")
        state = self._state_to_write()  # the calling thread's: a later backward refuses (nothing kept)
        state.cache = state.used_cache = None
        state.decoded = True
        first, gelu, second = self.ff.layers
        fused = x.dtype.kind == "f" and gelu.approximate == "tanh"
        h = _layer_norm(self.norm1, x, fused)
        x = x + self.att.forward(h, kv_cache=kv_cache)  # (..., T, E)
        h = _layer_norm(self.norm2, x, fused)
        first_p, second_p = _weights(first), _weights(second)
        h = h @ first_p["W"] + first_p["b"]  # (..., T, E) -> (..., T, F)
        h = gelu_tanh_forward_fused(h)[0] if fused else F.gelu_forward(h, gelu.approximate)[0]
        out = x + (h @ second_p["W"] + second_p["b"])  # (..., T, F) -> (..., T, E)
        if not np.isfinite(out).all():
            raise ValueError("TransformerBlock's output contains NaN or inf: a parameter holds "
                             "NaN or inf, or the activations overflowed")
        return out


def _weights(linear):
    """A Linear's ``W`` and ``b``, or an adapted one's merged (``LoRALinear.effective_params``)."""
    merged = getattr(linear, "effective_params", None)
    return linear.params if merged is None else merged()


def _layer_norm(norm, x, fused):
    """``norm``'s output on ``x`` (no cache kept): the fused passes or the reference op."""
    scale, shift = norm.params["scale"], norm.params["shift"]
    if fused and x.dtype == scale.dtype == shift.dtype:
        return layer_norm_forward_fused(x, scale, shift, norm.eps)[0]
    return F.layer_norm_forward(x, scale, shift, norm.eps)[0]


def _check_mask_names(dropout_masks, names):
    """``dropout_masks`` as a dict whose keys are among ``names``."""
    if dropout_masks is None:
        return {}
    if not isinstance(dropout_masks, dict):
        raise TypeError(f"dropout_masks must be a dict of name -> bool mask, got "
                        f"{type(dropout_masks).__name__}")
    unknown = sorted(set(dropout_masks) - set(names))
    if unknown:
        raise ValueError(f"dropout_masks has unknown names {unknown}; expected some of "
                         f"{list(names)}")
    return dropout_masks
