"""LoRA on every family's Decoder (``apply_lora(decoder, ["q_proj", "v_proj"], rank)``).

Oracles: the decoder before adaptation (``B = 0``: bit for bit); one forward
over the whole sequence for decoding chunk by chunk; the merged decoder
(``merge_lora``) for the adapted one's logits and greedy tokens, to 1e-12;
the complex-step derivative (``qkvnp.gradcheck``, ``method="complex_step"``)
of the adapters' gradients; the arrays before an AdamW step on
``adapter_params`` for everything that must not move; ``to_hf``'s refusal
names ``merge_lora``, and after the merge it gives the merged weights.
"""
from __future__ import annotations

import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import check_layer
from qkvnp.interop import to_hf
from qkvnp.layers import LoRALinear, adapter_grads, adapter_params, apply_lora, merge_lora
from qkvnp.models.decoder import Decoder, DecoderConfig
from qkvnp.optim import AdamW

SMALL = dict(vocab_size=13, emb_dim=8, num_layers=2, num_heads=2)
# each family at tiny size (as tests/models/test_decoder.py builds them)
CONFIGS = {
    "gpt2": DecoderConfig.gpt2(**SMALL, context_length=16),
    "llama3": DecoderConfig.llama3(**SMALL, hidden_dim=12, num_kv_heads=1),
    "mistral": DecoderConfig.mistral(**SMALL, hidden_dim=12, num_kv_heads=1, sliding_window=2),
    "qwen3": DecoderConfig.qwen3(**SMALL, hidden_dim=12, head_dim=6, num_kv_heads=1),
    "qwen3_moe": DecoderConfig.qwen3_moe(**SMALL, moe_hidden_dim=6, head_dim=4, num_experts=3,
                                         top_k=2),
    "gemma3": DecoderConfig.gemma3(**SMALL, hidden_dim=12, head_dim=4, num_kv_heads=1,
                                   sliding_window=2, query_pre_attn_scalar=6,
                                   layer_types=("sliding_attention", "full_attention")),
}
FAMILIES = list(CONFIGS)
IDS = np.array([[1, 4, 2, 7, 3, 0, 5], [5, 6, 0, 2, 9, 12, 1]])


def _adapted(name, seed=0):
    """``(adapted decoder, its logits before adaptation)``, ``B`` then drawn away from zero."""
    model = Decoder(CONFIGS[name], rng=seed)
    before = model.forward(IDS)
    names = apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=3.0, rng=seed + 1)
    assert names == [f"blocks.{i}.self_attn.{proj}" for i in range(2)
                     for proj in ("q_proj", "v_proj")]
    return model, before


def _nonzero_b(model, seed):
    rng = np.random.default_rng(seed)
    for key, value in adapter_params(model).items():
        if key.endswith(".B"):
            value[...] = 0.3 * rng.standard_normal(value.shape)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_an_adapted_decoder_is_unchanged_at_init_bit_for_bit(name):
    model, before = _adapted(name)
    np.testing.assert_array_equal(model.forward(IDS), before)
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    np.testing.assert_allclose(model.decode(IDS, caches), before, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_decode_generate_and_merge_equal_the_adapted_forward(name):
    model, before = _adapted(name)
    _nonzero_b(model, 2)
    adapted = model.forward(IDS)
    assert np.abs(adapted - before).max() > 1e-3  # the adapters change the map
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    steps = [model.decode(IDS[:, :3], caches)] + [model.decode(IDS[:, t:t + 1], caches)
                                                  for t in range(3, IDS.shape[1])]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), adapted, rtol=0, atol=1e-12)
    tokens = qkvnp.generate(model.eval(), IDS[:, :3], 6)
    assert merge_lora(model) == [f"blocks.{i}.self_attn.{proj}" for i in range(2)
                                 for proj in ("q_proj", "v_proj")]
    assert not any(isinstance(layer, LoRALinear) for _, layer in model.named_layers())
    np.testing.assert_allclose(model.forward(IDS), adapted, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(qkvnp.generate(model.eval(), IDS[:, :3], 6), tokens)


@pytest.mark.parametrize("name", FAMILIES)
def test_complex_step_certifies_the_adapters_gradients(name):
    model, _ = _adapted(name)
    _nonzero_b(model, 3)
    mask = np.array([[0, 1, 1, 1, 1, 1, 1], [1] * 7])
    report = check_layer(model, IDS[:, :5], forward_kwargs={"attention_mask": mask[:, :5]},
                         method="complex_step", sample=None)
    assert report.ok, report
    checked = " ".join(str(row) for row in report.rows)
    for key in adapter_params(model):
        assert key in checked, key


@pytest.mark.parametrize("name", FAMILIES)
def test_adamw_on_adapter_params_steps_the_adapters_alone(name):
    model, _ = _adapted(name)
    frozen = {key: layer.base.params["W"].copy() for key, layer in model.named_layers()
              if isinstance(layer, LoRALinear)}
    others = {key: value.copy() for key, value in model.params.items()
              if key not in adapter_params(model)}
    adapters = {key: value.copy() for key, value in adapter_params(model).items()}
    optimizer = AdamW(adapter_params(model), lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(5)
    for _ in range(2):  # B moves at step 1 (A's gradient is 0 while B = 0), A at step 2
        model.zero_grad()
        logits = model.forward(IDS)
        model.backward(rng.standard_normal(logits.shape))
        optimizer.step(adapter_grads(model))
    for key, value in others.items():
        np.testing.assert_array_equal(model.params[key], value, err_msg=key)
    layers = dict(model.named_layers())
    for key, value in frozen.items():
        np.testing.assert_array_equal(layers[key].base.params["W"], value, err_msg=key)
        assert not layers[key].base.grads["W"].any()  # no gradient of a frozen W
    for key, value in adapters.items():
        assert not np.array_equal(model.params[key], value), key


def test_to_hf_refuses_an_adapted_decoder_naming_merge_lora():
    model, _ = _adapted("qwen3")
    _nonzero_b(model, 4)
    with pytest.raises(ValueError, match=r"LoRA adapters \(blocks\.0\.self_attn\.q_proj, "
                                         r".*merge_lora"):
        to_hf(model)
    with pytest.raises(ValueError, match="merge_lora"):
        to_hf(model, grads=True)
    layer = model.blocks[0].self_attn.q_proj
    expected = layer.effective_params()["W"]
    merge_lora(model)
    state = to_hf(model)
    np.testing.assert_array_equal(state["model.layers.0.self_attn.q_proj.weight"], expected.T)


def test_adapted_feed_forward_and_head_decode_as_the_forward():
    # oracle: one forward over the whole sequence; decode reads the adapted head's merged W
    model = Decoder(CONFIGS["llama3"], rng=0)
    names = apply_lora(model, ["gate_proj", "down_proj", "head"], rank=2, rng=1)
    assert names[-1] == "head" and len(names) == 5
    _nonzero_b(model, 6)
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    steps = [model.decode(IDS[:, :4], caches)] + [model.decode(IDS[:, t:t + 1], caches)
                                                  for t in range(4, IDS.shape[1])]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), model.forward(IDS), rtol=0,
                               atol=1e-12)
