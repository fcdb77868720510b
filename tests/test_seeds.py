"""The seeds' printed numbers, reproduced through the public API (issue 2).

Oracle for every test here: the numbers printed by the seeds' tutorials, as
restated in issue 2 ("Reproduce the seeds' numbers"). The data below is copied
from the issue on purpose, not imported from ``qkvnp.apps.demo``, so that a typo in
the demo's constants cannot hide here (``tests/apps/test_demo.py`` checks that the
demo uses this same data). Values printed to 4 decimals are compared with
``atol=5e-5`` (half a unit of the last printed digit), the 8-decimal ones with
``atol=5e-9``.

What the seeds' numbers reveal about their scaling (checked below, by
computing both candidates and matching the printed digits):

* case 1 (journey, d_in=3, d_k=2): scaled by 1/sqrt(d_k) = 1/sqrt(2), as
  qkvnp's default. 1/sqrt(3) (the embedding size) would not match.
* case 2 (integer numpy example, d_k=3): scaled by 1/sqrt(3) = 1/sqrt(d_k)
  (which here equals the embedding size); unscaled would not match.
* case 3 (no weights, scores = X X^T): NOT scaled (scale = 1); 1/sqrt(3)
  would not match.
"""
import numpy as np

import qkvnp
from qkvnp import functional as F

ATOL_4 = 5e-5  # numbers printed with 4 decimals
ATOL_8 = 5e-9  # numbers printed with 8 decimals

