"""The gated feed-forward layer (``GatedFeedForward``) and ``SiLU`` against their oracles.

Shape key: B batch, T tokens, E embedding, F hidden width.

Oracles: the pure op pair ``qkvnp.functional.gated_mlp_forward/backward``
on the layer's weights; central differences and the complex step of every
parameter and input gradient (:func:`qkvnp.gradcheck.check_layer`,
float64); a PyTorch module of three ``nn.Linear(bias=False)`` named as
Hugging Face's ``LlamaMLP`` / ``GemmaMLP`` (``gate_proj``, ``up_proj``,
``down_proj``), loaded with the same weights (``weight = W.T``): outputs
and gradients to 1e-10 in float64.
"""
import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp.gradcheck import check_layer

ACTIVATIONS = ["silu", "gelu_tanh"]


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_feed_forward_equals_the_op_on_its_weights(activation, rng):
    mlp = qkvnp.GatedFeedForward(6, 10, activation=activation, rng=0)
    x = rng.normal(size=(2, 3, 6))
    dout = rng.normal(size=x.shape)
    out = mlp.forward(x)
    dx = mlp.backward(dout)
    p = mlp.params
    expected, cache = F.gated_mlp_forward(x, p["gate_proj.W"], p["up_proj.W"], p["down_proj.W"],
                                          activation)
    dx_op, dW_gate, dW_up, dW_down = F.gated_mlp_backward(dout, cache)
    assert out.shape == x.shape and dx.shape == x.shape
    # GeGLU's layer runs GELU's fused pass (qkvnp.kernels.pointwise): equal to round-off
    for ours, op in ((out, expected), (dx, dx_op), (mlp.grads["gate_proj.W"], dW_gate),
                     (mlp.grads["up_proj.W"], dW_up), (mlp.grads["down_proj.W"], dW_down)):
        np.testing.assert_allclose(ours, op, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_gated_feed_forward_gradients_match_numerical_derivatives(activation, method, rng):
    mlp = qkvnp.GatedFeedForward(4, 6, activation=activation, rng=1)
    report = check_layer(mlp, rng.normal(size=(2, 3, 4)), method=method)
    assert_ok(report)
    checked = {row.name for row in report.rows}
    assert {"param gate_proj.W", "param up_proj.W", "param down_proj.W", "input 0"} <= checked


@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_silu_layer_gradient_matches_numerical_derivatives(method, rng):
    assert_ok(check_layer(qkvnp.SiLU(), 3.0 * rng.normal(size=(3, 5)), method=method))


def test_gated_feed_forward_names_and_shapes_are_hugging_faces():
    mlp = qkvnp.GatedFeedForward(4, 6, rng=0)
    assert list(mlp.params) == ["gate_proj.W", "up_proj.W", "down_proj.W"]
    shapes = {name: w.shape for name, w in mlp.state_dict().items()}
    assert shapes == {"gate_proj.W": (4, 6), "up_proj.W": (4, 6), "down_proj.W": (6, 4)}
    assert isinstance(mlp.act_fn, qkvnp.SiLU)
    assert isinstance(qkvnp.GatedFeedForward(4, 6, activation="gelu_tanh").act_fn, qkvnp.GELU)


def test_gated_feed_forward_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="activation must be one of"):
        qkvnp.GatedFeedForward(4, 6, activation="relu")
    with pytest.raises(ValueError, match="hidden_dim"):
        qkvnp.GatedFeedForward(4, 0)
    with pytest.raises((TypeError, ValueError), match="emb_dim"):
        qkvnp.GatedFeedForward(4.5, 6)
    mlp = qkvnp.GatedFeedForward(4, 6, rng=0)
    with pytest.raises(RuntimeError, match="backward called before forward"):
        mlp.backward(np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 4\)"):
        mlp.forward(np.ones((2, 5)))
    with pytest.raises(ValueError, match="x contains NaN"):
        mlp.forward(np.full((2, 4), np.nan))
    mlp.forward(np.ones((2, 4)))
    with pytest.raises(ValueError, match="dout"):
        mlp.backward(np.ones((2, 6)))


def test_gated_feed_forward_float32_is_float32_and_near_float64(rng):
    mlp32 = qkvnp.GatedFeedForward(8, 12, rng=0, dtype=np.float32)
    mlp64 = qkvnp.GatedFeedForward(8, 12, rng=0)
    mlp64.load_state_dict({k: v.astype(np.float64) for k, v in mlp32.state_dict().items()})
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    out32, out64 = mlp32.forward(x), mlp64.forward(x)
    dx32, dx64 = mlp32.backward(dout), mlp64.backward(dout)
    assert out32.dtype == dx32.dtype == np.float32
    for ours, exact in [(out32, out64), (dx32, dx64)] + [
            (mlp32.grads[k], mlp64.grads[k]) for k in mlp64.grads]:
        assert ours.dtype == np.float32
        assert np.abs(ours - exact).max() <= 1e-5 * max(1.0, np.abs(exact).max())


def test_gated_feed_forward_extreme_inputs_stay_finite(rng):
    mlp = qkvnp.GatedFeedForward(4, 6, rng=0)
    x = 1e3 * rng.normal(size=(3, 4))
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = mlp.forward(x)
        dx = mlp.backward(rng.normal(size=out.shape))
    assert np.isfinite(out).all() and np.isfinite(dx).all()


def torch_mlp(torch, E, F_, activation):
    """Hugging Face's ``LlamaMLP`` (``"silu"``) or ``GemmaMLP`` (``"gelu_tanh"``), written out."""
    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(E, F_, bias=False, dtype=torch.float64)
            self.up_proj = torch.nn.Linear(E, F_, bias=False, dtype=torch.float64)
            self.down_proj = torch.nn.Linear(F_, E, bias=False, dtype=torch.float64)
            self.act_fn = (torch.nn.SiLU() if activation == "silu"
                           else torch.nn.GELU(approximate="tanh"))

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return MLP()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_feed_forward_matches_a_torch_mlp_with_the_same_weights(torch, activation, rng):
    E, F_ = 8, 20
    mlp = qkvnp.GatedFeedForward(E, F_, activation=activation, rng=2)
    module = torch_mlp(torch, E, F_, activation)
    # Hugging Face's names: mlp.gate_proj.weight is our gate_proj.W transposed
    with torch.no_grad():
        for name, weight in module.state_dict().items():
            weight.copy_(torch.tensor(mlp.state_dict()[name.replace(".weight", ".W")].T))
    x, dout = rng.normal(size=(2, 7, E)), rng.normal(size=(2, 7, E))
    out = mlp.forward(x)
    dx = mlp.backward(dout)
    x_t = torch.tensor(x, requires_grad=True)
    out_t = module(x_t)
    out_t.backward(torch.tensor(dout))
    pairs = [("out", out, out_t), ("x", dx, x_t.grad)] + [
        (name, mlp.grads[name.replace(".weight", ".W")], p.grad.T)
        for name, p in module.named_parameters()]
    for name, ours, theirs in pairs:
        theirs = theirs.detach().numpy()
        assert ours.shape == theirs.shape, name
        err = np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max())
        assert err <= 1e-10, f"{name}: {err:.3e}"
