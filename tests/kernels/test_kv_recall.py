"""The kv-recall model's factored attention backward (``qkvnp.kernels.kv_recall``).

Oracle: the reference it replaces, ``attention_backward(dout, cache,
key_is_value=True)`` (itself checked against central differences in
``tests/test_gradients.py``): the same ``dquery`` bit for bit, and the
product of the two factors equal to the reference's ``dX``.
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.kernels.kv_recall import items_backward_factors


@pytest.mark.parametrize("query_shape, items_shape, dropout", [
    ((4, 1, 8), (4, 6, 8), False),  # the model's: one query row per sequence
    ((2, 3, 5), (2, 7, 5), True),  # several query rows, a replayed dropout mask
    ((3, 2, 4), (7, 4), False),  # one item set shared by every batch element (broadcast)
])
def test_factors_multiply_to_the_reference_gradient(query_shape, items_shape, dropout):
    rng = np.random.default_rng(7)
    query, items = rng.normal(size=query_shape), rng.normal(size=items_shape)
    options = {}
    if dropout:
        _, drawn = F.attention_forward(query, items, items, dropout_p=0.5, rng=1)
        options = {"dropout_p": 0.5, "dropout_mask": drawn.dropout_mask}
    out, cache = F.attention_forward(query, items, items, **options)
    dout = rng.normal(size=out.shape)
    dquery, ditems, none = F.attention_backward(dout, cache, key_is_value=True)
    dquery_factors, left, right = items_backward_factors(dout, cache)
    T, S, D = query_shape[-2], items_shape[-2], items_shape[-1]
    assert left.shape[-2:] == (2 * T, S) and right.shape[-2:] == (2 * T, D)
    np.testing.assert_array_equal(dquery_factors, dquery)
    product = F.sum_to_shape(np.swapaxes(left, -1, -2) @ right, items.shape)
    np.testing.assert_array_equal(product, ditems)
    assert none is None


def test_refuses_two_arrays_and_a_grouped_cache():
    # Oracle: the documented contract of one array as both key and value.
    rng = np.random.default_rng(5)
    query, items = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4))
    out, cache = F.attention_forward(query, items, items.copy())
    with pytest.raises(ValueError, match="key_is_value=True needs the forward's key and value"):
        items_backward_factors(np.ones(out.shape), cache)
    out, cache = F.attention_forward(rng.normal(size=(4, 3, 4)), items, items, enable_gqa=True)
    with pytest.raises(ValueError, match="key_is_value=True needs an ungrouped cache"):
        items_backward_factors(np.ones(out.shape), cache)
