"""RMSNorm (and QK-norm, the same op on each head's D) against its oracles.

Shape key: R rows (any leading dims), E the normalised last axis; B batch,
H heads, T tokens, D head dim for QK-norm.

Oracles: closed forms (a constant row c gives ``weight * c / sqrt(c^2 + eps)``,
about ``weight * sign(c)``; a zero row gives 0 and ``dx = gain * dout / sqrt(eps)``;
rows of unit RMS up to ``eps``; a known row); an identity the math
guarantees (``<x, dx> = eps r^2 <g, x_hat>`` per row: scaling a row changes
the output only through eps); central differences and the complex step of
``<dout, f(x)>`` with a random ``dout`` (:mod:`qkvnp.gradcheck`, float64,
``TOLERANCES``); PyTorch autograd of ``torch.nn.functional.rms_norm`` and of
Hugging Face's Llama and Gemma 3 norms written out in torch, to 1e-10 in
float64 and 1e-5 in float32.
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
CONVENTIONS = [False, True]  # unit_offset: weight as is (Llama, Qwen3), 1 + weight (Gemma 3)
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


def assert_close(what, ours, theirs, dtype):
    """``max|ours - torch| / max(1, max|torch|)`` below ``TOLERANCE[dtype]``."""
    theirs = theirs.detach().numpy()
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} != torch's {theirs.shape}"
    assert ours.dtype == np.dtype(dtype), f"{what}: dtype {ours.dtype}, expected {dtype}"
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    err = diff.max() / max(1.0, np.abs(theirs).max())
    worst = np.unravel_index(diff.argmax(), diff.shape)
    assert err <= TOLERANCE[np.dtype(dtype)], (
        f"{what}: scaled error {err:.3e} at {worst}: ours {ours[worst]!r}, torch {theirs[worst]!r}")


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("unit_offset", CONVENTIONS)
def test_a_constant_row_gives_the_gain_times_its_sign(unit_offset, rng):
    # x = c everywhere: mean square c^2, so out = gain * c / sqrt(c^2 + eps)
    weight = rng.normal(size=5)
    gain = weight + 1.0 if unit_offset else weight
    for c in (2.5, -0.75):
        out, _ = F.rms_norm_forward(np.full((2, 5), c), weight, unit_offset=unit_offset)
        assert out.shape == (2, 5)
        expected = gain * c / math.sqrt(c * c + 1e-6)
        np.testing.assert_allclose(out, np.broadcast_to(expected, (2, 5)), rtol=1e-15)
        np.testing.assert_allclose(out, np.sign(c) * np.broadcast_to(gain, (2, 5)), rtol=1e-6)


@given(finite_arrays((3, 6)))
def test_rows_have_unit_rms_up_to_eps(x):
    # weight ones: rms(out) = sqrt(ms / (ms + eps)) with ms the row's mean square
    out, _ = F.rms_norm_forward(x, np.ones(6))
    assert out.shape == x.shape
    mean_square = (x * x).mean(axis=-1)
    rms = np.sqrt((out * out).mean(axis=-1))
    np.testing.assert_allclose(rms, np.sqrt(mean_square / (mean_square + 1e-6)),
                               rtol=1e-12, atol=1e-15)


def test_rms_norm_matches_the_formula_on_a_known_row():
    # (3, -4): mean square 12.5, so the row is (3, -4) / sqrt(12.5 + eps), times the gain
    row = np.array([3.0, -4.0])
    weight = np.array([2.0, 0.5])
    denominator = math.sqrt(12.5 + 1e-6)
    out, _ = F.rms_norm_forward(row, weight)
    np.testing.assert_allclose(out, row / denominator * weight, rtol=1e-15)
    out, _ = F.rms_norm_forward(row, weight, unit_offset=True)
    np.testing.assert_allclose(out, row / denominator * (1.0 + weight), rtol=1e-15)


@pytest.mark.parametrize("unit_offset", CONVENTIONS)
def test_a_zero_row_gives_zero_and_passes_the_gradient_scaled_by_one_over_sqrt_eps(
        unit_offset, rng):
    # x = 0: r = 1/sqrt(eps), x_hat = 0, so out = 0, dx = r * gain * dout, dweight = 0
    weight = rng.normal(size=4)
    gain = weight + 1.0 if unit_offset else weight
    out, cache = F.rms_norm_forward(np.zeros((3, 4)), weight, 1e-4, unit_offset=unit_offset)
    np.testing.assert_array_equal(out, 0.0)
    dout = rng.normal(size=(3, 4))
    dx, dweight = F.rms_norm_backward(dout, cache)
    np.testing.assert_allclose(dx, gain * dout / math.sqrt(1e-4), rtol=1e-14)
    np.testing.assert_array_equal(dweight, 0.0)


@given(finite_arrays((2, 3, 5)), st.booleans(), st.integers(0, 2**32 - 1))
def test_input_gradient_along_the_row_is_eps_r_squared_times_g_dot_x_hat(x, unit_offset, seed):
    # sum_j x_j dx_j = sum_j g_j x_hat_j (1 - r^2 ms) = eps r^2 sum_j g_j x_hat_j: scaling
    # a row changes the output only through eps
    rng = np.random.default_rng(seed)
    weight = rng.normal(size=5)
    eps = 1e-2
    out, cache = F.rms_norm_forward(x, weight, eps, unit_offset=unit_offset)
    dout = rng.normal(size=out.shape)
    dx, _ = F.rms_norm_backward(dout, cache)
    g = dout * cache.gain
    expected = eps * cache.rstd[..., 0] ** 2 * (g * cache.normalized).sum(axis=-1)
    lhs = (x * dx).sum(axis=-1)
    bound = 1e-12 * max(1.0, float(np.abs(x * dx).sum(axis=-1).max()))
    np.testing.assert_allclose(lhs, expected, rtol=0, atol=bound)


# ------------------------------------------------------------------ numerical derivatives


@pytest.mark.parametrize("unit_offset", CONVENTIONS)
@pytest.mark.parametrize("shape", [(6,), (2, 3, 5), (2, 3, 4, 8)])  # a vector, (B, T, E), QK (B, H, T, D)
@pytest.mark.parametrize("method", METHODS)
def test_rms_norm_gradients_match_numerical_derivatives(method, shape, unit_offset, rng):
    inputs = {"x": rng.normal(size=shape), "weight": rng.normal(size=shape[-1])}
    report = check_op(F.rms_norm_forward, F.rms_norm_backward, inputs,
                      forward_kwargs={"unit_offset": unit_offset}, method=method)
    assert_ok(report)
    assert {row.name for row in report.rows} == {"x", "weight"}


@given(finite_arrays((2, 4)), finite_arrays((4,)), st.booleans())
def test_rms_norm_complex_step_on_drawn_rows(x, weight, unit_offset):
    # NOTE: rows of RMS below 1e-3 are left out: their derivatives are of order
    # 1/sqrt(ms + eps), and the test above covers the zero row's closed form
    assume(np.sqrt((x * x).mean(axis=-1)).min() > 1e-3)
    inputs = {"x": x, "weight": weight}
    # atol: the suite's absolute floor of 1e-3 (tests/ops/test_gradients.py): dx is a
    # cancelling difference r (g - x_hat <g x_hat>) of terms of order |g|
    assert_ok(check_op(F.rms_norm_forward, F.rms_norm_backward, inputs,
                       forward_kwargs={"unit_offset": unit_offset},
                       method="complex_step", atol=1e-3))


# ------------------------------------------------------------------ PyTorch


def torch_rms_norm(torch, x, weight, eps, unit_offset, form):
    """The three torch oracles, on tensors: PyTorch's op, HF's Llama and Gemma 3 norms.

    HF casts to float32 whatever the input's dtype; ``cast`` is the input's
    own dtype here, the patch a float64 comparison needs (the test below
    shows the unpatched one is float32-accurate only).
    """
    gain = 1.0 + weight if unit_offset else weight
    if form == "torch":
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), gain, eps)
    hidden = x.to(x.dtype)  # HF: x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if form == "llama":  # LlamaRMSNorm, Qwen3RMSNorm: weight * hidden.to(input_dtype)
        return gain * hidden.to(x.dtype)
    return (hidden * gain).type_as(x)  # Gemma3RMSNorm: (1 + weight) in float32, then cast


@pytest.mark.parametrize("form", ["torch", "llama", "gemma3"])
@pytest.mark.parametrize("unit_offset", CONVENTIONS)
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 16), (2, 4, 3, 8)])  # rows, (B, T, E), QK (B, H, T, D)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rms_norm_matches_torch_autograd(torch, dtype, shape, unit_offset, form, rng):
    x = (3.0 * rng.normal(size=shape)).astype(dtype)
    weight = rng.normal(size=shape[-1]).astype(dtype)
    dout = rng.normal(size=shape).astype(dtype)
    out, cache = F.rms_norm_forward(x, weight, 1e-6, unit_offset=unit_offset)
    dx, dweight = F.rms_norm_backward(dout, cache)
    x_t = torch.tensor(x, requires_grad=True)
    weight_t = torch.tensor(weight, requires_grad=True)
    out_t = torch_rms_norm(torch, x_t, weight_t, 1e-6, unit_offset, form)
    out_t.backward(torch.tensor(dout))
    assert_close("out", out, out_t, dtype)
    assert_close("dx", dx, x_t.grad, dtype)
    assert_close("dweight", dweight, weight_t.grad, dtype)


def test_qk_norm_is_rms_norm_over_each_heads_d(torch, rng):
    # Qwen3's q_norm / k_norm: RMSNorm(D) on q viewed as (B, T, H, D), before the
    # transpose to (B, H, T, D) and before RoPE; the op on (B, H, T, D) with
    # weight (D,) gives the same, each (b, h, t) vector normalised on its own
    B, T, H, D = 2, 5, 3, 8
    q = rng.normal(size=(B, T, H * D))
    q_weight = rng.normal(size=D)
    dout = rng.normal(size=(B, H, T, D))
    q_heads = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, T, H*D) -> (B, H, T, D)
    out, cache = F.rms_norm_forward(q_heads, q_weight)
    dq_heads, dq_weight = F.rms_norm_backward(dout, cache)
    dq = dq_heads.transpose(0, 2, 1, 3).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, H*D)
    assert out.shape == (B, H, T, D) and dq_weight.shape == (D,)
    # one (b, h, t) by hand: its D entries alone set its scale
    vector = q[1, 2, D:2 * D]  # b = 1, t = 2, h = 1
    np.testing.assert_allclose(out[1, 1, 2], vector / np.sqrt((vector ** 2).mean() + 1e-6)
                               * q_weight, rtol=1e-14)
    q_t = torch.tensor(q, requires_grad=True)
    weight_t = torch.tensor(q_weight, requires_grad=True)
    out_t = torch.nn.functional.rms_norm(q_t.view(B, T, H, D), (D,), weight_t, 1e-6)
    out_t = out_t.transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D), as Qwen3Attention
    out_t.backward(torch.tensor(dout))
    assert_close("out", out, out_t, np.float64)
    assert_close("dq", dq, q_t.grad, np.float64)
    assert_close("dq_weight", dq_weight, weight_t.grad, np.float64)


def test_hugging_faces_float32_cast_is_why_a_float64_comparison_patches_it(torch, rng):
    # HF's LlamaRMSNorm casts to float32 whatever the dtype: unpatched, a float64
    # model's norm is float32-accurate (the comparisons above patch the cast)
    x = rng.normal(size=(4, 16))
    out, _ = F.rms_norm_forward(x, np.ones(16))
    hidden = torch.tensor(x).to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    unpatched = (torch.ones(16, dtype=torch.float64) * hidden.to(torch.float64)).numpy()
    error = np.abs(out - unpatched).max()
    assert 1e-10 < error < 1e-5


# ------------------------------------------------------------------ bad input


def test_rms_norm_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        F.rms_norm_forward(np.ones((2, 4)), np.ones(3))
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        F.rms_norm_forward(np.ones((2, 4)), np.ones((1, 4)))
    for eps in (0.0, -1e-6, float("inf"), float("nan"), True, "1e-6"):
        with pytest.raises(ValueError, match="eps must be a finite float > 0"):
            F.rms_norm_forward(np.ones((2, 4)), np.ones(4), eps=eps)
    with pytest.raises(ValueError, match="x contains NaN"):
        F.rms_norm_forward(np.full((2, 4), np.nan), np.ones(4))
    with pytest.raises(ValueError, match="weight contains NaN"):
        F.rms_norm_forward(np.ones((2, 4)), np.array([1.0, np.inf, 1.0, 1.0]))
    with pytest.raises(TypeError, match="x must hold real numbers"):
        F.rms_norm_forward(np.ones((2, 4), complex), np.ones(4))
    with pytest.raises(TypeError, match="x must be an array, got None"):
        F.rms_norm_forward(None, np.ones(4))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., E\)"):
        F.rms_norm_forward(np.float64(1.0), np.ones(1))
    with pytest.raises(TypeError, match="unit_offset must be a bool"):
        F.rms_norm_forward(np.ones((2, 4)), np.ones(4), unit_offset=1.0)
    _, cache = F.rms_norm_forward(np.ones((2, 4)), np.ones(4))
    with pytest.raises(ValueError, match="dout"):
        F.rms_norm_backward(np.ones((4,)), cache)
    with pytest.raises(ValueError, match="dout contains NaN"):
        F.rms_norm_backward(np.full((2, 4), np.nan), cache)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_outputs_and_gradients_keep_the_compute_dtype(dtype, rng):
    x = rng.normal(size=(3, 4)).astype(dtype)
    out, cache = F.rms_norm_forward(x, np.ones(4, dtype))
    dx, dweight = F.rms_norm_backward(rng.normal(size=(3, 4)), cache)
    assert out.dtype == dx.dtype == dweight.dtype == np.dtype(dtype)
    assert dx.shape == x.shape and dweight.shape == (4,)


def test_the_cache_owns_its_gain(rng):
    # editing the weight after the forward must not change the backward's gain
    weight = rng.normal(size=4)
    _, cache = F.rms_norm_forward(rng.normal(size=(2, 4)), weight)
    weight[:] = 0.0
    assert np.abs(cache.gain).min() > 0.0
