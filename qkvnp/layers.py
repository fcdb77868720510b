"""Layers built from the ops of :mod:`qkvnp.functional`.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D = E // H head dim. Leading dims are optional: ``(T, E)`` works like
``(B, T, E)``.

A layer holds ``params`` and ``grads`` (dicts with the same keys and shapes),
``forward`` keeps the caches its ``backward`` reads, and ``backward``
*accumulates* into ``grads`` (like autograd engines' ``+=``) and returns the
gradient of its inputs. ``zero_grad()`` resets the gradients.

dtypes: a layer computes in its ``dtype``. ``forward`` casts its real inputs
to it (ints, bools, float16/32/64 and float128 alike, silently: a float128
input loses its extra precision; Embedding's indices stay integers), and
``backward`` casts ``dout`` the same way. Both refuse non-real arrays
(``TypeError``) and NaN or inf (``ValueError``), naming the argument; a value
that only becomes inf in the cast (float64 1e300 into float32) is refused too.
``backward`` checks ``dout`` once (exact shape, no broadcasting); the ops it
then calls do not check the intermediate gradients again.
"""
from collections import namedtuple

import numpy as np

from . import functional as F
from ._checks import (as_float_array, as_upstream_grad, check_int, check_last_dim, check_ndim,
                      compute_dtype, make_rng)

__all__ = ["Layer", "SelfAttention", "MultiHeadAttention", "xavier_uniform",
           "Linear", "Embedding", "embedding_forward", "embedding_backward", "EmbeddingCache"]


def xavier_uniform(rng, fan_in, fan_out, dtype):
    """Glorot/Xavier uniform ``(fan_in, fan_out)``: U(-a, a), a = sqrt(6/(fan_in+fan_out))."""
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(dtype)


IMPLS = ("auto", "reference", "fast", "tiled")

#: ``impl="auto"`` switches from the dense fast path (:mod:`qkvnp.fast`) to
#: the tiled path (:mod:`qkvnp.tiled`) when the key length reaches this many
#: positions. Measured (MultiHeadAttention E=256, H=4, B=1, forward+backward,
#: one core, CPU time, tiled / fast): L=1024 1.29 (f32) 1.22 (f64), L=2048
#: 1.23 / 1.11, L=4096 1.10 / 0.94: from 4096 on the two cost about the same
#: and tiled needs memory linear in L instead of the ``H L^2`` dense weights.
TILED_MIN_LENGTH = 4096
#: ... or when the dense ``(..., H, T, S)`` softmax matrix the fast path keeps
#: for the backward would take more than this many bytes.
DENSE_WEIGHTS_BUDGET = 256 << 20


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _fast():
    """:mod:`qkvnp.fast`, imported on first use (``import qkvnp`` stays light)."""
    from . import fast

    return fast


def _fast_cache(cache):
    """``cache`` if it is a fast-path cache (whose buffers a new forward may reuse)."""
    return cache if isinstance(cache, _fast().FastLayerCache) else None


def _resolve_impl(impl, groups, T, S, dtype, return_weights):
    """The code path one forward takes: ``impl``, with ``"auto"`` decided here.

    ``"auto"`` is the fast dense path, or the tiled path from
    :data:`TILED_MIN_LENGTH` keys on or when the dense weights of ``groups``
    (batch x heads) ``(T, S)`` matrices exceed :data:`DENSE_WEIGHTS_BUDGET`;
    ``return_weights=True`` keeps the dense path (the tiled path never builds
    the weights; asked for explicitly, it falls back to the fast dense core).
    """
    if impl != "auto":
        return impl
    dense_bytes = groups * T * S * np.dtype(dtype).itemsize
    if not return_weights and (S >= TILED_MIN_LENGTH or dense_bytes > DENSE_WEIGHTS_BUDGET):
        return "tiled"
    return "fast"


def _layer_dtype(dtype):
    try:
        requested = np.dtype(dtype)
    except TypeError:
        requested = None
    if requested is None or requested.kind != "f" or requested.itemsize > 8:
        raise TypeError(f"dtype must be float16, float32 or float64, got {dtype!r}")
    return compute_dtype(requested, names=("dtype",))


