"""qkvnp's Decoder against Hugging Face transformers' own models, six architectures.

Oracle: transformers itself (skipped when absent), float64, eval mode,
``attn_implementation="eager"``, models built from small configs with random
weights (no hub download), loaded into qkvnp by :func:`qkvnp.interop.from_hf`:

- logits to 1e-10, unpadded and with left and right padding (the rows of
  real tokens only: a padded row's logits are meaningless in both);
- every parameter's gradient of a cross-entropy loss to 1e-10, compared by
  name through ``to_hf(grads=True)``;
- greedy ``generate`` giving transformers' greedy tokens;
- one AdamW step against ``torch.optim.AdamW``, keeping the tie.

transformers computes some things in float32 whatever the model's dtype.
Patched in these tests alone (``hf_float64``), to keep float64 in float64:

- every ``*RotaryEmbedding.forward`` (``position_ids.float() * inv_freq.float()``),
  with the ``inv_freq`` buffers recomputed in float64 (they are made in float32);
- every ``*RMSNorm.forward`` (``hidden_states.to(torch.float32)``, Gemma's ``x.float()``);
- ``torch.nn.functional.softmax``'s ``dtype=torch.float32`` (the eager attention's
  and Qwen3-MoE's router's).

Qwen3-MoE runs ``experts_implementation="eager"`` (the default ``grouped_mm``
refuses float64).

The loss is computed here from the float64 logits (``ForCausalLMLoss`` would
call ``logits.float()``). Gemma's embedding scale is ``sqrt(E)`` held in a
float32 buffer in transformers, and so in the preset: not patched.
"""
from __future__ import annotations

import numpy as np
import pytest

import qkvnp
from qkvnp.interop import from_hf, to_hf
from qkvnp.optim import AdamW

FAMILIES = ("gpt2", "llama", "mistral", "qwen3", "qwen3_moe", "gemma3_text", "llama3_scaled",
            "gemma3_scaled")
LLAMA3_SCALING = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
V, E, H, K, D, F_, L, CONTEXT = 97, 32, 4, 2, 16, 48, 2, 64


def hf_config(transformers, family):
    """A small config of ``family`` (eager attention), every option that matters set."""
    common = dict(vocab_size=V, hidden_size=E, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=K, intermediate_size=F_, max_position_embeddings=CONTEXT,
                  attn_implementation="eager", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":
        return transformers.GPT2Config(n_layer=L, n_embd=E, n_head=H, vocab_size=V,
                                       n_positions=CONTEXT, attn_implementation="eager",
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "llama3_scaled":  # Llama 3.1's frequency scaling
        return transformers.LlamaConfig(rope_parameters=LLAMA3_SCALING, **common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=4, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=D, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=D, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=24, norm_topk_prob=True,
                                           experts_implementation="eager", **common)
    rope = None
    if family == "gemma3_scaled":  # Gemma 3's linear scaling of the global layers
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return transformers.Gemma3TextConfig(
        rope_parameters=rope, head_dim=D, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, attn_logit_softcapping=None, final_logit_softcapping=20.0,
        **common)


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
           "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
           "llama3_scaled": "LlamaForCausalLM", "gemma3_scaled": "Gemma3ForCausalLM"}


def _rms_norm64(self, x):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    normed = x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
    if type(self).__name__.startswith("Gemma"):
        return normed * (1.0 + self.weight)
    return self.weight * normed


def _rotary64(self, x, position_ids, layer_type=None):
    import torch

    prefix = f"{layer_type}_" if layer_type else ""
    inv_freq = getattr(self, prefix + "inv_freq")
    scaling = getattr(self, prefix + "attention_scaling")
    freqs = position_ids[..., None].to(torch.float64) * inv_freq  # float64 buffer, see below
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


@pytest.fixture
def hf_float64(torch, monkeypatch):
    """Patch transformers' float32 spots (see the module docstring); returns a builder."""
    transformers = pytest.importorskip("transformers")
    softmax = torch.nn.functional.softmax

    def softmax_in_input_dtype(input, *args, dtype=None, **kwargs):
        return softmax(input, *args, dtype=None if input.dtype == torch.float64 else dtype,
                       **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_in_input_dtype)

    def build(family, seed=0):
        torch.manual_seed(seed)
        config = hf_config(transformers, family)
        model = getattr(transformers, CLASSES[family])(config).double().eval()
        with torch.no_grad():
            for parameter in model.parameters():  # away from the init's near-uniform logits
                parameter.add_(0.1 * torch.randn_like(parameter))
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(type(module), "forward", _rms_norm64)
            if name.endswith("RotaryEmbedding"):
                monkeypatch.setattr(type(module), "forward", _rotary64)
                _float64_inv_freq(torch, module, config)
        return model

    return build


def _float64_inv_freq(torch, module, config):
    """The rotary module's ``inv_freq`` buffers recomputed in float64.

    transformers makes them in float32; they are replaced by
    ``qkvnp.ops.rope_scaling.rope_inverse_frequency``'s float64 values
    (that function is checked against transformers' own frequencies in
    ``tests/ops``), so what is compared here is the rest of the model.
    """
    from qkvnp.ops.rope_scaling import rope_inverse_frequency

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    per_type = rope.items() if "rope_theta" not in rope else [(None, rope)]
    for layer_type, parameters in per_type:
        inverse, _ = rope_inverse_frequency(head_dim, parameters["rope_theta"], parameters)
        setattr(module, f"{layer_type}_inv_freq" if layer_type else "inv_freq",
                torch.tensor(inverse))


PADDINGS = {"none": None,
            "left": np.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7]),
            "right": np.array([[1, 1, 1, 1, 1, 0, 0], [1] * 7])}


