"""The transformer ops (LayerNorm, GELU, activation dropout, residual add) against their oracles.

Shape key: R rows (any leading dims), E the normalised last axis.

Oracles: central differences and complex step of ``<dout, f(x)>`` with a
random ``dout`` (:mod:`qkvnp.gradcheck`, float64, ``TOLERANCES``); closed
forms (the standard normal CDF at 0 and 1, ``gelu(x) - gelu(-x) = x``,
normalised rows of mean 0 and variance ``var / (var + eps)``); invariances
the math guarantees (LayerNorm ignores a constant added to a row, so its
input gradient sums to 0 over each row).
"""
import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from qkvnp import functional as F
from qkvnp.gradcheck import check_op

from strategies import finite_arrays

METHODS = ["central", "complex_step"]


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


@st.composite
def rows_and_affine(draw):
    """``x (R..., E)`` with ``E >= 2``, and ``scale``, ``shift`` ``(E,)``."""
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    E = draw(st.integers(2, 6))
    x = draw(finite_arrays(tuple(lead) + (E,)))
    scale = draw(finite_arrays((E,)))
    shift = draw(finite_arrays((E,)))
    return x, scale, shift


# ------------------------------------------------------------------ LayerNorm


@pytest.mark.parametrize("method", METHODS)
def test_layer_norm_gradients_match_numerical_derivatives(method, rng):
    x = rng.normal(size=(2, 3, 5))
    inputs = {"x": x, "scale": rng.normal(size=5), "shift": rng.normal(size=5)}
    assert_ok(check_op(F.layer_norm_forward, F.layer_norm_backward, inputs, method=method))


@given(rows_and_affine())
def test_layer_norm_gradients_on_drawn_rows(case):
    x, scale, shift = case
    # NOTE: complex step, free of truncation error: a row of small spread s has
    # derivatives of order 1/s, and the central difference's h^2 (third
    # derivative) error exceeds 1e-6 from s ~ 0.1 (a drawn row can even be
    # constant: r = 1/sqrt(eps) then). Central differences: the test above.
    # A constant row is its own test below: its x - mean is round-off, which
    # r = 1/sqrt(eps) magnifies past the complex step's 1e-12.
    assume(np.ptp(x, axis=-1).min() > 1e-3)
    inputs = {"x": x, "scale": scale, "shift": shift}
    # atol: the suite's absolute floor of 1e-3 (tests/ops/test_gradients.py): dx is a
    # cancelling sum r (g - <g> - x_hat <g x_hat>) of terms of order |g|, which
    # for E = 2 is O(eps) exactly; its entries below the floor are compared to
    # 1e-15 absolute (round-off of the terms), not relative to themselves.
    # rtol: complex step's 1e-12 times the rows' condition max|x| / spread: the
    # subtraction x - mean loses that factor of the forward's digits, which the
    # complex step differentiates (a row of [-1.0625, -1, ..., -1] loses 17)
    condition = max(1.0, float((np.abs(x).max(axis=-1) / np.ptp(x, axis=-1)).max()))
    assert_ok(check_op(F.layer_norm_forward, F.layer_norm_backward, inputs,
                       method="complex_step", atol=1e-3, rtol=1e-12 * condition))


