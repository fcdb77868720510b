"""Hugging Face transformers' decoders in and out of qkvnp's :class:`~qkvnp.models.decoder.Decoder`.

Shape key: E embedding (``hidden_size``), V vocabulary, H query heads, K
key/value heads, D head dim, F the MLP's width, X experts.

:func:`from_hf` builds a :class:`~qkvnp.models.decoder.Decoder` from a
transformers model object (anything with ``.config.to_dict()`` and
``.state_dict()``; tensors converted by duck typing, never importing torch
or transformers); :func:`to_hf` gives its parameters, or gradients, under the
names of that model's ``named_parameters()``. The architectures
(:data:`HF_ARCHITECTURES`) and how each maps:

==========================  ==============  ==========================================
transformers class          ``model_type``  qkvnp
==========================  ==============  ==========================================
``GPT2LMHeadModel``         gpt2            ``DecoderConfig.gpt2``; ``c_attn`` splits
                                            into ``q/k/v_proj`` (Conv1D: no transpose)
``LlamaForCausalLM``        llama           ``DecoderConfig.llama3``
``MistralForCausalLM``      mistral         ``DecoderConfig.mistral``
``Qwen3ForCausalLM``        qwen3           ``DecoderConfig.qwen3``
``Qwen3MoeForCausalLM``     qwen3_moe       ``DecoderConfig.qwen3_moe``; the fused
                                            ``experts.gate_up_proj (X, 2F, E)`` splits
``Gemma3ForCausalLM``       gemma3_text     ``DecoderConfig.gemma3``
==========================  ==============  ==========================================

torch's ``nn.Linear`` stores ``weight = W.T``. A tied table comes once, under
the name transformers keeps (``transformer.wte.weight``,
``model.embed_tokens.weight``).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from .._checks import as_numpy

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike

__all__ = ["HF_ARCHITECTURES", "from_hf", "to_hf", "save_hf"]

#: The transformers classes :func:`from_hf` accepts, and their ``model_type``.
HF_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
                    "MistralForCausalLM": "mistral", "Qwen3ForCausalLM": "qwen3",
                    "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma3ForCausalLM": "gemma3_text"}

# bookkeeping entries of a config: they do not change the forward
_BOOKKEEPING = {
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "_name_or_path", "model_type", "output_attentions", "tokenizer_class",
    "task_specific_params", "prefix", "sep_token_id", "decoder_start_token_id",
    "tie_encoder_decoder", "_attn_implementation_autoset", "finetuning_task",
}
# dropout rates: the Decoder has no dropout (evaluation semantics); documented in from_hf
_DROPOUT = {"resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout",
            "summary_first_dropout"}


def _architecture(source, config):
    """The ``model_type`` of ``source`` (None: a directory's config), or a ``ValueError``."""
    name = type(source).__name__
    if source is not None and name in HF_ARCHITECTURES:
        return HF_ARCHITECTURES[name]
    named = config.get("architectures") or []
    if len(named) == 1 and named[0] in HF_ARCHITECTURES:
        return HF_ARCHITECTURES[named[0]]
    if source is None and not named and config.get("model_type") in HF_ARCHITECTURES.values():
        return config["model_type"]
    shown = named[0] if named else f"{name} (model_type {config.get('model_type')!r})"
    raise ValueError(f"from_hf does not support the architecture {shown}; supported: "
                     f"{sorted(HF_ARCHITECTURES)}")


class _Reader:
    """Reads a config dict's entries, then refuses every entry not read, by name."""

    def __init__(self, config, family):
        self.config, self.family, self.read = config, family, set(_BOOKKEEPING | _DROPOUT)

    def get(self, key, default=None):
        self.read.add(key)
        return self.config.get(key, default)

    def expect(self, key, allowed, default=None):
        """The entry ``key``, refused unless it is one of ``allowed``."""
        value = self.get(key, default)
        if value not in allowed:
            raise ValueError(f"from_hf: {self.family}'s config option {key}={value!r} cannot be "
                             f"expressed by qkvnp's Decoder (supported: {list(allowed)})")
        return value

    def finish(self):
        unknown = sorted(set(self.config) - self.read)
        if unknown:
            raise ValueError(f"from_hf: {self.family}'s config options {unknown} are unknown to "
                             "qkvnp's Decoder; refused rather than dropped")


def _rope(reader, parameters, where="rope_parameters"):
    """``(rope_theta, scaling)`` of a ``rope_parameters`` dict; scaling None when ``"default"``.

    A scaling the Decoder lacks (``"dynamic"``, ``"longrope"``...) or a key it
    does not know is refused by name, with ``where`` in the message.
    """
    from ..ops.rope_scaling import rope_inverse_frequency

    parameters = dict(parameters or {})
    base = float(parameters.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default" and set(parameters) <= {"rope_theta", "rope_type", "type"}:
        return base, None
    head_dim = 2  # the keys and the type are checked here; the head dim by DecoderConfig
    try:
        rope_inverse_frequency(head_dim, base, parameters)
    except (TypeError, ValueError) as error:
        raise ValueError(f"from_hf: {reader.family}'s config option {where} cannot be "
                         f"expressed by qkvnp's Decoder: {error}") from None
    return base, parameters


def _gpt2_config(r):
    from ..models.decoder import DecoderConfig

    # the defaults are GPT2Config's: a config.json may leave them out
    r.expect("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    r.expect("scale_attn_weights", (True,), True)
    r.expect("scale_attn_by_inverse_layer_idx", (False,), False)
    r.expect("reorder_and_upcast_attn", (False,), False)
    r.expect("add_cross_attention", (False,), False)
    r.get("n_ctx")  # older configs' copy of n_positions, unread by transformers
    for key in ("summary_type", "summary_use_proj", "summary_activation",
                "summary_proj_to_labels"):  # GPT2DoubleHeadsModel's head, not this model's
        r.get(key)
    cfg = DecoderConfig.gpt2(vocab_size=r.get("vocab_size"), emb_dim=r.get("n_embd"),
                             num_layers=r.get("n_layer"), num_heads=r.get("n_head"),
                             context_length=r.get("n_positions"), hidden_dim=r.get("n_inner"),
                             norm_eps=r.get("layer_norm_epsilon"))
    return cfg, bool(r.get("tie_word_embeddings", True))


def _llama_like_config(r):
    """Llama, Mistral, Qwen3, Qwen3-MoE and Gemma 3's common entries, as DecoderConfig fields."""
    family = r.family
    act_key = "hidden_activation" if family == "gemma3_text" else "hidden_act"
    act = "gelu_pytorch_tanh" if family == "gemma3_text" else "silu"
    r.expect(act_key, (act,), act)
    bias = bool(r.get("attention_bias", False))
    fields = dict(vocab_size=r.get("vocab_size"), emb_dim=r.get("hidden_size"),
                  num_layers=r.get("num_hidden_layers"), num_heads=r.get("num_attention_heads"),
                  num_kv_heads=r.get("num_key_value_heads"), head_dim=r.get("head_dim"),
                  context_length=r.get("max_position_embeddings"), norm_eps=r.get("rms_norm_eps"),
                  hidden_dim=r.get("intermediate_size"), qkv_bias=bias, out_bias=bias,
                  tie_embeddings=bool(r.get("tie_word_embeddings", False)), family=family)
    if family == "llama":
        r.expect("pretraining_tp", (1,), 1)
        r.expect("mlp_bias", (False,), False)
    if family == "mistral":
        window = r.get("sliding_window")
        kind = "full_attention" if window is None else "sliding_attention"
        fields.update(layer_types=(kind,) * fields["num_layers"], sliding_window=window)
    if family in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
        uses_window = r.get("use_sliding_window", False)
        r.get("max_window_layers")
        types = r.get("layer_types")
        if types is None and uses_window:
            raise ValueError(f"from_hf: {family}'s config option use_sliding_window=True "
                             "without layer_types cannot be expressed by qkvnp's Decoder")
        fields.update(layer_types=None if types is None else tuple(types),
                      sliding_window=r.get("sliding_window"))
    rope = r.get("rope_parameters")
    if family == "gemma3_text":
        rope = dict(rope or {})
        fields["rope_base"], fields["rope_scaling"] = _rope(
            r, rope.pop("full_attention", None), "rope_parameters.full_attention")
        fields["rope_local_base"], local_scaling = _rope(
            r, rope.pop("sliding_attention", None), "rope_parameters.sliding_attention")
        if local_scaling is not None:
            raise ValueError("from_hf: gemma3_text's config option rope_parameters."
                             "sliding_attention scales RoPE: qkvnp's Decoder scales the global "
                             "layers only, as Gemma 3's checkpoints do")
        if rope:
            raise ValueError(f"from_hf: gemma3_text's config options rope_parameters."
                             f"{sorted(rope)} cannot be expressed by qkvnp's Decoder")
    else:
        fields["rope_base"], fields["rope_scaling"] = _rope(r, rope)
    return fields


def _family_config(r):
    """The DecoderConfig of a non-GPT-2 family, and whether its head is tied."""
    from ..models.decoder import DecoderConfig

    fields = _llama_like_config(r)
    if r.family == "qwen3_moe":
        r.expect("decoder_sparse_step", (1,), 1)
        r.expect("mlp_only_layers", ([],), [])
        r.expect("output_router_logits", (False,), False)
        r.get("router_aux_loss_coef")
        fields.update(mlp="moe", num_experts=r.get("num_experts", r.get("num_local_experts")),
                      top_k=r.get("num_experts_per_tok"), norm_topk_prob=bool(r.get("norm_topk_prob")),
                      moe_hidden_dim=r.get("moe_intermediate_size"))
        r.get("num_local_experts")
        fields["hidden_dim"] = fields["moe_hidden_dim"]  # the dense MLP's width is unused
    if r.family == "gemma3_text":
        r.expect("use_bidirectional_attention", (False, None), False)
        r.get("_sliding_window_pattern")  # layer_types is what the model reads
        if r.get("attn_logit_softcapping") is not None:
            # NOTE: transformers' Gemma3Attention does not pass it to its attention:
            # honouring it would not be transformers' model, dropping it would be silent
            raise ValueError("from_hf: gemma3_text's config option attn_logit_softcapping="
                             f"{r.config['attn_logit_softcapping']!r} is refused: transformers' "
                             "Gemma3Attention does not apply it (set it to None)")
        fields.update(
            norm_unit_offset=True, placement="sandwich", mlp="geglu", qk_norm=True,
            scale=float(r.get("query_pre_attn_scalar")) ** -0.5,
            layer_types=tuple(r.get("layer_types")), sliding_window=r.get("sliding_window"),
            final_softcap=r.get("final_logit_softcapping"),
            embed_scale=float(np.float32(np.sqrt(fields["emb_dim"]))))
    return DecoderConfig(**fields), fields["tie_embeddings"]


def _config(config, family):
    """The DecoderConfig of a config dict, every entry read or refused."""
    reader = _Reader(config, family)
    cfg, _ = _gpt2_config(reader) if family == "gpt2" else _family_config(reader)
    if family == "gpt2" and not reader.config.get("tie_word_embeddings", True):
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    reader.finish()
    return cfg


# ---------------------------------------------------------------- names


def _transposed(name):
    """A spec: one qkvnp array that is the transpose of the HF one."""
    return name, [name], lambda arrays: arrays[0].T, lambda array: [array.T]


def _gpt2_specs(cfg):
    """``(hf name, qkvnp names, to_hf, from_hf)`` of GPT-2's parameters."""
    specs = [("transformer.wte.weight", ["embed.weight"]),
             ("transformer.wpe.weight", ["pos_embed.weight"])]
    for i in range(cfg.num_layers):
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        attn = [f"{ours}self_attn.{p}_proj" for p in "qkv"]
        specs += [(hf + "ln_1.weight", [ours + "attn_norm.scale"]),
                  (hf + "ln_1.bias", [ours + "attn_norm.shift"]),
                  (hf + "attn.c_attn.weight", [f"{name}.W" for name in attn], "split"),
                  (hf + "attn.c_attn.bias", [f"{name}.b" for name in attn], "split"),
                  (hf + "attn.c_proj.weight", [ours + "self_attn.o_proj.W"]),
                  (hf + "attn.c_proj.bias", [ours + "self_attn.o_proj.b"]),
                  (hf + "ln_2.weight", [ours + "mlp_norm.scale"]),
                  (hf + "ln_2.bias", [ours + "mlp_norm.shift"]),
                  (hf + "mlp.c_fc.weight", [ours + "mlp.layers.0.W"]),
                  (hf + "mlp.c_fc.bias", [ours + "mlp.layers.0.b"]),
                  (hf + "mlp.c_proj.weight", [ours + "mlp.layers.2.W"]),
                  (hf + "mlp.c_proj.bias", [ours + "mlp.layers.2.b"])]
    specs += [("transformer.ln_f.weight", ["final_norm.scale"]),
              ("transformer.ln_f.bias", ["final_norm.shift"])]
    out = []
    for hf, names, *split in specs:
        if split:  # Conv1D's (E, 3E) holds [W_q, W_k, W_v] side by side
            out.append((hf, names, lambda arrays: np.concatenate(arrays, axis=-1),
                        lambda array: np.split(array, 3, axis=-1)))
        else:  # Conv1D stores x @ W's W as is
            out.append((hf, names, lambda arrays: arrays[0], lambda array: [array]))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ["head.W"], lambda a: a[0].T, lambda a: [a.T]))
    return out


def _moe_specs(hf, ours, cfg):
    X = cfg.num_experts
    names = [f"{ours}mlp.experts.{i}.{w}" for i in range(X) for w in ("W_gate", "W_up")]
    downs = [f"{ours}mlp.experts.{i}.W_down" for i in range(X)]

    def gate_up_to_hf(arrays):  # X pairs (E, F) -> (X, 2F, E)
        return np.stack([np.concatenate([arrays[2 * i].T, arrays[2 * i + 1].T]) for i in range(X)])

    def gate_up_from_hf(array):  # (X, 2F, E) -> X pairs (E, F)
        return [part.T for expert in array for part in np.split(expert, 2, axis=0)]

    return [(hf + "mlp.gate.weight", [ours + "mlp.router.W"], lambda a: a[0].T, lambda a: [a.T]),
            (hf + "mlp.experts.gate_up_proj", names, gate_up_to_hf, gate_up_from_hf),
            (hf + "mlp.experts.down_proj", downs, lambda a: np.stack([w.T for w in a]),
             lambda array: [w.T for w in array])]


def _moe_file_specs(hf, ours, cfg):
    """A checkpoint file's experts: one ``(out, in)`` matrix each, as ``save_pretrained`` writes."""
    specs = [(hf + "mlp.gate.weight", [ours + "mlp.router.W"], lambda a: a[0].T, lambda a: [a.T])]
    for i in range(cfg.num_experts):
        for p, w in (("gate", "W_gate"), ("up", "W_up"), ("down", "W_down")):
            specs.append((f"{hf}mlp.experts.{i}.{p}_proj.weight", [f"{ours}mlp.experts.{i}.{w}"],
                          lambda a: a[0].T, lambda a: [a.T]))
    return specs


def _llama_specs(cfg, files=False):
    """``(hf name, qkvnp names, to_hf, from_hf)`` of the Llama-like families' parameters."""
    specs = [("model.embed_tokens.weight", ["embed.weight"], lambda a: a[0], lambda a: [a])]

    def same(hf, name):
        return hf, [name], lambda a: a[0], lambda a: [a]

    def linear(hf, name):
        return hf, [name], lambda a: a[0].T, lambda a: [a.T]

    sandwich = cfg.placement == "sandwich"
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        for p in ("q", "k", "v", "o"):
            specs.append(linear(f"{hf}self_attn.{p}_proj.weight", f"{ours}self_attn.{p}_proj.W"))
            if (cfg.qkv_bias if p != "o" else cfg.out_bias):
                specs.append(same(f"{hf}self_attn.{p}_proj.bias", f"{ours}self_attn.{p}_proj.b"))
        if cfg.qk_norm:
            specs += [same(f"{hf}self_attn.{p}_norm.weight", f"{ours}self_attn.{p}_norm.weight")
                      for p in ("q", "k")]
        if cfg.mlp == "moe":
            specs += (_moe_file_specs if files else _moe_specs)(hf, ours, cfg)
        else:
            specs += [linear(f"{hf}mlp.{p}_proj.weight", f"{ours}mlp.{p}_proj.W")
                      for p in ("gate", "up", "down")]
        specs.append(same(hf + "input_layernorm.weight", ours + "attn_norm.weight"))
        if sandwich:
            specs += [same(hf + "post_attention_layernorm.weight", ours + "attn_post_norm.weight"),
                      same(hf + "pre_feedforward_layernorm.weight", ours + "mlp_norm.weight"),
                      same(hf + "post_feedforward_layernorm.weight", ours + "mlp_post_norm.weight")]
        else:
            specs.append(same(hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight"))
    specs.append(same("model.norm.weight", "final_norm.weight"))
    if not cfg.tie_embeddings:
        specs.append(linear("lm_head.weight", "head.W"))
    return specs


def _specs(cfg, files=False):
    if cfg.family is None:
        raise ValueError("to_hf needs the model's family (DecoderConfig.family, set by the "
                         "presets and from_hf) to know transformers' names")
    # NOTE: files keep Qwen3-MoE's experts apart; transformers' modules fuse them
    return _gpt2_specs(cfg) if cfg.family == "gpt2" else _llama_specs(cfg, files)


# ---------------------------------------------------------------- in and out


class _StateDict:
    """A model object's state dict as the tensors :func:`_fill` reads."""

    def __init__(self, state):
        self.arrays = {name: as_numpy(value, f"state_dict[{name!r}]")
                       for name, value in state.items()}
        self.where, self.files_layout = "the state dict", False

    def names(self):
        return set(self.arrays)

    def shape(self, name):
        return self.arrays[name].shape

    def array(self, name):
        return self.arrays[name]

    def release(self, name):
        del self.arrays[name]


def _unpacked(unpack, array, names, params, hf, where):
    """``unpack(array)``'s parts, each checked against its parameter's shape."""
    try:
        parts = list(unpack(array))
    except (ValueError, IndexError):
        parts = []
    shapes = [params[name].shape for name in names]
    if [part.shape for part in parts] != shapes:
        raise ValueError(f"from_hf: {where}'s {hf!r} has shape {tuple(array.shape)}, which "
                         f"does not give qkvnp's {names[:3]} of shapes {shapes[:3]}")
    return parts


def _legacy_rope(config, family):
    """A pre-5 config.json's ``rope_theta`` and ``rope_scaling`` as ``rope_parameters``."""
    if "rope_parameters" in config or family == "gpt2":
        return config
    config = dict(config)
    full = dict(config.pop("rope_scaling", None) or {})
    full["rope_theta"] = config.pop("rope_theta", 1e6 if family == "gemma3_text" else 1e4)
    full.setdefault("rope_type", full.pop("type", "default"))
    if family == "gemma3_text":
        local = config.pop("rope_local_base_freq", 10000.0)
        config["rope_parameters"] = {"full_attention": full, "sliding_attention":
                                     {"rope_type": "default", "rope_theta": local}}
    else:
        config["rope_parameters"] = full
    return config


def _check_names(cfg, tensors, family):
    """Every tensor the config needs is there, no other, and the table fits: before allocating."""
    specs = _specs(cfg, tensors.files_layout)
    names = tensors.names()
    if cfg.tie_embeddings:
        names.discard("lm_head.weight")  # the same tensor as the table
    missing = [hf for hf, *_ in specs if hf not in names]
    if missing:
        raise ValueError(f"from_hf: {tensors.where} has no {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    unknown = sorted(names - {hf for hf, *_ in specs})
    if unknown:
        raise ValueError(f"from_hf: {tensors.where}'s entries {unknown[:5]} are unknown to "
                         f"qkvnp's Decoder for {family}; refused rather than dropped")
    table = specs[0][0]  # the token table: (V, E) as the config says
    if tuple(tensors.shape(table)) != (cfg.vocab_size, cfg.emb_dim):
        raise ValueError(f"from_hf: {tensors.where}'s {table!r} has shape "
                         f"{tuple(tensors.shape(table))}, the config says "
                         f"({cfg.vocab_size}, {cfg.emb_dim})")
    return specs


def _fill(model, tensors, specs):
    """Write each of ``tensors``' arrays into the model's, in place: all checked first.

    ``specs`` are :func:`_check_names`' of the model's config and ``tensors``.

    NOTE: one tensor at a time, converted (transposed, widened, cast) straight
    into its parameter and then released: the model is held once, never a
    second copy of it. The largest go first, while the model's pages are
    still untouched: the one tensor in flight adds least to the peak then.
    """
    params = model.params
    for hf, ours, _, unpack in specs:  # shapes only: zero-stride stand-ins, nothing read
        stand_in = np.broadcast_to(np.empty((), np.float32), tensors.shape(hf))
        _unpacked(unpack, stand_in, ours, params, hf, tensors.where)
    specs.sort(key=lambda spec: -int(np.prod(tensors.shape(spec[0]), dtype=np.int64)))
    for hf, ours, _, unpack in specs:
        array = tensors.array(hf)
        for name, part in zip(ours, _unpacked(unpack, array, ours, params, hf, tensors.where)):
            np.copyto(params[name], part, casting="unsafe")
            if not np.isfinite(params[name]).all():
                raise ValueError(f"from_hf: {tensors.where}'s {hf!r} holds NaN or inf")
        del array, part
        tensors.release(hf)
    return model


def from_hf(source: Any, *, dtype: DTypeLike = np.float64) -> Any:
    """A :class:`~qkvnp.models.decoder.Decoder` holding a transformers model's weights.

    Parameters
    ----------
    source : transformers model, or str or os.PathLike
        One of :data:`HF_ARCHITECTURES`, or anything with ``.config``
        (``to_dict()``, whose ``architectures`` or the object's class name
        says which) and ``.state_dict()`` of tensors or arrays; or a
        directory as ``save_pretrained`` writes it: ``config.json`` and
        ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
        (read by ``qkvnp.interop.safetensors``, memory-mapped; no torch needed).
    dtype : float dtype, keyword-only
        The Decoder's dtype (bfloat16 tensors go through float32, exactly).

    Returns
    -------
    Decoder
        Its ``config.family`` is the ``model_type``, so :func:`to_hf` knows the names.

    Raises
    ------
    ValueError
        For another architecture (naming it and the supported ones), for a
        config option the Decoder cannot express (naming it: RoPE scaling,
        ``scale_attn_by_inverse_layer_idx``, a sliding window without
        ``layer_types``...), for a tensor it does not know, lacks, or whose
        shape does not fit, and for NaN or inf; from a directory also for a
        ``config.json`` with missing or absurd sizes, an index naming a
        tensor twice or naming one its shard lacks, and a malformed
        safetensors file (:class:`~qkvnp.interop.safetensors.SafetensorsError`):
        each message names the file. The names and the table's size are
        checked before the model is allocated, every tensor's shape before
        any tensor is read.
    FileNotFoundError
        A directory without ``config.json`` or weights, or a missing shard.

    Notes
    -----
    Dropout rates (``attention_dropout``, GPT-2's ``*_pdrop``) are not carried:
    the Decoder has no dropout, which is the evaluation mode's forward.

    The model is built with ``Decoder.empty`` and each tensor converted
    straight into its array: loading N parameters holds about N x the
    dtype's size, plus one tensor (``docs/checkpoints.md``).
    """
    from ..models.decoder import Decoder

    def build(source, config, tensors):
        family = _architecture(source, config)
        cfg = _config(_legacy_rope(config, family), family)  # a transformers 4 config too
        specs = _check_names(cfg, tensors, family)  # before allocating
        return _fill(Decoder.empty(cfg, dtype=dtype), tensors, specs)

    if isinstance(source, (str, os.PathLike)):
        from .hf_directory import open_directory

        config, tensors = open_directory(source)
        with tensors:
            return build(None, config, tensors)
    return build(source, source.config.to_dict(), _StateDict(source.state_dict()))


def to_hf(model: Any, *, grads: bool = False) -> dict[str, Any]:
    """The Decoder's parameters (or gradients) under transformers' ``named_parameters()`` names.

    Parameters
    ----------
    model : Decoder
        With ``config.family`` set (the presets and :func:`from_hf` set it).
    grads : bool, keyword-only
        The gradients instead of the parameters.

    Returns
    -------
    dict of str -> ndarray
        New arrays; a tied table once, under the name transformers keeps
        (``transformer.wte.weight``, ``model.embed_tokens.weight``).

    Raises
    ------
    ValueError
        If ``model`` holds LoRA adapters (:func:`qkvnp.layers.apply_lora`),
        naming them: transformers' model has no place for them, and no
        gradient of the frozen weights exists. Call
        :func:`qkvnp.layers.merge_lora` first for the merged weights.

    Examples
    --------
    >>> from qkvnp.models.decoder import Decoder, DecoderConfig
    >>> cfg = DecoderConfig.gpt2(vocab_size=20, emb_dim=8, num_layers=1, num_heads=2,
    ...                          context_length=16)
    >>> state = to_hf(Decoder(cfg, rng=0))
    >>> state["transformer.h.0.attn.c_attn.weight"].shape, "lm_head.weight" in state
    ((8, 24), False)
    """
    from ..layers.lora import adapted_layers

    adapted = adapted_layers(model)
    if adapted:
        # NOTE: refused rather than merged in silence: with grads=True no gradient of the
        # frozen W exists, and merged weights would hide that the model was adapted
        raise ValueError(f"model has LoRA adapters ({', '.join(adapted[:3])}"
                         f"{', ...' if len(adapted) > 3 else ''}): to_hf gives transformers' "
                         "weights, which have no adapters; call qkvnp.layers.merge_lora(model) "
                         "first for the merged weights")
    arrays = model.grads if grads else model.params
    return {hf: np.array(pack([arrays[name] for name in names]))
            for hf, names, pack, _ in _specs(model.config)}


# ---------------------------------------------------------------- a directory out


def _rope_parameters(base, scaling):
    return dict(scaling, rope_theta=base) if scaling else {"rope_type": "default",
                                                           "rope_theta": base}


def _gemma_entries(cfg):
    """Gemma 3's own entries of a config dict."""
    scalar = cfg.scale ** -2  # the score scale is query_pre_attn_scalar ** -0.5
    if float(round(scalar)) ** -0.5 == cfg.scale:
        scalar = round(scalar)
    local = cfg.rope_base if cfg.rope_local_base is None else cfg.rope_local_base
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": cfg.final_softcap, "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": _rope_parameters(cfg.rope_base,
                                                                   cfg.rope_scaling),
                                "sliding_attention": _rope_parameters(local, None)}}


def _hf_config(cfg, dtype_name):
    """transformers' ``config.json`` of ``cfg``, refused unless it reads back as ``cfg``."""
    family = cfg.family
    if family == "gpt2":
        config = {"vocab_size": cfg.vocab_size, "n_embd": cfg.emb_dim, "n_layer": cfg.num_layers,
                  "n_head": cfg.num_heads, "n_positions": cfg.context_length,
                  "n_inner": cfg.hidden_dim, "layer_norm_epsilon": cfg.norm_eps,
                  "activation_function": "gelu_new"}
        if cfg.vocab_size <= 50256:  # GPT2Config's default token ids lie outside a small vocabulary
            config.update(bos_token_id=None, eos_token_id=None)
    else:
        config = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.emb_dim,
                  "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                  "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                  "intermediate_size": cfg.hidden_dim, "rms_norm_eps": cfg.norm_eps,
                  "max_position_embeddings": cfg.context_length, "hidden_act": "silu",
                  "attention_bias": cfg.qkv_bias,
                  "rope_parameters": _rope_parameters(cfg.rope_base, cfg.rope_scaling)}
    sliding = "sliding_attention" in cfg.layer_types
    if family == "mistral":
        config["sliding_window"] = cfg.sliding_window if sliding else None
    if family in ("qwen3", "qwen3_moe", "gemma3_text"):
        config.update(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window)
    if family in ("qwen3", "qwen3_moe"):
        config["use_sliding_window"] = sliding
    if family == "qwen3_moe":
        config.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                      norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.moe_hidden_dim)
    if family == "gemma3_text":
        del config["hidden_act"]
        config.update(_gemma_entries(cfg))
    # NOTE: transformers 5 reads "dtype", earlier versions "torch_dtype"
    config.update(tie_word_embeddings=cfg.tie_embeddings, model_type=family, dtype=dtype_name,
                  torch_dtype=dtype_name,
                  architectures=[name for name, kind in HF_ARCHITECTURES.items()
                                 if kind == family])
    back = _config(dict(config), family)
    differ = [field.name for field in dataclasses.fields(cfg)
              if getattr(back, field.name) != getattr(cfg, field.name)]
    if differ:
        raise ValueError(f"save_hf: the DecoderConfig's {differ} cannot be written as a "
                         f"transformers {family} config")
    return config


