"""``generate(..., top_p=)``: nucleus sampling, and ``on_token``.

Oracle: a direct, per-row Python implementation of the stated rule. After
top-k and the temperature, ``p = softmax(logits / t)``; sort ``p`` descending,
find the fewest tokens whose probabilities sum to at least ``top_p`` (of the
row's sum), keep every token whose probability is at least the last kept one's
(ties with it kept, as top-k keeps ties with the k-th), renormalise, and draw
by the inverse CDF with the same uniform the generator gives.
"""
import math

import numpy as np
import pytest

import qkvnp

from test_generation import FixedLogits


def nucleus_by_hand(row, top_p, temperature, top_k, u):
    """The token the rule picks from ``row`` (a list of logits) for the uniform ``u``."""
    row = [float(x) for x in row]
    if top_k is not None:
        kth = sorted(row, reverse=True)[top_k - 1]
        row = [x if x >= kth else -math.inf for x in row]
    top = max(row)
    weights = [math.exp((x - top) / temperature) if x > -math.inf else 0.0 for x in row]
    total = sum(weights)
    probs = [w / total for w in weights]
    ordered = sorted(probs, reverse=True)
    mass, last = 0.0, ordered[-1]
    for p in ordered:
        mass += p
        last = p
        if mass >= top_p * sum(ordered):
            break
    kept = [p if p >= last else 0.0 for p in probs]
    cumulative, target = 0.0, u * sum(kept)
    for token, p in enumerate(kept):
        cumulative += p
        if cumulative > target:
            return token
    return len(kept) - 1


@pytest.mark.parametrize("top_p, temperature, top_k", [
    (0.5, 1.0, None),  # a few tokens of a spread row
    (0.9, 0.7, None),
    (0.3, 2.0, 5),  # after top-k
    (1.0, 1.0, None),  # every token of non-zero probability
    (1e-9, 1.0, None),  # the argmax alone (and its ties)
])
def test_top_p_picks_what_the_rule_picks_with_the_same_uniforms(top_p, temperature, top_k):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 12)) * 2
    logits[:8, :3] = 4.0  # rows with tied maxima
    model = FixedLogits(logits)
    tokens = qkvnp.generate(model, np.zeros((64, 1), int), 1, temperature=temperature,
                            top_k=top_k, top_p=top_p, rng=5)[:, 1]
    uniforms = np.random.default_rng(5).random(64)
    expected = [nucleus_by_hand(row, top_p, temperature, top_k, u)
                for row, u in zip(logits, uniforms)]
    assert tokens.shape == (64,)
    assert tokens.tolist() == expected


def test_top_p_keeps_ties_with_the_last_token_and_never_samples_outside():
    # oracle: closed form. Probabilities about [0.4, 0.2, 0.2, 0.2] (logits ln 2, 0, 0, 0):
    # top_p 0.5 needs 0.4 + 0.2; the three 0.2 are tied, so all four are kept (the draws
    # then follow the full row); top_p 0.3 keeps token 0 alone
    rows = 4000
    logits = np.tile([math.log(2.0), 0.0, 0.0, 0.0], (rows, 1))
    model = FixedLogits(logits)
    tokens = qkvnp.generate(model, np.zeros((rows, 1), int), 1, temperature=1.0, top_p=0.5,
                            rng=0)[:, 1]
    assert set(np.unique(tokens)) == {0, 1, 2, 3}
    assert abs(np.mean(tokens == 0) - 0.4) < 0.05
    only = qkvnp.generate(model, np.zeros((rows, 1), int), 1, temperature=1.0, top_p=0.3,
                          rng=0)[:, 1]
    assert set(np.unique(only)) == {0}


def test_top_p_changes_nothing_when_greedy():
    # oracle: the argmax is always in the nucleus
    logits = np.random.default_rng(1).normal(size=(4, 9))
    model = FixedLogits(logits)
    idx = np.zeros((4, 1), int)
    assert np.array_equal(qkvnp.generate(model, idx, 3, top_p=0.1),
                          qkvnp.generate(model, idx, 3))


@pytest.mark.parametrize("top_p", [0, -0.1, 1.5, float("nan"), "0.5", True])
def test_a_bad_top_p_is_refused_by_name(top_p):
    model = FixedLogits(np.zeros((1, 4)))
    with pytest.raises(ValueError, match=r"top_p must be a float in \(0, 1\]"):
        qkvnp.generate(model, np.zeros((1, 1), int), 1, temperature=1.0, top_p=top_p)


def test_on_token_sees_each_steps_tokens_as_they_are_chosen():
    # oracle: the tokens generate returns, step by step; none after eos
    logits = np.random.default_rng(2).normal(size=(2, 7))
    model = FixedLogits(logits)
    seen = []
    out = qkvnp.generate(model, np.zeros((2, 1), int), 4, temperature=1.0, rng=3,
                         on_token=seen.append)
    assert [s.tolist() for s in seen] == out[:, 1:].T.tolist()
    seen.clear()
    eos = int(logits[0].argmax())
    one = FixedLogits(logits[:1])
    out = qkvnp.generate(one, np.zeros((1, 1), int), 4, eos_id=eos, on_token=seen.append)
    assert out.shape == (1, 1) and seen == []
    with pytest.raises(TypeError, match="on_token must be callable"):
        qkvnp.generate(one, np.zeros((1, 1), int), 1, on_token=3)
