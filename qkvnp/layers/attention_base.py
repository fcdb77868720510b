"""What :class:`SelfAttention` and :class:`MultiHeadAttention` share: the path, dropout, decoding.

Shape key: B batch, H heads, T query length, S key length, E embedding.

A layer holds its parameters and asks :func:`qkvnp.layers.dispatch.layer_forward`
for a path (:func:`qkvnp.kernels.choose_path` decides, ``last_dispatch``
says which ran and why); its cache is the calling thread's (:class:`Layer`).
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from .transaction import journal_generator
from ..ops.dropout import check_dropout_p, spawn_generator
from .kv_cache import KVCache, cached_forward
from ..ops.masks import check_is_causal
from .base import Layer
from .dispatch import layer_backward, layer_forward

__all__ = ["AttentionLayer"]


class AttentionLayer(Layer):
    """What both attention layers share: the path, asked of :mod:`qkvnp.kernels`."""

    supports_complex_step = True  # on the reference path (qkvnp.gradcheck, method="complex_step")
    dropout = 0.0
    dropout_rng = None
    variants = None  # qkvnp.layers.variant_layer.VariantOptions of a layer built with variants

    def _init_dropout(self, dropout, rng):
        """``dropout`` checked, and the layer's own Generator, spawned from ``rng``.

        Called after the weights are drawn: spawning does not consume ``rng``'s
        draws, so the weights of this layer and of layers built after it from
        the same ``rng`` are those of a layer without dropout.
        """
        self.dropout = check_dropout_p(dropout, "dropout")
        self.dropout_rng = spawn_generator(rng)

    def _init_variants(self, num_heads, head_dim, **options):
        """The variant options checked (:func:`qkvnp.layers.variant_layer.check_options`) and
        their parameters: ``rel_bias`` ``(num_buckets, H)`` and ``sinks`` ``(H,)``, zeros (no
        draw from ``rng``: the weights of a seed do not depend on the options)."""
        from .variant_layer import check_options

        self.variants = check_options(num_heads, head_dim, **options)
        if self.variants is not None and self.variants.position_bias == "relative":
            self.params["rel_bias"] = np.zeros((self.variants.num_buckets, num_heads), self.dtype)
        if self.variants is not None and self.variants.sinks:
            self.params["sinks"] = np.zeros(num_heads, dtype=self.dtype)

    def _variant_repr_items(self):
        """The variant options that are on, for ``repr``."""
        if self.variants is None:
            return []
        off = {"rope": False, "rope_base": 10000.0, "rope_layout": "half", "position_bias": None,
               "num_buckets": 32, "max_distance": 128, "sinks": False, "softcap": None,
               "window": None, "scale": None}
        return [(name, value) for name, value in self.variants._asdict().items()
                if value != off[name]]

    def generators(self):
        """``{"dropout_rng": the Generator that draws the dropout masks}``."""
        return {"dropout_rng": self.dropout_rng}

    def _repr_items(self):
        """``dropout`` only when not 0; the variant options that are on."""
        return [(name, value) for name, value in super()._repr_items()
                if name != "dropout" or value] + self._variant_repr_items()

    def _dropout_args(self, dropout_mask, rng):
        """The dropout arguments of one forward: a given mask always, a drawn one in training."""
        if dropout_mask is not None:
            if self.dropout == 0.0:
                raise ValueError(f"dropout_mask needs a layer built with 0 < dropout < 1, this "
                                 f"{type(self).__name__} has dropout=0.0")
            return {"dropout_p": self.dropout, "dropout_mask": dropout_mask}
        if not self.training or self.dropout == 0.0:
            return {}
        rng = self.dropout_rng if rng is None else rng
        journal_generator(rng)  # a refused model call puts its state back
        return {"dropout_p": self.dropout, "rng": rng}

    def _kernel_forward(self, inputs, kind, num_heads, mask, is_causal, need_weights, out_proj,
                        originals, dropout=None):
        """Run :func:`qkvnp.layers.dispatch.layer_forward`, keep its cache and its dispatch.

        NOTE: the kernels write only into fresh memory, so a refused call
        (``ValueError``, ``TypeError``, however late) leaves the thread's
        previous cache whole: it is replaced only once the forward succeeded.
        """
        state = self._state_to_write()
        state.used_cache = None  # a used-up cache is dead: free it before the new one
        with kernels.buffer_owner(self):  # the pool lets this layer's buffers go with it
            out, weights, cache, dispatch = layer_forward(
                self.params, inputs, kind, num_heads, mask, is_causal, impl=self.impl,
                need_weights=need_weights, out_proj=out_proj, originals=originals,
                variants=self.variants, **(dropout or {}))
        self._cache, state.dispatch = cache, dispatch
        return out, weights

    @property
    def last_dispatch(self):
        """The path the calling thread's last forward ran and why (None before one)."""
        return self._thread.dispatch

    def _decode(self, query, attn_mask, is_causal, key_padding_mask, return_weights, kv_cache,
                dropout_mask):
        """``forward(query, kv_cache=...)``: one inference-only decoding step (no dropout).

        Returns ``(out, weights)``; ``is_causal`` is checked and otherwise
        ignored (decoding is causal, bottom-right aligned).
        """
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be a qkvnp.KVCache, got {type(kv_cache).__name__}")
        if dropout_mask is not None:
            raise ValueError("kv_cache decoding is inference only and drops nothing: "
                             "dropout_mask cannot be given with kv_cache")
        check_is_causal(is_causal)
        query = self._check_tokens(query)
        with kernels.buffer_owner(self):  # the pool lets this layer's buffers go with it
            if self.variants is not None:
                from .variant_decoding import decode

                out, weights, dispatch = decode(self, query, kv_cache, attn_mask,
                                                key_padding_mask, return_weights)
            else:
                out, weights, dispatch = cached_forward(self, query, kv_cache, attn_mask,
                                                        key_padding_mask, return_weights)
        state = self._state_to_write()
        state.cache = state.used_cache = None  # nothing for a backward: inference only
        state.decoded, state.dispatch = True, dispatch
        return out, weights

    def _need_cache(self):
        """:meth:`Layer._need_cache`, which also refuses a backward after a decoding step."""
        state = self._thread
        if state.cache is None and state.decoded:
            name = type(self).__name__
            raise RuntimeError(f"{name}.backward after a kv_cache decoding step: "
                               "forward(x, kv_cache=...) is inference only and keeps nothing "
                               "for a backward; train with forward(x, is_causal=True)")
        return super()._need_cache()

    def _kernel_backward(self, dout, retain_cache, cache=None):
        """Run :func:`qkvnp.layers.dispatch.layer_backward` on ``cache`` (default the calling
        thread's, :meth:`_need_cache`); accumulate; return the input gradients."""
        cache = self._need_cache() if cache is None else cache
        with kernels.buffer_owner(self):  # scratch buffers too: let go with the layer
            grads, dinputs = layer_backward(dout, cache)  # checks dout
        self._accumulate_all(grads)  # one lock for the 8 additions
        self._release_cache(retain_cache)
        return dinputs
