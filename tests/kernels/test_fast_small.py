"""The whole-array core (``qkvnp.kernels.fast_small``) when its row-max bound is loose.

Oracle: a naive softmax in float64 (``scores - max``, ``exp``, divide by the
row sum), the weights applied to the values. The bound ``|q| max|k|`` is far
above a row's largest score when the query is nearly orthogonal to the
longest keys (here by about 95 in float32 and float64): the core must still
answer, from the exact row max, instead of declining.
"""
import numpy as np
import pytest

from qkvnp.kernels.fast_small import mask_row_max, small_forward


def _loose_problem(dtype):
    rng = np.random.default_rng(3)
    query = np.zeros((2, 5, 2), dtype)  # (G, T, D)
    query[..., 0] = 10.0  # |q| = 10
    key = np.zeros((2, 6, 2), dtype)  # (G, S, D)
    key[..., 1] = 10.0  # |k| = 10, orthogonal to q: scores from the small first column
    key[..., 0] = rng.uniform(-0.5, 0.5, size=(2, 6))
    value = rng.standard_normal((2, 6, 3)).astype(dtype)  # (G, S, Dv)
    return query, key, value


def _naive(query, key, value, mask):
    scores = query.astype(np.float64) @ key.astype(np.float64).swapaxes(-1, -2)  # (G, T, S)
    if mask is not None:
        scores = scores + mask
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ value.astype(np.float64)  # (G, T, S) @ (G, S, Dv) -> (G, T, Dv)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("normalize", [False, True])  # kept numerators / kept weights
@pytest.mark.parametrize("causal", [False, True])  # no mask / additive causal mask (T < S)
def test_a_loose_row_max_bound_still_gives_the_softmax(dtype, normalize, causal):
    query, key, value = _loose_problem(dtype)
    T, S = query.shape[1], key.shape[1]
    mask = None
    if causal:
        mask = np.where(np.tri(T, S, S - T, dtype=bool), 0, -np.inf).astype(dtype)  # (T, S)
    exp_scores = np.empty((2, T, S), dtype)
    inv_sum = np.empty((2, T, 1), dtype)
    out = np.empty((2, T, value.shape[-1]), dtype)
    answered = small_forward(query, key, value, mask, mask_row_max(mask, dtype), exp_scores,
                             inv_sum, out, normalize=normalize)
    assert answered is True
    assert out.shape == (2, T, 3)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, _naive(query, key, value, mask), rtol=tolerance,
                               atol=tolerance)
