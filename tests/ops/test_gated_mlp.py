"""The gated MLP op (``gated_mlp_forward`` / ``gated_mlp_backward``) against its oracles.

Shape key: ``...`` leading dims, E embedding, F hidden width.

Oracles: the formula written out with the ops it composes
(``act(x W_gate) * (x W_up)) W_down``); central differences and the
complex step of ``<dout, f(x, W_gate, W_up, W_down)>`` with a random
``dout`` (:mod:`qkvnp.gradcheck`, float64); PyTorch autograd of the same
formula with ``torch.nn.functional.silu`` (SwiGLU) and
``torch.nn.functional.gelu(approximate="tanh")`` (GeGLU): 1e-10 in float64,
1e-5 in float32, relative to ``max(1, max|torch|)``.
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.gradcheck import check_op

ACTIVATIONS = ["silu", "gelu_tanh"]
METHODS = ["central", "complex_step"]
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


def make_inputs(rng, lead=(2, 3), E=4, F_=6, dtype=np.float64):
    return {"x": rng.normal(size=lead + (E,)).astype(dtype),
            "W_gate": rng.normal(size=(E, F_)).astype(dtype),
            "W_up": rng.normal(size=(E, F_)).astype(dtype),
            "W_down": rng.normal(size=(F_, E)).astype(dtype)}


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_mlp_is_the_formula_of_its_ops(activation, rng):
    inputs = make_inputs(rng)
    out, _ = F.gated_mlp_forward(**inputs, activation=activation)
    gate = inputs["x"] @ inputs["W_gate"]
    act = F.silu_forward(gate)[0] if activation == "silu" else F.gelu_forward(gate, "tanh")[0]
    expected = (act * (inputs["x"] @ inputs["W_up"])) @ inputs["W_down"]
    assert out.shape == inputs["x"].shape
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("method", METHODS)
def test_gated_mlp_gradients_match_numerical_derivatives(activation, method, rng):
    report = check_op(F.gated_mlp_forward, F.gated_mlp_backward, make_inputs(rng),
                      forward_kwargs={"activation": activation}, method=method)
    assert_ok(report)
    assert {row.name for row in report.rows} >= {"x", "W_gate", "W_up", "W_down"}


@pytest.mark.parametrize("lead", [(), (5,), (2, 1, 3)])  # no leading dims, one, three
def test_gated_mlp_complex_step_certificate_on_any_leading_dims(lead, rng):
    report = check_op(F.gated_mlp_forward, F.gated_mlp_backward,
                      make_inputs(rng, lead=lead, E=3, F_=5), method="complex_step")
    assert_ok(report)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_mlp_extreme_inputs_stay_finite(activation, rng):
    # gates of order +-1e3: silu's exp(-|g|) and tanh saturate, nothing overflows
    inputs = make_inputs(rng)
    inputs["x"] = 300.0 * inputs["x"]
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out, cache = F.gated_mlp_forward(**inputs, activation=activation)
        grads = F.gated_mlp_backward(rng.normal(size=out.shape), cache)
    assert np.isfinite(out).all()
    assert all(np.isfinite(g).all() for g in grads)


def test_gated_mlp_refuses_bad_arguments_by_name(rng):
    good = make_inputs(rng)
    with pytest.raises(ValueError, match="activation must be one of"):
        F.gated_mlp_forward(**good, activation="gelu")
    with pytest.raises(ValueError, match="activation must be one of"):
        F.gated_mlp_forward(**good, activation=None)
    cases = [
        ("W_gate", np.ones(4), r"W_gate must have shape \(E, F\), got shape \(4,\)"),
        ("W_up", np.ones((4, 5)), r"W_up must have W_gate's shape \(4, 6\), got shape \(4, 5\)"),
        ("W_down", np.ones((4, 6)), r"W_down must have shape \(6, 4\)"),
        ("x", np.ones((2, 5)), r"x must have shape \(\.\.\., 4\)"),
    ]
    for name, value, message in cases:
        with pytest.raises(ValueError, match=message):
            F.gated_mlp_forward(**{**good, name: value})
    with pytest.raises(ValueError, match="W_up contains NaN"):
        F.gated_mlp_forward(**{**good, "W_up": np.full((4, 6), np.nan)})
    with pytest.raises(TypeError, match="W_down must hold real numbers"):
        F.gated_mlp_forward(**{**good, "W_down": np.ones((6, 4), complex)})
    with pytest.raises(TypeError, match="x must be an array, got None"):
        F.gated_mlp_forward(**{**good, "x": None})
    _, cache = F.gated_mlp_forward(**good)
    with pytest.raises(ValueError, match="dout"):
        F.gated_mlp_backward(np.ones((2, 3, 6)), cache)


def test_gated_mlp_keeps_its_own_copies_of_the_inputs(rng):
    inputs = make_inputs(rng)
    out, cache = F.gated_mlp_forward(**inputs)
    dout = rng.normal(size=out.shape)
    before = F.gated_mlp_backward(dout, cache)
    for value in inputs.values():
        value[...] = 3.0  # in-place edits after the forward change no gradient
    for got, expected in zip(F.gated_mlp_backward(dout, cache), before):
        np.testing.assert_array_equal(got, expected)


def test_gated_mlp_float32_stays_float32_and_near_float64(rng):
    inputs = make_inputs(rng, dtype=np.float32)
    out32, cache32 = F.gated_mlp_forward(**inputs)
    out64, cache64 = F.gated_mlp_forward(**{k: v.astype(np.float64) for k, v in inputs.items()})
    dout = rng.normal(size=out32.shape)
    grads32 = F.gated_mlp_backward(dout.astype(np.float32), cache32)
    grads64 = F.gated_mlp_backward(dout, cache64)
    assert out32.dtype == np.float32 and all(g.dtype == np.float32 for g in grads32)
    for ours, exact in zip((out32,) + grads32, (out64,) + grads64):
        assert np.abs(ours - exact).max() <= 1e-5 * max(1.0, np.abs(exact).max())


def torch_gated_mlp(torch, x, W_gate, W_up, W_down, activation):
    gate = x @ W_gate
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    return (act * (x @ W_up)) @ W_down


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_mlp_matches_torch_autograd(torch, activation, dtype, rng):
    inputs = make_inputs(rng, lead=(2, 5), E=8, F_=12, dtype=dtype)
    out, cache = F.gated_mlp_forward(**inputs, activation=activation)
    dout = rng.normal(size=out.shape).astype(dtype)
    grads = F.gated_mlp_backward(dout, cache)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
    out_t = torch_gated_mlp(torch, **tensors, activation=activation)
    out_t.backward(torch.tensor(dout))
    tol = TOLERANCE[np.dtype(dtype)]
    theirs = [out_t] + [tensors[k].grad for k in ("x", "W_gate", "W_up", "W_down")]
    for name, ours, t in zip(("out", "x", "W_gate", "W_up", "W_down"), (out,) + grads, theirs):
        t = t.detach().numpy()
        assert ours.shape == t.shape and ours.dtype == t.dtype, name
        err = np.abs(ours.astype(np.float64) - t).max() / max(1.0, np.abs(t).max())
        assert err <= tol, f"{name}: {err:.3e} > {tol}"
