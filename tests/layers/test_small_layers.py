"""Tests of the small layers: Linear, Embedding and embedding_forward/backward.

Oracles: closed forms (``x @ W + b`` written out, a row lookup by a Python
loop, repeated indices counted by hand), central differences
(``qkvnp.gradcheck``), and PyTorch's ``F.linear``/``F.embedding`` autograd in
float64.
"""
import numpy as np
import pytest

from qkvnp.gradcheck import check_layer, check_op
from qkvnp.ops.embedding import BINCOUNT_MAX_ENTRIES
from qkvnp.functional import embedding_backward, embedding_backward_factored, embedding_forward
from qkvnp.layers import Embedding, Linear

# ---------------------------------------------------------------- Linear


@pytest.mark.parametrize("x_shape", [(4,), (5, 4), (2, 3, 4)])  # one vector, (T, N), (B, T, N)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_closed_form(x_shape, bias, rng):
    # oracle: out = x @ W + b computed entry by entry with einsum
    layer = Linear(4, 3, bias=bias, rng=0)
    x = rng.normal(size=x_shape)
    out = layer.forward(x)
    assert out.shape == x_shape[:-1] + (3,)
    expected = np.einsum("...n,nm->...m", x, layer.params["W"])
    if bias:
        expected = expected + layer.params["b"]
    # rounding bound of a length-4 dot product: a few eps times sum |x_n W_nm|
    bound = 8 * np.finfo(np.float64).eps * (np.abs(x) @ np.abs(layer.params["W"]) + 1)
    assert np.all(np.abs(out - expected) <= bound)
    assert set(layer.params) == ({"W", "b"} if bias else {"W"})


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])  # tolerances from gradcheck's table
def test_linear_gradcheck(bias, dtype, rng):
    # oracle: central differences on W, b and x
    layer = Linear(4, 3, bias=bias, rng=1, dtype=dtype)
    report = check_layer(layer, rng.normal(size=(2, 5, 4)))
    assert report.ok, report.table()
    assert {row.name for row in report.rows} == (
        {"param W", "input 0"} | ({"param b"} if bias else set()))


def test_linear_matches_torch(torch, rng):
    # oracle: torch.nn.functional.linear(x, W.T, b) and autograd, float64
    layer = Linear(6, 4, rng=2)
    x = rng.normal(size=(3, 5, 6))
    dout = rng.normal(size=(3, 5, 4))
    out = layer.forward(x)
    dx = layer.backward(dout)
    x_t = torch.tensor(x, requires_grad=True)
    weight_t = torch.tensor(layer.params["W"].T.copy(), requires_grad=True)
    bias_t = torch.tensor(layer.params["b"], requires_grad=True)
    out_t = torch.nn.functional.linear(x_t, weight_t, bias_t)
    out_t.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx, x_t.grad.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.grads["W"], weight_t.grad.numpy().T, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.grads["b"], bias_t.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_linear_accumulates_and_zero_grad_resets(rng):
    # oracle: gradients of two backward calls add up (autograd's +=); zero_grad gives zeros
    layer = Linear(3, 2, rng=0)
    x1, x2 = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    d1, d2 = rng.normal(size=(4, 2)), rng.normal(size=(4, 2))
    layer.forward(x1)
    layer.backward(d1)
    layer.forward(x2)
    layer.backward(d2)
    np.testing.assert_allclose(layer.grads["W"], x1.T @ d1 + x2.T @ d2, rtol=1e-14)
    np.testing.assert_allclose(layer.grads["b"], d1.sum(0) + d2.sum(0), rtol=1e-14)
    layer.zero_grad()
    assert all(not g.any() and g.shape == layer.params[k].shape for k, g in layer.grads.items())


def test_linear_init_like_torch_and_reproducible():
    # oracle: nn.Linear's bound 1/sqrt(in_features); the same seed gives the same weights
    layer = Linear(16, 50, rng=3)
    bound = 1 / np.sqrt(16)
    assert np.abs(layer.params["W"]).max() <= bound
    assert np.abs(layer.params["b"]).max() <= bound
    assert np.abs(layer.params["W"]).max() > 0.9 * bound  # uses the whole range (800 draws)
    np.testing.assert_array_equal(layer.params["W"], Linear(16, 50, rng=3).params["W"])
    assert layer.num_parameters() == 16 * 50 + 50


