"""The attention layers: :class:`SelfAttention` and :class:`MultiHeadAttention`.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D = E // H head dim.

They hold parameters, gradients and the cache of the last forward; the math
of every path is in :mod:`qkvnp.kernels`, chosen by
:func:`qkvnp.kernels.choose_path` (``layer.last_dispatch`` says which ran).
"""
from __future__ import annotations


import numpy as np

from .. import kernels
from .._checks import (as_float_array, check_bool, check_int, check_last_dim, check_ndim, layer_dtype,
                       make_rng)
from .kv_cache import KVCache
from ..ops.masks import fold_key_padding_mask
from .attention_base import AttentionLayer
from .base import xavier_uniform

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import BoolArray, DTypeLike, FloatArray

__all__ = ["SelfAttention", "MultiHeadAttention"]


class SelfAttention(AttentionLayer):
    """Single-head self-attention with trainable query, key and value projections.

    Parameters
    ----------
    d_in : int
        Embedding size of the input tokens.
    d_out : int
        Size of queries, keys, values and of the output.
    qkv_bias : bool
        Add ``b_query``, ``b_key``, ``b_value`` of shape ``(d_out,)``. The
        third positional argument, as the book's ``qkv_bias``; a non-bool
        raises ``TypeError``. Every argument after it is keyword-only.
    rng : numpy.random.Generator or int, optional
        Source of the Xavier-uniform initial weights.
    dtype : float dtype
        float32 or float64 (float16 is computed in float32).
    impl : {"auto", "reference", "fast", "tiled"}
        The path (:mod:`qkvnp.kernels`): the readable oracle, the fast
        fused kernels, the tiled ones (memory linear in length), or the
        default ``"auto"`` (fast, or tiled for long sequences; see
        :func:`qkvnp.kernels.choose_path`). Same results up to rounding.
    dropout : float
        Drop probability of the attention weights in training
        mode, in ``[0, 1)`` (the book's and PyTorch's ``dropout``). The masks
        come from the layer's own ``dropout_rng``, spawned from ``rng`` after
        the weights are drawn (the weights do not depend on ``dropout``).
    rope, rope_base, rope_layout, position_bias, num_buckets, max_distance, sinks, softcap, window, scale
        Keyword-only: the attention variants, as :class:`MultiHeadAttention`'s
        with one head (``rel_bias`` ``(num_buckets, 1)``, ``sinks`` ``(1,)``;
        ``scale=None`` is ``1/sqrt(d_out)``).

    Attributes
    ----------
    params : dict
        ``W_query, W_key, W_value``: ``(d_in, d_out)`` (the ``x @ W`` convention),
        plus ``b_query, b_key, b_value``: ``(d_out,)`` with ``qkv_bias``.
    grads : dict
        Same keys and shapes as ``params``.
    last_dispatch : qkvnp.kernels.Dispatch or None
        The path the last forward ran and why (``None`` before a forward).
    training : bool
        True (the default) until ``eval()``; drawn dropout only in training.
    dropout_rng : numpy.random.Generator
        Draws the dropout masks (a checkpoint saves its state).

    Notes
    -----
    Forward: :math:`q = xW_q + b_q,\\ k = xW_k + b_k,\\ v = xW_v + b_v,\\
    o = \\mathrm{softmax}(qk^T/\\sqrt{d_{out}} + M)\\,v`.
    Backward: attention backward gives :math:`\\bar q, \\bar k, \\bar v`; each
    projection's backward gives its weight gradient, and since ``x`` feeds all
    three, :math:`\\bar x = \\bar q W_q^T + \\bar k W_k^T + \\bar v W_v^T`.
    ``b_key`` always gets a zero gradient: it adds :math:`q \\cdot b_k` to every
    score of a query's row, and softmax ignores a constant added to a row.

    Examples
    --------
    >>> layer = SelfAttention(3, 2, rng=0)
    >>> out = layer.forward(np.ones((6, 3)))
    >>> out.shape
    (6, 2)
    >>> layer.backward(np.ones((6, 2))).shape
    (6, 3)
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False, *,
                 rng: np.random.Generator | int | None = None, dtype: DTypeLike = np.float64,
                 impl: str = "auto", dropout: float = 0.0, rope: bool = False,
                 rope_base: float = 10000.0, rope_layout: str = "half",
                 position_bias: str | None = None, num_buckets: int = 32, max_distance: int = 128,
                 sinks: bool = False, softcap: float | None = None,
                 window: tuple[int | None, int | None] | None = None,
                 scale: float | None = None) -> None:
        self.impl = kernels.check_impl(impl)
        self.d_in = check_int(d_in, "d_in", 1)
        self.d_out = check_int(d_out, "d_out", 1)
        qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.dtype = layer_dtype(dtype)
        rng = make_rng(rng)
        self.params = {
            name: xavier_uniform(rng, self.d_in, self.d_out, self.dtype)
            for name in ("W_query", "W_key", "W_value")
        }
        if qkv_bias:
            for name in ("b_query", "b_key", "b_value"):
                self.params[name] = np.zeros(self.d_out, dtype=self.dtype)
        self.qkv_bias = bool(qkv_bias)
        self._init_variants(1, self.d_out, rope=rope, rope_base=rope_base,
                            rope_layout=rope_layout, position_bias=position_bias,
                            num_buckets=num_buckets, max_distance=max_distance, sinks=sinks,
                            softcap=softcap, window=window, scale=scale)
        self._init_dropout(dropout, rng)
        self._cache = None
        self.zero_grad()

    _repr_fields = ("d_in", "d_out", "qkv_bias", "dtype", "impl", "dropout")

    def forward(self, x: FloatArray, attn_mask: BoolArray | FloatArray | None = None,
                is_causal: bool | str = False, return_weights: bool = False, *,
                dropout_mask: BoolArray | None = None,
                rng: np.random.Generator | int | None = None,
                kv_cache: KVCache | None = None) -> FloatArray | tuple[FloatArray, FloatArray]:
        """Attend over the tokens of ``x``.

        Parameters
        ----------
        x : ndarray, shape (..., T, d_in)
            Cast to the layer's dtype (ints and float128 included).
        attn_mask : ndarray of bool or float, optional
            Broadcastable to ``(..., T, T)``; bool True = may attend.
        is_causal : bool or "bottom_right"
        return_weights : bool
        dropout_mask : ndarray of bool, optional
            Broadcastable to ``(..., T, T)``, True = keep: applied (with the
            layer's ``dropout``) in training and evaluation mode alike, to
            replay a mask.
        rng : numpy.random.Generator or int, optional
            Draws this forward's mask instead of ``dropout_rng`` (training
            mode, ``dropout > 0``).
        kv_cache : qkvnp.KVCache, keyword-only, optional
            Incremental decoding (inference only), as
            :meth:`MultiHeadAttention.forward`'s: ``x`` holds the ``T`` new
            tokens, which attend to every cached token causally
            (bottom-right), whatever ``is_causal`` says; ``attn_mask`` covers
            all ``S`` cached keys, ``(..., T, S)``. No dropout; a later
            ``backward`` raises ``RuntimeError``.

        Returns
        -------
        out : ndarray, shape (..., T, d_out)
        weights : ndarray, shape (..., T, T) (``(..., T, S)`` with ``kv_cache``)
            Only with ``return_weights=True``; after dropout, as PyTorch's.

        Raises
        ------
        TypeError
            If ``x`` does not hold real numbers, or the mask is neither bool
            nor float.
        ValueError
            On a shape mismatch, or NaN or inf in ``x``; with ``kv_cache``,
            on a cache of another layer or shape (``kv_cache.reset()``).
        """
        if kv_cache is not None:
            out, weights = self._decode(x, attn_mask, is_causal, None, return_weights, kv_cache,
                                        dropout_mask)
            return (out, weights) if return_weights else out
        x_in, x = x, self._check_tokens(x)
        out, weights = self._kernel_forward((x,), "self", 1, attn_mask, is_causal,
                                            return_weights, out_proj=False, originals=(x_in,),
                                            dropout=self._dropout_args(dropout_mask, rng))
        return (out, weights) if return_weights else out

    def _check_tokens(self, x):
        """``x`` checked and cast to the layer's dtype."""
        x = as_float_array(x, "x", self.dtype)
        check_ndim(x, "x", 2, f"(..., T, {self.d_in})")
        check_last_dim(x, "x", self.d_in, f"(..., T, {self.d_in})")
        return x

    def backward(self, dout: FloatArray, retain_cache: bool = False) -> FloatArray:
        """Accumulate parameter gradients into ``grads`` and return ``dx``.

        Parameters
        ----------
        dout : ndarray, shape (..., T, d_out)
            Same shape as the forward output (not broadcast); cast to the
            layer's dtype.
        retain_cache : bool
            Keep the cache for one more backward (PyTorch's ``retain_graph``).

        Returns
        -------
        dx : ndarray, shape (..., T, d_in)

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf.
        RuntimeError
            Without a forward cache to use (see :class:`~qkvnp.layers.Layer`).
        """
        (dx,) = self._kernel_backward(dout, retain_cache)  # x fed query, key and value: their sum
        return dx


