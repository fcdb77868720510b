"""The Decoder of every family: complex-step gradients, decoding, the tie, refused configs.

Oracles: the complex-step derivative (``qkvnp.gradcheck.check_layer``,
``method="complex_step"``) of each family's whole model at tiny size, for
every parameter; one causal forward over the whole sequence for
chunk-by-chunk decoding (with rolling windows); closed forms for the tie
(``head.W`` is the table's transpose; its gradient is the sum of both uses).
Parity with transformers is ``tests/test_interop_hf.py``.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import check_layer
from qkvnp.models.decoder import Decoder, DecoderConfig

SMALL = dict(vocab_size=13, emb_dim=8, num_layers=2, num_heads=2)


def family_configs():
    """Each family at tiny size, and two options no preset turns on (post-norm, soft-caps)."""
    return {
        "gpt2": DecoderConfig.gpt2(**SMALL, context_length=16),
        "llama3": DecoderConfig.llama3(**SMALL, hidden_dim=12, num_kv_heads=1),
        "mistral": DecoderConfig.mistral(**SMALL, hidden_dim=12, num_kv_heads=1, sliding_window=2),
        "qwen3": DecoderConfig.qwen3(**SMALL, hidden_dim=12, head_dim=6, num_kv_heads=1),
        "qwen3_moe": DecoderConfig.qwen3_moe(**SMALL, moe_hidden_dim=6, head_dim=4,
                                             num_experts=3, top_k=2),
        "gemma3": DecoderConfig.gemma3(**SMALL, hidden_dim=12, head_dim=4, num_kv_heads=1,
                                       sliding_window=2, query_pre_attn_scalar=6,
                                       layer_types=("sliding_attention", "full_attention")),
        "post_softcaps": dataclasses.replace(
            DecoderConfig.llama3(**SMALL, hidden_dim=12), placement="post", attn_softcap=5.0,
            final_softcap=3.0, tie_embeddings=True, qkv_bias=True, family=None),
    }


CONFIGS = family_configs()


def _perturbed(model, seed):
    """Norm weights away from their ones/zeros start, so that their gradients are checked."""
    rng = np.random.default_rng(seed)
    for name, value in model.params.items():
        value += 0.1 * rng.standard_normal(value.shape)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_model_complex_step(name):
    model = _perturbed(Decoder(CONFIGS[name], rng=0), 1)
    ids = np.array([[1, 4, 2, 7, 3], [5, 6, 0, 2, 9]])
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    report = check_layer(model, ids, forward_kwargs={"attention_mask": mask},
                         method="complex_step", sample=None)
    assert report.ok, report


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_chunk_by_chunk_equals_one_forward(name):
    model = _perturbed(Decoder(CONFIGS[name], rng=2), 3)
    ids = np.random.default_rng(4).integers(0, 13, size=(2, 7))
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    steps = [model.decode(ids[:, :3], caches)] + [model.decode(ids[:, t:t + 1], caches)
                                                  for t in range(3, 7)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), model.forward(ids), rtol=0,
                               atol=1e-12)
    window = model.config.sliding_window
    for block, cache in zip(model.blocks, caches):
        if block.window is not None:  # a sliding layer's cache rolls
            assert len(cache) == window - 1 and cache.start == 7 - (window - 1)
    model.decode(ids[:, :1], [qkvnp.KVCache() for _ in range(model.num_layers)])
    with pytest.raises(RuntimeError, match="after decode"):
        model.backward(np.ones((2, 1, 13)))


def test_tied_table_is_one_parameter_whose_gradient_sums_both_uses():
    model = Decoder(CONFIGS["gpt2"], rng=0)
    assert "head.W" not in model.params and "embed.weight" in model.params
    ids = np.array([[1, 2, 3]])
    dlogits = np.random.default_rng(0).standard_normal((1, 3, 13))
    model.forward(ids)
    model.backward(dlogits)
    total = model.grads["embed.weight"].copy()
    # the head's use alone: x_final^T dlogits, transposed (the forward's cache holds x_final)
    untied = Decoder(dataclasses.replace(CONFIGS["gpt2"], tie_embeddings=False), rng=0)
    state = model.state_dict()
    untied.load_state_dict({**{k: v for k, v in state.items()}, "head.W": state["head.W"]})
    untied.forward(ids)
    untied.backward(dlogits)
    np.testing.assert_allclose(total, untied.grads["embed.weight"] + untied.grads["head.W"].T,
                               rtol=0, atol=1e-12)
    assert state["head.W"].shape == (8, 13)
    np.testing.assert_array_equal(state["head.W"], state["embed.weight"].T)
    model.load_state_dict(state)  # the head's name is accepted
    bad = dict(state, **{"head.W": state["head.W"] + 1})
    with pytest.raises(ValueError, match="head.W"):
        model.load_state_dict(bad)


def test_padded_rows_are_finite_and_real_rows_ignore_the_padding():
    model = Decoder(CONFIGS["qwen3"], rng=0)
    ids = np.array([[0, 0, 3, 4, 5]])
    padded = model.forward(ids, attention_mask=np.array([[0, 0, 1, 1, 1]]),
                           position_ids=np.array([[0, 0, 0, 1, 2]]))
    assert np.isfinite(padded).all()
    np.testing.assert_allclose(padded[:, 2:], model.forward(ids[:, 2:]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("field, value, error", [
    ("vocab_size", 0, ValueError), ("emb_dim", 2.0, TypeError), ("num_kv_heads", 3, ValueError),
    ("norm", "batch", ValueError), ("placement", "middle", ValueError),
    ("mlp", "relu", ValueError), ("positions", "alibi", ValueError),
    ("norm_eps", 0.0, ValueError), ("qk_norm", 1, TypeError),
    ("layer_types", ("full_attention",), ValueError),
    ("layer_types", ("sliding_attention", "full_attention"), ValueError),  # no sliding_window
    ("rope_scaling", {"rope_type": "llama3"}, ValueError), ("final_softcap", -1.0, ValueError),
    ("mlp", "moe", ValueError),  # without num_experts
    ("family", "bert", ValueError), ("head_dim", 3, ValueError),  # odd with RoPE
])
def test_bad_configs_are_refused_by_name(field, value, error):
    fields = dict(vocab_size=10, emb_dim=8, num_layers=2, num_heads=2, hidden_dim=12)
    fields[field] = value
    with pytest.raises(error, match=field):
        DecoderConfig(**fields)


def test_bad_inputs_are_refused_by_name():
    model = Decoder(CONFIGS["llama3"], rng=0)
    with pytest.raises(ValueError, match="attention_mask"):
        model.forward(np.array([[1, 2]]), attention_mask=np.array([[1, 2]]))
    with pytest.raises(ValueError, match="position_ids"):
        model.forward(np.array([[1, 2]]), position_ids=np.array([[0, -1]]))
    with pytest.raises(ValueError, match="ids"):
        model.forward(np.array([1, 2]))
    with pytest.raises(TypeError, match="config"):
        Decoder({"vocab_size": 3})


def test_lora_adapters_on_the_projections_train_and_decode():
    # Oracle: one causal forward, as for the plain model; adapters found by name
    from qkvnp.layers import adapter_grads, apply_lora

    model = Decoder(CONFIGS["qwen3"], rng=0)
    names = apply_lora(model, ["q_proj", "v_proj", "o_proj", "down_proj", "head"], 2, rng=0)
    assert "blocks.1.self_attn.q_proj" in names and "head" in names
    _perturbed(model, 5)  # B away from zero, so that the adapters change the output
    ids = np.array([[1, 2, 3, 4, 5]])
    logits = model.forward(ids)
    model.backward(np.ones(logits.shape))
    assert all(np.abs(grad).sum() > 0 for grad in adapter_grads(model).values())
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    steps = [model.decode(ids[:, :2], caches), model.decode(ids[:, 2:], caches)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("option, value, error", [
    ("scale", -1.0, ValueError), ("scale", float("nan"), ValueError), ("scale", "a", TypeError),
    ("softcap", 0.0, ValueError), ("rope", "yes", TypeError)])
def test_decoder_attention_refuses_a_bad_option_by_name(option, value, error):
    from qkvnp.layers import DecoderAttention

    with pytest.raises(error, match=option):
        DecoderAttention(8, 2, 4, 2, **{option: value})
