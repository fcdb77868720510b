"""The SiLU op (``silu_forward`` / ``silu_backward``) against its oracles.

Shape key: ``...`` any shape (elementwise).

Oracles: closed forms (``silu(0) = 0``, ``silu'(0) = 1/2``,
``silu(x) -> x`` and ``silu'(x) -> 1`` for large ``x``, ``silu(x) - silu(-x) = x``
as ``sigmoid(x) + sigmoid(-x) = 1``); central differences and the complex
step of ``<dout, f(x)>`` with a random ``dout`` (:mod:`qkvnp.gradcheck`,
float64); PyTorch autograd of ``torch.nn.functional.silu`` (1e-10 in
float64, float32's epsilon times a small factor in float32).
"""
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkvnp import functional as F
from qkvnp.gradcheck import check_op

from strategies import finite_arrays

METHODS = ["central", "complex_step"]
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


def test_silu_closed_forms_at_zero_and_far_out():
    # silu(0) = 0 * 1/2 = 0, silu'(0) = s + 0 = 1/2; far out, s = 1 (x > 0) or 0 (x < 0)
    x = np.array([0.0, 40.0, -40.0, 1.0])
    out, cache = F.silu_forward(x)
    assert out.shape == x.shape
    np.testing.assert_allclose(out[:3], [0.0, 40.0, -40.0 * np.exp(-40.0)], rtol=1e-15, atol=0)
    np.testing.assert_allclose(out[3], 1.0 / (1.0 + np.exp(-1.0)), rtol=1e-15)
    dx = F.silu_backward(np.ones(4), cache)
    np.testing.assert_allclose(dx[:2], [0.5, 1.0], rtol=1e-15)
    # silu'(-40) = s (1 + x (1 - s)) with s = e^-40 / (1 + e^-40)
    s = np.exp(-40.0) / (1.0 + np.exp(-40.0))
    np.testing.assert_allclose(dx[2], s * (1.0 - 40.0 * (1.0 - s)), rtol=1e-14)


@given(finite_arrays(st.tuples(st.integers(1, 5)), bound=50.0))
def test_silu_odd_part_is_the_identity(x):
    # sigmoid(x) + sigmoid(-x) = 1: silu(x) - silu(-x) = x (s + (1 - s)) = x
    plus, _ = F.silu_forward(x)
    minus, _ = F.silu_forward(-x)
    np.testing.assert_allclose(plus - minus, x, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("method", METHODS)
def test_silu_gradients_match_numerical_derivatives(method, rng):
    inputs = {"x": 4.0 * rng.normal(size=(2, 3, 4))}
    assert_ok(check_op(F.silu_forward, F.silu_backward, inputs, method=method))


@given(finite_arrays(st.tuples(st.integers(1, 3), st.integers(1, 4)), bound=30.0))
def test_silu_complex_step_certificate_on_drawn_inputs(x):
    # both branches of the stable sigmoid (x >= 0 and x < 0) are drawn
    assert_ok(check_op(F.silu_forward, F.silu_backward, {"x": x}, method="complex_step"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_extreme_inputs_give_finite_values_and_no_warning(dtype):
    # exp only of -|x|: nothing overflows; silu(-1000) = -0 (underflow), silu(1000) = 1000
    x = np.array([-1000.0, -100.0, -1e-30, 0.0, 1e-30, 100.0, 1000.0], dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            out, cache = F.silu_forward(x)
            dx = F.silu_backward(np.ones_like(x), cache)
    assert out.dtype == dx.dtype == np.dtype(dtype)
    assert np.isfinite(out).all() and np.isfinite(dx).all()
    np.testing.assert_array_equal(out[[0, -1]], [0.0, 1000.0])
    np.testing.assert_array_equal(dx[[0, -1]], [0.0, 1.0])


def test_silu_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="x contains NaN"):
        F.silu_forward(np.array([0.0, np.nan]))
    with pytest.raises(TypeError, match="x must hold real numbers"):
        F.silu_forward(np.ones(2, complex))
    with pytest.raises(TypeError, match="x must be an array, got None"):
        F.silu_forward(None)
    _, cache = F.silu_forward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="dout"):
        F.silu_backward(np.ones(3), cache)
    with pytest.raises(ValueError, match="dout contains NaN"):
        F.silu_backward(np.full((2, 3), np.inf), cache)


def test_silu_keeps_its_own_copy_of_x(rng):
    x = rng.normal(size=(3, 4))
    out, cache = F.silu_forward(x)
    dout = rng.normal(size=x.shape)
    before = F.silu_backward(dout, cache)
    x[...] = 7.0  # an in-place edit after the forward does not change the gradient
    np.testing.assert_array_equal(F.silu_backward(dout, cache), before)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_silu_matches_torch_autograd(torch, dtype, rng):
    x = (5.0 * rng.normal(size=(3, 4, 5))).astype(dtype)
    x[0, 0, :3] = [-1000.0, 0.0, 1000.0]
    dout = rng.normal(size=x.shape).astype(dtype)
    out, cache = F.silu_forward(x)
    dx = F.silu_backward(dout, cache)
    x_t = torch.tensor(x, requires_grad=True)
    out_t = torch.nn.functional.silu(x_t)
    out_t.backward(torch.tensor(dout))
    tol = TOLERANCE[np.dtype(dtype)]
    for ours, theirs in ((out, out_t), (dx, x_t.grad)):
        theirs = theirs.detach().numpy()
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        scale = max(1.0, np.abs(theirs).max())
        assert np.abs(ours.astype(np.float64) - theirs).max() <= tol * scale
