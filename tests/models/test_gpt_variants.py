"""The GPT and its block with the attention options of the layers (GQA, RoPE, windows...).

Shape key: B batch, T tokens, E embedding, V vocabulary, H heads.

Oracles: central differences and complex step (:mod:`qkvnp.gradcheck`,
float64, random upstream gradients) under the cross-entropy loss; the
book's generation loop, recomputing the cropped context at every step
without a cache (``tests/models/test_generation.py``'s ``book_generate``): tokens
identical, logits to 1e-12; the blocks built one by one with the same
options (the model passes them on, nothing else); the interop layouts,
which must refuse what the book's and PyTorch's layers do not compute.
"""
import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import check_layer
from qkvnp.interop import from_torch, to_torch

from test_generation import assert_logits_close, book_generate
from test_gpt import GPTWithLoss, assert_ok

# Each case: the options of every block's attention (and of the feed-forward).
OPTIONS = {
    "gqa": dict(num_kv_heads=1),
    "rope+window": dict(rope=True, window=(2, 0)),
    "alibi+softcap": dict(position_bias="alibi", softcap=3.0),
    "relative+sinks": dict(position_bias="relative", num_buckets=4, max_distance=8, sinks=True),
    "gqa+rope+sinks": dict(num_kv_heads=2, rope=True, rope_layout="interleaved", sinks=True),
    "ff": dict(hidden_dim=12, approximate="none"),
}


def gpt(rng=0, **options):
    return qkvnp.GPTModel(vocab_size=11, context_length=8, emb_dim=8, num_heads=4,
                          num_layers=2, rng=rng, **options)


def generic_point(model, rng):
    """Parameters off their start (norms at ones/zeros, sinks and rel_bias at 0)."""
    for name, value in model.params.items():
        if "norm" in name or "sinks" in name or "rel_bias" in name:
            value += 0.3 * rng.normal(size=value.shape)


@pytest.mark.parametrize("case", sorted(OPTIONS))
@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_gpt_gradients_with_attention_options(case, method, rng):
    model = gpt(**OPTIONS[case])
    generic_point(model, rng)
    idx = rng.integers(0, 11, size=(2, 6))
    targets = rng.integers(0, 11, size=(2, 6))
    report = check_layer(GPTWithLoss(model), idx, targets, method=method)
    assert_ok(report)
    names = {row.name for row in report.rows}
    if OPTIONS[case].get("sinks"):
        assert "param model.trf_blocks.1.att.sinks" in names
    if OPTIONS[case].get("position_bias") == "relative":
        assert "param model.trf_blocks.0.att.rel_bias" in names


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_the_model_passes_its_options_to_every_block(case, rng):
    options = OPTIONS[case]
    model = gpt(**options)
    block = qkvnp.TransformerBlock(8, 4, rng=0, **options)
    for built in model.trf_blocks:
        assert built.att.variants == block.att.variants
        assert built.att.num_kv_heads == block.att.num_kv_heads
        assert built.ff.hidden_dim == block.ff.hidden_dim
        assert built.ff.layers[1].approximate == block.ff.layers[1].approximate
        assert {k: v.shape for k, v in built.params.items()} == \
            {k: v.shape for k, v in block.params.items()}
    assert model.num_kv_heads == block.att.num_kv_heads
    assert model.variants == block.att.variants
    assert model.hidden_dim == block.ff.hidden_dim
    # the parameters of the options are in params, grads and state_dict
    state = model.state_dict()
    assert set(state) == set(model.params) == set(model.grads)


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled", "auto"])
def test_every_path_gives_the_same_logits_with_options(impl, rng):
    options = dict(num_kv_heads=2, rope=True, window=(3, 0), softcap=4.0, sinks=True)
    reference = gpt(impl="reference", **options)
    generic_point(reference, rng)
    model = gpt(impl=impl, **options)
    model.load_state_dict(reference.state_dict())
    idx = rng.integers(0, 11, size=(2, 7))
    np.testing.assert_allclose(model.forward(idx), reference.forward(idx), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("case", ["gqa", "rope+window", "alibi+softcap", "relative+sinks",
                                  "gqa+rope+sinks"])
@pytest.mark.parametrize("context_size", [8, 5])  # 5: the context slides
def test_cached_decoding_with_options_equals_recomputing_the_context(case, context_size, rng):
    model = gpt(**OPTIONS[case])
    generic_point(model, rng)
    prompt = rng.integers(0, 11, size=(2, 3))
    expected, expected_logits = book_generate(model, prompt, 9, context_size)
    tokens, logits = qkvnp.generate(model, prompt, 9, context_size=context_size,
                                    return_logits=True)
    np.testing.assert_array_equal(tokens, expected)
    assert_logits_close(logits, expected_logits)


def test_decoding_token_by_token_through_a_rolling_window_continues_the_positions(rng):
    # window (2, 0): each cache keeps the last 2 keys, so len(cache) stops at 2-3;
    # the positions of the learned table and of RoPE must still count every token
    model = gpt(rope=True, window=(2, 0))
    generic_point(model, rng)
    model.eval()
    idx = rng.integers(0, 11, size=(1, 8))
    whole = model.forward(idx)  # (1, 8, V)
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    steps = [model.decode(idx[:, t:t + 1], caches) for t in range(8)]
    assert len(caches[0]) <= 3 and caches[0].start + len(caches[0]) == 8
    assert_logits_close(np.concatenate(steps, axis=1), whole)
    with pytest.raises(ValueError, match="context_length=8"):
        model.decode(idx[:, :1], caches)  # position 8 is past the table


def test_the_book_layouts_refuse_what_the_book_does_not_compute():
    for options, pattern in [(dict(num_kv_heads=2), "num_kv_heads=2"),
                             (dict(rope=True), "rope=True"),
                             (dict(window=(2, 0)), "window=\\(2, 0\\)"),
                             (dict(sinks=True), "sinks=True"),
                             (dict(hidden_dim=12), "hidden_dim=12"),
                             (dict(approximate="none"), "approximate='none'")]:
        model = gpt(**options)
        with pytest.raises(ValueError, match=pattern):
            to_torch(model, "book.GPTModel")
        with pytest.raises(ValueError, match=pattern):
            from_torch(model, to_torch(gpt(), "book.GPTModel"), "book.GPTModel")
    att = qkvnp.MultiHeadAttention(8, 2, rope=True, qkv_bias=False, out_bias=True)
    for layout in ("torch.nn.MultiheadAttention", "book.MultiHeadAttention"):
        with pytest.raises(ValueError, match="rope=True"):
            to_torch(att, layout)
    # the book's configuration still goes both ways
    model = gpt()
    again = gpt(rng=1)
    from_torch(again, to_torch(model, "book.GPTModel"), "book.GPTModel")
    for name, value in model.params.items():
        np.testing.assert_array_equal(again.params[name], value)


def test_bad_options_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="num_kv_heads"):
        gpt(num_kv_heads=3)
    with pytest.raises(ValueError, match="approximate"):
        gpt(approximate="erf")
    with pytest.raises(ValueError, match="window"):
        gpt(window=(-1, 0))
    with pytest.raises(TypeError, match="rope"):
        gpt(rope="yes")
    with pytest.raises(ValueError, match="hidden_dim"):
        gpt(hidden_dim=0)


def test_train_help_lists_the_text_task(capsys):
    from qkvnp.apps.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "{kv-recall,partner,teacher,text}" in out and "train --task text --help" in out
