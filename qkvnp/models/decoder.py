"""One decoder for today's families, configured rather than subclassed: :class:`Decoder`.

Shape key: B batch, T tokens, S keys (past + new), E embedding (``emb_dim``),
V vocabulary (``vocab_size``), H query heads, K key/value heads, D head dim,
L layers.

GPT-2, Llama 3, Qwen3, Qwen3-MoE, Gemma 3 (text) and Mistral are
configurations (:class:`DecoderConfig` and its family presets); the blocks
are :class:`qkvnp.layers.decoder_block.DecoderBlock`. Every backward is
hand-derived; the derivations are in ``docs/derivations_gpt.md`` ("The
decoder of today's families"), the families side by side in
``docs/families.md``.
"""
from __future__ import annotations


import numpy as np

from .._checks import as_upstream_grad, check_indices, check_state_value, layer_dtype, make_rng
from ..layers.base import LoadResult, Model
from ..layers.basic import Embedding, Linear
from ..layers.decoder_block import DecoderAttention, DecoderBlock, inference_forward, \
    train_blocks_backward, train_blocks_forward
from ..layers.kv_cache import KVCache
from ..layers.mlp import GatedFeedForward
from ..layers.moe import MoEFeedForward
from ..layers.norms import RMSNorm
from ..layers.tied import TiedLinear
from ..layers.transformer import FeedForward, LayerNorm, Sequential
from ..ops.masks import causal_mask
from ..ops.softcap import softcap_backward, softcap_forward
from .decoder_config import LAYER_TYPES, MLP_KINDS, NORM_KINDS, POSITION_KINDS, DecoderConfig

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Mapping
    from .._typing import ArrayLike, DTypeLike, FloatArray, IntArray

__all__ = ["DecoderConfig", "Decoder", "NORM_KINDS", "MLP_KINDS", "POSITION_KINDS", "LAYER_TYPES"]


def _unfilled():
    """The Generator of :meth:`Decoder.empty`: every draw a zero-size stand-in, its shape noted.

    NOTE: the layers initialise with ``rng.uniform(...).astype(dtype)`` or
    ``rng.standard_normal(...).astype(dtype)``; these two are the draws. The
    class is made at the call: subclassing ``np.random.Generator`` at import
    would import numpy's random module (compiled) with ``import qkvnp``.
    """

    class Unfilled(np.random.Generator):
        def __init__(self):
            super().__init__(np.random.PCG64(0))
            self.shapes = {}  # id(stand-in) -> (stand-in, the shape it stands for)

        def uniform(self, low=0.0, high=1.0, size=None):  # type: ignore[override]
            return _StandIn(self, size)

        def standard_normal(self, size=None, dtype=np.float64, out=None):  # type: ignore[override]
            return _StandIn(self, size)

    return Unfilled()


class _StandIn:
    """A draw of :func:`_unfilled`'s Generator: ``astype`` gives a zero-size array, noted with the shape."""

    def __init__(self, draws, shape):
        self.draws, self.shape = draws, shape

    def astype(self, dtype, **_):
        stand_in = np.empty(0, dtype)
        self.draws.shapes[id(stand_in)] = (stand_in, self.shape)
        return stand_in


def _check_attention_mask(attention_mask, shape):
    """``attention_mask`` (Hugging Face's 0/1, shape ``shape``) as bool, True = a real token."""
    if attention_mask is None:
        return np.ones(shape, bool)
    mask = np.asarray(attention_mask)
    if mask.dtype.kind not in "biu" or mask.shape != tuple(shape) or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"attention_mask must hold 0 and 1 (1 = a real token) with shape "
                         f"{tuple(shape)}, got dtype {mask.dtype} and shape {mask.shape}")
    return mask.astype(bool)


