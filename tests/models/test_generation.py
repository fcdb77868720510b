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


def previous_generate(model, idx, max_new_tokens, context_size=None, temperature=0.0,
                      top_k=None, rng=None, eos_id=None, use_cache=True):
    """The loop ``qkvnp.generate`` had before its memory was bounded, verbatim but for
    the argument checks: its tokens and logits are the oracle of the bounded loop's."""
    context_size = context_size or model.context_length
    rng = np.random.default_rng(rng)
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    chosen_logits, pending = [], None
    for _ in range(max_new_tokens):
        window = idx[:, -context_size:]
        position = caches[0].start + len(caches[0])
        if not use_cache or pending is None or position + 1 > context_size:
            for cache in caches:
                cache.reset()
            logits = model.decode(window, caches)[:, -1]
        else:
            logits = model.decode(pending, caches)[:, -1]
        chosen = logits
        if top_k is not None:
            kth = np.sort(chosen, axis=-1)[:, -top_k][:, None]
            chosen = np.where(chosen < kth, -np.inf, chosen)
        if temperature == 0.0:
            next_tokens = chosen.argmax(axis=-1)
        else:
            scaled = chosen / temperature
            probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            u = rng.random(probs.shape[0])[:, None]
            cdf = np.cumsum(probs, axis=-1)
            next_tokens = np.minimum((cdf <= u * cdf[:, -1:]).sum(axis=-1), probs.shape[-1] - 1)
        if eos_id is not None and (next_tokens == eos_id).all():
            break
        chosen_logits.append(logits)
        idx = np.concatenate([idx, next_tokens[:, None]], axis=1)
        pending = next_tokens[:, None]
    return idx, np.stack(chosen_logits, axis=1)


@pytest.mark.parametrize("options", [
    {},  # greedy
    {"temperature": 0.7, "rng": 3},  # sampling over the whole vocabulary
    {"temperature": 1.3, "top_k": 4, "rng": 5},  # sampling among the top 4
    {"temperature": 1.0, "rng": 11, "context_size": 6},  # the window slides
    {"temperature": 0.9, "rng": 2, "use_cache": False},  # recomputing the context
    {"temperature": 1.0, "rng": 0, "eos_id": "third"},  # one row, stopped at its third token
])
@pytest.mark.parametrize("window", [None, (3, 0)])  # the book's model; a sliding-window one
def test_the_bounded_loop_gives_the_previous_loops_tokens_and_logits(options, window, rng):
    model = qkvnp.GPTModel(vocab_size=17, context_length=10, emb_dim=12, num_heads=3,
                           num_layers=2, qkv_bias=True, rng=0, window=window)
    prompt = rng.integers(0, 17, size=(3, 4))
    if options.get("eos_id") == "third":
        prompt = prompt[:1]  # eos stops when every row chose it
        full = qkvnp.generate(model, prompt, 12, **{**options, "eos_id": None})
        options = {**options, "eos_id": int(full[0, 6])}
    expected, expected_logits = previous_generate(model, prompt, 12, **options)
    tokens, logits = qkvnp.generate(model, prompt, 12, return_logits=True, **options)
    assert tokens.shape == expected.shape and logits.shape == expected_logits.shape
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(logits, expected_logits)
    assert "eos_id" not in options or tokens.shape[1] <= 4 + 2  # it did stop
    assert tokens.base is None and logits.base is None  # each owns just its filled part
    np.testing.assert_array_equal(qkvnp.generate(model, prompt, 12, **options), expected)


