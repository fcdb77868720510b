"""The book's GPT (chapter 4) without autograd: :class:`GPTModel`.

Shape key: B batch (any leading dims), T tokens (at most ``context_length``),
E embedding (``emb_dim``), V vocabulary (``vocab_size``), H heads, L layers.

Every backward is hand-derived (the blocks' in
:mod:`qkvnp.layers.transformer`, the ops' in ``qkvnp.ops.layer_norm``,
``qkvnp.ops.gelu``, ``qkvnp.ops.dropout`` and ``qkvnp.ops.residual``);
the derivations are in ``docs/derivations_gpt.md``.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._checks import (as_upstream_grad, check_bool, check_int, check_indices, layer_dtype,
                      make_rng)
from ..ops.dropout import check_dropout_p
from ..kernels._runtime import blas_section, get_block_sizes, single_threaded_blas
from ..layers.kv_cache import KVCache
from ..layers.base import Model
from ..layers.basic import Embedding, Linear
from ..layers.tied import TiedLinear
from ..layers.transformer import Dropout, LayerNorm, Sequential, TransformerBlock

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike, FloatArray, IntArray

__all__ = ["GPTModel", "BOOK_CONFIG_KEYS"]

#: The keys of the book's ``GPT_CONFIG_124M`` that :meth:`GPTModel.from_config` reads.
BOOK_CONFIG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers",
                    "drop_rate", "qkv_bias")


class GPTModel(Model):
    """The book's ``GPTModel``: embeddings, pre-LayerNorm blocks, final norm, output head.

    Parameters
    ----------
    vocab_size : int
        ``V``.
    context_length : int
        The number of positions (the position table's rows); longer inputs
        are refused.
    emb_dim : int
        ``E``.
    num_heads : int
        ``H``, a divisor of ``E`` (the book's ``n_heads``).
    num_layers : int
        ``L``, the number of blocks (the book's ``n_layers``).
    dropout : float
        The book's ``drop_rate``: after the embeddings, on the attention
        weights, and on each block branch, in training mode.
    qkv_bias : bool
        Biases of the query, key and value projections.
    rng : numpy.random.Generator or int, keyword-only, optional
        Seed or Generator of the initial weights (a new unseeded Generator if None).
    dtype : float dtype, keyword-only
        Floating dtype of the parameters and the computation (float32 or float64).
    impl : {"auto", "reference", "fast", "tiled"}, keyword-only
        The attention path of every block (:mod:`qkvnp.kernels`); assignable.
    hidden_dim : int, keyword-only, optional
        The feed-forward's width (default ``4 * emb_dim``, the book's).
    approximate : {"tanh", "none"}, keyword-only
        The GELU's: ``"tanh"`` (default) is the book's and GPT-2's.
    num_kv_heads : int, keyword-only, optional
        Grouped-query attention in every block (``K`` key/value heads, a
        divisor of ``num_heads``; default one per query head).
    tie_embeddings : bool, keyword-only
        GPT-2's weight tying: the output head reads the token table,
        ``logits = x @ tok_emb.weight.T``, one parameter used twice
        (``out_head`` is then a :class:`~qkvnp.layers.TiedLinear`). See Notes.
    rope, rope_base, rope_layout, position_bias, num_buckets, max_distance, sinks, softcap, window, scale : keyword-only
        The attention variants of every block, as
        :class:`~qkvnp.MultiHeadAttention`'s (``docs/variants.md``): e.g.
        ``rope=True``, ``window=(left, 0)``, ``softcap=50.0``. The learned
        position table stays (the book's); :meth:`decode` and
        :func:`qkvnp.generate` continue the positions of RoPE and keep a
        window's cache rolling. All off by default: the book's model.

    Attributes
    ----------
    tok_emb, pos_emb : Embedding
    drop_emb : Dropout
    trf_blocks : Sequential of TransformerBlock
        Registered as ``trf_blocks.0``, ``trf_blocks.1``, ...
    final_norm : LayerNorm
    out_head : Linear or TiedLinear
        ``(E, V)``, no bias; with ``tie_embeddings`` the token table's
        transpose, owned by ``tok_emb``.
    params : dict
        The book's names with qkvnp's sub-layer keys, e.g.
        ``"trf_blocks.0.att.W_query"``; :mod:`qkvnp.interop`'s layout
        ``"book.GPTModel"`` maps them to the book's state dict.

    Notes
    -----
    Forward, for ids :math:`i_{b,t}`:

    .. math:: x_0 = \\mathrm{drop}(W_{tok}[i] + W_{pos}[0..T-1]), \\quad
              x_l = \\mathrm{block}_l(x_{l-1}), \\quad
              z = \\mathrm{norm}(x_L)\\, W_{head}

    Backward in reverse. The position table is used once per sequence of
    the batch, so its gradient is the batch sum of the embedding
    gradient, :math:`\\bar W_{pos}[t] = \\sum_b \\bar x_0[b, t]`; the token
    table gets :math:`\\bar x_0[b, t]` added into row :math:`i_{b,t}`.

    **Tied embeddings** (``tie_embeddings=True``; GPT-2 is the book's GPT
    with ``qkv_bias=True`` and the tie): ``params`` and ``grads`` hold the
    table once, as ``"tok_emb.weight"`` (so every optimizer steps it once),
    and its gradient is the sum of both uses,
    :math:`\\bar W_{tok} = \\mathrm{scatter}(\\bar x_0) + \\bar z^T h`
    (``docs/derivations_gpt.md``, "Tied embeddings"). :meth:`state_dict`
    gives it under both names, ``"out_head.W"`` being a copy of its
    transpose, as PyTorch's state dict of a tied model has both; :meth:`load_state_dict` takes
    both (refusing, by name, two values that differ) or either one alone.

    Only the book's configuration (no option after ``impl`` changed) loads
    into and from the book's ``GPTModel`` (:mod:`qkvnp.interop`'s layout
    ``"book.GPTModel"`` refuses the others, naming the option).

    Examples
    --------
    >>> model = GPTModel(vocab_size=11, context_length=8, emb_dim=8, num_heads=2,
    ...                  num_layers=2, rng=0)
    >>> idx = np.array([[1, 2, 3], [4, 5, 6]])
    >>> logits = model.forward(idx)
    >>> logits.shape
    (2, 3, 11)
    >>> dlogits = np.random.default_rng(0).normal(size=logits.shape)
    >>> model.backward(dlogits) is None
    True
    >>> model.grads["tok_emb.weight"].shape
    (11, 8)
    """

    supports_complex_step = True  # on the reference path (qkvnp.gradcheck)

    def __init__(self, vocab_size: int, context_length: int, emb_dim: int, num_heads: int,
                 num_layers: int, dropout: float = 0.0, qkv_bias: bool = False, *,
                 rng: np.random.Generator | int | None = None, dtype: DTypeLike = np.float64,
                 impl: str = "auto", hidden_dim: int | None = None, approximate: str = "tanh",
                 num_kv_heads: int | None = None, rope: bool = False,
                 rope_base: float = 10000.0, rope_layout: str = "half",
                 position_bias: str | None = None, num_buckets: int = 32,
                 max_distance: int = 128, sinks: bool = False, softcap: float | None = None,
                 window: tuple[int | None, int | None] | None = None,
                 scale: float | None = None, tie_embeddings: bool = False) -> None:
        self.vocab_size = check_int(vocab_size, "vocab_size", 1)
        self.context_length = check_int(context_length, "context_length", 1)
        self.emb_dim = check_int(emb_dim, "emb_dim", 1)
        self.num_heads = check_int(num_heads, "num_heads", 1)
        self.num_layers = check_int(num_layers, "num_layers", 1)
        self.dropout = check_dropout_p(dropout, "dropout")
        self.qkv_bias = check_bool(qkv_bias, "qkv_bias")
        self.tie_embeddings = check_bool(tie_embeddings, "tie_embeddings")
        self.dtype = layer_dtype(dtype)
        rng = make_rng(rng)
        self.tok_emb = Embedding(self.vocab_size, self.emb_dim, rng=rng, dtype=dtype)
        self.pos_emb = Embedding(self.context_length, self.emb_dim, rng=rng, dtype=dtype)
        self.drop_emb = Dropout(self.dropout, rng=rng)
        options: dict[str, Any] = dict(
            hidden_dim=hidden_dim, approximate=approximate, num_kv_heads=num_kv_heads,
            rope=rope, rope_base=rope_base, rope_layout=rope_layout,
            position_bias=position_bias, num_buckets=num_buckets, max_distance=max_distance,
            sinks=sinks, softcap=softcap, window=window, scale=scale)
        self.trf_blocks = Sequential([
            TransformerBlock(self.emb_dim, self.num_heads, self.dropout, self.qkv_bias, rng=rng,
                             dtype=dtype, impl=impl, **options)
            for _ in range(self.num_layers)])
        self.final_norm = LayerNorm(self.emb_dim, dtype=dtype)
        # NOTE: the head is drawn last: a tied model draws nothing for it, and its
        # other weights are those of the same seed untied
        self.out_head: Linear | TiedLinear
        if self.tie_embeddings:
            self.out_head = TiedLinear(self.tok_emb)
        else:
            self.out_head = Linear(self.emb_dim, self.vocab_size, bias=False, rng=rng, dtype=dtype)
        self._cache = None
        self.zero_grad()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, rng: np.random.Generator | int | None = None,
                    dtype: DTypeLike = np.float64, impl: str = "auto",
                    tie_embeddings: bool = False) -> Any:
        """Build from the book's config dict (``GPT_CONFIG_124M``'s keys).

        Parameters
        ----------
        cfg : mapping
            ``vocab_size``, ``context_length``, ``emb_dim``, ``n_heads``,
            ``n_layers``, ``drop_rate``, ``qkv_bias`` (``qkvnp.models.gpt.BOOK_CONFIG_KEYS``);
            other keys are refused, so that a typo does not pass silently.
        rng, dtype, impl, tie_embeddings : keyword-only
            As the constructor's (the book's config has no key for the tie:
            ``tie_embeddings=True`` with ``qkv_bias: True`` is GPT-2).

        Raises
        ------
        ValueError
            If a key is missing or unknown.

        Examples
        --------
        >>> cfg = {"vocab_size": 50, "context_length": 8, "emb_dim": 8, "n_heads": 2,
        ...        "n_layers": 1, "drop_rate": 0.1, "qkv_bias": False}
        >>> GPTModel.from_config(cfg, rng=0).num_parameters()
        1728
        """
        keys = set(getattr(cfg, "keys", lambda: ())())
        if not hasattr(cfg, "keys"):
            raise TypeError(f"cfg must be a mapping with keys {list(BOOK_CONFIG_KEYS)}, got "
                            f"{type(cfg).__name__}")
        missing = [k for k in BOOK_CONFIG_KEYS if k not in keys]
        unknown = sorted(keys - set(BOOK_CONFIG_KEYS))
        if missing or unknown:
            raise ValueError(f"cfg must have the keys {list(BOOK_CONFIG_KEYS)}; missing "
                             f"{missing}, unknown {unknown}")
        return cls(cfg["vocab_size"], cfg["context_length"], cfg["emb_dim"], cfg["n_heads"],
                   cfg["n_layers"], cfg["drop_rate"], cfg["qkv_bias"], rng=rng, dtype=dtype,
                   impl=impl, tie_embeddings=tie_embeddings)

    # NOTE: what the model was built with, read from its first block (every block
    # was built with the same options), not kept a second time
    @property
    def hidden_dim(self) -> int:
        """The feed-forward's width ``F``."""
        return self.trf_blocks[0].ff.hidden_dim

    @property
    def approximate(self) -> str:
        """The GELU's form, ``"tanh"`` or ``"none"``."""
        return self.trf_blocks[0].ff.layers[1].approximate

    @property
    def num_kv_heads(self) -> int:
        """The key/value heads of every block's attention."""
        return self.trf_blocks[0].att.num_kv_heads

    @property
    def variants(self) -> Any:
        """The attention variants of every block (``VariantOptions``), or None."""
        return self.trf_blocks[0].att.variants

    @property
    def impl(self) -> Any:
        """The attention path of the blocks; assigning it sets every block's."""
        return self.trf_blocks[0].impl

    @impl.setter
    def impl(self, value: Any) -> None:
        for block in self.trf_blocks:
            block.impl = value

    def dropout_mask_shapes(self, batch_shape: tuple[int, ...], num_tokens: int) -> dict[str, Any]:
        """The shape of every dropout site, by the name :meth:`forward`'s ``dropout_masks`` takes.

        Parameters
        ----------
        batch_shape : tuple of int
            ``(B,)`` for ids of shape ``(B, T)``.
        num_tokens : int
            ``T``.

        Returns
        -------
        dict
            ``"drop_emb"`` ``(*batch, T, E)``, and for each block ``l``
            ``"trf_blocks.l.att"`` ``(*batch, H, T, T)``,
            ``"trf_blocks.l.drop_shortcut1"`` and ``...drop_shortcut2``
            ``(*batch, T, E)``.
        """
        batch, T, E = tuple(batch_shape), int(num_tokens), self.emb_dim
        shapes = {"drop_emb": batch + (T, E)}
        for i in range(self.num_layers):
            shapes[f"trf_blocks.{i}.att"] = batch + (self.num_heads, T, T)
            shapes[f"trf_blocks.{i}.drop_shortcut1"] = batch + (T, E)
            shapes[f"trf_blocks.{i}.drop_shortcut2"] = batch + (T, E)
        return shapes

    def _check_ids(self, idx, offset=0):
        """``idx`` as checked integer ids ``(..., T)`` with ``offset + T <= context_length``."""
        idx = check_indices(idx, self.vocab_size, "idx")
        if idx.ndim < 1:
            raise ValueError(f"idx must have shape (..., T), got shape {idx.shape}")
        T = idx.shape[-1]
        if T < 1 or offset + T > self.context_length:
            raise ValueError(f"idx must hold 1 to context_length={self.context_length} tokens "
                             f"(positions {offset}..{offset + T - 1}), got T={T}; crop the "
                             f"context to its last {self.context_length} tokens")
        return idx

    def forward(self, idx: IntArray, *, dropout_masks: dict[str, Any] | None = None) -> FloatArray:
        """Logits of the next token at every position.

        Parameters
        ----------
        idx : ndarray of int, shape (..., T)
            Token ids in ``[0, vocab_size)``, ``1 <= T <= context_length``.
        dropout_masks : dict, keyword-only, optional
            Bool masks (True = keep) to replay, by the names of
            :meth:`dropout_mask_shapes`; applied in either mode, as a
            layer's ``dropout_mask``. Missing sites are drawn (training,
            ``dropout > 0``) or not applied.

        Returns
        -------
        logits : ndarray, shape (..., T, vocab_size)

        Raises
        ------
        TypeError
            If ``idx`` is not an integer array.
        ValueError
            If an id is out of range, ``T > context_length``, or a mask name
            is unknown.
        """
        idx = self._check_ids(idx)
        masks = _block_masks(dropout_masks, self.num_layers)
        positions = np.arange(idx.shape[-1])
        x = self.tok_emb.forward(idx) + self.pos_emb.forward(positions)  # (..., T, E) + (T, E)
        x = self.drop_emb.forward(x, mask=masks["drop_emb"])
        # NOTE: the first block checks its input; each block checks its output,
        # the next one's input, and the activations inside are not checked again
        with self._blas_threads(x):
            for i, block in enumerate(self.trf_blocks):
                x = block.forward(x, dropout_masks=masks[i], check=i == 0)  # (..., T, E)
            x = self.final_norm.forward(x, check=False)
            logits = self.out_head.forward(x, check=False)  # (..., T, E) -> (..., T, V)
        if not np.isfinite(logits).all():
            raise ValueError("GPTModel's logits contain NaN or inf: a parameter holds NaN or "
                             "inf, or the activations overflowed")
        self._cache = logits.shape
        return logits

    def backward(self, dlogits: FloatArray, retain_cache: bool = False) -> Any:
        """Accumulate every parameter's gradient; return None (ids are not differentiable).

        Parameters
        ----------
        dlogits : ndarray, shape (..., T, vocab_size)
        retain_cache : bool
            Keep every cache for one more backward.

        Raises
        ------
        ValueError, TypeError
            If ``dlogits`` is not of the logits' shape, not real, or not finite.
        RuntimeError
            Without a forward to use, or after :meth:`decode`.
        """
        shape = self._need_cache()
        dlogits = as_upstream_grad(dlogits, "dlogits", shape, self.dtype)
        with self._blas_threads(dlogits):
            # (..., T, V) -> (..., T, E)
            dx = self.out_head.backward(dlogits, retain_cache, check=False)
            dx = self.final_norm.backward(dx, retain_cache, check=False)
            for block in reversed(list(self.trf_blocks)):
                dx = block.backward(dx, retain_cache, check=False)  # each checks its dx
        dx = self.drop_emb.backward(dx, retain_cache, check=False)
        self.tok_emb.backward(dx, retain_cache)
        # NOTE: every sequence reads the same position rows: their gradient is the batch sum
        dpos = dx.reshape((-1,) + dx.shape[-2:]).sum(axis=0)  # (..., T, E) -> (T, E)
        self.pos_emb.backward(dpos, retain_cache)
        self._release_cache(retain_cache)
        return None

    def decode(self, idx: IntArray, kv_caches: Any) -> FloatArray:
        """Logits of the new tokens ``idx``, attending to ``kv_caches``' past (inference only).

        Parameters
        ----------
        idx : ndarray of int, shape (..., T)
            The new tokens; their positions follow the cached ones (those a
            window's rolling cache dropped included, ``cache.start``).
        kv_caches : sequence of qkvnp.KVCache
            One per block, all holding the same past (empty at the start).

        Returns
        -------
        logits : ndarray, shape (..., T, vocab_size)

        Raises
        ------
        ValueError
            If the past plus the new tokens exceed ``context_length``, or the
            caches are not one per block.

        Notes
        -----
        No dropout (evaluation semantics) and nothing kept for a backward:
        a later :meth:`backward` raises ``RuntimeError``.
        """
        if isinstance(kv_caches, KVCache) or not hasattr(kv_caches, "__iter__"):
            raise TypeError(f"kv_caches must be a sequence of one qkvnp.KVCache per block "
                            f"({self.num_layers}), got {type(kv_caches).__name__}")
        kv_caches = list(kv_caches)
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches must hold one KVCache per block ({self.num_layers}), "
                             f"got {len(kv_caches)}")
        for i, cache in enumerate(kv_caches):
            if not isinstance(cache, KVCache):
                raise TypeError(f"kv_caches[{i}] must be a qkvnp.KVCache, got "
                                f"{type(cache).__name__}")
        # NOTE: the position of the first new token: the cached tokens and those a
        # window's rolling cache dropped (KVCache.start), as RoPE counts them
        past = kv_caches[0].start + len(kv_caches[0])
        if any((cache.start, len(cache)) != (kv_caches[0].start, len(kv_caches[0]))
               for cache in kv_caches):
            raise ValueError("kv_caches must all hold the same number of tokens; reset them")
        idx = self._check_ids(idx, offset=past)
        tok, pos = self.tok_emb.params["weight"], self.pos_emb.params["weight"]
        x = tok[idx] + pos[past:past + idx.shape[-1]]  # (..., T, E)
        for block, cache in zip(self.trf_blocks, kv_caches):
            x = block.decode(x, cache)
        from ..kernels.pointwise import layer_norm_forward_fused
        from ..ops.layer_norm import layer_norm_forward

        scale, shift = self.final_norm.params["scale"], self.final_norm.params["shift"]
        norm = layer_norm_forward_fused if x.dtype.kind == "f" else layer_norm_forward
        x = norm(x, scale, shift, self.final_norm.eps)[0]  # the blocks' output: checked
        state = self._state_to_write()  # the calling thread's: nothing kept for a backward
        state.cache = state.used_cache = None
        state.decoded = True
        if self.tie_embeddings:
            W_head = self.tok_emb.params["weight"].T  # (V, E) -> (E, V)
        else:  # a Linear's W, or an adapted head's merged one (qkvnp.layers.LoRALinear)
            merged = getattr(self.out_head, "effective_params", None)
            W_head = (self.out_head.params if merged is None else merged())["W"]
        logits = x @ W_head  # (..., T, E) -> (..., T, V)
        if not np.isfinite(logits).all():
            raise ValueError("GPTModel's logits contain NaN or inf: a parameter holds NaN or "
                             "inf, or the activations overflowed")
        return logits

    def state_dict(self) -> dict[str, FloatArray]:
        """Copies of the parameters; a tied model's table also as ``"out_head.W"`` ``(E, V)``.

        Returns
        -------
        dict
            ``name -> ndarray`` (copies). With ``tie_embeddings`` the shared
            table comes under both of its names, ``"tok_emb.weight"`` and
            ``"out_head.W"`` (its transpose), as PyTorch's ``state_dict``
            of a tied model gives both.
        """
        state = super().state_dict()
        if self.tie_embeddings:
            state["out_head.W"] = state["tok_emb.weight"].T.copy()  # (V, E) -> (E, V)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Copy ``state_dict`` into the parameters, in place.

        As :meth:`~qkvnp.layers.Layer.load_state_dict`. With ``tie_embeddings``,
        the shared table may come as ``"tok_emb.weight"`` ``(V, E)``, as
        ``"out_head.W"`` ``(E, V)``, or both (what :meth:`state_dict` gives); both must then hold the same
        values (after the cast to the model's dtype), else ``ValueError``
        naming the two, and nothing is loaded. An untied model takes the
        two as two parameters.

        Parameters
        ----------
        state_dict : mapping
        strict : bool

        Returns
        -------
        LoadResult

        Raises
        ------
        ValueError, TypeError
            As :meth:`~qkvnp.layers.Layer.load_state_dict`'s, and for a tied pair that differs.
        """
        if not self.tie_embeddings or not isinstance(state_dict, Mapping) or \
                "out_head.W" not in state_dict:
            return super().load_state_dict(state_dict, strict)
        from .._checks import check_state_value

        state = dict(state_dict)
        table = self.tok_emb.params["weight"]
        head = check_state_value(state.pop("out_head.W"), "state_dict['out_head.W']",
                                 table.T.shape, table.dtype)
        if "tok_emb.weight" in state:
            tok = check_state_value(state["tok_emb.weight"], "state_dict['tok_emb.weight']",
                                    table.shape, table.dtype)
            if not np.array_equal(tok, head.T):
                raise ValueError("state_dict['tok_emb.weight'] and state_dict['out_head.W'] "
                                 "differ, but the model ties its head to the token table "
                                 "(tie_embeddings=True): give one value, or build the model "
                                 "with tie_embeddings=False")
        state["tok_emb.weight"] = head.T
        return super().load_state_dict(state, strict)

    def _blas_threads(self, x):
        """OpenBLAS at one thread (:class:`single_threaded_blas`) for the blocks and the
        head when the step's largest product, ``2 * rows * E * max(4 E, V)`` flops, is
        below the ``min_parallel_flops`` setting; else a :class:`blas_section` (BLAS's own
        count, and the blocks' attention on it too, not split over the pool).

        NOTE: OpenBLAS spreads even these small products over its threads, which
        then spin while the step's NumPy passes that follow want the cores: on a
        loaded host two threads measured up to ten times slower than one, on an
        idle one about the same (``benchmarks/gpt_compare.py``;
        benchmarks/NOTES.md). The thread count is process-wide while the
        section is open (as in the kernels' sections); other threads' NumPy
        products run at one thread meanwhile.
        """
        rows = x.size // x.shape[-1]
        largest = 2 * rows * self.emb_dim * max(4 * self.emb_dim, self.vocab_size)
        if largest < get_block_sizes()["min_parallel_flops"]:
            return single_threaded_blas()
        return blas_section()  # the blocks' attention keeps its batch whole (split_threads)

    def _need_cache(self):
        """The forward's logits shape, or a ``RuntimeError`` saying what to call."""
        state = self._thread
        if state.cache is None and state.decoded:
            raise RuntimeError("GPTModel.backward after decode: decoding is inference only "
                               "and keeps nothing for a backward; call forward(idx) first")
        return super()._need_cache()


def _block_masks(dropout_masks, num_layers):
    """``{"drop_emb": mask or None, 0: {...}, 1: {...}}`` from the flat dotted names."""
    masks = {"drop_emb": None}
    masks.update({i: {} for i in range(num_layers)})
    if dropout_masks is None:
        return masks
    if not isinstance(dropout_masks, dict):
        raise TypeError(f"dropout_masks must be a dict of name -> bool mask, got "
                        f"{type(dropout_masks).__name__}")
    for name, mask in dropout_masks.items():
        parts = str(name).split(".")
        if name == "drop_emb":
            masks["drop_emb"] = mask
        elif (len(parts) == 3 and parts[0] == "trf_blocks" and parts[1].isdigit()
              and int(parts[1]) < num_layers
              and parts[2] in ("att", "drop_shortcut1", "drop_shortcut2")):
            masks[int(parts[1])][parts[2]] = mask
        else:
            raise ValueError(f"dropout_masks has an unknown name {name!r}; the names are those "
                             "of GPTModel.dropout_mask_shapes (e.g. 'drop_emb', "
                             "'trf_blocks.0.att')")
    return masks