def save_hf(model: Any, path: str | os.PathLike, *, dtype: Any = None) -> None:
    """Write a Decoder as a directory transformers' ``from_pretrained(path)`` loads.

    Parameters
    ----------
    model : Decoder
        With ``config.family`` set (the presets and :func:`from_hf` set it).
    path : str or os.PathLike
        The directory: made if absent (its parent must exist); an existing
        one's ``config.json`` and ``model.safetensors`` are replaced.
    dtype : numpy float dtype or "bfloat16", keyword-only, optional
        The stored dtype (default the model's; ``"bfloat16"`` rounds to nearest even).

    Raises
    ------
    ValueError
        A model without a family, a configuration transformers' config of
        that family cannot express, a ``path`` that is a file or holds a
        sharded checkpoint (``model.safetensors.index.json``): before
        anything is written.

    Notes
    -----
    Writes ``model.safetensors`` (``{"format": "pt"}`` metadata, Qwen3-MoE's
    experts one by one, a tied table once under the name transformers
    keeps) and ``config.json`` (``architectures``, ``model_type``,
    ``dtype`` and, for transformers before 5, ``torch_dtype``). Each file is
    written atomically, weights first: a reader never sees half a file, and
    an interrupted save leaves at worst new weights beside the old
    ``config.json``, which :func:`from_hf` refuses by name if their sizes
    disagree. Token ids (``bos_token_id``...) are not written: the Decoder
    does not hold them.
    """
    import json

    from .._io import atomic_write
    from .safetensors import save_safetensors

    cfg = model.config
    specs = _specs(cfg, files=True)
    stored = np.dtype(model.dtype) if dtype is None else dtype
    name = "bfloat16" if isinstance(stored, str) and stored == "bfloat16" else np.dtype(stored).name
    config = _hf_config(cfg, name)
    directory = os.fspath(path)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"save_hf: {directory!r} is a file; give a directory")
    if os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        raise ValueError(f"save_hf: {directory!r} holds a sharded checkpoint "
                         "(model.safetensors.index.json); give another directory")
    os.makedirs(directory, exist_ok=True)
    params = model.params
    tensors = {hf: pack([params[n] for n in names]) for hf, names, pack, _ in specs}
    save_safetensors(tensors, os.path.join(directory, "model.safetensors"), dtype=dtype,
                     metadata={"format": "pt"})
    with atomic_write(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
