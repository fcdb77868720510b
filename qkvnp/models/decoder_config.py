"""The configuration of :class:`qkvnp.models.decoder.Decoder`: :class:`DecoderConfig` and its family presets.

Shape key: E embedding (``emb_dim``), V vocabulary, H query heads, K
key/value heads, D head dim, L layers.

Each family (GPT-2, Llama 3, Mistral, Qwen3, Qwen3-MoE, Gemma 3) is a preset
classmethod; any field can then be changed with ``dataclasses.replace``, and
every field is checked, a bad one refused by name.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..layers.decoder_block import BLOCK_PLACEMENTS
from ..ops.rope_scaling import rope_inverse_frequency

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any

__all__ = ["DecoderConfig", "NORM_KINDS", "MLP_KINDS", "POSITION_KINDS", "LAYER_TYPES"]

#: :attr:`DecoderConfig.norm`: LayerNorm (GPT-2) or RMSNorm (the others).
NORM_KINDS = ("layer", "rms")
#: :attr:`DecoderConfig.mlp`: GPT-2's GELU MLP with biases, SwiGLU, GeGLU, a mixture of SwiGLU experts.
MLP_KINDS = ("gelu", "swiglu", "geglu", "moe")
#: :attr:`DecoderConfig.positions`: a learned table (GPT-2) or rotary (the others).
POSITION_KINDS = ("learned", "rope")
#: :attr:`DecoderConfig.layer_types` entries, Hugging Face's names.
LAYER_TYPES = ("full_attention", "sliding_attention")
_FAMILIES = ("gpt2", "llama", "qwen3", "qwen3_moe", "gemma3_text", "mistral")


def _positive_int(value, name, minimum=1):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"DecoderConfig.{name} must be an int, got {type(value).__name__} "
                        f"{value!r}")
    if value < minimum:
        raise ValueError(f"DecoderConfig.{name} must be >= {minimum}, got {value}")


def _positive_float(value, name, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"DecoderConfig.{name} must be a number{' or None' * allow_none}, got "
                        f"{type(value).__name__} {value!r}")
    if not 0 < float(value) < math.inf:
        raise ValueError(f"DecoderConfig.{name} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """What makes a family: every option of :class:`Decoder`, checked when made.

    Parameters
    ----------
    vocab_size, emb_dim, num_layers, num_heads : int
        ``V``, ``E``, ``L``, ``H``.
    hidden_dim : int
        The feed-forward's width (``intermediate_size``).
    context_length : int
        The most positions (``max_position_embeddings``; the learned table's rows).
    head_dim : int, optional
        ``D`` (default ``E // H``; Qwen3 and Gemma 3 set it apart).
    num_kv_heads : int, optional
        ``K``, a divisor of ``H`` (default ``H``).
    norm : {"layer", "rms"}
        LayerNorm (with a shift) or RMSNorm.
    norm_eps : float
        The norms' eps (GPT-2 and Llama 3: 1e-5; Qwen3, Gemma 3, Mistral: 1e-6).
    norm_unit_offset : bool
        RMSNorm's ``(1 + weight)`` (Gemma), also the QK-norm's.
    placement : {"pre", "post", "sandwich"}
        Where the norms go (:class:`~qkvnp.layers.decoder_block.DecoderBlock`).
    mlp : {"gelu", "swiglu", "geglu", "moe"}
        GPT-2's MLP (biases, tanh GELU), the gated MLPs, or a mixture of SwiGLU experts.
    num_experts, top_k : int, optional
        With ``mlp="moe"``: ``X`` experts, ``k`` a token.
    norm_topk_prob : bool
        With ``mlp="moe"``: renormalise the ``k`` gates (Qwen3-MoE's option).
    moe_hidden_dim : int, optional
        With ``mlp="moe"``: each expert's width (``moe_intermediate_size``).
    qkv_bias, out_bias : bool
        Biases of the query/key/value projections and of the output projection.
    qk_norm : bool
        RMSNorm of each head's queries and keys before RoPE (Qwen3, Gemma 3).
    scale : float, optional
        The score scale (default ``1 / sqrt(D)``).
    attn_softcap : float, optional
        Gemma 2's attention-logit soft-cap.
    layer_types : tuple of str, optional
        One of ``LAYER_TYPES`` (``"full_attention"``, ``"sliding_attention"``) a layer (default all ``"full_attention"``).
    sliding_window : int, optional
        The window of the ``"sliding_attention"`` layers: query ``i`` sees
        keys ``i - sliding_window < j <= i`` (Hugging Face's meaning).
    positions : {"learned", "rope"}
        A learned position table added to the token vectors (GPT-2), or RoPE in
        every attention (layout ``"half"``, Hugging Face's ``rotate_half``).
    rope_base : float
        ``rope_theta`` of the full-attention layers.
    rope_local_base : float, optional
        ``rope_theta`` of the sliding layers (Gemma 3's ``rope_local_base_freq``;
        default ``rope_base``).
    rope_scaling : mapping, optional
        Hugging Face's rope-scaling mapping (``"linear"``, ``"llama3"``,
        ``"yarn"``: ``qkvnp.ops.rope_scaling.rope_inverse_frequency``),
        applied to the full-attention layers; the sliding layers too unless
        ``rope_local_base`` is set (Gemma 3 scales its global layers only).
    embed_scale : float, optional
        The token embeddings are multiplied by it (Gemma: ``sqrt(E)``).
    tie_embeddings : bool
        The head reads the embedding table (one parameter used twice).
    final_softcap : float, optional
        ``final_softcap * tanh(logits / final_softcap)`` (Gemma 2).
    init_std : float
        The token (and position) tables start ``N(0, init_std**2)``, as
        transformers' ``initializer_range`` (default 0.02): a tied head then
        starts with small logits (a standard-normal table gives logits of
        order ``sqrt(E)``). The projections start as PyTorch's ``nn.Linear``.
        Loading weights (:func:`qkvnp.interop.from_hf`) replaces them all.
    family : str, optional
        The Hugging Face ``model_type`` the config expresses (set by the
        presets and :func:`qkvnp.interop.from_hf`; :func:`qkvnp.interop.to_hf`
        reads it for the names).

    Raises
    ------
    TypeError, ValueError
        When made, naming the first bad field.

    Examples
    --------
    >>> cfg = DecoderConfig.llama3(vocab_size=50, emb_dim=16, num_layers=2, num_heads=4,
    ...                            num_kv_heads=2, hidden_dim=24)
    >>> cfg.norm, cfg.mlp, cfg.positions, cfg.head_dim
    ('rms', 'swiglu', 'rope', 4)
    """

    vocab_size: int
    emb_dim: int
    num_layers: int
    num_heads: int
    hidden_dim: int
    context_length: int = 2048
    head_dim: int | None = None
    num_kv_heads: int | None = None
    norm: str = "rms"
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False
    placement: str = "pre"
    mlp: str = "swiglu"
    num_experts: int | None = None
    top_k: int | None = None
    norm_topk_prob: bool = False
    moe_hidden_dim: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    scale: float | None = None
    attn_softcap: float | None = None
    layer_types: tuple | None = None
    sliding_window: int | None = None
    positions: str = "rope"
    rope_base: float = 10000.0
    rope_local_base: float | None = None
    rope_scaling: Any = None
    embed_scale: float | None = None
    tie_embeddings: bool = False
    final_softcap: float | None = None
    init_std: float = 0.02
    family: str | None = None

    def __post_init__(self):
        for name in ("vocab_size", "emb_dim", "num_layers", "num_heads", "hidden_dim",
                     "context_length"):
            _positive_int(getattr(self, name), name)
        if self.head_dim is None:
            if self.emb_dim % self.num_heads:
                raise ValueError(f"DecoderConfig.head_dim must be given when num_heads="
                                 f"{self.num_heads} does not divide emb_dim={self.emb_dim}")
            object.__setattr__(self, "head_dim", self.emb_dim // self.num_heads)
        _positive_int(self.head_dim, "head_dim")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive_int(self.num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DecoderConfig.num_kv_heads must divide num_heads="
                             f"{self.num_heads}, got {self.num_kv_heads}")
        for name, kinds in (("norm", NORM_KINDS), ("placement", BLOCK_PLACEMENTS),
                            ("mlp", MLP_KINDS), ("positions", POSITION_KINDS)):
            if getattr(self, name) not in kinds:
                raise ValueError(f"DecoderConfig.{name} must be one of {kinds}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("norm_unit_offset", "norm_topk_prob", "qkv_bias", "out_bias", "qk_norm",
                     "tie_embeddings"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"DecoderConfig.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        _positive_float(self.norm_eps, "norm_eps")
        for name in ("attn_softcap", "final_softcap", "embed_scale", "rope_local_base", "scale"):
            _positive_float(getattr(self, name), name, allow_none=True)
        _positive_float(self.rope_base, "rope_base")
        _positive_float(self.init_std, "init_std")
        self._check_more()

    def _check_more(self):
        """The fields that depend on others: MoE sizes, layer types, RoPE, family."""
        if self.mlp == "moe":
            for name in ("num_experts", "top_k", "moe_hidden_dim"):
                if getattr(self, name) is None:
                    raise ValueError(f"DecoderConfig.{name} must be given with mlp='moe'")
                _positive_int(getattr(self, name), name)
            if self.top_k > self.num_experts:
                raise ValueError(f"DecoderConfig.top_k must be <= num_experts="
                                 f"{self.num_experts}, got {self.top_k}")
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if not isinstance(self.layer_types, (tuple, list)) or len(self.layer_types) != \
                self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"DecoderConfig.layer_types must hold num_layers={self.num_layers} "
                             f"entries of {LAYER_TYPES}, got {self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if "sliding_attention" in self.layer_types:
            if self.sliding_window is None:
                raise ValueError("DecoderConfig.sliding_window must be given when layer_types "
                                 "has 'sliding_attention'")
            _positive_int(self.sliding_window, "sliding_window")
        if self.rope_scaling is not None:
            try:
                rope_inverse_frequency(self.head_dim, self.rope_base, self.rope_scaling)
            except (TypeError, ValueError) as error:
                raise type(error)(f"DecoderConfig.rope_scaling: {error}") from None
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even with RoPE, got {self.head_dim}")
        if self.family is not None and self.family not in _FAMILIES:
            raise ValueError(f"DecoderConfig.family must be None or one of {_FAMILIES}, got "
                             f"{self.family!r}")

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for a full-attention layer."""
        kind = (self.layer_types or ("full_attention",) * self.num_layers)[layer]
        return self.sliding_window if kind == "sliding_attention" else None

    # ------------------------------------------------------------ family presets

    @classmethod
    def gpt2(cls, *, vocab_size: int = 50257, emb_dim: int = 768, num_layers: int = 12,
             num_heads: int = 12, context_length: int = 1024, hidden_dim: int | None = None,
             norm_eps: float = 1e-5) -> DecoderConfig:
        """GPT-2: LayerNorm before each branch, GELU MLP with biases, learned positions, tied head."""
        return cls(vocab_size, emb_dim, num_layers, num_heads, hidden_dim or 4 * emb_dim,
                   context_length, norm="layer", norm_eps=norm_eps, mlp="gelu", qkv_bias=True,
                   out_bias=True, positions="learned", tie_embeddings=True, family="gpt2")

    @classmethod
    def llama3(cls, *, vocab_size: int, emb_dim: int, num_layers: int, num_heads: int,
               hidden_dim: int, num_kv_heads: int | None = None, context_length: int = 8192,
               rope_base: float = 500000.0, norm_eps: float = 1e-5,
               tie_embeddings: bool = False, head_dim: int | None = None,
               rope_scaling: Any = None) -> DecoderConfig:
        """Llama 3: RMSNorm, SwiGLU, RoPE (3.1 on: ``rope_scaling`` of type ``"llama3"``), GQA."""
        return cls(vocab_size, emb_dim, num_layers, num_heads, hidden_dim, context_length,
                   head_dim=head_dim, num_kv_heads=num_kv_heads, norm_eps=norm_eps,
                   rope_base=rope_base, rope_scaling=rope_scaling,
                   tie_embeddings=tie_embeddings, family="llama")

    @classmethod
    def mistral(cls, *, vocab_size: int, emb_dim: int, num_layers: int, num_heads: int,
                hidden_dim: int, num_kv_heads: int | None = None, context_length: int = 32768,
                rope_base: float = 10000.0, norm_eps: float = 1e-6,
                sliding_window: int | None = 4096, head_dim: int | None = None) -> DecoderConfig:
        """Mistral: Llama's layers, every layer windowed when ``sliding_window`` is set."""
        kind = "full_attention" if sliding_window is None else "sliding_attention"
        return cls(vocab_size, emb_dim, num_layers, num_heads, hidden_dim, context_length,
                   head_dim=head_dim, num_kv_heads=num_kv_heads, norm_eps=norm_eps,
                   rope_base=rope_base, layer_types=(kind,) * num_layers,
                   sliding_window=sliding_window, family="mistral")

    @classmethod
    def qwen3(cls, *, vocab_size: int, emb_dim: int, num_layers: int, num_heads: int,
              hidden_dim: int, head_dim: int = 128, num_kv_heads: int | None = None,
              context_length: int = 40960, rope_base: float = 1000000.0,
              norm_eps: float = 1e-6, tie_embeddings: bool = False) -> DecoderConfig:
        """Qwen3: Llama's layers with QK-norm and a head dim of its own."""
        return cls(vocab_size, emb_dim, num_layers, num_heads, hidden_dim, context_length,
                   head_dim=head_dim, num_kv_heads=num_kv_heads, norm_eps=norm_eps,
                   qk_norm=True, rope_base=rope_base, tie_embeddings=tie_embeddings,
                   family="qwen3")

    @classmethod
    def qwen3_moe(cls, *, vocab_size: int, emb_dim: int, num_layers: int, num_heads: int,
                  moe_hidden_dim: int, num_experts: int, top_k: int, head_dim: int = 128,
                  num_kv_heads: int | None = None, norm_topk_prob: bool = True,
                  context_length: int = 40960, rope_base: float = 1000000.0,
                  norm_eps: float = 1e-6) -> DecoderConfig:
        """Qwen3-MoE: Qwen3 with a mixture of SwiGLU experts in every layer."""
        return cls(vocab_size, emb_dim, num_layers, num_heads, moe_hidden_dim, context_length,
                   head_dim=head_dim, num_kv_heads=num_kv_heads, norm_eps=norm_eps,
                   mlp="moe", num_experts=num_experts, top_k=top_k,
                   norm_topk_prob=norm_topk_prob, moe_hidden_dim=moe_hidden_dim, qk_norm=True,
                   rope_base=rope_base, family="qwen3_moe")

    @classmethod
    def gemma3(cls, *, vocab_size: int, emb_dim: int, num_layers: int, num_heads: int,
               hidden_dim: int, head_dim: int = 256, num_kv_heads: int | None = None,
               query_pre_attn_scalar: float = 256, sliding_window: int = 512,
               layer_types: tuple | None = None, context_length: int = 131072,
               rope_base: float = 1000000.0, rope_local_base: float = 10000.0,
               norm_eps: float = 1e-6) -> DecoderConfig:
        """Gemma 3 (text): sandwich RMSNorms with ``(1 + weight)``, GeGLU, QK-norm, scaled
        embeddings, tied head, five sliding layers for one global (``layer_types``)."""
        if layer_types is None:
            layer_types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(num_layers))
        # NOTE: transformers holds sqrt(E) in a float32 buffer, cast to the model's dtype
        embed_scale = float(np.float32(math.sqrt(emb_dim)))
        return cls(vocab_size, emb_dim, num_layers, num_heads, hidden_dim, context_length,
                   head_dim=head_dim, num_kv_heads=num_kv_heads, norm_eps=norm_eps,
                   norm_unit_offset=True, placement="sandwich", mlp="geglu", qk_norm=True,
                   scale=float(query_pre_attn_scalar) ** -0.5, layer_types=layer_types,
                   sliding_window=sliding_window, rope_base=rope_base,
                   rope_local_base=rope_local_base, embed_scale=embed_scale,
                   tie_embeddings=True, family="gemma3_text")