class Layer:
    """Base class: ``params``/``grads`` dicts, ``zero_grad``, parameter count.

    Subclasses fill ``self.params`` in ``__init__`` and call
    ``self.zero_grad()``; ``backward`` adds into ``self.grads``.
    """

    params: dict
    grads: dict

    def zero_grad(self):
        """Reset every gradient to zeros of its parameter's shape and dtype."""
        self.grads = {name: np.zeros_like(p) for name, p in self.params.items()}

    def num_parameters(self):
        """Total number of scalar parameters."""
        return sum(p.size for p in self.params.values())

    def _accumulate(self, name, grad):
        if grad is not None:
            self.grads[name] += grad

    def _forward_fast(self, inputs, kind, num_heads, mask, is_causal, impl, return_weights,
                      out_proj):
        """Forward on :func:`qkvnp.fast.mha_forward`, reusing the previous cache's buffers."""
        previous, self._cache = self._cache, None  # its buffers get overwritten
        try:
            out, weights, self._cache = _fast().mha_forward(
                self.params, inputs, kind, num_heads, mask, is_causal, core=impl,
                need_weights=return_weights, out_proj=out_proj, workspace=_fast_cache(previous))
        except (ValueError, TypeError):
            self._cache = previous  # refused before any buffer was written
            raise
        return out, weights

    def _accumulate_fast(self, grads):
        """Accumulate the fast path's gradients (only those of existing params)."""
        for name, grad in grads.items():
            if name in self.params:
                self._accumulate(name, grad)

    def _need_cache(self):
        if getattr(self, "_cache", None) is None:
            raise ValueError(
                f"{type(self).__name__}.backward called before forward: call "
                "forward(...) first, then backward(dout)"
            )
        return self._cache

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class SelfAttention(Layer):
    """Single-head self-attention with trainable query, key and value projections.

    Parameters
    ----------
    d_in : int
        Embedding size of the input tokens.
    d_out : int
        Size of queries, keys, values and of the output.
    qkv_bias : bool
        Add ``b_query``, ``b_key``, ``b_value`` of shape ``(d_out,)``.
    rng : numpy.random.Generator or int, optional
        Source of the Xavier-uniform initial weights.
    dtype : float dtype
        float32 or float64 (float16 is computed in float32).
    impl : {"auto", "reference", "fast", "tiled"}
        Which code path computes attention: ``"reference"`` (the readable
        oracle of :mod:`qkvnp.functional`, below), ``"fast"`` (:mod:`qkvnp.fast`:
        fused projection, in-place softmax, threads), ``"tiled"``
        (:mod:`qkvnp.tiled` core: memory linear in the length) or ``"auto"``
        (the default: fast, or tiled for long sequences; see
        :func:`_resolve_impl`). All give the same results up to rounding.

    Attributes
    ----------
    params : dict
        ``W_query, W_key, W_value``: ``(d_in, d_out)`` (the seeds' ``x @ W``),
        plus ``b_query, b_key, b_value``: ``(d_out,)`` with ``qkv_bias``.
    grads : dict
        Same keys and shapes as ``params``.

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

    def __init__(self, d_in, d_out, qkv_bias=False, rng=None, dtype=np.float64, impl="auto"):
        self.impl = _check_impl(impl)
        self.d_in = check_int(d_in, "d_in", 1)
        self.d_out = check_int(d_out, "d_out", 1)
        self.dtype = _layer_dtype(dtype)
        rng = make_rng(rng)
        self.params = {
            name: xavier_uniform(rng, self.d_in, self.d_out, self.dtype)
            for name in ("W_query", "W_key", "W_value")
        }
        if qkv_bias:
            for name in ("b_query", "b_key", "b_value"):
                self.params[name] = np.zeros(self.d_out, dtype=self.dtype)
        self.qkv_bias = bool(qkv_bias)
        self._cache = None
        self.zero_grad()

    def forward(self, x, attn_mask=None, is_causal=False, return_weights=False):
        """Attend over the tokens of ``x``.

        Parameters
        ----------
        x : ndarray, shape (..., T, d_in)
            Cast to the layer's dtype (ints and float128 included).
        attn_mask : ndarray of bool or float, optional
            Broadcastable to ``(..., T, T)``; bool True = may attend.
        is_causal : bool
        return_weights : bool

        Returns
        -------
        out : ndarray, shape (..., T, d_out)
        weights : ndarray, shape (..., T, T)
            Only with ``return_weights=True``.

        Raises
        ------
        TypeError
            If ``x`` does not hold real numbers, or the mask is neither bool
            nor float.
        ValueError
            On a shape mismatch, or NaN or inf in ``x``.
        """
        x = as_float_array(x, "x", self.dtype)
        check_ndim(x, "x", 2, f"(..., T, {self.d_in})")
        check_last_dim(x, "x", self.d_in, f"(..., T, {self.d_in})")
        T = x.shape[-2]
        impl = _resolve_impl(self.impl, int(np.prod(x.shape[:-2])), T, T, self.dtype, return_weights)
        if impl != "reference":
            out, weights = self._forward_fast(
                (x,), "self", 1, attn_mask, is_causal, impl, return_weights, out_proj=False)
            return (out, weights) if return_weights else out
        p = self.params
        query, query_cache = F.linear_forward(x, p["W_query"], p.get("b_query"))  # (..., T, d_in) -> (..., T, d_out)
        key, key_cache = F.linear_forward(x, p["W_key"], p.get("b_key"))  # (..., T, d_in) -> (..., T, d_out)
        value, value_cache = F.linear_forward(x, p["W_value"], p.get("b_value"))  # (..., T, d_in) -> (..., T, d_out)
        out, attention_cache = F.attention_forward(query, key, value, attn_mask, is_causal)  # -> (..., T, d_out)
        self._cache = (query_cache, key_cache, value_cache, attention_cache, out.shape)
        return (out, attention_cache.weights) if return_weights else out

    def backward(self, dout):
        """Accumulate parameter gradients into ``grads`` and return ``dx``.

        Parameters
        ----------
        dout : ndarray, shape (..., T, d_out)
            Same shape as the forward output (not broadcast); cast to the
            layer's dtype.

        Returns
        -------
        dx : ndarray, shape (..., T, d_in)

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf, or backward is
            called before forward.
        """
        if _fast_cache(self._need_cache()) is not None:
            grads, (dx,) = _fast().mha_backward(dout, self._cache)  # checks dout
            self._accumulate_fast(grads)
            return dx
        query_cache, key_cache, value_cache, attention_cache, out_shape = self._need_cache()
        dout = as_upstream_grad(dout, "dout", out_shape, attention_cache.weights.dtype)
        # reverse order of forward, one line for one line (F._*: dout is checked)
        dquery, dkey, dvalue = F._attention_backward(dout, attention_cache)
        dx_value, dW_value, db_value = F._linear_backward(dvalue, value_cache)
        dx_key, dW_key, db_key = F._linear_backward(dkey, key_cache)
        # NOTE: db_key is 0 in exact arithmetic (q . b_key is the same for every
        # key of a query's row, and softmax ignores a constant added to a row);
        # computed, it is round-off, ~1e-16 of the other gradients. Not forced to 0,
        # so that a gradient check still sees what the backward really computes.
        dx_query, dW_query, db_query = F._linear_backward(dquery, query_cache)
        for name, grad in (("W_query", dW_query), ("W_key", dW_key), ("W_value", dW_value),
                           ("b_query", db_query), ("b_key", db_key), ("b_value", db_value)):
            self._accumulate(name, grad)
        return dx_query + dx_key + dx_value  # x feeds q, k and v


class MultiHeadAttention(Layer):
    """Multi-head attention with output projection (BERT, PyTorch, ``fc_out``).

    Parameters
    ----------
    embed_dim : int
        ``E``, the model size; queries, keys, values and output have ``E`` features.
    num_heads : int
        ``H``, must divide ``E``; each head has ``D = E // H`` features.
    bias : bool
        Add ``b_query, b_key, b_value, b_out`` of shape ``(E,)``.
    kdim, vdim : int, optional
        Feature sizes of the ``key`` and ``value`` inputs (default ``E``).
    rng : numpy.random.Generator or int, optional
    dtype : float dtype
    impl : {"auto", "reference", "fast", "tiled"}
        See :class:`SelfAttention`.

    Attributes
    ----------
    params : dict
        ``W_query (E, E)``, ``W_key (kdim, E)``, ``W_value (vdim, E)``,
        ``W_out (E, E)``; with ``bias`` also ``b_query, b_key, b_value, b_out (E,)``.
        Head ``h`` uses columns ``h*D:(h+1)*D`` of the input projections and
        rows ``h*D:(h+1)*D`` of ``W_out``. PyTorch stores the transposes:
        ``W_query = in_proj_weight[:E].T``, ``W_out = out_proj.weight.T``.
    grads : dict

    Notes
    -----
    Forward: :math:`Q = X_q W_q + b_q` (likewise K, V), split into heads,
    :math:`O_h = \\mathrm{softmax}(Q_h K_h^T / \\sqrt{D} + M) V_h`, heads
    merged, :math:`Y = O W_{out} + b_{out}`. Backward runs the same ops'
    backwards in reverse order.

    Masks: ``attn_mask`` (bool True = may attend, or float added to the
    scores) broadcasts to ``(B, H, T, S)``; ``key_padding_mask`` is bool
    ``(B, S)`` with **True = a real token that may be attended**. PyTorch's
    ``nn.MultiheadAttention`` uses the opposite polarity for both boolean
    masks (True = ignore): pass ``~mask`` when porting code.

    Examples
    --------
    >>> mha = MultiHeadAttention(8, 2, rng=0)
    >>> x = np.ones((3, 5, 8))
    >>> mha.forward(x, is_causal=True).shape
    (3, 5, 8)
    >>> mha.backward(np.ones((3, 5, 8))).shape
    (3, 5, 8)
    """

    def __init__(self, embed_dim, num_heads, bias=True, kdim=None, vdim=None, rng=None,
                 dtype=np.float64, impl="auto"):
        self.impl = _check_impl(impl)
        self.embed_dim = check_int(embed_dim, "embed_dim", 1)
        self.num_heads = check_int(num_heads, "num_heads", 1)
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} "
                f"and num_heads={num_heads}"
            )
        self.head_dim = self.embed_dim // self.num_heads
        self.kdim = self.embed_dim if kdim is None else check_int(kdim, "kdim", 1)
        self.vdim = self.embed_dim if vdim is None else check_int(vdim, "vdim", 1)
        self.dtype = _layer_dtype(dtype)
        self.bias = bool(bias)
        rng = make_rng(rng)
        E = self.embed_dim
        self.params = {
            "W_query": xavier_uniform(rng, E, E, self.dtype),
            "W_key": xavier_uniform(rng, self.kdim, E, self.dtype),
            "W_value": xavier_uniform(rng, self.vdim, E, self.dtype),
            "W_out": xavier_uniform(rng, E, E, self.dtype),
        }
        if self.bias:
            for name in ("b_query", "b_key", "b_value", "b_out"):
                self.params[name] = np.zeros(E, dtype=self.dtype)
        self._cache = None
        self.zero_grad()

    # -- input checks -------------------------------------------------------

    def _check_inputs(self, query, key, value):
        self_attention = key is None and value is None
        if key is None and value is not None:
            raise ValueError("key must be given when value is given (value defaults to key)")
        query = as_float_array(query, "query", self.dtype)
        check_ndim(query, "query", 2, f"(..., T, {self.embed_dim})")
        check_last_dim(query, "query", self.embed_dim, f"(..., T, {self.embed_dim})")
        if self_attention:
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(
                    "self-attention (key=None) needs kdim == vdim == embed_dim; pass key "
                    "and value for a layer built with other kdim/vdim"
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

    def _combine_masks(self, attn_mask, key_padding_mask, batch, T, S):
        """Fold ``key_padding_mask`` into ``attn_mask``; check the mask's rank."""
        scores_shape = batch + (self.num_heads, T, S)
        if attn_mask is not None:
            attn_mask = np.asarray(attn_mask)
            if attn_mask.ndim not in (2, len(scores_shape)):
                raise ValueError(
                    f"attn_mask must have shape (T, S) = {(T, S)} or "
                    f"{batch + ('H or 1', T, S)}, got shape {attn_mask.shape}"
                )
        if key_padding_mask is None:
            return attn_mask
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.dtype != np.bool_:
            raise TypeError(
                "key_padding_mask must be bool (True = real token that may be attended), "
                f"got dtype {key_padding_mask.dtype}"
            )
        if key_padding_mask.shape != batch + (S,):
            raise ValueError(
                f"key_padding_mask must have shape {batch + (S,)} (batch, S), "
                f"got shape {key_padding_mask.shape}"
            )
        padding = key_padding_mask.reshape(batch + (1, 1, S))  # (B, S) -> (B, 1, 1, S)
        if attn_mask is None or attn_mask.dtype == np.bool_:
            return padding if attn_mask is None else attn_mask & padding
        if attn_mask.dtype.kind != "f":
            return attn_mask  # let prepare_mask raise its TypeError
        # a float mask is added, then the boolean padding removes keys: -inf does both
        return np.where(padding, attn_mask.astype(self.dtype, copy=False), -np.inf)

    # -- forward / backward ---------------------------------------------------

    def forward(self, query, key=None, value=None, attn_mask=None, is_causal=False,
                key_padding_mask=None, return_weights=False):
        """Multi-head attention of ``query`` over ``key``/``value``.

        Parameters
        ----------
        query : ndarray, shape (..., T, E)
            Like ``key`` and ``value``, cast to the layer's dtype (ints and
            float128 included).
        key : ndarray, shape (..., S, kdim), optional
            Omitted: self-attention (``key = value = query``).
        value : ndarray, shape (..., S, vdim), optional
            Omitted with ``key`` given: ``value = key``.
        attn_mask : ndarray of bool or float, optional
            ``(T, S)`` or ``(..., H or 1, T, S)``; bool True = may attend.
        is_causal : bool
        key_padding_mask : ndarray of bool, shape (..., S), optional
            True = real token (may be attended). Opposite of PyTorch.
        return_weights : bool
            Also return the per-head weights ``(..., H, T, S)``.

        Returns
        -------
        out : ndarray, shape (..., T, E)
        weights : ndarray, shape (..., H, T, S)
            Only with ``return_weights=True``.

        Raises
        ------
        TypeError
            If an input does not hold real numbers, or a mask has the wrong dtype.
        ValueError
            On a shape mismatch, or NaN or inf in an input.
        """
        query, key, value, kind = self._check_inputs(query, key, value)
        batch, T, S = query.shape[:-2], query.shape[-2], key.shape[-2]
        mask = self._combine_masks(attn_mask, key_padding_mask, batch, T, S)
        p, H = self.params, self.num_heads
        impl = _resolve_impl(self.impl, int(np.prod(batch)) * H, T, S, self.dtype, return_weights)
        if impl != "reference":
            inputs = {"self": (query,), "key_only": (query, key), "cross": (query, key, value)}[kind]
            out, weights = self._forward_fast(
                inputs, kind, H, mask, is_causal, impl, return_weights, out_proj=True)
            return (out, weights) if return_weights else out
        q, q_cache = F.linear_forward(query, p["W_query"], p.get("b_query"))  # (..., T, E) -> (..., T, E)
        k, k_cache = F.linear_forward(key, p["W_key"], p.get("b_key"))  # (..., S, kdim) -> (..., S, E)
        v, v_cache = F.linear_forward(value, p["W_value"], p.get("b_value"))  # (..., S, vdim) -> (..., S, E)
        q_heads, q_split = F.split_heads_forward(q, H)  # (..., T, E) -> (..., H, T, D)
        k_heads, k_split = F.split_heads_forward(k, H)  # (..., S, E) -> (..., H, S, D)
        v_heads, v_split = F.split_heads_forward(v, H)  # (..., S, E) -> (..., H, S, D)
        # NOTE: the scale is 1/sqrt(head_dim). The seeds' tutorial divides by
        # sqrt(embed_size), a known bug that over-smooths the softmax.
        heads, attention_cache = F.attention_forward(q_heads, k_heads, v_heads, mask, is_causal)  # -> (..., H, T, D)
        merged, merge_cache = F.merge_heads_forward(heads)  # (..., H, T, D) -> (..., T, E)
        out, out_cache = F.linear_forward(merged, p["W_out"], p.get("b_out"))  # (..., T, E) -> (..., T, E)
        self._cache = (kind, q_cache, k_cache, v_cache, q_split, k_split, v_split,
                       attention_cache, merge_cache, out_cache, out.shape)
        return (out, attention_cache.weights) if return_weights else out

    def backward(self, dout):
        """Accumulate parameter gradients into ``grads``; return input gradients.

        Parameters
        ----------
        dout : ndarray, shape (..., T, E)
            Same shape as the forward output (not broadcast); cast to the
            layer's dtype.

        Returns
        -------
        dx : ndarray, shape (..., T, E)
            For self-attention (the input fed query, key and value: their sum).
        (dquery, dkey, dvalue) : tuple
            For cross-attention. When ``value`` was omitted (``value = key``),
            ``dkey`` is the key input's total gradient and ``dvalue`` is None.

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf, or backward is
            called before forward.
        """
        if _fast_cache(self._need_cache()) is not None:
            grads, dinputs = _fast().mha_backward(dout, self._cache)  # checks dout
            self._accumulate_fast(grads)
            kind = self._cache.kind
            return dinputs[0] if kind == "self" else dinputs + (None,) * (kind == "key_only")
        (kind, q_cache, k_cache, v_cache, q_split, k_split, v_split,
         attention_cache, merge_cache, out_cache, out_shape) = self._need_cache()
        dout = as_upstream_grad(dout, "dout", out_shape, out_cache.W.dtype)
        # reverse order of forward, one line for one line (F._*: dout is checked)
        dmerged, dW_out, db_out = F._linear_backward(dout, out_cache)
        dheads = F._merge_heads_backward(dmerged, merge_cache)
        dq_heads, dk_heads, dv_heads = F._attention_backward(dheads, attention_cache)
        dv = F._split_heads_backward(dv_heads, v_split)
        dk = F._split_heads_backward(dk_heads, k_split)
        dq = F._split_heads_backward(dq_heads, q_split)
        dvalue, dW_value, db_value = F._linear_backward(dv, v_cache)
        dkey, dW_key, db_key = F._linear_backward(dk, k_cache)
        # NOTE: db_key is round-off around an exact 0, see SelfAttention.backward
        dquery, dW_query, db_query = F._linear_backward(dq, q_cache)
        for name, grad in (("W_query", dW_query), ("W_key", dW_key), ("W_value", dW_value),
                           ("W_out", dW_out), ("b_query", db_query), ("b_key", db_key),
                           ("b_value", db_value), ("b_out", db_out)):
            self._accumulate(name, grad)
        if kind == "self":
            return dquery + dkey + dvalue  # x feeds query, key and value
        if kind == "key_only":
            return dquery, dkey + dvalue, None  # key fed both key and value
        return dquery, dkey, dvalue