def _keep_masks(valid, T, past, start, windows, shared=False):
    """``{window: keep (B, 1, T, S)}``: causal, real keys only, and within each window.

    Query ``t`` is token ``past + t`` of the sequence, key ``s`` is token
    ``start + s``; ``valid`` ``(B, S)`` says which keys are real tokens.
    With ``shared``, a sequence seen whole (``past = start = 0``, ``S = T``)
    of real tokens only gets :func:`~qkvnp.ops.masks.causal_mask`'s shared
    ``(T, T)`` array (for ``window`` None) and ``(T, T)`` windowed ones.
    """
    query = past + np.arange(T)[:, None]  # (T, 1)
    key = start + np.arange(valid.shape[-1])[None, :]  # (1, S)
    if shared and past == start == 0 and valid.shape[-1] == T and valid.all():
        # NOTE: the attention cores recognise the shared causal mask and skip its
        # -inf entries (an exp of -inf is numpy's slow path; benchmarks/NOTES.md)
        keep = causal_mask(T, T)  # (T, T), read-only
        return {window: keep if window is None else keep & (query - key < window)
                for window in windows}
    keep = (key <= query)[None, None] & valid[:, None, None, :]  # (B, 1, T, S)
    # NOTE: a left-padded query row sees no key: its attention output is 0
    # (qkvnp's fully masked row), finite but meaningless, as its logits are
    return {window: keep if window is None else keep & (query - key < window)[None, None]
            for window in windows}


