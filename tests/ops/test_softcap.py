"""The final-logit soft-cap op (``softcap_forward`` / ``softcap_backward``) against its oracles.

Shape key: B batch, T length, V vocabulary (elementwise).

Oracles: closed forms (``softcap(0) = 0`` with slope 1, ``-> +-cap`` far
out, odd); PyTorch autograd of Gemma's ``tanh(x / cap) * cap`` to 1e-10
in float64 with a random upstream gradient; the complex step of
:mod:`qkvnp.gradcheck` (``check_op``).
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.gradcheck import check_op


def test_closed_forms():
    x = np.array([0.0, 1e-8, 1e6, -1e6])
    out, cache = F.softcap_forward(x, 30.0)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, [0.0, 1e-8, 30.0, -30.0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(F.softcap_backward(np.ones(4), cache), [1.0, 1.0, 0.0, 0.0],
                               rtol=1e-15, atol=0)
    odd, _ = F.softcap_forward(-x, 30.0)
    assert np.array_equal(odd, -out)


def test_matches_torch_autograd(torch):
    rng = np.random.default_rng(0)
    logits = 40 * rng.standard_normal((2, 5, 11))  # (B, T, V), many beyond the cap
    dout = rng.standard_normal(logits.shape)
    out, cache = F.softcap_forward(logits, 30.0)
    dlogits = F.softcap_backward(dout, cache)
    xt = torch.tensor(logits, requires_grad=True)
    expected = torch.tanh(xt / 30.0) * 30.0  # Gemma2ForCausalLM's final_logit_softcapping
    expected.backward(torch.tensor(dout))
    assert out.shape == logits.shape and dlogits.shape == logits.shape
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dlogits, xt.grad.numpy(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", ["central", "complex_step"])
@pytest.mark.parametrize("cap", [0.5, 30.0])
def test_gradients_match_numerical_derivatives(method, cap):
    inputs = {"x": 3 * np.random.default_rng(1).standard_normal((3, 7))}
    report = check_op(F.softcap_forward, F.softcap_backward, inputs, forward_kwargs={"cap": cap},
                      method=method)
    assert report.rows and report.ok, report


def test_float32_stays_float32():
    out, cache = F.softcap_forward(np.ones((2, 3), np.float32), 2.0)
    assert out.dtype == np.float32
    assert F.softcap_backward(np.ones((2, 3)), cache).dtype == np.float32


@pytest.mark.parametrize("cap, error", [(None, TypeError), ("30", TypeError), (True, TypeError),
                                        (0.0, ValueError), (-1.0, ValueError),
                                        (float("inf"), ValueError), (float("nan"), ValueError)])
def test_bad_cap_refused_by_name(cap, error):
    with pytest.raises(error, match="cap must be a positive"):
        F.softcap_forward(np.ones(3), cap)


def test_bad_inputs_refused_by_name():
    with pytest.raises(ValueError, match="x"):
        F.softcap_forward(np.array([1.0, np.nan]), 1.0)
    _, cache = F.softcap_forward(np.ones((2, 3)), 1.0)
    with pytest.raises(ValueError, match="dout"):
        F.softcap_backward(np.ones((3, 2)), cache)
