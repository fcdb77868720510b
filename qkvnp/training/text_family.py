"""The text task's model on a family's config (``train --task text --family qwen3``).

Shape key: V = 256 byte values, T context, E embedding, H query heads, K
key/value heads, D head dim, F feed-forward width, X experts, k experts a token.

Without ``--family`` the text task trains the book's :class:`~qkvnp.GPTModel`
(:mod:`qkvnp.training.text`). With it, a :class:`~qkvnp.Decoder` built from
that family's preset (:class:`~qkvnp.DecoderConfig`) with the task's sizes:

========== ============================================================
task       decoder
========== ============================================================
context    ``context_length`` (also the learned table's rows, GPT-2)
emb_dim    ``E``
num_heads  ``H``; ``D = E // H`` (Qwen3's and Gemma 3's own head dims
           would make a byte model mostly attention)
num_layers ``L``
kv_heads   ``K`` (not GPT-2's: it has no grouped-query attention)
window     Mistral's window on every layer; Gemma 3's sliding layers'
           (default ``T // 2``: five local layers to one global)
========== ============================================================

Derived: ``F = 4 E`` for GPT-2's GELU MLP, ``8 E / 3`` rounded up to a
multiple of 8 for the gated MLPs (the same parameters as ``4 E`` ungated);
Qwen3-MoE has ``X = 8`` experts of width ``F / 2`` rounded up to 8, ``k = 2``
a token (the active width is ``F``); Gemma 3's score scale is ``D ** -0.5``
(``query_pre_attn_scalar = D``). The header of a run prints them.

Options a family cannot take are refused by name: ``--dropout`` (the
decoder has none), ``--rope`` (the rotary families always rotate, GPT-2
never does), ``--kv-heads`` for GPT-2, ``--window`` outside Mistral and
Gemma 3, and ``--softcap`` (Gemma 2's attention soft-cap: transformers'
Gemma 3 does not apply it, so no family here has it).
"""
from __future__ import annotations

__all__ = ["FAMILIES", "check_family", "decoder_config", "describe", "family_parameter_floor"]

#: The ``--family`` choices, in the order of the guide (``docs/families.md``).
FAMILIES = ("gpt2", "llama3", "mistral", "qwen3", "qwen3_moe", "gemma3")
_ROTARY = ("llama3", "mistral", "qwen3", "qwen3_moe", "gemma3")
_WINDOWED = ("mistral", "gemma3")
_EXPERTS, _TOP_K = 8, 2


def check_family(config):
    """Refuse ``config``'s options that its family cannot take (``ValueError`` naming both).

    A ``config`` without a family (the book's GPT) passes.
    """
    family = config.family
    if family is None:
        return
    if family not in FAMILIES:
        raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, got {family!r}")
    refused = []
    if config.dropout:
        refused.append(("--dropout", "the decoder has no dropout"))
    if config.rope:
        refused.append(("--rope", "its positions are rotary already" if family in _ROTARY
                        else "its positions are a learned table"))
    if config.kv_heads is not None and family == "gpt2":
        refused.append(("--kv-heads", "it has no grouped-query attention"))
    if config.window is not None and family not in _WINDOWED:
        refused.append(("--window", "it has no sliding window (mistral and gemma3 have)"))
    if config.softcap is not None:
        refused.append(("--softcap", "it has no attention soft-cap"))
    if refused:
        name, why = refused[0]
        raise ValueError(f"{name} is not an option of --family {family}: {why}")
    if family in _ROTARY and (config.emb_dim // config.num_heads) % 2:
        raise ValueError(f"--family {family} uses RoPE, which rotates pairs: the head dim "
                         f"--emb-dim / --num-heads must be even, got "
                         f"{config.emb_dim // config.num_heads}")


def _round8(width):
    return -(-int(width) // 8) * 8


def _sizes(config):
    """``(D, F, moe width)``: the derived head dim and feed-forward widths."""
    head_dim = config.emb_dim // config.num_heads
    hidden = 4 * config.emb_dim if config.family == "gpt2" else _round8(8 * config.emb_dim / 3)
    return head_dim, hidden, _round8(hidden / _TOP_K)


def decoder_config(config):
    """The :class:`~qkvnp.DecoderConfig` of ``config``'s family with its sizes (vocabulary 256)."""
    from ..models.decoder import DecoderConfig

    family = config.family
    head_dim, hidden, moe_hidden = _sizes(config)
    shared = dict(vocab_size=256, emb_dim=config.emb_dim, num_layers=config.num_layers,
                  num_heads=config.num_heads, context_length=config.context)
    if family == "gpt2":
        return DecoderConfig.gpt2(hidden_dim=hidden, **shared)
    shared.update(num_kv_heads=config.kv_heads, head_dim=head_dim)
    if family == "llama3":
        return DecoderConfig.llama3(hidden_dim=hidden, **shared)
    if family == "mistral":
        return DecoderConfig.mistral(hidden_dim=hidden, sliding_window=config.window, **shared)
    if family == "qwen3":
        return DecoderConfig.qwen3(hidden_dim=hidden, **shared)
    if family == "qwen3_moe":
        return DecoderConfig.qwen3_moe(moe_hidden_dim=moe_hidden, num_experts=_EXPERTS,
                                       top_k=_TOP_K, **shared)
    window = config.window if config.window is not None else max(1, config.context // 2)
    return DecoderConfig.gemma3(hidden_dim=hidden, query_pre_attn_scalar=head_dim,
                                sliding_window=window, **shared)


def describe(config):
    """The header's model line of a family run: the preset's name and the derived sizes."""
    cfg = decoder_config(config)
    parts = [f"vocab 256, context {cfg.context_length}, width {cfg.emb_dim}, "
             f"{cfg.num_heads} heads of {cfg.head_dim}, {cfg.num_kv_heads} key/value heads, "
             f"{cfg.num_layers} layers"]
    if cfg.mlp == "moe":
        parts.append(f"{cfg.num_experts} experts of width {cfg.moe_hidden_dim}, top {cfg.top_k}")
    else:
        parts.append(f"{cfg.mlp} MLP of width {cfg.hidden_dim}")
    if cfg.sliding_window is not None:
        sliding = sum(kind == "sliding_attention" for kind in cfg.layer_types)
        parts.append(f"window {cfg.sliding_window} on {sliding} of {cfg.num_layers} layers")
    return f"Decoder({config.family}: {', '.join(parts)})"


def family_parameter_floor(config):
    """A lower bound of the parameters of a family's decoder, computed without building it.

    The 256-row token table (the head may be tied to it), and per block the
    query and output projections, ``2 E^2`` (``H D = E``).
    """
    return 256 * config.emb_dim + config.num_layers * 2 * config.emb_dim * config.emb_dim