class Decoder(Model):
    """A decoder-only language model configured by a :class:`DecoderConfig`.

    Parameters
    ----------
    config : DecoderConfig
        The family and sizes (e.g. ``DecoderConfig.qwen3(...)``).
    rng : numpy.random.Generator or int, keyword-only, optional
        Seed or Generator of the initial weights.
    dtype : float dtype, keyword-only
        float32 or float64.

    Attributes
    ----------
    embed : Embedding
        The token table ``(V, E)``; with ``tie_embeddings`` also the head.
    pos_embed : Embedding
        With ``positions="learned"`` only, ``(context_length, E)``.
    blocks : Sequential of DecoderBlock
        ``blocks.0``, ``blocks.1``, ...
    final_norm : LayerNorm or RMSNorm
    head : Linear or TiedLinear
        ``(E, V)``, no bias; with ``tie_embeddings`` a
        :class:`~qkvnp.layers.TiedLinear` reading the table (no parameter of its own).
    config : DecoderConfig
    vocab_size, num_layers, context_length, emb_dim : int
        From the config (what :func:`qkvnp.generate` reads).

    Notes
    -----
    Forward, with :math:`s` the embedding scale and :math:`\\kappa` the final soft-cap:

    .. math:: x_0 = s\\,W_{emb}[i] + W_{pos}[p], \\quad x_l = \\mathrm{block}_l(x_{l-1}), \\quad
              z = \\kappa \\tanh(\\mathrm{norm}(x_L) W_{head} / \\kappa)

    With ``tie_embeddings``, :math:`W_{head} = W_{emb}^T`: one parameter
    used twice, whose gradient is the sum of the head's
    :math:`(\\mathrm{norm}(x_L)^T \\bar z)^T` and the lookup's scatter
    (``docs/derivations_gpt.md``). ``params`` and ``grads`` hold it once,
    as ``embed.weight``, so an optimizer steps it once; :meth:`state_dict`
    also gives it as ``head.W`` (transposed) and :meth:`load_state_dict`
    accepts that name.

    Examples
    --------
    >>> cfg = DecoderConfig.qwen3(vocab_size=20, emb_dim=8, num_layers=1, num_heads=2,
    ...                           head_dim=4, hidden_dim=12)
    >>> model = Decoder(cfg, rng=0)
    >>> logits = model.forward(np.array([[1, 2, 3]]))
    >>> logits.shape
    (1, 3, 20)
    >>> model.backward(np.ones(logits.shape)) is None
    True
    """

    supports_complex_step = True
    #: ``forward``, ``decode`` and :func:`qkvnp.generate` take an ``attention_mask`` (padding).
    supports_padding = True

    def __init__(self, config: DecoderConfig, *, rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.dtype = layer_dtype(dtype)
        self.vocab_size, self.num_layers = config.vocab_size, config.num_layers
        self.context_length, self.emb_dim = config.context_length, config.emb_dim
        rng = make_rng(rng)
        self.embed = Embedding(config.vocab_size, config.emb_dim, rng=rng, dtype=dtype)
        self.embed.params["weight"] *= np.asarray(config.init_std, self.dtype)  # N(0, init_std^2)
        if config.positions == "learned":
            self.pos_embed = Embedding(config.context_length, config.emb_dim, rng=rng, dtype=dtype)
            self.pos_embed.params["weight"] *= np.asarray(config.init_std, self.dtype)
        self.blocks = Sequential([self._block(i, rng) for i in range(config.num_layers)])
        self.final_norm = self._norm()
        self.head: Linear | TiedLinear
        if config.tie_embeddings:  # one table used twice: the head reads the embedding's
            self.head = TiedLinear(self.embed)
        else:
            self.head = Linear(config.emb_dim, config.vocab_size, False, rng=rng, dtype=dtype)
        self.zero_grad()

    @classmethod
    def empty(cls, config: DecoderConfig, *, dtype: DTypeLike = np.float64) -> Decoder:
        """A Decoder whose weight matrices are allocated (``np.empty``) and not filled: fill them.

        What a loader builds before writing a checkpoint into ``params`` in
        place (:func:`qkvnp.interop.from_hf`): no random number is drawn and
        no page of a matrix (or of a gradient) is touched until it is
        written, so a loaded model is held once. The norms start at their
        usual ones and zeros.
        """
        draws = _unfilled()
        model = cls(config, rng=draws, dtype=dtype)
        # NOTE: built on zero-size stand-ins, then each matrix and its gradient made once:
        # the layers' constructors re-zero their gradients at every level of nesting
        params = model.params
        for name, value in params.items():
            if id(value) in draws.shapes:
                params[name] = np.empty(draws.shapes[id(value)][1], model.dtype)
        model.zero_grad()
        return model

    def _norm(self, dim=None):
        """A LayerNorm or RMSNorm of the config over ``dim`` (default ``E``)."""
        cfg = self.config
        dim = cfg.emb_dim if dim is None else dim
        if cfg.norm == "layer":
            return LayerNorm(dim, cfg.norm_eps, dtype=self.dtype)
        return RMSNorm(dim, cfg.norm_eps, unit_offset=cfg.norm_unit_offset, dtype=self.dtype)

    def _block(self, i, rng):
        """Block ``i``: its attention (its window and RoPE base), its feed-forward, its norms."""
        cfg, dtype = self.config, self.dtype
        window = cfg.window(i)
        local = window is not None and cfg.rope_local_base is not None
        # NOTE: Gemma 3 scales its global layers only; its sliding ones use the local base as is
        base, scaling = (cfg.rope_local_base, None) if local else (cfg.rope_base, cfg.rope_scaling)
        attn = DecoderAttention(cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads,
                                qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
                                qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
                                norm_unit_offset=cfg.norm_unit_offset, scale=cfg.scale,
                                softcap=cfg.attn_softcap, rope=cfg.positions == "rope",
                                rope_base=base, rope_scaling=scaling, rng=rng, dtype=dtype)
        mlp: Any
        if cfg.mlp == "gelu":
            mlp = FeedForward(cfg.emb_dim, cfg.hidden_dim, rng=rng, dtype=dtype)
        elif cfg.mlp == "moe":
            mlp = MoEFeedForward(cfg.emb_dim, cfg.moe_hidden_dim, cfg.num_experts, cfg.top_k,
                                 norm_topk_prob=cfg.norm_topk_prob, rng=rng, dtype=dtype)
        else:
            mlp = GatedFeedForward(cfg.emb_dim, cfg.hidden_dim, rng=rng, dtype=dtype,
                                   activation="silu" if cfg.mlp == "swiglu" else "gelu_tanh")
        norms = [self._norm() for _ in range(4 if cfg.placement == "sandwich" else 2)]
        return DecoderBlock(attn, mlp, norms, cfg.placement, window)

    def _inputs(self, ids, attention_mask, position_ids, past):
        """Checked ids ``(B, T)``, the real-token mask ``(B, past + T)`` and positions ``(B, T)``."""
        ids = check_indices(ids, self.vocab_size, "ids")
        if ids.ndim != 2 or ids.shape[1] < 1:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got shape {ids.shape}")
        B, T = ids.shape
        if past + T > self.context_length:
            raise ValueError(f"ids must hold at most context_length={self.context_length} "
                             f"tokens with the {past} cached, got T={T}")
        valid = _check_attention_mask(attention_mask, (B, past + T))
        if position_ids is None:
            # NOTE: as transformers' forward: arange from the cached tokens, whatever
            # the padding (its generate passes cumsum(mask) - 1 instead)
            positions = np.broadcast_to(past + np.arange(T), (B, T))
        else:
            positions = np.asarray(position_ids)
            if positions.dtype.kind not in "iu" or positions.shape not in ((B, T), (1, T)) or \
                    (positions < 0).any() or (positions >= self.context_length).any():
                raise ValueError(f"position_ids must be integers in [0, context_length="
                                 f"{self.context_length}) of shape ({B}, {T}) or (1, {T}), got "
                                 f"dtype {positions.dtype} and shape {positions.shape}")
            positions = np.broadcast_to(positions, (B, T))
        return ids, valid, positions

    def _embed(self, ids, positions, layer_calls):
        """``x_0`` ``(B, T, E)``: scaled token vectors plus the learned positions."""
        cfg = self.config
        x = self.embed.forward(ids) if layer_calls else self.embed.params["weight"][ids]
        if cfg.embed_scale is not None:
            x = x * np.asarray(cfg.embed_scale, self.dtype)  # (B, T, E)
        if cfg.positions == "learned":
            table = self.pos_embed
            x = x + (table.forward(positions) if layer_calls else table.params["weight"][positions])
        return x

    def forward(self, ids: IntArray, *, attention_mask: ArrayLike | None = None,
                position_ids: ArrayLike | None = None) -> FloatArray:
        """Logits of the next token at every position.

        Parameters
        ----------
        ids : ndarray of int, shape (B, T)
        attention_mask : ndarray of 0/1, shape (B, T), keyword-only, optional
            Hugging Face's: 1 = a real token, 0 = padding (left or right).
            Padded keys are masked; the logits of padded rows are finite and
            meaningless.
        position_ids : ndarray of int, shape (B, T) or (1, T), keyword-only, optional
            Default ``arange(T)`` for every row, as transformers' forward (its
            ``generate`` passes ``cumsum(attention_mask) - 1`` for left padding:
            pass that to match it).

        Returns
        -------
        logits : ndarray, shape (B, T, V)
        """
        ids, valid, positions = self._inputs(ids, attention_mask, position_ids, 0)
        T = ids.shape[1]
        keeps = _keep_masks(valid, T, 0, 0, {block.window for block in self.blocks}, shared=True)
        x = self._embed(ids, positions, True)  # (B, T, E)
        fused = train_blocks_forward(self.blocks, x, [keeps[block.window] for block in
                                                      self.blocks], positions[:, None, :],
                                     *self._fused_head())  # (B, T, E) or (B, T, V)
        if fused is not None:  # qkvnp.kernels.decoder_train, when choose_train_path says so
            x, fused = fused  # (B, T, V) when the final norm and the head ran there too
        for block in self.blocks if fused is None else ():
            x = block.forward(x, keeps[block.window], positions[:, None, :])  # (B, T, E)
        logits = x
        if fused is None or fused.head is None:
            x = self.final_norm.forward(x, check=False)
            logits = self.head.forward(x, check=False)  # (B, T, E) -> (B, T, V)
        cap_cache = None
        if self.config.final_softcap is not None:
            logits, cap_cache = softcap_forward(logits, self.config.final_softcap)  # (B, T, V)
        self._cache = (logits.shape, cap_cache, fused)
        return logits

    def backward(self, dlogits: FloatArray, retain_cache: bool = False) -> Any:
        """Accumulate every gradient into ``grads``; return None (ids are not differentiable)."""
        state = self._thread
        if state.cache is None and state.decoded:
            raise RuntimeError("Decoder.backward after decode: decoding keeps nothing for a "
                               "backward; call forward(ids) first")
        shape, cap_cache, fused = self._need_cache()
        in_shares = fused is not None and fused.head is not None  # the head's backward too
        # NOTE: there each share tests its own rows of dlogits finite, on its worker
        # thread, before it reads them (benchmarks/NOTES.md)
        dlogits = as_upstream_grad(dlogits, "dlogits", shape, self.dtype, finite=not in_shares)
        if cap_cache is not None:
            dlogits = softcap_backward(dlogits, cap_cache)  # (B, T, V)
        dx = dlogits
        if fused is None or fused.head is None:
            # NOTE: a tied head adds its gradient into the table's, beside the lookup's below
            dx = self.head.backward(dlogits, retain_cache, check=False)  # (B, T, V) -> (B, T, E)
            dx = self.final_norm.backward(dx, retain_cache, check=False)
        if fused is not None:  # the blocks (and the head and the final norm when they ran there)
            dx = train_blocks_backward(self.blocks, dx, fused, self.final_norm, self.head,
                                       finite_name="dlogits" if in_shares else None)
        for block in reversed(list(self.blocks)) if fused is None else ():
            dx = block.backward(dx, retain_cache)  # (B, T, E)
        if self.config.positions == "learned":
            self.pos_embed.backward(dx, retain_cache, check=False)
        if self.config.embed_scale is not None:
            dx = dx * np.asarray(self.config.embed_scale, self.dtype)
        self.embed.backward(dx, retain_cache, check=False)
        self._release_cache(retain_cache)
        return None

    def _fused_head(self):
        """``(final_norm, head)`` when both can run in the fused blocks' shares, else ``(None, None)``."""
        head = self.head
        if type(self.final_norm) is RMSNorm and type(head) is Linear and not head.bias and \
                self.config.final_softcap is None:
            return self.final_norm, head
        return None, None

    def decode(self, ids: IntArray, kv_caches: Any, *, attention_mask: ArrayLike | None = None,
               position_ids: ArrayLike | None = None) -> FloatArray:
        """Logits of the new tokens ``ids``, attending to ``kv_caches``' past (inference only).

        Parameters
        ----------
        ids : ndarray of int, shape (B, T)
            The new tokens; they follow the cached ones.
        kv_caches : sequence of qkvnp.KVCache
            One per layer, empty at the start. A sliding layer's cache keeps
            only the last ``sliding_window - 1`` tokens (rolling).
        attention_mask : ndarray of 0/1, shape (B, past + T), keyword-only, optional
            Every token so far, cached and new (as transformers' generate passes it).
        position_ids : ndarray of int, shape (B, T), keyword-only, optional
            Default: the new tokens' indices in the sequence.

        Returns
        -------
        logits : ndarray, shape (B, T, V)
        """
        if isinstance(kv_caches, KVCache) or not hasattr(kv_caches, "__iter__"):
            raise TypeError(f"kv_caches must be a sequence of one qkvnp.KVCache per layer "
                            f"({self.num_layers}), got {type(kv_caches).__name__}")
        kv_caches = list(kv_caches)
        if len(kv_caches) != self.num_layers or not all(isinstance(c, KVCache) for c in kv_caches):
            raise ValueError(f"kv_caches must hold one qkvnp.KVCache per layer "
                             f"({self.num_layers}), got {len(kv_caches)} items")
        past = kv_caches[0].start + len(kv_caches[0])
        if any(cache.start + len(cache) != past for cache in kv_caches):
            raise ValueError("kv_caches must all have seen the same tokens; reset them")
        ids, valid, positions = self._inputs(ids, attention_mask, position_ids, past)
        T = ids.shape[1]
        x = self._embed(ids, positions, False)  # (B, T, E)
        for block, cache in zip(self.blocks, kv_caches):
            keep = _keep_masks(valid[:, cache.start:], T, past, cache.start,
                               (block.window,))[block.window]  # (B, 1, T, S)
            x = block.decode_step(x, cache, keep, positions[:, None, :])  # (B, T, E)
        x = inference_forward(self.final_norm, x)  # nothing kept for a backward
        # through the head's own forward only when adapted (LoRA): a plain or tied head is
        # its product alone, as the blocks' Linears are in decoding
        logits = inference_forward(self.head, x)  # (B, T, E) -> (B, T, V)
        if self.config.final_softcap is not None:
            logits = softcap_forward(logits, self.config.final_softcap)[0]  # (B, T, V)
        state = self._state_to_write()  # nothing kept for a backward
        state.cache = state.used_cache = None
        state.decoded = True
        return logits

    def state_dict(self) -> dict[str, FloatArray]:
        """Copies of the parameters; a tied table also as ``head.W`` ``(E, V)``, its transpose."""
        state = super().state_dict()
        if self.config.tie_embeddings:
            state["head.W"] = state["embed.weight"].T.copy()
        return state

    def load_state_dict(self, state_dict: Mapping[str, ArrayLike],
                        strict: bool = True) -> LoadResult:
        """As ``Layer.load_state_dict``; a tied table may also come as ``head.W``.

        With ``tie_embeddings``, ``head.W`` ``(E, V)`` is the table's transpose:
        loaded into ``embed.weight`` when that is absent, refused when both
        are given and differ.
        """
        if not (self.config.tie_embeddings and hasattr(state_dict, "keys")
                and "head.W" in state_dict):
            return super().load_state_dict(state_dict, strict)
        state = dict(state_dict)
        head = check_state_value(state.pop("head.W"), "state_dict['head.W']",
                                 (self.emb_dim, self.vocab_size), self.dtype)
        if "embed.weight" not in state:
            state["embed.weight"] = head.T
        elif not np.array_equal(np.asarray(state["embed.weight"]), head.T):
            raise ValueError("state_dict['head.W'] must be the transpose of "
                             "state_dict['embed.weight']: the head is tied to the embedding")
        return super().load_state_dict(state, strict)