@given(rows_and_affine())
def test_layer_norm_rows_have_mean_zero_and_variance_var_over_var_plus_eps(case):
    x, _, _ = case
    E = x.shape[-1]
    out, _ = F.layer_norm_forward(x, np.ones(E), np.zeros(E))
    assert out.shape == x.shape
    var = x.var(axis=-1)
    np.testing.assert_allclose(out.mean(axis=-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(out.var(axis=-1), var / (var + 1e-5), rtol=1e-10, atol=1e-12)


@given(rows_and_affine(), st.integers(0, 2**32 - 1))
def test_layer_norm_input_gradient_sums_to_zero_over_each_row(case, seed):
    # adding c to a whole row changes nothing, so d/dc = sum_j dx_j = 0
    x, scale, shift = case
    out, cache = F.layer_norm_forward(x, scale, shift)
    dout = np.random.default_rng(seed).normal(size=out.shape)
    dx, _, _ = F.layer_norm_backward(dout, cache)
    bound = 1e-10 * max(1.0, np.abs(dx).max())
    assert np.abs(dx.sum(axis=-1)).max() <= bound


def test_a_constant_row_normalises_to_the_shift_and_passes_the_gradient_through(rng):
    # variance 0: y = shift (x - mean = 0, up to the round-off of the mean, which
    # r = 1/sqrt(eps) ~ 316 magnifies), and dx = r (g - mean(g)) as x_hat = 0
    x = np.full((2, 5), 1.8921684)
    scale, shift = rng.normal(size=5), rng.normal(size=5)
    out, cache = F.layer_norm_forward(x, scale, shift)
    np.testing.assert_allclose(out, np.broadcast_to(shift, x.shape), rtol=0, atol=1e-12)
    dout = rng.normal(size=x.shape)
    dx, _, _ = F.layer_norm_backward(dout, cache)
    g = dout * scale
    expected = (g - g.mean(axis=-1, keepdims=True)) / np.sqrt(1e-5)
    np.testing.assert_allclose(dx, expected, rtol=1e-10, atol=1e-10)


def test_layer_norm_matches_the_book_formula_on_a_known_row():
    # (1, 2, 3): mean 2, biased variance 2/3, so the row is (-1, 0, 1) / sqrt(2/3 + eps)
    out, _ = F.layer_norm_forward(np.array([1.0, 2.0, 3.0]), np.full(3, 2.0), np.full(3, 0.5))
    expected = 2.0 * np.array([-1.0, 0.0, 1.0]) / math.sqrt(2.0 / 3.0 + 1e-5) + 0.5
    np.testing.assert_allclose(out, expected, rtol=1e-15)


def test_layer_norm_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"scale must have shape \(4,\)"):
        F.layer_norm_forward(np.ones((2, 4)), np.ones(3), np.zeros(4))
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
        F.layer_norm_forward(np.ones((2, 4)), np.ones(4), np.zeros(4), eps=0.0)
    with pytest.raises(ValueError, match="x contains NaN"):
        F.layer_norm_forward(np.full((2, 4), np.nan), np.ones(4), np.zeros(4))
    with pytest.raises(TypeError, match="x must hold real numbers"):
        F.layer_norm_forward(np.ones((2, 4), complex), np.ones(4), np.zeros(4))
    _, cache = F.layer_norm_forward(np.ones((2, 4)), np.ones(4), np.zeros(4))
    with pytest.raises(ValueError, match="dout"):
        F.layer_norm_backward(np.ones((4,)), cache)


# ------------------------------------------------------------------ GELU


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("method", METHODS)
def test_gelu_gradients_match_numerical_derivatives(approximate, method, rng):
    inputs = {"x": 3.0 * rng.normal(size=(2, 3, 4))}
    report = check_op(F.gelu_forward, F.gelu_backward, inputs, method=method,
                      forward_kwargs={"approximate": approximate})
    assert_ok(report)


@given(finite_arrays(st.tuples(st.integers(1, 3), st.integers(1, 4)), bound=6.0),
       st.sampled_from(["tanh", "none"]))
def test_gelu_gradients_on_drawn_inputs(x, approximate):
    report = check_op(F.gelu_forward, F.gelu_backward, {"x": x},
                      forward_kwargs={"approximate": approximate})
    assert_ok(report)


@given(finite_arrays(st.tuples(st.integers(1, 5)), bound=8.0), st.sampled_from(["tanh", "none"]))
def test_gelu_odd_part_is_the_identity(x, approximate):
    # Phi(x) + Phi(-x) = 1 (and tanh is odd): gelu(x) - gelu(-x) = x
    plus, _ = F.gelu_forward(x, approximate)
    minus, _ = F.gelu_forward(-x, approximate)
    np.testing.assert_allclose(plus - minus, x, rtol=1e-14, atol=1e-14)


def test_gelu_exact_values_and_the_tanh_approximation_error():
    # exact: gelu(1) = Phi(1) = (1 + erf(1/sqrt 2)) / 2; gelu(0) = 0, gelu'(0) = 1/2
    out, cache = F.gelu_forward(np.array([0.0, 1.0]), "none")
    np.testing.assert_allclose(out, [0.0, 0.5 * (1 + math.erf(1 / math.sqrt(2)))], rtol=1e-15)
    np.testing.assert_allclose(F.gelu_backward(np.ones(2), cache)[0], 0.5, rtol=1e-15)
    # the tanh form stays within 5e-4 of the exact one (Hendrycks and Gimpel's approximation)
    x = np.linspace(-6, 6, 2001)
    gap = np.abs(F.gelu_forward(x, "tanh")[0] - F.gelu_forward(x, "none")[0]).max()
    assert 1e-5 < gap < 5e-4


def test_gelu_refuses_an_unknown_approximation():
    with pytest.raises(ValueError, match="approximate must be one of"):
        F.gelu_forward(np.ones(2), "erf")


# ------------------------------------------------------------------ dropout, residual


@pytest.mark.parametrize("method", METHODS)
def test_activation_dropout_with_a_replayed_mask_matches_numerical_derivatives(method, rng):
    mask = rng.random((3, 4)) > 0.3
    report = check_op(F.activation_dropout_forward, F.activation_dropout_backward,
                      {"x": rng.normal(size=(2, 3, 4))}, forward_kwargs={"p": 0.3, "mask": mask},
                      method=method)
    assert_ok(report)


def test_activation_dropout_scales_kept_entries_and_zeroes_the_rest(rng):
    x = rng.normal(size=(4, 5))
    out, cache = F.activation_dropout_forward(x, 0.25, rng=0)
    keep = out != 0
    assert 0 < keep.sum() < keep.size
    # multiplied by the factor 1 / (1 - p), as torch's dropout (x * (mask / (1 - p)))
    np.testing.assert_array_equal(out, np.where(keep, x * (1 / 0.75), 0.0))
    dout = rng.normal(size=x.shape)
    np.testing.assert_array_equal(F.activation_dropout_backward(dout, cache),
                                  np.where(keep, dout * (1 / 0.75), 0.0))
    with pytest.raises(ValueError, match="mask needs 0 < p < 1"):
        F.activation_dropout_forward(x, 0.0, mask=np.ones_like(x, bool))
    with pytest.raises(ValueError, match="mask must broadcast"):
        F.activation_dropout_forward(x, 0.5, mask=np.ones((3,), bool))


def test_residual_add_passes_the_gradient_to_both_inputs(rng):
    inputs = {"x": rng.normal(size=(2, 3)), "branch": rng.normal(size=(2, 3))}
    assert_ok(check_op(F.residual_add_forward, F.residual_add_backward, inputs))
    with pytest.raises(ValueError, match="branch must have x's shape"):
        F.residual_add_forward(np.ones((2, 3)), np.ones(3))