# ---------------------------------------------------------------- small layers


class Linear(Layer):
    """Affine layer ``y = x @ W + b`` over the last axis (``fc``, ``nn.Linear``).

    Parameters
    ----------
    in_features : int
        ``N``, size of each input vector.
    out_features : int
        ``M``, size of each output vector.
    bias : bool
        Add ``b`` of shape ``(M,)``.
    rng : numpy.random.Generator or int, optional
        Source of the initial weights.
    dtype : float dtype
        float32 or float64 (float16 is computed in float32).

    Attributes
    ----------
    params : dict
        ``W (N, M)`` (the seeds' ``x @ W`` convention; PyTorch's
        ``nn.Linear.weight`` is ``W.T``) and, with ``bias``, ``b (M,)``.
    grads : dict
        Same keys and shapes as ``params``.

    Notes
    -----
    Forward: :math:`Y = XW + b` (:func:`qkvnp.functional.linear_forward`).
    Backward, leading dims of :math:`X` flattened into rows:
    :math:`\\bar X = \\bar Y W^T`, :math:`\\bar W = X^T \\bar Y`,
    :math:`\\bar b = \\sum_{rows} \\bar Y`.

    Initialisation as PyTorch's ``nn.Linear``: ``W`` and ``b`` uniform in
    :math:`[-1/\\sqrt{N}, 1/\\sqrt{N}]`.

    Examples
    --------
    >>> layer = Linear(3, 2, rng=0)
    >>> layer.forward(np.ones((4, 5, 3))).shape
    (4, 5, 2)
    >>> layer.backward(np.ones((4, 5, 2))).shape
    (4, 5, 3)
    >>> layer.grads["b"]
    array([20., 20.])
    """

    def __init__(self, in_features, out_features, bias=True, rng=None, dtype=np.float64):
        self.in_features = check_int(in_features, "in_features", 1)
        self.out_features = check_int(out_features, "out_features", 1)
        self.dtype = _layer_dtype(dtype)
        self.bias = bool(bias)
        rng = make_rng(rng)
        bound = 1.0 / np.sqrt(self.in_features)
        self.params = {
            "W": rng.uniform(-bound, bound, size=(self.in_features, self.out_features)).astype(self.dtype),
        }
        if self.bias:
            self.params["b"] = rng.uniform(-bound, bound, size=self.out_features).astype(self.dtype)
        self._cache = None
        self.zero_grad()

    def forward(self, x):
        """Apply the affine map to the last axis of ``x``.

        Parameters
        ----------
        x : ndarray, shape (..., in_features)
            Cast to the layer's dtype (ints and float128 included).

        Returns
        -------
        out : ndarray, shape (..., out_features)

        Raises
        ------
        TypeError
            If ``x`` does not hold real numbers.
        ValueError
            On a shape mismatch, or NaN or inf in ``x``.
        """
        x = as_float_array(x, "x", self.dtype)
        check_ndim(x, "x", 1, f"(..., {self.in_features})")
        check_last_dim(x, "x", self.in_features, f"(..., {self.in_features})")
        out, linear_cache = F.linear_forward(x, self.params["W"], self.params.get("b"))  # (..., N) -> (..., M)
        self._cache = (linear_cache, out.shape)
        return out

    def backward(self, dout):
        """Accumulate ``dW`` (and ``db``) into ``grads``; return ``dx``.

        Parameters
        ----------
        dout : ndarray, shape (..., out_features)
            Same shape as the forward output (not broadcast); cast to the
            layer's dtype.

        Returns
        -------
        dx : ndarray, shape (..., in_features)

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf, or backward is
            called before forward.
        """
        linear_cache, _ = self._need_cache()
        dx, dW, db = F.linear_backward(dout, linear_cache)  # checks dout
        self._accumulate("W", dW)
        if self.bias:
            self._accumulate("b", db)
        return dx


