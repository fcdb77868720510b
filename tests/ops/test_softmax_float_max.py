"""The reference softmax with scores at the largest float, whatever scipy does.

Oracle: closed forms. Equal scores give equal weights (1/n each), every row
that is not fully masked sums to 1, a fully masked row is all zeros. scipy 1.8
computed ``exp(x - logsumexp(x))``, and ``logsumexp`` of three scores at
``finfo.max`` overflows to ``inf`` in the sum and gave weights [1, 1, 1].
"""
import warnings

import numpy as np
import pytest

from qkvnp.functional import softmax


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_three_scores_tied_at_the_float_max_share_the_weight(dtype):
    big = np.finfo(dtype).max
    scores = np.array([
        [big, big, big],           # the tie at the float max: 1/3 each
        [big, big, -np.inf],       # two tied, one masked: 1/2, 1/2, 0
        [-big, big, 0.0],          # max - min overflows: all weight on the max
        [1.0, 1.0, 1.0],           # an ordinary tie, for comparison
        [-np.inf, -np.inf, -np.inf],  # fully masked: zeros, as documented
    ], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid-value warning
        weights = softmax(scores, axis=-1)
    assert weights.shape == scores.shape
    assert weights.dtype == dtype
    expected = np.array([
        [1 / 3, 1 / 3, 1 / 3],
        [1 / 2, 1 / 2, 0.0],
        [0.0, 1.0, 0.0],
        [1 / 3, 1 / 3, 1 / 3],
        [0.0, 0.0, 0.0],
    ])
    rtol = 4 * np.finfo(dtype).eps
    np.testing.assert_allclose(weights, expected, rtol=rtol, atol=0)
    np.testing.assert_allclose(weights[:-1].sum(axis=-1), 1.0, rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_tie_at_the_float_max_along_another_axis(dtype):
    """The shift uses each row's own max along ``axis``, not the whole array's."""
    big = np.finfo(dtype).max
    scores = np.array([[big, 0.0], [big, 0.0], [big, 0.0]], dtype=dtype)  # (3, 2)
    weights = softmax(scores, axis=0)
    assert weights.shape == (3, 2)
    np.testing.assert_allclose(weights, np.full((3, 2), 1 / 3), rtol=4 * np.finfo(dtype).eps)
    np.testing.assert_allclose(weights.sum(axis=0), [1.0, 1.0], rtol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("axis", [-1, 0])
def test_only_fully_masked_rows_become_zeros(axis):
    """Oracle: the documented contract. Every entry -inf: zeros; a NaN or a +inf
    makes its row NaN (no softmax is defined, none is invented); other rows are
    scipy's softmax; no warning either way."""
    import scipy.special

    rows = np.array([[-np.inf, -np.inf, -np.inf], [np.nan, 1.0, 0.0],
                     [np.inf, 1.0, 0.0], [-np.inf, 2.0, 0.5]])
    scores = rows if axis == -1 else rows.T
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = softmax(scores, axis=axis)
    weights = weights if axis == -1 else weights.T
    np.testing.assert_array_equal(weights[0], 0.0)
    assert np.isnan(weights[1]).all() and np.isnan(weights[2]).all()
    np.testing.assert_array_equal(weights[3], scipy.special.softmax(rows[3]))