def test_linear_float32(rng):
    # oracle: the dtype rule; float32 results agree with a float64 layer to float32 precision
    layer32 = Linear(5, 3, rng=0, dtype=np.float32)
    layer64 = Linear(5, 3, rng=0)
    layer64.params = {k: v.astype(np.float64) for k, v in layer32.params.items()}
    layer64.zero_grad()
    x = rng.normal(size=(4, 5))
    out32 = layer32.forward(x)
    assert out32.dtype == np.float32 and layer32.params["W"].dtype == np.float32
    dx32 = layer32.backward(np.ones((4, 3)))
    assert dx32.dtype == np.float32 and layer32.grads["W"].dtype == np.float32
    np.testing.assert_allclose(out32, layer64.forward(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx32, layer64.backward(np.ones((4, 3))), rtol=1e-5, atol=1e-6)


def test_linear_errors_name_the_argument():
    layer = Linear(4, 3, rng=0)
    with pytest.raises(RuntimeError, match="backward called before forward"):
        layer.backward(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"x must have shape \(..., 4\), got shape \(2, 5\)"):
        layer.forward(np.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"x must have shape"):
        layer.forward(np.float64(1.0))
    with pytest.raises(TypeError, match="x must hold real numbers"):
        layer.forward(np.array(["a", "b", "c", "d"]))
    layer.forward(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 3\).*got shape \(3, 2\)"):
        layer.backward(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="in_features must be >= 1, got 0"):
        Linear(0, 3)
    with pytest.raises(TypeError, match="out_features must be an int, got float"):
        Linear(3, 2.0)


# ---------------------------------------------------------------- Embedding


def test_embedding_forward_is_a_row_lookup(rng):
    # oracle: a Python loop over the indices
    weight = rng.normal(size=(7, 3))
    indices = np.array([[6, 0, 6], [2, 2, 1]])
    out, _ = embedding_forward(indices, weight)
    assert out.shape == (2, 3, 3)
    for position in np.ndindex(indices.shape):
        np.testing.assert_array_equal(out[position], weight[indices[position]])


def test_embedding_backward_adds_repeated_indices(rng):
    # oracle: sum of dout over the positions of each index, by a Python loop
    # (the trap: dweight[indices] += dout keeps only one of the repeats)
    weight = rng.normal(size=(5, 2))
    indices = np.array([[1, 3, 1], [1, 0, 3]])
    dout = rng.normal(size=(2, 3, 2))
    _, cache = embedding_forward(indices, weight)
    dweight = embedding_backward(dout, cache)
    assert dweight.shape == weight.shape
    expected = np.zeros_like(weight)
    for position in np.ndindex(indices.shape):
        expected[indices[position]] += dout[position]
    np.testing.assert_allclose(dweight, expected, rtol=1e-15)
    assert not dweight[[2, 4]].any()  # rows never looked up


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("positions", [40, 400])  # float64: 600 entries by bincount, 6000 sparse
def test_embedding_backward_sums_in_input_order_to_the_bit(rng, dtype, positions):
    # oracle: the Python loop above, in the weight's dtype, which adds the
    # positions of each row in input order, as np.add.at does (the backward
    # multiplies by a sparse one-hot matrix, or bincounts float64 slots: same
    # order, same bits); many repeats of few rows, so that the order shows in float32
    assert 5 * 40 * 3 <= BINCOUNT_MAX_ENTRIES < 5 * 400 * 3
    weight = rng.normal(size=(4, 3)).astype(dtype)
    indices = rng.integers(0, 3, size=(5, positions))  # row 3 never looked up
    dout = rng.normal(size=(5, positions, 3)).astype(dtype)
    _, cache = embedding_forward(indices, weight)
    dweight = embedding_backward(dout, cache)
    expected = np.zeros_like(weight)
    for position in np.ndindex(indices.shape):
        expected[indices[position]] += dout[position]
    assert dweight.dtype == dtype
    np.testing.assert_array_equal(dweight, expected)
    added = np.zeros_like(weight)
    np.add.at(added, indices, dout)
    np.testing.assert_array_equal(dweight, added)


def test_embedding_backward_of_no_index_and_of_float16(rng):
    # oracle: no position -> zero gradient; a float16 weight's gradient in its
    # compute dtype (float32, as before this backward was a sparse product),
    # within float32's rounding of the float64 sums
    _, cache = embedding_forward(np.zeros((2, 0), dtype=int), np.ones((3, 4)))
    np.testing.assert_array_equal(embedding_backward(np.ones((2, 0, 4)), cache), np.zeros((3, 4)))
    indices, dout = np.array([[0, 2, 0, 0]]), rng.normal(size=(1, 4, 2))
    _, cache = embedding_forward(indices, np.ones((3, 2), np.float16))
    dweight = embedding_backward(dout, cache)
    assert dweight.dtype == cache.dtype == np.float32
    expected = np.stack([dout[0, [0, 2, 3]].sum(0), np.zeros(2), dout[0, 1]])
    np.testing.assert_allclose(dweight, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lead, rows, positions, num, dim", [
    ((6,), 2, 5, 4, 3),  # folded: 2 x 4 columns <= 5 x 3 entries a position set
    ((2, 3), 1, 8, 3, 2),  # folded, two leading dims
    ((6,), 2, 5, 40, 3),  # 2 x 40 > 5 x 3: dout is formed, embedding_backward takes it
    ((6,), 0, 5, 4, 3), ((6,), 2, 0, 4, 3), ((0,), 2, 5, 4, 3),  # empty: zeros
])
def test_embedding_backward_factored_equals_the_backward_of_the_formed_product(
        rng, dtype, lead, rows, positions, num, dim):
    # oracle: embedding_backward (the loop-checked op above) of
    # dout = swapaxes(left) @ right, formed; the fold sums in another order
    # (bincount in float64, then one product): equal to the dtype's rounding
    weight = rng.normal(size=(num, dim)).astype(dtype)
    indices = rng.integers(0, num, size=lead + (positions,))
    left = rng.normal(size=lead + (rows, positions)).astype(dtype)
    right = rng.normal(size=lead + (rows, dim)).astype(dtype)
    _, cache = embedding_forward(indices, weight)
    expected = embedding_backward(np.swapaxes(left, -1, -2) @ right, cache)
    got = embedding_backward_factored(left, right, cache)
    assert got.dtype == dtype and got.shape == (num, dim)
    tolerance = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_embedding_backward_factored_refuses_factors_of_another_shape(rng):
    # oracle: the documented contract, each error naming the argument
    _, cache = embedding_forward(np.zeros((4, 5), dtype=int), np.ones((3, 2)))
    left, right = np.ones((4, 2, 5)), np.ones((4, 2, 2))
    for bad_left in (np.ones((4, 2, 6)), np.ones((3, 2, 5)), np.ones((2, 5))):
        with pytest.raises(ValueError, match=r"left must have shape \(\.\.\., M, P\)"):
            embedding_backward_factored(bad_left, right, cache)
    for bad_right in (np.ones((4, 2, 3)), np.ones((4, 1, 2)), np.ones((4, 2))):
        with pytest.raises(ValueError, match=r"right must have shape \(4, 2, 2\)"):
            embedding_backward_factored(left, bad_right, cache)