def generate_peak_bytes(model, prompt, max_new_tokens, return_logits):
    """Peak traced memory of one sampled ``generate`` call (after one untraced warm-up)."""
    import tracemalloc

    def run():
        return qkvnp.generate(model, prompt, max_new_tokens, temperature=1.0, rng=0,
                              return_logits=return_logits)

    run()
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("return_logits", [False, True])
def test_generate_memory_grows_by_the_tokens_and_asked_logits_only(return_logits):
    """Oracle: peak traced memory. From 8 to 64 new tokens it may grow by the 56 token ids,
    plus with ``return_logits`` the 56 rows of ``B * V`` logits, and less than half a
    row more; a step's (B, T, V) output kept alive would add B * T * V per token.
    """
    B, V = 1, 16384  # a large vocabulary: one row of logits is 128 KiB
    model = qkvnp.GPTModel(vocab_size=V, context_length=8, emb_dim=8, num_heads=2,
                           num_layers=1, rng=0)
    prompt = np.arange(4 * B).reshape(B, 4)
    row = B * V * np.dtype(model.dtype).itemsize
    allowed = 56 * B * 8 + (56 * row if return_logits else 0) + row // 2
    grown = (generate_peak_bytes(model, prompt, 64, return_logits)
             - generate_peak_bytes(model, prompt, 8, return_logits))
    assert grown <= allowed, (grown, allowed)


class FixedLogits:
    """A stand-in model whose every decode step gives ``logits`` (B, V) at the last position."""

    def __init__(self, logits, dtype=np.float64):
        self.logits = np.asarray(logits, dtype=dtype)
        self.vocab_size, self.context_length, self.num_layers = self.logits.shape[1], 8, 1
        self.dtype = self.logits.dtype

    def decode(self, idx, caches):
        return np.repeat(self.logits[:, None, :], idx.shape[1], axis=1)  # (B, T, V)


@pytest.mark.parametrize("temperature, dtype", [
    (1e-320, np.float64),  # logits / t overflows
    (1e-300, np.float64),  # it does not, and the gaps are still worth 1e300 temperatures
    (1e-320, np.float32),  # t rounds to 0 in the logits' dtype
    (1e-40, np.float32),  # a float32 subnormal: logits / t overflows
])
def test_a_tiny_temperature_samples_the_argmax_limit_never_nan_or_token_0(temperature, dtype):
    """Oracle: ``softmax(logits / t)`` in closed form. For ``t`` so small that every gap
    to the maximum is huge, it is the uniform draw among the tied maxima: rows
    ``[0, 5, 5, 1]`` give tokens 1 and 2, about half each, never 0; rows of negative
    logits (``logits / t`` overflowing to ``-inf`` everywhere) their argmax."""
    rows = 4000
    model = FixedLogits(np.tile([0.0, 5.0, 5.0, 1.0], (rows, 1)), dtype)
    tokens = qkvnp.generate(model, np.zeros((rows, 1), int), 1, temperature=temperature,
                            rng=0)[:, 1]
    assert set(np.unique(tokens)) == {1, 2}
    assert abs(np.mean(tokens == 1) - 0.5) < 0.05  # 6 standard deviations
    for row in ([0.0, 1.0, 7.0, -3.0], [-9.0, -8.0, -2.0, -3.0]):
        one_row = FixedLogits([row], dtype)
        assert qkvnp.generate(one_row, np.zeros((1, 1), int), 3, temperature=temperature,
                              rng=0)[0, 1:].tolist() == [2, 2, 2]


def test_a_tiny_temperature_that_does_not_overflow_keeps_the_softmax_with_top_k():
    """Oracle: ``softmax(logits / t)`` in closed form. Gaps of ``t * log 3`` at ``t =
    1e-300`` give probabilities 1/13, 3/13, 9/13; top-k 3 sets the fourth to -inf."""
    t, rows = 1e-300, 20000
    gap = t * np.log(3.0)
    model = FixedLogits(np.tile([0.0, gap, 2 * gap, -1.0], (rows, 1)))
    tokens = qkvnp.generate(model, np.zeros((rows, 1), int), 1, temperature=t, top_k=3,
                            rng=1)[:, 1]
    frequencies = np.bincount(tokens, minlength=4) / rows
    np.testing.assert_allclose(frequencies, [1 / 13, 3 / 13, 9 / 13, 0.0], atol=0.015)


def test_logits_without_a_finite_maximum_are_refused_not_sampled_as_token_0():
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match="finite maximum in every row"):
            qkvnp.generate(FixedLogits([[0.0, bad, 1.0]]), np.zeros((1, 1), int), 1,
                           temperature=1.0, rng=0)