def _loss_grad(logits, targets, counted):
    """Mean cross-entropy over the counted rows and its gradient (the oracle's own formula)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
    dlogits = probs.copy()
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(probs, targets[..., None],
                                                                      -1) - 1, axis=-1)
    return dlogits * counted[..., None] / counted.sum()


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_transformers(torch, hf_float64, family, padding):
    hf = hf_float64(family)
    model = from_hf(hf)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, V, size=(2, 7))
    mask = PADDINGS[padding]
    counted = np.ones(ids.shape) if mask is None else mask.astype(float)
    targets = rng.integers(0, V, size=ids.shape)
    logits = model.forward(ids, attention_mask=mask)
    model.backward(_loss_grad(logits, targets, counted))

    hf_mask = None if mask is None else torch.tensor(mask)
    hf_logits = hf(torch.tensor(ids), attention_mask=hf_mask).logits
    labels = torch.tensor(np.where(counted > 0, targets, -100))
    loss = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, V), labels.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    assert logits.shape == hf_logits.shape
    real = counted > 0  # a padded row's logits are meaningless in both
    np.testing.assert_allclose(logits[real], hf_logits.detach().numpy()[real], rtol=0, atol=1e-10)
    ours = to_hf(model, grads=True)
    theirs = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    assert sorted(ours) == sorted(theirs)
    for name, grad in theirs.items():
        assert ours[name].shape == grad.shape, name
        np.testing.assert_allclose(ours[name], grad, rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_transformers(torch, hf_float64, family):
    hf = hf_float64(family, seed=2)
    model = from_hf(hf)
    ids = np.random.default_rng(3).integers(3, V, size=(2, 5))
    hf.generation_config.eos_token_id = None  # a fixed number of tokens in both
    expected = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=int),
                           max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(qkvnp.generate(model, ids, 6), expected)
    np.testing.assert_array_equal(qkvnp.generate(model, ids, 6, use_cache=False), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_on_left_padded_prompts_matches_transformers(torch, hf_float64, family):
    """Oracle: transformers' greedy generate on a left-padded batch (its positions are
    cumsum(mask) - 1; a padded prompt must give the tokens of the same prompt unpadded)."""
    hf = hf_float64(family, seed=2)
    model = from_hf(hf)
    ids = np.random.default_rng(4).integers(3, V, size=(2, 6))
    mask = np.array([[0, 0, 0, 1, 1, 1], [1] * 6])
    ids[mask == 0] = 0  # the pad token
    hf.generation_config.eos_token_id = None
    expected = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                           max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(qkvnp.generate(model, ids, 6, attention_mask=mask), expected)
    np.testing.assert_array_equal(
        qkvnp.generate(model, ids, 6, attention_mask=mask, use_cache=False), expected)
    alone = qkvnp.generate(model, ids[:1, 3:], 6)  # the short prompt without its padding
    np.testing.assert_array_equal(alone[:, 3:], expected[:1, 6:])


def test_generate_refuses_a_mask_the_model_cannot_take():
    gpt = qkvnp.GPTModel(16, 8, 8, 2, 1, rng=0)
    with pytest.raises(TypeError, match="attention_mask"):
        qkvnp.generate(gpt, np.array([[1, 2]]), 2, attention_mask=np.array([[1, 1]]))
    model = qkvnp.Decoder(qkvnp.DecoderConfig.qwen3(vocab_size=16, emb_dim=8, num_layers=1,
                                                    num_heads=2, head_dim=4, hidden_dim=8), rng=0)
    for bad in (np.array([[1, 2]]), np.array([[1]]), np.array([[0, 0]])):
        with pytest.raises(ValueError, match="attention_mask"):
            qkvnp.generate(model, np.array([[1, 2]]), 2, attention_mask=bad)


@pytest.mark.parametrize("family", ["gpt2", "gemma3_text", "qwen3_moe"])
def test_one_adamw_step_matches_torch_and_keeps_the_tie(torch, hf_float64, family):
    hf = hf_float64(family, seed=4)
    model = from_hf(hf)
    ids = np.random.default_rng(5).integers(3, V, size=(2, 6))
    targets = np.roll(ids, -1, axis=1)
    logits = model.forward(ids)
    model.backward(_loss_grad(logits, targets, np.ones(ids.shape)))
    hf_logits = hf(torch.tensor(ids)).logits
    torch.nn.functional.cross_entropy(hf_logits.reshape(-1, V),
                                      torch.tensor(targets).reshape(-1)).backward()
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    AdamW(model.params, **options).step(model.grads)
    torch.optim.AdamW(hf.parameters(), **options).step()
    ours = to_hf(model)
    for name, parameter in hf.named_parameters():
        np.testing.assert_allclose(ours[name], parameter.detach().numpy(), rtol=0, atol=1e-10,
                                   err_msg=name)
    if model.config.tie_embeddings:
        state = model.state_dict()
        np.testing.assert_array_equal(state["head.W"], state["embed.weight"].T)
        np.testing.assert_allclose(hf.lm_head.weight.detach().numpy(), state["embed.weight"],
                                   rtol=0, atol=1e-10)


def test_unsupported_architecture_is_refused_by_name(torch):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=V, hidden_size=E, num_hidden_layers=1,
                                      num_attention_heads=H, intermediate_size=F_)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*supported"):
        from_hf(transformers.Qwen2ForCausalLM(config))


@pytest.mark.parametrize("option, value, message", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
     "rope_parameters.*dynamic"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("pretraining_tp", 2, "pretraining_tp=2"),
    ("some_new_option", 1, "some_new_option"),
])
def test_options_the_decoder_cannot_express_are_refused_by_name(option, value, message):
    class Config:
        def to_dict(self):
            return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                    "vocab_size": V, "hidden_size": E, "num_hidden_layers": 1,
                    "num_attention_heads": H, "num_key_value_heads": K, "intermediate_size": F_,
                    "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6,
                    "hidden_act": "silu", "rope_parameters": {"rope_theta": 1e4}, option: value}

    class Source:
        config = Config()

        def state_dict(self):
            return {}

    with pytest.raises(ValueError, match=message):
        from_hf(Source())


def test_gemma3_attention_softcap_is_refused_as_transformers_ignores_it(torch):
    transformers = pytest.importorskip("transformers")
    config = hf_config(transformers, "gemma3_text")
    config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        from_hf(transformers.Gemma3ForCausalLM(config))


def _legacy(config):
    """A transformers 4 config dict of a 5 one: ``rope_theta``, ``rope_scaling`` (and
    Gemma 3's ``rope_local_base_freq``) where 5 writes ``rope_parameters``."""
    config = dict(config)
    rope = config.pop("rope_parameters")
    if "full_attention" in rope:
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    rope = dict(rope)
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return config


@pytest.mark.parametrize("family", ["llama3_scaled", "gemma3_scaled", "qwen3"])
def test_a_transformers_4_config_loads_as_its_5_form(torch, hf_float64, family, tmp_path):
    """Oracle: from_hf of the same model with transformers 5's config. The same weights
    under a transformers 4 config (``rope_theta``, ``rope_scaling``), given as a model
    object and as a directory, give the same logits to the bit."""
    import json

    hf = hf_float64(family)
    modern = from_hf(hf)
    legacy = _legacy(hf.config.to_dict())
    assert "rope_parameters" not in legacy

    class Config:
        to_dict = staticmethod(lambda: legacy)

    # a transformers 4 model object: its class's name, its config dict, its tensors
    Source = type(CLASSES[family], (), {"config": Config, "state_dict": staticmethod(hf.state_dict)})

    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    ids = np.random.default_rng(4).integers(3, V, size=(2, 7))
    expected = modern.forward(ids)
    for source in (Source(), tmp_path):
        model = from_hf(source)
        np.testing.assert_array_equal(model.forward(ids).astype(expected.dtype), expected)