def test_embedding_gradcheck(rng):
    # oracle: central differences on the weight (indices are constants)
    report = check_op(embedding_forward, embedding_backward, {"weight": rng.normal(size=(6, 3))},
                      forward_kwargs={"indices": np.array([[1, 1, 5], [0, 1, 2]])})
    assert report.ok, report.table()


def test_embedding_layer_matches_torch(torch, rng):
    # oracle: torch.nn.functional.embedding and autograd, float64
    layer = Embedding(9, 4, rng=0)
    indices = rng.integers(0, 9, size=(3, 7))
    dout = rng.normal(size=(3, 7, 4))
    out = layer.forward(indices)
    assert layer.backward(dout) is None
    weight_t = torch.tensor(layer.params["weight"], requires_grad=True)
    out_t = torch.nn.functional.embedding(torch.tensor(indices), weight_t)
    out_t.backward(torch.tensor(dout))
    np.testing.assert_array_equal(out, out_t.detach().numpy())
    np.testing.assert_allclose(layer.grads["weight"], weight_t.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_embedding_layer_accumulates_and_init(rng):
    # oracle: two backward calls add up; the weight is N(0, 1) (mean and std within
    # 5 standard errors over 4000 draws); the dtype is kept
    layer = Embedding(1000, 4, rng=5)
    weight = layer.params["weight"]
    assert weight.shape == (1000, 4) and weight.dtype == np.float64
    assert abs(weight.mean()) < 5 / np.sqrt(4000)
    assert abs(weight.std() - 1) < 5 / np.sqrt(2 * 4000)
    layer.forward(np.array([3, 3]))
    layer.backward(np.ones((2, 4)))
    layer.forward(np.array([3]))
    layer.backward(np.full((1, 4), 0.5))
    np.testing.assert_array_equal(layer.grads["weight"][3], np.full(4, 2.5))
    assert layer.grads["weight"].sum() == 10.0
    layer32 = Embedding(3, 2, rng=0, dtype=np.float32)
    assert layer32.forward(np.array([0, 2])).dtype == np.float32


def test_embedding_errors_name_the_argument():
    layer = Embedding(4, 2, rng=0)
    with pytest.raises(RuntimeError, match="backward called before forward"):
        layer.backward(np.zeros((1, 2)))
    with pytest.raises(TypeError, match="indices must hold integer token ids.*float64"):
        layer.forward(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"indices must be in \[0, 4\).*got 4 at index \(1, 0\)"):
        layer.forward(np.array([[0], [4]]))
    with pytest.raises(ValueError, match=r"indices must be in \[0, 4\).*got -1"):
        layer.forward(np.array([-1]))  # no silent wrap-around to the last row
    layer.forward(np.array([[0, 1, 2]]))
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 3, 2\).*got shape \(3, 2\)"):
        layer.backward(np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"weight must have shape \(num, dim\), got shape \(4,\)"):
        embedding_forward(np.array([0]), np.zeros(4))
    with pytest.raises(ValueError, match="embedding_dim must be >= 1"):
        Embedding(3, 0)