EmbeddingCache = namedtuple("EmbeddingCache", "indices weight_shape dtype")


def _check_indices(indices, num_embeddings, name="indices"):
    """Integer array with every entry in ``[0, num_embeddings)``."""
    if indices is None:
        raise TypeError(f"{name} must be an integer array, got None")
    indices = np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integer token ids (e.g. int64), got dtype {indices.dtype}"
        )
    bad = (indices < 0) | (indices >= num_embeddings)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be in [0, {num_embeddings}) (num_embeddings={num_embeddings}), "
            f"got {int(indices[where])} at index {where}"
        )
    return indices


def embedding_forward(indices, weight):
    """Look up rows of ``weight``: ``out[...] = weight[indices[...]]``.

    Parameters
    ----------
    indices : ndarray of int, shape (...)
        Entries in ``[0, num)``; negative indices are refused (no wrap-around).
    weight : ndarray, shape (num, dim)

    Returns
    -------
    out : ndarray, shape (..., dim)
    cache : EmbeddingCache

    Raises
    ------
    TypeError
        If ``indices`` is not an integer array.
    ValueError
        If ``weight`` is not 2-D or an index is out of range.

    Notes
    -----
    Forward: :math:`Y_{\\dots} = W_{i_{\\dots}}` (a one-hot matrix times
    :math:`W`). Backward: :math:`\\bar W_r = \\sum_{\\dots : i_{\\dots} = r}
    \\bar Y_{\\dots}`: every occurrence of row :math:`r` adds its upstream
    gradient (``np.add.at``, which, unlike ``dW[indices] += dout``, does not
    drop repeated indices). The indices get no gradient.

    Examples
    --------
    >>> out, cache = embedding_forward(np.array([2, 0, 2]), np.arange(6.0).reshape(3, 2))
    >>> out
    array([[4., 5.],
           [0., 1.],
           [4., 5.]])
    >>> embedding_backward(np.ones((3, 2)), cache)
    array([[1., 1.],
           [0., 0.],
           [2., 2.]])
    """
    weight = as_float_array(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"weight must have shape (num, dim), got shape {weight.shape}")
    indices = _check_indices(indices, weight.shape[0])
    out = weight[indices]  # (...) -> (..., dim)
    return out, EmbeddingCache(indices, weight.shape, weight.dtype)


