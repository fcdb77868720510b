"""ALiBi's slopes and bias, and the relative positions behind T5's buckets.

Oracles: the ALiBi paper's ``get_slopes`` (Press et al., its repository's
code, written out here), the closed form ``2**(-8h/n)`` for powers of two,
and ``-slope * |i - j|`` evaluated by a loop. T5's buckets are checked
against the ``transformers`` formula in ``tests/ops/test_variants_torch.py``.
"""
import math

import numpy as np
import pytest

import qkvnp
from qkvnp.ops.positions import alibi_bias, alibi_slopes, relative_position_bucket


def paper_get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + paper_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 64])
def test_alibi_slopes_are_the_papers(num_heads):
    slopes = alibi_slopes(num_heads)
    assert slopes.shape == (num_heads,)
    np.testing.assert_allclose(slopes, paper_get_slopes(num_heads), rtol=1e-15)


def test_alibi_slopes_power_of_two_closed_form():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** (-h) for h in range(1, 9)], rtol=1e-15)


def test_alibi_bias_by_loop():
    slopes = alibi_slopes(3)
    for offset in (0, 2):
        bias = alibi_bias(3, 5, slopes, offset=offset)
        assert bias.shape == (3, 3, 5)
        for h in range(3):
            for i in range(3):
                for j in range(5):
                    assert bias[h, i, j] == -slopes[h] * abs(i + offset - j)


def test_relative_bucket_ranges():
    buckets = relative_position_bucket(50, 60, num_buckets=16, max_distance=30)
    assert buckets.min() >= 0 and buckets.max() == 15
    causal = relative_position_bucket(50, 50, num_buckets=16, max_distance=30,
                                      bidirectional=False)
    assert np.all(causal[np.triu_indices(50, 1)] == 0)  # keys after the query: bucket 0
    assert np.all(np.diag(causal) == 0)


def test_refused_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match="slopes"):
        alibi_bias(2, 2, np.zeros((2, 2)))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_stay_in_the_table_for_every_allowed_max_distance(bidirectional):
    """Oracle: the definition's range, every bucket in [0, num_buckets), checked exhaustively on
    a grid (num_buckets 1..34, max_distance 1..40, distances -3 max_distance - 5 .. +), and the
    bound of T5's/HF's formula: the log-spaced buckets divide by log(max_distance / max_exact),
    max_exact = max(half // 2, 1) with half the buckets of a side, so a max_distance at or below
    it is refused by name, and one above it is accepted."""
    for num_buckets in range(2 if bidirectional else 1, 35):
        half = num_buckets // 2 if bidirectional else num_buckets
        bound = max(half // 2, 1)
        for max_distance in range(1, 41):
            reach = 3 * max_distance + 5
            if max_distance <= bound:
                with pytest.raises(ValueError, match=f"max_distance must be greater than "
                                                     f"{bound}.*got max_distance={max_distance}"):
                    relative_position_bucket(1, 2 * reach + 1, num_buckets, max_distance,
                                             bidirectional, offset=reach)
                continue
            buckets = relative_position_bucket(1, 2 * reach + 1, num_buckets, max_distance,
                                               bidirectional, offset=reach)  # j - i in -reach..reach
            assert buckets.shape == (1, 2 * reach + 1)
            assert buckets.min() >= 0 and buckets.max() < num_buckets, (num_buckets, max_distance)


@pytest.mark.parametrize("build", [
    lambda **kw: qkvnp.MultiHeadAttention(8, 2, **kw),
    lambda **kw: qkvnp.SelfAttention(8, 8, **kw),
    lambda **kw: qkvnp.TransformerBlock(8, 2, **kw),
    lambda **kw: qkvnp.GPTModel(11, 6, 8, 2, 1, **kw),
], ids=["MultiHeadAttention", "SelfAttention", "TransformerBlock", "GPTModel"])
def test_t5_max_distance_too_small_for_num_buckets_is_refused_by_the_constructors(build):
    """Oracle: the bound of the causal (unidirectional) buckets a layer may be called with,
    max_distance > num_buckets // 2; 8 buckets: 4 is refused by name, 5 builds."""
    with pytest.raises(ValueError, match="max_distance must be greater than 4 .*got "
                                         "max_distance=4"):
        build(position_bias="relative", num_buckets=8, max_distance=4)
    build(position_bias="relative", num_buckets=8, max_distance=5)