# ---- case 1: "Your journey starts with one step" (issue 2, case 1)
INPUTS = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                   [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
W_QUERY = np.array([[0.29611194, 0.51656228], [0.25167072, 0.68855679], [0.07397246, 0.86652195]])
W_KEY = np.array([[0.13657987, 0.10247904], [0.18405646, 0.72644675], [0.31525391, 0.68710667]])
W_VALUE = np.array([[0.07563531, 0.19663817], [0.31641197, 0.40174013], [0.1185683, 0.82739538]])
WEIGHTS_ROWS_0_1 = np.array([[0.1551, 0.2104, 0.2059, 0.1413, 0.1074, 0.1799],
                             [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820]])
CONTEXT = np.array([[0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203],
                    [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]])
QUERY_2 = np.array([0.4306, 1.4551])
SCORES_2 = np.array([1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440])

# ---- case 2: the numpy example with integer words and weights (issue 2, case 2)
WORDS = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]])
W_Q = np.array([[2, 0, 2], [2, 0, 0], [2, 1, 2]])
W_K = np.array([[2, 2, 2], [0, 2, 1], [0, 1, 1]])
W_V = np.array([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
ATTENTION = np.array([[0.98522025, 1.74174051, 0.75652026], [0.90965265, 1.40965265, 0.5],
                      [0.99851226, 1.75849334, 0.75998108], [0.99560386, 1.90407309, 0.90846923]])

# ---- case 3: attention without weights, scores = X X^T (issue 2, case 3)
CONTEXT_NO_WEIGHTS = np.array([[0.4421, 0.5931, 0.5790], [0.4419, 0.6515, 0.5683],
                               [0.4431, 0.6496, 0.5671], [0.4304, 0.6298, 0.5510],
                               [0.4671, 0.5910, 0.5266], [0.4177, 0.6503, 0.5645]])


def _journey_projections():
    """queries, keys, values of the journey example via ``linear_forward``."""
    queries, _ = F.linear_forward(INPUTS, W_QUERY)
    keys, _ = F.linear_forward(INPUTS, W_KEY)
    values, _ = F.linear_forward(INPUTS, W_VALUE)
    return queries, keys, values


def _self_attention(d_in, d_out, W_query, W_key, W_value, impl):
    """A SelfAttention layer whose random init is replaced by the seeds' matrices."""
    layer = qkvnp.SelfAttention(d_in, d_out, rng=0, impl=impl)
    for name, matrix in (("W_query", W_query), ("W_key", W_key), ("W_value", W_value)):
        layer.params[name][...] = matrix
    return layer


# ---------------------------------------------------------------- case 1


def test_case1_query_and_scores_of_token_2():
    """Oracle: the seeds' printed query x^2 W_query and its scores q^2 . k^j."""
    queries, keys, _ = _journey_projections()
    query_2 = queries[1]  # the seeds count from 1: token 2 is inputs[1]
    assert query_2.shape == (2,)
    np.testing.assert_allclose(query_2, QUERY_2, rtol=0, atol=ATOL_4)
    scores_2, _ = F.linear_forward(query_2, keys.T)  # q^2 @ K^T
    assert scores_2.shape == (6,)
    np.testing.assert_allclose(scores_2, SCORES_2, rtol=0, atol=ATOL_4)


def test_case1_functional_weights_and_context():
    """Oracle: the seeds' printed weights (rows 1, 2) and 6x2 context vectors."""
    queries, keys, values = _journey_projections()
    context, cache = F.attention_forward(queries, keys, values)  # default scale 1/sqrt(2)
    assert context.shape == (6, 2) and cache.weights.shape == (6, 6)
    np.testing.assert_allclose(cache.weights[:2], WEIGHTS_ROWS_0_1, rtol=0, atol=ATOL_4)
    np.testing.assert_allclose(context, CONTEXT, rtol=0, atol=ATOL_4)
    np.testing.assert_allclose(cache.scale, 1 / np.sqrt(2), rtol=1e-15)


def test_case1_scaled_dot_product_attention():
    """Oracle: the seeds' printed numbers, via the one-call public function too."""
    queries, keys, values = _journey_projections()
    context, weights = qkvnp.scaled_dot_product_attention(
        queries, keys, values, return_weights=True
    )
    assert context.shape == (6, 2) and weights.shape == (6, 6)
    np.testing.assert_allclose(weights[:2], WEIGHTS_ROWS_0_1, rtol=0, atol=ATOL_4)
    np.testing.assert_allclose(context, CONTEXT, rtol=0, atol=ATOL_4)


def test_case1_self_attention_layer(impl):
    """Oracle: the seeds' printed numbers, from SelfAttention with their W matrices."""
    layer = _self_attention(3, 2, W_QUERY, W_KEY, W_VALUE, impl)
    context, weights = layer.forward(INPUTS, return_weights=True)
    assert context.shape == (6, 2) and weights.shape == (6, 6)
    np.testing.assert_allclose(weights[:2], WEIGHTS_ROWS_0_1, rtol=0, atol=ATOL_4)
    np.testing.assert_allclose(context, CONTEXT, rtol=0, atol=ATOL_4)


def test_case1_single_query_gives_row_2():
    """Oracle: query token 2 alone reproduces row 2 of the weights and context."""
    queries, keys, values = _journey_projections()
    context_2, weights_2 = qkvnp.scaled_dot_product_attention(
        queries[1:2], keys, values, return_weights=True
    )  # (1, D) query against all six keys
    assert context_2.shape == (1, 2) and weights_2.shape == (1, 6)
    np.testing.assert_allclose(weights_2[0], WEIGHTS_ROWS_0_1[1], rtol=0, atol=ATOL_4)
    np.testing.assert_allclose(context_2[0], CONTEXT[1], rtol=0, atol=ATOL_4)


def test_softmax_of_a_single_score_is_one_but_the_row_softmax_is_not():
    """The seed's text applies softmax to a single score omega_22.

    Oracle: a one-element softmax is identically 1 (e^s / e^s), whatever s;
    the correct per-row softmax over all six scaled scores gives the seeds'
    listed weights, none of which is 1.
    """
    scaled = SCORES_2 / np.sqrt(2)
    for s in list(scaled) + [-50.0, 0.0, 123.4]:
        single = qkvnp.softmax(np.array([s]))
        assert single.shape == (1,)
        assert single[0] == 1.0
    weights_2, _ = F.softmax_forward(scaled)
    assert weights_2.shape == (6,)
    np.testing.assert_allclose(weights_2, WEIGHTS_ROWS_0_1[1], rtol=0, atol=ATOL_4)
    assert np.all(weights_2 < 0.25)  # every weight shares the mass with the others
    # the "weight" the single-score softmax claims for token 2 is 4x too large
    assert abs(qkvnp.softmax(scaled[1:2])[0] - weights_2[1]) > 0.7


def test_scaling_by_embedding_size_gives_other_numbers():
    """1/sqrt(d_k) (the head dim, here 2) is correct; 1/sqrt(embed size = 3) is the bug.

    Oracle: the seeds' printed weights, which were computed with 1/sqrt(d_k).
    Why d_k: for q, k with independent unit-variance entries, q . k has
    variance d_k, so dividing by sqrt(d_k) gives scores of unit variance
    whatever the head size; the embedding size says nothing about the length
    of the vectors being multiplied. The seeds' Transformer tutorial divides
    by sqrt(embed_size): its scores shrink as heads are added.
    """
    queries, keys, values = _journey_projections()
    _, right = qkvnp.scaled_dot_product_attention(queries, keys, values, return_weights=True)
    _, wrong = qkvnp.scaled_dot_product_attention(
        queries, keys, values, scale=1 / np.sqrt(INPUTS.shape[-1]), return_weights=True
    )
    np.testing.assert_allclose(right[:2], WEIGHTS_ROWS_0_1, rtol=0, atol=ATOL_4)
    # the wrong scale misses the printed digits by far more than rounding
    assert np.max(np.abs(wrong[:2] - WEIGHTS_ROWS_0_1)) > 100 * ATOL_4
    # and flattens the softmax: every row is closer to uniform (smaller max weight)
    assert np.all(wrong.max(axis=-1) < right.max(axis=-1))


# ---------------------------------------------------------------- case 2


def test_case2_integer_example_functional():
    """Oracle: the seeds' 8-digit output; integer input is promoted to float64.

    The printed numbers use the scale 1/sqrt(d_k) = 1/sqrt(3) (our default);
    without scaling the result differs in the first decimals.
    """
    queries, _ = F.linear_forward(WORDS, W_Q)
    keys, _ = F.linear_forward(WORDS, W_K)
    values, _ = F.linear_forward(WORDS, W_V)
    assert queries.dtype == np.float64
    out, cache = F.attention_forward(queries, keys, values)
    assert out.shape == (4, 3) and out.dtype == np.float64
    np.testing.assert_allclose(cache.scale, 1 / np.sqrt(3), rtol=1e-15)
    np.testing.assert_allclose(out, ATTENTION, rtol=0, atol=ATOL_8)
    unscaled = qkvnp.scaled_dot_product_attention(queries, keys, values, scale=1.0)
    assert np.max(np.abs(unscaled - ATTENTION)) > 1e-2


def test_case2_integer_example_layer(impl):
    """Oracle: the seeds' 8-digit output, from SelfAttention(3, 3) fed integer words."""
    layer = _self_attention(3, 3, W_Q, W_K, W_V, impl)
    out = layer.forward(WORDS)  # int64 input, promoted to the layer's float64
    assert out.shape == (4, 3) and out.dtype == np.float64
    np.testing.assert_allclose(out, ATTENTION, rtol=0, atol=ATOL_8)


# ---------------------------------------------------------------- case 3


def test_case3_without_weights_is_unscaled():
    """Oracle: the seeds' printed context vectors of softmax(X X^T) X.

    Computing both candidates shows the seeds did not scale here: scale=1
    matches to the printed digits, the default 1/sqrt(3) does not.
    """
    unscaled = qkvnp.scaled_dot_product_attention(INPUTS, INPUTS, INPUTS, scale=1.0)
    assert unscaled.shape == (6, 3)
    np.testing.assert_allclose(unscaled, CONTEXT_NO_WEIGHTS, rtol=0, atol=ATOL_4)
    scaled = qkvnp.scaled_dot_product_attention(INPUTS, INPUTS, INPUTS)
    assert np.max(np.abs(scaled - CONTEXT_NO_WEIGHTS)) > 100 * ATOL_4


def test_case3_matches_the_explicit_softmax_of_the_gram_matrix():
    """Oracle: the textbook recipe scores = X X^T, weights = softmax(scores), Z = weights X."""
    scores, _ = F.linear_forward(INPUTS, INPUTS.T)  # X X^T, (6, 6)
    weights, _ = F.softmax_forward(scores)
    context, _ = F.linear_forward(weights, INPUTS)  # (6, 6) @ (6, 3)
    assert context.shape == (6, 3)
    np.testing.assert_allclose(weights.sum(axis=-1), np.ones(6), rtol=0, atol=1e-15)
    np.testing.assert_allclose(context, CONTEXT_NO_WEIGHTS, rtol=0, atol=ATOL_4)
