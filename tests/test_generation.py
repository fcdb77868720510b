"""qkvnp.generate against the book's loop: recompute the cropped context at every step.

Shape key: B batch, T tokens, V vocabulary.

Oracle: :func:`book_generate`, written here from the book's chapter 5
``generate`` (``idx[:, -context_size:]``, ``model(idx_cond)[:, -1]``, top-k
to ``-inf``, argmax at temperature 0, ``eos`` stops) over the model's
evaluation-mode ``forward`` -- no cache. The cached decoding must give the
same tokens, and logits equal to 1e-12 relative.
"""
import numpy as np
import pytest

import qkvnp


def book_generate(model, idx, max_new_tokens, context_size, top_k=None, eos_id=None):
    """The book's greedy loop, recomputing the whole cropped context each step."""
    model.eval()
    logits_seen = []
    for _ in range(max_new_tokens):
        logits = model.forward(idx[:, -context_size:])[:, -1]  # (B, V)
        chosen = logits
        if top_k is not None:
            kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
            chosen = np.where(logits < kth, -np.inf, logits)
        next_tokens = chosen.argmax(axis=-1)
        if eos_id is not None and (next_tokens == eos_id).all():
            break
        logits_seen.append(logits)
        idx = np.concatenate([idx, next_tokens[:, None]], axis=1)
    return idx, np.stack(logits_seen, axis=1)


def model_and_prompt(rng, batch=2):
    model = qkvnp.GPTModel(vocab_size=17, context_length=10, emb_dim=12, num_heads=3,
                           num_layers=2, qkv_bias=True, rng=0, dropout=0.1)
    return model, rng.integers(0, 17, size=(batch, 4))


def assert_logits_close(ours, theirs):
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-12 * np.abs(theirs).max()


@pytest.mark.parametrize("context_size", [10, 6])  # 6: the window slides after 2 new tokens
def test_cached_greedy_decoding_equals_recomputing_the_context(context_size, rng):
    model, prompt = model_and_prompt(rng)
    expected, expected_logits = book_generate(model, prompt, 12, context_size)
    tokens, logits = qkvnp.generate(model, prompt, 12, context_size=context_size,
                                    return_logits=True)
    assert tokens.shape == (2, 16)
    np.testing.assert_array_equal(tokens, expected)
    assert_logits_close(logits, expected_logits)
    uncached, _ = qkvnp.generate(model, prompt, 12, context_size=context_size, use_cache=False,
                                 return_logits=True)
    np.testing.assert_array_equal(uncached, expected)


def test_top_k_one_is_greedy_and_top_k_filters_the_samples(rng):
    model, prompt = model_and_prompt(rng, batch=1)
    greedy = qkvnp.generate(model, prompt, 6)
    np.testing.assert_array_equal(qkvnp.generate(model, prompt, 6, temperature=5.0, top_k=1,
                                                 rng=3), greedy)
    tokens, logits = qkvnp.generate(model, prompt, 30, temperature=2.0, top_k=3, rng=1,
                                    return_logits=True)
    top3 = np.argsort(logits[0], axis=-1)[:, -3:]  # (n, 3)
    assert all(token in row for token, row in zip(tokens[0, 4:], top3))


def test_sampling_is_reproducible_with_a_seed_and_follows_the_cache_free_path(rng):
    model, prompt = model_and_prompt(rng)
    a = qkvnp.generate(model, prompt, 15, temperature=1.0, rng=7, context_size=7)
    b = qkvnp.generate(model, prompt, 15, temperature=1.0, rng=7, context_size=7,
                       use_cache=False)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 19)


def test_generation_stops_at_eos(rng):
    model, prompt = model_and_prompt(rng, batch=1)
    greedy = qkvnp.generate(model, prompt, 8)
    eos = int(greedy[0, 6])  # the third new token
    first = int(np.argmax(greedy[0, 4:] == eos))  # its first appearance among the new ones
    stopped = qkvnp.generate(model, prompt, 8, eos_id=eos)
    np.testing.assert_array_equal(stopped, greedy[:, :4 + first])
    expected, _ = book_generate(model, prompt, 8, 10, eos_id=eos)
    np.testing.assert_array_equal(stopped, expected)


def test_decoding_leaves_no_cache_for_a_backward_and_refuses_bad_arguments(rng):
    model, prompt = model_and_prompt(rng)
    qkvnp.generate(model, prompt, 2)
    with pytest.raises(RuntimeError, match="backward after decode"):
        model.backward(np.zeros((2, 4, 17)))
    with pytest.raises(ValueError, match="context_size must be in"):
        qkvnp.generate(model, prompt, 2, context_size=11)
    with pytest.raises(ValueError, match="top_k must be in"):
        qkvnp.generate(model, prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="temperature must be a finite float >= 0"):
        qkvnp.generate(model, prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"idx must be integer token ids of shape \(B, T\)"):
        qkvnp.generate(model, prompt[0], 2)
    with pytest.raises(ValueError, match="context_length=10"):
        model.decode(np.zeros((1, 11), int), [qkvnp.KVCache(), qkvnp.KVCache()])
