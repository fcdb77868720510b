"""The RMSNorm layer: its gradients, its initial state, its arguments.

Shape key: B batch, T tokens, E the normalised axis; H heads, D head dim for QK-norm.

Oracles: central differences and the complex step of the whole layer
(:func:`qkvnp.gradcheck.check_layer`, float64, ``TOLERANCES``); the op it
calls (:func:`qkvnp.functional.rms_norm_forward`, its own tests hold it to
torch); ``torch.nn.RMSNorm`` with the same weight and autograd, to 1e-10 in
float64; closed forms of the initial state (ones, or zeros with
``unit_offset``: both start as the plain normalisation).
"""
import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp.gradcheck import check_layer


@pytest.mark.parametrize("unit_offset", [False, True])  # weight as is (Llama, Qwen3), 1 + weight (Gemma 3)
@pytest.mark.parametrize("shape", [(2, 3, 6), (2, 3, 4, 6)])  # (B, T, E), QK-norm (B, H, T, D)
@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_rms_norm_layer_gradcheck(method, shape, unit_offset, rng):
    layer = qkvnp.RMSNorm(6, unit_offset=unit_offset)
    layer.params["weight"][:] = rng.normal(size=6)  # away from the initial ones / zeros
    report = check_layer(layer, rng.normal(size=shape), method=method)
    assert report.ok, "\n" + report.table()
    assert {row.name for row in report.rows} == {"param weight", "input 0"}


@pytest.mark.parametrize("unit_offset", [False, True])
def test_the_initial_layer_is_the_plain_normalisation(unit_offset, rng):
    # weight ones, or zeros with unit_offset: either way the gain starts at 1
    layer = qkvnp.RMSNorm(5, unit_offset=unit_offset)
    expected_weight = np.zeros(5) if unit_offset else np.ones(5)
    np.testing.assert_array_equal(layer.params["weight"], expected_weight)
    x = rng.normal(size=(3, 5))
    out = layer.forward(x)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6),
                               rtol=1e-14)


def test_the_layer_calls_the_op_and_accumulates_its_weight_gradient(rng):
    layer = qkvnp.RMSNorm(4, eps=1e-5, unit_offset=True)
    layer.params["weight"][:] = rng.normal(size=4)
    x, dout = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))
    out, cache = F.rms_norm_forward(x, layer.params["weight"], 1e-5, unit_offset=True)
    dx, dweight = F.rms_norm_backward(dout, cache)
    np.testing.assert_array_equal(layer.forward(x), out)
    np.testing.assert_array_equal(layer.backward(dout), dx)
    np.testing.assert_array_equal(layer.grads["weight"], dweight)
    layer.forward(x)
    layer.backward(dout)  # backward adds, as autograd's +=
    np.testing.assert_allclose(layer.grads["weight"], 2.0 * dweight, rtol=1e-15)
    layer.zero_grad()
    np.testing.assert_array_equal(layer.grads["weight"], 0.0)


def test_the_layer_matches_torch_rms_norm(torch, rng):
    # oracle: torch.nn.RMSNorm(E, eps) with the same weight, autograd, float64
    layer = qkvnp.RMSNorm(8)
    layer.params["weight"][:] = rng.normal(size=8)
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    theirs = torch.nn.RMSNorm(8, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(layer.params["weight"]))
    x_t = torch.tensor(x, requires_grad=True)
    out_t = theirs(x_t)
    out_t.backward(torch.tensor(dout))
    out = layer.forward(x)
    dx = layer.backward(dout)
    for ours, reference in ((out, out_t), (dx, x_t.grad), (layer.grads["weight"], theirs.weight.grad)):
        np.testing.assert_allclose(ours, reference.detach().numpy(), rtol=0, atol=1e-10)


def test_float32_layer_computes_in_float32(rng):
    layer = qkvnp.RMSNorm(4, dtype=np.float32)
    out = layer.forward(rng.normal(size=(2, 4)))  # float64 input, cast to the layer's dtype
    dx = layer.backward(rng.normal(size=(2, 4)))
    assert out.dtype == dx.dtype == layer.grads["weight"].dtype == np.float32


def test_state_dict_round_trip_and_repr(rng):
    layer = qkvnp.RMSNorm(3, unit_offset=True)
    other = qkvnp.RMSNorm(3, unit_offset=True)
    layer.params["weight"][:] = rng.normal(size=3)
    other.load_state_dict(layer.state_dict())
    np.testing.assert_array_equal(other.params["weight"], layer.params["weight"])
    assert repr(layer) == "RMSNorm(dim=3, eps=1e-06, unit_offset=True, dtype=float64)"


def test_the_layer_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dim"):
        qkvnp.RMSNorm(0)
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
        qkvnp.RMSNorm(4, eps=0.0)
    with pytest.raises(TypeError, match="unit_offset must be a bool"):
        qkvnp.RMSNorm(4, unit_offset=1)
    with pytest.raises(TypeError, match="dtype"):
        qkvnp.RMSNorm(4, dtype=np.int64)
    layer = qkvnp.RMSNorm(4)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 4\)"):
        layer.forward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="x contains NaN"):
        layer.forward(np.full((2, 4), np.inf))
    layer.forward(np.ones((2, 4)))
    with pytest.raises(ValueError, match="dout"):
        layer.backward(np.ones((2, 3)))
