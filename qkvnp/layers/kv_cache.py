"""Incremental decoding: :class:`KVCache` and the cached forward of an attention layer.

Shape key: B batch (any leading dims), H query heads, K key/value heads
(``H_kv``), T new tokens, S = past + T keys, E embedding, D = E // H head dim.

``mha.forward(x_t, kv_cache=cache)`` projects the ``T`` new tokens ``x_t``,
appends their keys and values to ``cache`` and lets them attend to every
cached token with the bottom-right causal alignment (new token ``i`` sees the
past and the new tokens ``0..i``): decoding a sequence chunk by chunk gives
the outputs of one causal forward over the whole sequence. It is inference
only: the layer keeps no cache for a backward (which then raises
``RuntimeError``), as PyTorch's ``torch.no_grad()`` decoding loops.
"""
from __future__ import annotations

import weakref
from collections import namedtuple

import numpy as np

from .. import functional as F
from .transaction import journal
from ..ops.overflow import check_projection
from .. import kernels
from ..ops.masks import fold_key_padding_mask, prepare_mask

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import FloatArray

__all__ = ["KVCache", "cached_forward"]


class KVCache:
    """The keys and values of one attention layer's past tokens.

    For :class:`~qkvnp.MultiHeadAttention` and :class:`~qkvnp.SelfAttention`
    alike (``layer.forward(x_t, kv_cache=cache)``).

    Empty when built; the first ``layer.forward(x, kv_cache=cache)`` binds it
    to that layer and to the batch shape, head count, head dim and dtype of
    its keys. Later calls with another layer or another shape raise
    ``ValueError``; :meth:`reset` empties it for a new sequence (and frees
    the binding). Storage grows by doubling, so decoding ``S`` tokens one by
    one copies ``O(S)`` keys, not ``O(S^2)``.

    Attributes
    ----------
    key, value : ndarray, shape (..., K, S, D), or None when empty
        Views of the cached (projected, per key/value head) keys and values.

    Examples
    --------
    >>> import qkvnp
    >>> mha = qkvnp.MultiHeadAttention(8, 2, rng=0)
    >>> cache = qkvnp.KVCache()
    >>> x = np.random.default_rng(0).standard_normal((1, 3, 8))
    >>> steps = [mha.forward(x[:, t:t + 1], kv_cache=cache) for t in range(3)]
    >>> len(cache), bool(np.allclose(np.concatenate(steps, axis=1), mha.forward(x, is_causal=True)))
    (3, True)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every cached token and the layer it was bound to."""
        journal(self)  # inside a model's decode: put back if the call is refused
        self._layer: weakref.ref[Any] | None = None  # to the layer, once bound
        # (..., K, capacity, D) buffers; None exactly while _layer is None
        self._key: Any = None
        self._value: Any = None
        self._length = 0
        self.start = 0  # tokens dropped from the front (keep_last): the position of key 0

    def _save_state(self):
        """What the cache holds, for :mod:`qkvnp.layers.transaction`'s journal.

        NOTE: the buffers need no copy: a step writes new tokens past the
        cached ones (:meth:`stage`) or into new buffers (growing,
        :meth:`keep_last`), never over the tokens a saved state shows.
        """
        return self._layer, self._key, self._value, self._length, self.start

    def _restore_state(self, saved):
        """Put back what :meth:`_save_state` returned (a refused decoding step)."""
        self._layer, self._key, self._value, self._length, self.start = saved

    def __len__(self):
        """The number of cached tokens ``S``."""
        return self._length

    @property
    def key(self) -> FloatArray | None:
        return None if self._key is None else self._key[..., :self._length, :]

    @property
    def value(self) -> FloatArray | None:
        return None if self._value is None else self._value[..., :self._length, :]

    def __repr__(self):
        if self._key is None:
            return "KVCache(empty)"
        shape = self._key.shape[:-2] + (self._length, self._key.shape[-1])
        return f"KVCache(length={self._length}, key shape={shape}, dtype={self._key.dtype.name})"

    def check(self, layer: Any, key: FloatArray) -> None:
        """Raise ``ValueError`` unless ``key`` ``(..., K, T, D)`` of ``layer`` fits this cache."""
        if self._layer is None:
            return
        owner = self._layer()
        if owner is not layer:
            other = "a layer that no longer exists" if owner is None else repr(owner)
            raise ValueError(
                f"kv_cache holds the keys of another layer ({other}), not of {layer!r}: "
                "use one KVCache per layer, or call kv_cache.reset() to start over"
            )
        expected = self._key.shape[:-2] + (key.shape[-2], self._key.shape[-1])
        if key.shape != expected or key.dtype != self._key.dtype:
            raise ValueError(
                f"kv_cache holds {self._length} tokens of keys (batch dims, heads, D) = "
                f"{self._key.shape[:-2] + (self._key.shape[-1],)} in {self._key.dtype}; the new "
                f"tokens give {key.shape[:-2] + (key.shape[-1],)} in {key.dtype}: call "
                "kv_cache.reset() to start a new sequence"
            )

    def append(self, layer: Any, key: FloatArray,
               value: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Append the ``T`` new keys and values ``(..., K, T, D)``; return all ``S`` of each."""
        staged = self.stage(layer, key, value)
        self.commit(staged)
        return staged.keys, staged.values  # the cache's key and value, now

    def stage(self, layer: Any, key: Any, value: Any) -> Any:
        """The ``S`` keys and values with the ``T`` new ones, **without appending them**.

        They are written where no one reads: past the cached tokens of the
        storage (``key`` and ``value`` show only those), or into a grown copy.
        A decoding step stages, runs every check that can refuse it, and only
        then calls :meth:`commit`: a refused step leaves the cache as it was.

        Returns
        -------
        staged : tuple
            For :meth:`commit`; ``staged.keys`` and ``staged.values``, shape
            ``(..., K, S, D)``, are the ``S`` keys and values.
        """
        self.check(layer, key)
        T = key.shape[-2]
        key_buffer, value_buffer = self._key, self._value
        if key_buffer is None:
            key_buffer = np.empty(key.shape[:-2] + (max(T, 16), key.shape[-1]), key.dtype)
            value_buffer = np.empty(value.shape[:-2] + (max(T, 16), value.shape[-1]), value.dtype)
        elif self._length + T > key_buffer.shape[-2]:
            capacity = max(2 * key_buffer.shape[-2], self._length + T)
            key_buffer = _grown(key_buffer, self._length, capacity)
            value_buffer = _grown(value_buffer, self._length, capacity)
        length = self._length + T
        key_buffer[..., self._length:length, :] = key
        value_buffer[..., self._length:length, :] = value
        return _Staged(layer, key_buffer, value_buffer, self._length, length,
                       key_buffer[..., :length, :], value_buffer[..., :length, :])

    def commit(self, staged: Any) -> None:
        """Make the tokens :meth:`stage` wrote part of the cache."""
        if staged.start != self._length:
            raise RuntimeError("kv_cache changed between stage and commit: stage again")
        journal(self)  # inside a model's decode: put back if a later block refuses the step
        if self._key is None:
            self._layer = weakref.ref(staged.layer)
        self._key, self._value = staged.key_buffer, staged.value_buffer
        self._length = staged.length

    def keep_last(self, n: Any) -> None:
        """Keep only the last ``n`` cached tokens (a sliding window's rolling buffer).

        The dropped tokens' count adds to ``start``, so that positions (RoPE)
        continue across steps. The kept tokens move to new buffers of the same
        capacity (one copy, as a shift in place would cost): arrays that an
        earlier ``key`` or ``value`` returned keep what they showed. A window
        ``(left, 0)`` decoding token by token holds at most ``left + 1`` keys,
        in buffers that stop growing.
        """
        keep = min(max(int(n), 0), self._length)
        drop = self._length - keep
        if drop <= 0:
            return
        journal(self)
        moved = []
        for buffer in (self._key, self._value):
            fresh = np.empty_like(buffer)  # (..., K, capacity, D)
            fresh[..., :keep, :] = buffer[..., drop:self._length, :]
            moved.append(fresh)
        self._key, self._value = moved
        self._length = keep
        self.start += drop

    @property
    def nbytes(self) -> Any:
        """Bytes held by the key and value buffers (their capacity, not their length)."""
        return 0 if self._key is None else self._key.nbytes + self._value.nbytes

_Staged = namedtuple("_Staged", "layer key_buffer value_buffer start length keys values")


def _grown(buffer, length, capacity):
    """A ``(..., capacity, D)`` buffer starting with the ``length`` rows of ``buffer``."""
    grown = np.empty(buffer.shape[:-2] + (capacity, buffer.shape[-1]), buffer.dtype)
    grown[..., :length, :] = buffer[..., :length, :]
    return grown


def _project_heads(x, params, name, num_heads):
    """``x W + b`` split into heads: ``(..., T, in) -> (..., n, T, D)``."""
    y = x @ params["W_" + name]  # (..., T, in) @ (in, n*D) -> (..., T, n*D)
    if "b_" + name in params:
        y = y + params["b_" + name]
    check_projection(y, name)
    return F.split_heads_forward(y, num_heads)[0]  # (..., T, n*D) -> (..., n, T, D)


def cached_forward(layer, x, kv_cache, attn_mask, key_padding_mask, need_weights):
    """One decoding step of ``layer`` on the new tokens ``x``.

    Parameters
    ----------
    layer : MultiHeadAttention or SelfAttention
        SelfAttention: one head, no head axis in its masks and weights, no
        output projection (its cache holds keys ``(..., 1, S, D)``).
    x : ndarray, shape (..., T, E)
        The new tokens, already cast and checked by the layer.
    kv_cache : KVCache
    attn_mask : None or ndarray, as the layer's, against all ``S`` keys
    key_padding_mask : None or ndarray, shape (..., S)
        Of every cached token and the new ones (MultiHeadAttention only).
    need_weights : bool

    Returns
    -------
    out : ndarray, shape (..., T, E)
    weights : ndarray, shape (..., H, T, S) (SelfAttention: (..., T, S)), or None
    dispatch : qkvnp.kernels.Dispatch
    """
    from ..kernels import fast, tiled  # as kernels does: only when a layer runs

    params = layer.params
    one_head = "W_out" not in params  # SelfAttention
    H = 1 if one_head else layer.num_heads
    D = params["W_query"].shape[1] // H
    K = params["W_key"].shape[1] // D
    batch, T = x.shape[:-2], x.shape[-2]
    S = len(kv_cache) + T
    # every check that can refuse the call runs before the cache grows
    if one_head:
        mask = attn_mask  # broadcastable to (..., T, S), as in SelfAttention.forward
        prepare_mask(mask, False, batch + (T, S), layer.dtype)  # checked; causal: by the core
    else:
        mask = fold_key_padding_mask(attn_mask, key_padding_mask, batch, H, T, S, layer.dtype)
        prepare_mask(mask, False, batch + (H, T, S), layer.dtype)
    q = _project_heads(x, params, "query", H)  # (..., T, E) -> (..., H, T, D)
    k = _project_heads(x, params, "key", K)  # (..., T, E) -> (..., K, T, D)
    v = _project_heads(x, params, "value", K)  # (..., T, E) -> (..., K, T, D)
    # NOTE: the causal mask skips about half the blocks only when the new tokens
    # are the whole sequence (a first chunk); a step of T << S tokens skips few.
    dispatch = kernels.choose_path(layer.impl, int(np.prod(batch, dtype=np.int64)) * H, T, S,
                                   layer.dtype, need_weights, is_causal=T == S)
    dispatch = dispatch._replace(reason="kv_cache decoding step; " + dispatch.reason)
    # NOTE: staged, not appended: the core below may still refuse the step
    # (keys overflowed to inf), which must leave the cache as it was
    staged = kv_cache.stage(layer, k, v)
    keys, values = staged.keys, staged.values  # (..., K, S, D) each
    if one_head:  # SelfAttention's shapes have no head axis
        q, keys, values = q[..., 0, :, :], keys[..., 0, :, :], values[..., 0, :, :]
    core = {"reference": F, "fast": fast, "tiled": tiled}[dispatch.path]
    # NOTE: the new tokens are the last T of the S keys: bottom-right alignment.
    # The cores fall back to the reference's exact clipping themselves when
    # the scores may overflow (the layer's bound covers the new tokens only).
    inference = {"inference": True} if dispatch.path == "fast" else {}  # no copies for a backward
    heads, cache = core.attention_forward(q, keys, values, mask, "bottom_right",
                                          enable_gqa=K != H, **inference)  # -> (..., H, T, D)
    kv_cache.commit(staged)  # every check passed
    weights = None
    if need_weights:
        weights = fast.attention_weights(cache) if dispatch.path == "fast" else cache.weights
    if one_head:
        return heads, weights, dispatch  # (..., T, D): no output projection
    merged = F.merge_heads_forward(heads)[0]  # (..., H, T, D) -> (..., T, E)
    out = merged @ params["W_out"]  # (..., T, E) @ (E, E) -> (..., T, E)
    if "b_out" in params:
        out = out + params["b_out"]
    return out, weights, dispatch