def embedding_backward(dout, cache):
    """Backward of :func:`embedding_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., dim)
    cache : EmbeddingCache

    Returns
    -------
    dweight : ndarray, shape (num, dim)
        Rows never looked up are 0; repeated indices add up.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
    """
    indices, weight_shape, dtype = cache
    dout = as_upstream_grad(dout, "dout", indices.shape + (weight_shape[1],), dtype)
    dweight = np.zeros(weight_shape, dtype=dtype)
    np.add.at(dweight, indices.reshape(-1), dout.reshape(-1, weight_shape[1]))  # (rows, dim) -> (num, dim)
    return dweight


class Embedding(Layer):
    """Lookup table of ``num_embeddings`` trainable vectors (``nn.Embedding``).

    Parameters
    ----------
    num_embeddings : int
        Vocabulary size (or number of positions, for learned positional embeddings).
    embedding_dim : int
        Size of each vector.
    rng : numpy.random.Generator or int, optional
    dtype : float dtype

    Attributes
    ----------
    params : dict
        ``weight (num_embeddings, embedding_dim)``, initialised N(0, 1) as
        PyTorch's ``nn.Embedding``.
    grads : dict

    Notes
    -----
    See :func:`embedding_forward`. ``backward`` returns None: integer indices
    are not differentiable.

    Examples
    --------
    >>> emb = Embedding(10, 4, rng=0)
    >>> emb.forward(np.array([[1, 2, 1]])).shape
    (1, 3, 4)
    >>> emb.backward(np.ones((1, 3, 4))) is None
    True
    >>> emb.grads["weight"][1]
    array([2., 2., 2., 2.])
    """

    def __init__(self, num_embeddings, embedding_dim, rng=None, dtype=np.float64):
        self.num_embeddings = check_int(num_embeddings, "num_embeddings", 1)
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", 1)
        self.dtype = _layer_dtype(dtype)
        rng = make_rng(rng)
        self.params = {
            "weight": rng.standard_normal((self.num_embeddings, self.embedding_dim)).astype(self.dtype),
        }
        self._cache = None
        self.zero_grad()

    def forward(self, indices):
        """Return the vectors of ``indices``.

        Parameters
        ----------
        indices : ndarray of int, shape (...)
            Entries in ``[0, num_embeddings)``.

        Returns
        -------
        out : ndarray, shape (..., embedding_dim)
        """
        out, self._cache = embedding_forward(indices, self.params["weight"])  # (...) -> (..., dim)
        return out

    def backward(self, dout):
        """Accumulate the gradient of ``weight`` into ``grads``; return None.

        Parameters
        ----------
        dout : ndarray, shape (..., embedding_dim)
            Same shape as the forward output (not broadcast); cast to the
            weight's dtype.

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf, or backward is
            called before forward.
        """
        cache = self._need_cache()
        self._accumulate("weight", embedding_backward(dout, cache))
        return None