class MultiHeadAttention(AttentionLayer):
    """Multi-head attention with output projection (BERT, PyTorch, ``fc_out``).

    Parameters
    ----------
    embed_dim : int
        ``E``, the projected width the heads split: queries, keys and values
        have ``E`` features (the book's ``d_out``).
    num_heads : int
        ``H``, must divide ``E``; each head has ``D = E // H`` features.
    bias : bool
        Add ``b_query, b_key, b_value`` ``(E,)`` and ``b_out`` ``(out_dim,)``
        (``qkv_bias`` and ``out_bias`` override it per group). Keyword-only,
        as is every argument after ``num_heads`` (PyTorch's third positional
        is ``dropout``, the book's ``context_length``); ``bias``,
        ``qkv_bias`` and ``out_bias`` given a non-bool raise ``TypeError``.
    kdim, vdim : int, optional
        Feature sizes of the ``key`` and ``value`` inputs (default ``E``).
    rng : numpy.random.Generator or int, optional
        Seed or Generator of the initial weights (a new unseeded Generator if None).
    dtype : float dtype
        Floating dtype of the parameters and the computation (float32 or float64).
    impl : {"auto", "reference", "fast", "tiled"}
        See :class:`SelfAttention`.
    qdim : int, optional
        Feature size of the ``query`` input (default ``E``; the book's ``d_in``).
    out_dim : int, optional
        Feature size of the output (default ``E``).
    qkv_bias, out_bias : bool, optional
        Biases of the input projections and of the output projection; None
        (default) follows ``bias``. The book's layer is ``qkv_bias=False``
        (its default) with ``out_bias=True``.
    dropout : float
        Dropout on the attention weights in training mode; see
        :class:`SelfAttention`.
    num_kv_heads : int, optional
        ``K``, a divisor of ``H`` (default ``H``): grouped-query attention
        (``K = 1``: multi-query). Keys and values are projected to ``K`` heads
        of ``D`` features, query head ``h`` using key/value head
        ``h // (H / K)`` (PyTorch's ``enable_gqa`` order), on every path.
    rope, rope_base, rope_layout : keyword-only
        ``rope=True`` rotates each head's queries and keys after the
        projections (:func:`qkvnp.functional.rope_forward`, base
        ``rope_base``, pairs by ``rope_layout``), query ``i`` at position
        ``i`` (``i + S - T`` bottom-right), key ``j`` at ``j``. With a
        ``KVCache``, keys are cached rotated and positions continue.
    position_bias : {None, "alibi", "relative"}, keyword-only
        ``"alibi"``: ALiBi's fixed bias :func:`qkvnp.ops.positions.alibi_bias`;
        ``"relative"``: T5's learned ``rel_bias`` ``(num_buckets, H)``
        (zeros), looked up by :func:`qkvnp.ops.positions.relative_position_bucket`
        (bidirectional unless the forward is causal).
    num_buckets, max_distance : int, keyword-only
        The relative bias's buckets (default 32) and the distance from which
        offsets share the last bucket (default 128, more than
        ``num_buckets // 2``); used by ``position_bias="relative"`` only.
    sinks : bool, keyword-only
        A learned logit per head in each softmax's denominator: parameter
        ``sinks`` ``(H,)``, zeros.
    softcap : float, optional, keyword-only
        Scores become ``softcap * tanh(scores / softcap)``.
    window : (left, right), optional, keyword-only
        Sliding window (:func:`qkvnp.functional.attention_forward`); a
        ``KVCache`` then keeps only the last ``left`` keys between steps.
    scale : float, optional, keyword-only
        The score scale: ``softmax(scale * q k^T)``. None (default) is
        ``1/sqrt(D)``; a positive float replaces it (T5's 1.0, Gemma's
        ``query_pre_attn_scalar ** -0.5``). It runs on the reference or
        tiled path (``last_dispatch`` says so), and with a ``KVCache``;
        ``1/sqrt(D)`` itself is the default and keeps every path.
    The variants run on the reference path (``last_dispatch`` says so);
    derivations in ``docs/derivations_variants.md``.

    Attributes
    ----------
    params : dict
        ``W_query (qdim, E)``, ``W_key (kdim, E)``, ``W_value (vdim, E)``,
        ``W_out (E, out_dim)``; with ``qkv_bias`` also ``b_query, b_key,
        b_value (E,)``, with ``out_bias`` also ``b_out (out_dim,)``.
        With ``num_kv_heads=K``, ``W_key``, ``W_value`` are ``(kdim or vdim, K*D)``
        and ``b_key``, ``b_value`` ``(K*D,)``.
        Head ``h`` uses columns ``h*D:(h+1)*D`` of the input projections and
        rows ``h*D:(h+1)*D`` of ``W_out``. PyTorch stores the transposes:
        ``W_query = in_proj_weight[:E].T``, ``W_out = out_proj.weight.T``.
    grads : dict
    last_dispatch : qkvnp.kernels.Dispatch or None
        The path the last forward ran and why (``None`` before a forward).

    Notes
    -----
    Forward: :math:`Q = X_q W_q + b_q` (likewise K, V), split into heads,
    :math:`O_h = \\mathrm{softmax}(Q_h K_h^T / \\sqrt{D} + M) V_h`, heads
    merged, :math:`Y = O W_{out} + b_{out}`. Backward runs the same ops'
    backwards in reverse order.

    The book's ``MultiHeadAttention(d_in, d_out, context_length, dropout,
    num_heads, qkv_bias)`` (chapter 3) is ``MultiHeadAttention(embed_dim=d_out,
    num_heads=num_heads, qdim=d_in, kdim=d_in, vdim=d_in, qkv_bias=qkv_bias,
    out_bias=True)`` called with ``is_causal=True``; :mod:`qkvnp.interop`
    loads its weights.

    Masks: ``attn_mask`` (bool True = may attend, or float added to the
    scores) broadcasts to ``(B, H, T, S)``; ``key_padding_mask`` is bool
    ``(B, S)`` with **True = a real token that may be attended**. PyTorch's
    ``nn.MultiheadAttention`` uses the opposite polarity for both boolean
    masks (True = ignore): pass ``~mask`` when porting code.

    Examples
    --------
    >>> mha = MultiHeadAttention(8, 2, rng=0)
    >>> mha
    MultiHeadAttention(embed_dim=8, num_heads=2, bias=True, dtype=float64, impl='auto')
    >>> x = np.ones((3, 5, 8))
    >>> mha.forward(x, is_causal=True).shape
    (3, 5, 8)
    >>> mha.backward(np.ones((3, 5, 8))).shape
    (3, 5, 8)
    >>> book = MultiHeadAttention(2, 2, qdim=3, kdim=3, vdim=3, qkv_bias=False, out_bias=True)
    >>> book.forward(np.ones((2, 6, 3)), is_causal=True).shape
    (2, 6, 2)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None,
                 rng: np.random.Generator | int | None = None, dtype: DTypeLike = np.float64,
                 impl: str = "auto", qdim: int | None = None, out_dim: int | None = None,
                 qkv_bias: bool | None = None, out_bias: bool | None = None, dropout: float = 0.0,
                 num_kv_heads: int | None = None, rope: bool = False, rope_base: float = 10000.0,
                 rope_layout: str = "half", position_bias: str | None = None,
                 num_buckets: int = 32, max_distance: int = 128, sinks: bool = False,
                 softcap: float | None = None,
                 window: tuple[int | None, int | None] | None = None,
                 scale: float | None = None) -> None:
        self.impl = kernels.check_impl(impl)
        bias = check_bool(bias, "bias")
        qkv_bias = check_bool(qkv_bias, "qkv_bias", allow_none=True)
        out_bias = check_bool(out_bias, "out_bias", allow_none=True)
        self.embed_dim = check_int(embed_dim, "embed_dim", 1)
        self.num_heads = check_int(num_heads, "num_heads", 1)
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} "
                f"and num_heads={num_heads}"
            )
        self.head_dim = self.embed_dim // self.num_heads
        self.num_kv_heads = self._check_kv_heads(num_kv_heads)
        self.kdim = self.embed_dim if kdim is None else check_int(kdim, "kdim", 1)
        self.vdim = self.embed_dim if vdim is None else check_int(vdim, "vdim", 1)
        self.qdim = self.embed_dim if qdim is None else check_int(qdim, "qdim", 1)
        self.out_dim = self.embed_dim if out_dim is None else check_int(out_dim, "out_dim", 1)
        self.dtype = layer_dtype(dtype)
        self.bias = bool(bias)
        self.qkv_bias = self.bias if qkv_bias is None else bool(qkv_bias)
        self.out_bias = self.bias if out_bias is None else bool(out_bias)
        rng = make_rng(rng)
        E = self.embed_dim
        E_kv = self.num_kv_heads * self.head_dim  # E unless grouped-query attention
        # NOTE: drawn in this order whatever the options, so that a seed gives
        # the same weights as before qdim/out_dim/num_kv_heads existed
        self.params = {
            "W_query": xavier_uniform(rng, self.qdim, E, self.dtype),
            "W_key": xavier_uniform(rng, self.kdim, E_kv, self.dtype),
            "W_value": xavier_uniform(rng, self.vdim, E_kv, self.dtype),
            "W_out": xavier_uniform(rng, E, self.out_dim, self.dtype),
        }
        if self.qkv_bias:
            for name in ("b_query", "b_key", "b_value"):
                self.params[name] = np.zeros(E if name == "b_query" else E_kv, dtype=self.dtype)
        if self.out_bias:
            self.params["b_out"] = np.zeros(self.out_dim, dtype=self.dtype)
        self._init_variants(self.num_heads, self.head_dim, rope=rope, rope_base=rope_base,
                            rope_layout=rope_layout, position_bias=position_bias,
                            num_buckets=num_buckets, max_distance=max_distance, sinks=sinks,
                            softcap=softcap, window=window, scale=scale)
        self._init_dropout(dropout, rng)
        self._cache = None
        self.zero_grad()

    _repr_fields = ("embed_dim", "num_heads", "bias", "kdim", "vdim", "dtype", "impl",
                    "qdim", "out_dim", "qkv_bias", "out_bias", "dropout", "num_kv_heads")

    def _repr_items(self):
        """Widths only where they differ from embed_dim (as PyTorch prints), biases from bias."""
        defaults = {"kdim": self.embed_dim, "vdim": self.embed_dim, "qdim": self.embed_dim,
                    "out_dim": self.embed_dim, "qkv_bias": self.bias, "out_bias": self.bias,
                    "num_kv_heads": self.num_heads}
        return [(name, value) for name, value in super()._repr_items()
                if name not in defaults or value != defaults[name]]

    def _check_kv_heads(self, num_kv_heads):
        """``num_kv_heads`` (default ``num_heads``), a positive divisor of ``num_heads``."""
        if num_kv_heads is None:
            return self.num_heads
        num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1,
                                 expected=f"a positive divisor of num_heads={self.num_heads}")
        if self.num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must be a positive divisor of num_heads="
                             f"{self.num_heads}, got {num_kv_heads}")
        return num_kv_heads

    def _check_tokens(self, query):
        """The new tokens of a decoding step, checked and cast as a self-attention input."""
        return self._check_inputs(query, None, None)[0]

    def _check_inputs(self, query, key, value):
        self_attention = key is None and value is None
        if key is None and value is not None:
            raise ValueError("key must be given when value is given (value defaults to key)")
        query = as_float_array(query, "query", self.dtype)
        check_ndim(query, "query", 2, f"(..., T, {self.qdim})")
        check_last_dim(query, "query", self.qdim, f"(..., T, {self.qdim})")
        if self_attention:
            if not self.qdim == self.kdim == self.vdim:
                raise ValueError(
                    f"self-attention (key=None) needs qdim == kdim == vdim, got qdim="
                    f"{self.qdim}, kdim={self.kdim}, vdim={self.vdim}; pass key and value "
                    "for a layer built with other widths"
                )
            return query, query, query, "self"
        value_omitted = value is None
        key = as_float_array(key, "key", self.dtype)
        value = key if value_omitted else as_float_array(value, "value", self.dtype)
        check_ndim(key, "key", 2, f"(..., S, {self.kdim})")
        check_last_dim(key, "key", self.kdim, f"(..., S, {self.kdim})")
        check_last_dim(value, "value", self.vdim, f"(..., S, {self.vdim})")
        if value.shape[:-1] != key.shape[:-1]:
            raise ValueError(
                f"value must have shape {key.shape[:-1] + (self.vdim,)} to match key "
                f"{key.shape}, got shape {value.shape}"
            )
        if key.shape[:-2] != query.shape[:-2]:
            raise ValueError(
                f"key must have the batch dims of query {query.shape[:-2]}, "
                f"got shape {key.shape}"
            )
        return query, key, value, "key_only" if value_omitted else "cross"

    def forward(self, query: FloatArray, key: FloatArray | None = None,
                value: FloatArray | None = None, attn_mask: BoolArray | FloatArray | None = None,
                is_causal: bool | str = False, key_padding_mask: BoolArray | float | None = None,
                return_weights: bool = False, *, dropout_mask: BoolArray | None = None,
                rng: np.random.Generator | int | None = None, kv_cache: KVCache | None = None,
                average_weights: bool = False) -> FloatArray | tuple[FloatArray, FloatArray]:
        """Multi-head attention of ``query`` over ``key``/``value``.

        Parameters
        ----------
        query : ndarray, shape (..., T, qdim)
            Like ``key`` and ``value``, cast to the layer's dtype (ints and
            float128 included).
        key : ndarray, shape (..., S, kdim), optional
            Omitted: self-attention (``key = value = query``).
        value : ndarray, shape (..., S, vdim), optional
            Omitted with ``key`` given: ``value = key``.
        attn_mask : ndarray of bool or float, optional
            ``(T, S)``, ``(..., H or 1, T, S)``, or ``(B*H, T, S)`` as
            PyTorch's 3-D masks (batch ``b``, head ``h`` at ``b*H + h``); bool
            True = may attend. A 3-D mask is read as ``(B*H, T, S)`` when the
            batch has one dim ``(B,)``: its first dim must then be ``B*H``
            (with ``H = 1`` or ``B = 1`` that is also a per-batch or per-head
            mask, the same thing); a ``(B, T, S)`` mask for every head is
            refused as ambiguous: pass ``mask[:, None]``.
        is_causal : bool or "bottom_right"
            True: top-left aligned (query ``i`` sees keys ``0..i``);
            ``"bottom_right"``: keys ``0..i + S - T`` (PyTorch's ``causal_lower_right``).
        key_padding_mask : ndarray of bool or float, shape (..., S), optional
            Bool: **True = real token** (may be attended), the opposite of
            PyTorch's bool ``key_padding_mask`` (True = pad): pass ``~mask``
            when porting. Float: added to the scores (``0`` keeps a key,
            ``-inf`` removes it), the same as PyTorch's float masks.
        return_weights : bool
            Also return the per-head weights ``(..., H, T, S)``.
        dropout_mask : ndarray of bool, optional
            Broadcastable to ``(..., H, T, S)``, True = keep; applied in
            either mode (see :class:`SelfAttention`).
        rng : numpy.random.Generator or int, optional
            Draws this forward's mask instead of ``dropout_rng``.
        kv_cache : qkvnp.KVCache, keyword-only, optional
            Incremental decoding (self-attention only, inference only):
            ``query`` holds the ``T`` new tokens; their keys and values are
            appended to the cache and they attend to every cached token,
            causally with the bottom-right alignment, whatever ``is_causal``
            says (decoding is causal); masks cover all ``S`` cached keys. No
            dropout, even in training mode; a later ``backward`` raises
            ``RuntimeError``.
        average_weights : bool, keyword-only
            With ``return_weights``, return the weights averaged over the
            heads, ``(..., T, S)`` (PyTorch's ``average_attn_weights``, whose
            default is True; here False).

        Returns
        -------
        out : ndarray, shape (..., T, out_dim)
        weights : ndarray, shape (..., H, T, S), or (..., T, S) averaged
            Only with ``return_weights=True``; after dropout, as PyTorch's.

        Raises
        ------
        TypeError
            If an input does not hold real numbers, or a mask has the wrong dtype.
        ValueError
            On a shape mismatch, or NaN or inf in an input; with ``kv_cache``,
            on a cache of another layer or shape (``kv_cache.reset()``).
        """
        query_in, key_in, value_in = query, key, value
        if kv_cache is not None:
            return self._decode_tokens(query, key, value, attn_mask, is_causal, key_padding_mask,
                                       return_weights, average_weights, kv_cache, dropout_mask)
        query, key, value, kind = self._check_inputs(query, key, value)
        batch, T, S = query.shape[:-2], query.shape[-2], key.shape[-2]
        mask = fold_key_padding_mask(attn_mask, key_padding_mask, batch, self.num_heads, T, S,
                                     self.dtype)
        inputs = {"self": (query,), "key_only": (query, key), "cross": (query, key, value)}[kind]
        out, weights = self._kernel_forward(inputs, kind, self.num_heads, mask, is_causal,
                                            return_weights, out_proj=True,
                                            originals=(query_in, key_in, value_in),
                                            dropout=self._dropout_args(dropout_mask, rng))
        return _returned(out, weights, return_weights, average_weights)

    def _decode_tokens(self, query, key, value, attn_mask, is_causal, key_padding_mask,
                       return_weights, average_weights, kv_cache, dropout_mask):
        """``forward(query, kv_cache=...)``: the new tokens as ``query`` alone, then ``_decode``."""
        if key is not None or value is not None:
            raise ValueError("kv_cache is for self-attention decoding: pass the new tokens as "
                             "query only (key and value come from the cache)")
        out, weights = self._decode(query, attn_mask, is_causal, key_padding_mask, return_weights,
                                    kv_cache, dropout_mask)
        return _returned(out, weights, return_weights, average_weights)

    def backward(self, dout: FloatArray, retain_cache: bool = False) -> FloatArray:
        """Accumulate parameter gradients into ``grads``; return input gradients.

        Parameters
        ----------
        dout : ndarray, shape (..., T, out_dim)
            Same shape as the forward output (not broadcast); cast to the
            layer's dtype.
        retain_cache : bool
            Keep the cache for one more backward (PyTorch's ``retain_graph``).

        Returns
        -------
        dx : ndarray, shape (..., T, qdim)
            For self-attention (the input fed query, key and value: their sum).
        (dquery, dkey, dvalue) : tuple
            For cross-attention. When ``value`` was omitted (``value = key``),
            ``dkey`` is the key input's total gradient and ``dvalue`` is None.

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf.
        RuntimeError
            Without a forward cache to use (see :class:`~qkvnp.layers.Layer`), or after a
            ``kv_cache`` decoding step (inference only).
        """
        cache = self._need_cache()
        kind = cache.kind
        dinputs = self._kernel_backward(dout, retain_cache, cache)
        if kind == "self":
            return dinputs[0]  # the input fed query, key and value: their sum
        if kind == "key_only":
            return dinputs + (None,)  # (dquery, dkey): key fed both key and value
        return dinputs


def _returned(out, weights, return_weights, average_weights):
    """``out``, or ``(out, weights)`` with the weights averaged over heads if asked."""
    if not return_weights:
        return out
    if average_weights:
        weights = weights.mean(axis=-3)  # (..., H, T, S) -> (..., T, S)
    return out, weights
