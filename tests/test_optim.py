"""Tests of qkvnp.optim: SGD, Adam, AdamW.

Oracles: closed forms of the first steps (an SGD step is exactly
``theta - lr * g``; Adam's first step is ``-lr * g / (|g| + eps)``, about
``-lr * sign(g)``), bitwise equality of an interrupted and an uninterrupted
run through an ``.npz`` file, and ``torch.optim`` trajectories over 100
steps in float64 fed the very same gradients.
"""
import numpy as np
import pytest

from qkvnp.optim import SGD, Adam, AdamW, Optimizer


def make_params(rng, dtype=np.float64):
    """Two parameters of different shapes, so state is checked per name."""
    return {"W_query": rng.normal(size=(3, 4)).astype(dtype),
            "b_query": rng.normal(size=(4,)).astype(dtype)}


def quadratic_grads(params, curvature, offset):
    """Gradient of sum_name 0.5 <theta, A theta> - <c, theta> (theta flattened per name)."""
    return {name: (curvature[name] @ p.ravel() - offset[name]).reshape(p.shape)
            for name, p in params.items()}


def make_quadratic(rng, params):
    """A random positive-definite curvature and offset per parameter."""
    curvature, offset = {}, {}
    for name, p in params.items():
        a = rng.normal(size=(p.size, p.size))
        curvature[name] = a @ a.T / p.size + 0.1 * np.eye(p.size)
        offset[name] = rng.normal(size=p.size)
    return curvature, offset


# ---------------------------------------------------------------- closed forms


def test_sgd_step_is_exact(rng):
    # oracle: theta - lr * g, bitwise; the arrays keep their identity (in place)
    params = make_params(rng)
    before = {k: v.copy() for k, v in params.items()}
    arrays = {k: id(v) for k, v in params.items()}
    grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
    SGD(params, lr=0.3).step(grads)
    for name in params:
        assert id(params[name]) == arrays[name]
        np.testing.assert_array_equal(params[name], before[name] - 0.3 * grads[name])


def test_sgd_weight_decay_step_is_exact(rng):
    # oracle: theta - lr * (g + lambda * theta)
    params = make_params(rng)
    before = {k: v.copy() for k, v in params.items()}
    grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
    SGD(params, lr=0.1, weight_decay=0.01).step(grads)
    for name in params:
        np.testing.assert_array_equal(
            params[name], before[name] - 0.1 * (grads[name] + 0.01 * before[name]))


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_two_steps_closed_form(nesterov, rng):
    # oracle: b1 = g1, b2 = mu b1 + (1 - tau) g2 (tau = 0 for Nesterov); update b or g + mu b
    mu, tau, lr = 0.9, 0.0 if nesterov else 0.25, 0.1
    theta0 = rng.normal(size=5)
    g1, g2 = rng.normal(size=5), rng.normal(size=5)
    params = {"w": theta0.copy()}
    optimizer = SGD(params, lr=lr, momentum=mu, dampening=tau, nesterov=nesterov)
    optimizer.step({"w": g1})
    b1 = g1
    theta1 = theta0 - lr * (g1 + mu * b1 if nesterov else b1)
    np.testing.assert_allclose(params["w"], theta1, rtol=1e-15)
    optimizer.step({"w": g2})
    b2 = mu * b1 + (1 - tau) * g2
    theta2 = theta1 - lr * (g2 + mu * b2 if nesterov else b2)
    np.testing.assert_allclose(params["w"], theta2, rtol=1e-14)
    np.testing.assert_allclose(optimizer.state_dict()["momentum_buffer/w"], b2, rtol=1e-15)


def test_adam_first_step_is_about_lr_sign(rng):
    # oracle: m1 = (1 - b1) g, v1 = (1 - b2) g^2, so after bias correction the step is
    # lr * g / (|g| + eps): lr * sign(g) up to eps / |g|; a zero gradient does not move
    theta0 = rng.normal(size=6)
    g = np.array([3.0, -0.5, 1e-3, -200.0, 0.0, 1e-9])
    params = {"w": theta0.copy()}
    Adam(params, lr=0.01).step({"w": g})
    step = params["w"] - theta0
    np.testing.assert_allclose(step, -0.01 * g / (np.abs(g) + 1e-8), rtol=1e-12, atol=1e-18)
    np.testing.assert_allclose(step[:4], -0.01 * np.sign(g[:4]), rtol=1e-5)
    assert step[4] == 0.0
    assert abs(step[5]) < 0.01 * 0.1  # |g| = 1e-9 < eps: eps dominates, the step is ~lr/11


def test_adamw_decays_without_gradient_and_adam_does_not():
    # oracle: AdamW shrinks theta by (1 - lr * lambda) even for g = 0; Adam's L2 enters
    # through g = lambda * theta, so its first step is lr * sign(theta)
    params_w = {"w": np.array([2.0, -4.0])}
    AdamW(params_w, lr=0.1, weight_decay=0.5).step({"w": np.zeros(2)})
    np.testing.assert_array_equal(params_w["w"], np.array([2.0, -4.0]) * (1 - 0.1 * 0.5))
    params_l2 = {"w": np.array([2.0, -4.0])}
    Adam(params_l2, lr=0.1, weight_decay=0.5).step({"w": np.zeros(2)})
    np.testing.assert_allclose(params_l2["w"], [2.0 - 0.1, -4.0 + 0.1], rtol=1e-9)


def test_adamw_with_zero_decay_equals_adam(rng):
    # oracle: the two algorithms differ only in the decay line
    params_a, params_b = make_params(rng), None
    params_b = {k: v.copy() for k, v in params_a.items()}
    adam, adamw = Adam(params_a, lr=0.01), AdamW(params_b, lr=0.01, weight_decay=0.0)
    for _ in range(5):
        grads = {k: rng.normal(size=v.shape) for k, v in params_a.items()}
        adam.step(grads)
        adamw.step(grads)
    for name in params_a:
        np.testing.assert_array_equal(params_a[name], params_b[name])


def test_float32_parameters_stay_float32(rng):
    # oracle: the dtype rule; state buffers take the parameter's dtype
    params = make_params(rng, np.float32)
    for optimizer in (SGD(params, lr=0.1, momentum=0.9), Adam(params), AdamW(params)):
        optimizer.step({k: rng.normal(size=v.shape) for k, v in params.items()})
        assert all(p.dtype == np.float32 for p in params.values())
        assert all(v.dtype == np.float32 for k, v in optimizer.state_dict().items() if k != "step")


def test_lr_is_a_validated_public_attribute(rng):
    # oracle: after assigning lr, the next SGD step uses it (exact closed form)
    params = {"w": np.ones(3)}
    optimizer = SGD(params, lr=1.0)
    optimizer.lr = 0.25
    optimizer.step({"w": np.full(3, 2.0)})
    np.testing.assert_array_equal(params["w"], np.full(3, 0.5))
    for bad in (0.0, -1.0, np.nan):
        with pytest.raises(ValueError, match="lr must be"):
            optimizer.lr = bad
    with pytest.raises(TypeError, match="lr must be a real number, got str"):
        optimizer.lr = "0.1"
    assert optimizer.lr == 0.25


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("make, message", [
    (lambda p: SGD(p, lr=0.0), "lr must be > 0, got 0.0"),
    (lambda p: SGD(p, lr=float("inf")), "lr must be finite"),
    (lambda p: SGD(p, lr=0.1, momentum=-0.1), "momentum must be >= 0.0, got -0.1"),
    (lambda p: SGD(p, lr=0.1, dampening=-1), "dampening must be >= 0.0"),
    (lambda p: SGD(p, lr=0.1, weight_decay=-1e-3), "weight_decay must be >= 0.0"),
    (lambda p: SGD(p, lr=0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda p: SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening == 0"),
    (lambda p: Adam(p, betas=(1.0, 0.999)), r"betas\[0\] must be in \[0, 1\), got 1.0"),
    (lambda p: Adam(p, betas=(0.9, -0.1)), r"betas\[1\] must be in \[0, 1\)"),
    (lambda p: Adam(p, betas=(0.9,)), "betas must be a pair"),
    (lambda p: Adam(p, eps=0.0), "eps must be > 0"),
    (lambda p: AdamW(p, weight_decay=-0.01), "weight_decay must be >= 0.0"),
    (lambda p: Adam({}, lr=0.1), "params must hold at least one parameter"),
])
def test_hyperparameters_are_validated(make, message):
    with pytest.raises(ValueError, match=message):
        make({"w": np.zeros(2)})


def test_params_must_be_a_dict_of_float_arrays():
    with pytest.raises(TypeError, match="params must be a dict"):
        SGD([np.zeros(2)], lr=0.1)
    with pytest.raises(TypeError, match=r"params\['w'\] must be a float ndarray.*int64"):
        SGD({"w": np.zeros(2, dtype=np.int64)}, lr=0.1)
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        SGD({"w": np.zeros(2)}, lr=0.1, momentum=0.9, nesterov=1)
    with pytest.raises(TypeError, match="momentum must be a real number, got str"):
        SGD({"w": np.zeros(2)}, lr=0.1, momentum="0.9")


@pytest.mark.parametrize("grads, error, message", [
    ({"b_query": np.zeros(4)}, ValueError, "grads is missing the gradient of parameter 'W_query'"),
    ({"W_query": np.zeros((4, 3)), "b_query": np.zeros(4)}, ValueError,
     r"grads\['W_query'\] must have the shape of its parameter \(3, 4\), got shape \(4, 3\)"),
    ({"W_query": np.zeros((3, 4)), "b_query": np.zeros(4), "W_key": np.zeros(1)}, ValueError,
     "grads has key 'W_key' that is not a parameter"),
    ({"W_query": np.zeros((3, 4)), "b_query": np.array(["x"] * 4)}, TypeError,
     r"grads\['b_query'\] must be real-valued"),
])
def test_bad_grads_are_named_and_nothing_moves(grads, error, message, rng):
    # oracle: the parameters and the state are bitwise unchanged after the error
    params = make_params(rng)
    optimizer = Adam(params, lr=0.1)
    optimizer.step({k: rng.normal(size=v.shape) for k, v in params.items()})
    before_params = {k: v.copy() for k, v in params.items()}
    before_state = optimizer.state_dict()
    with pytest.raises(error, match=message):
        optimizer.step(grads)
    for name in params:
        np.testing.assert_array_equal(params[name], before_params[name])
    after_state = optimizer.state_dict()
    assert after_state.keys() == before_state.keys()
    for key in before_state:
        np.testing.assert_array_equal(after_state[key], before_state[key])


def test_params_changed_after_construction_are_refused(rng):
    # oracle: an optimizer's state is per name and shape; a new, missing or reshaped
    # parameter is an error, not a KeyError or a silent broadcast
    params = make_params(rng)
    optimizer = Adam(params)
    grads = {k: np.ones_like(v) for k, v in params.items()}
    params["extra"] = np.zeros(2)
    with pytest.raises(ValueError, match="params changed .*'extra'"):
        optimizer.step({**grads, "extra": np.zeros(2)})
    del params["extra"]
    params["b_query"] = np.zeros(5)
    with pytest.raises(ValueError, match=r"params changed .*'b_query': expected \(\(4,\)"):
        optimizer.step({**grads, "b_query": np.zeros(5)})
    params["b_query"] = np.zeros(4)  # same shape and dtype, new array: fine, updated in place
    optimizer.step(grads)
    assert optimizer.step_count == 1


# ---------------------------------------------------------------- state dict


OPTIMIZERS = [
    pytest.param(lambda p: SGD(p, lr=0.05), id="sgd"),
    pytest.param(lambda p: SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
                 id="sgd-momentum"),
    pytest.param(lambda p: SGD(p, lr=0.05, momentum=0.9, nesterov=True), id="sgd-nesterov"),
    pytest.param(lambda p: Adam(p, lr=0.01, weight_decay=1e-2), id="adam"),
    pytest.param(lambda p: AdamW(p, lr=0.01), id="adamw"),
]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_state_dict_is_flat_and_npz_ready(make, rng):
    # oracle: the documented key layout; np.savez/np.load(allow_pickle=False) accepts it
    params = make_params(rng)
    optimizer = make(params)
    state = optimizer.state_dict()
    assert state["step"].shape == () and state["step"].dtype == np.int64 and state["step"] == 0
    buffers = {"SGD": ["momentum_buffer"] if getattr(optimizer, "momentum", 0) else [],
               "Adam": ["exp_avg", "exp_avg_sq"], "AdamW": ["exp_avg", "exp_avg_sq"]}
    expected = {"step"} | {f"{b}/{n}" for b in buffers[type(optimizer).__name__] for n in params}
    assert set(state) == expected
    for key, value in state.items():
        assert isinstance(value, np.ndarray) and value.dtype != object
        if key != "step":
            assert value.shape == params[key.split("/", 1)[1]].shape


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_resume_through_npz_is_bitwise_identical(make, rng, tmp_path):
    # oracle: 20 uninterrupted steps == 8 steps, save to .npz, fresh optimizer loads, 12 steps
    params = make_params(rng)
    curvature, offset = make_quadratic(rng, params)
    start = {k: v.copy() for k, v in params.items()}

    straight = make(params)
    for _ in range(20):
        straight.step(quadratic_grads(params, curvature, offset))

    first = {k: v.copy() for k, v in start.items()}
    optimizer = make(first)
    for _ in range(8):
        optimizer.step(quadratic_grads(first, curvature, offset))
    np.savez(tmp_path / "state.npz", **optimizer.state_dict())
    np.savez(tmp_path / "params.npz", **first)
    with np.load(tmp_path / "params.npz", allow_pickle=False) as saved:
        second = {k: saved[k] for k in saved.files}
    resumed = make(second)
    with np.load(tmp_path / "state.npz", allow_pickle=False) as saved:
        resumed.load_state_dict(saved)
    assert resumed.step_count == 8
    for _ in range(12):
        resumed.step(quadratic_grads(second, curvature, offset))

    for name in params:
        assert params[name].tobytes() == second[name].tobytes(), name
    for key, value in straight.state_dict().items():
        assert value.tobytes() == resumed.state_dict()[key].tobytes(), key


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_step_does_not_modify_the_grads(make, rng):
    # oracle: a copy of the grads taken before two steps
    params = make_params(rng)
    optimizer = make(params)
    grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
    saved = {k: v.copy() for k, v in grads.items()}
    optimizer.step(grads)
    optimizer.step(grads)
    for name in grads:
        np.testing.assert_array_equal(grads[name], saved[name])


def test_state_dict_returns_copies(rng):
    # oracle: writing into the exported arrays does not change the optimizer
    params = make_params(rng)
    optimizer = Adam(params)
    optimizer.step({k: np.ones_like(v) for k, v in params.items()})
    exported = optimizer.state_dict()
    exported["exp_avg/W_query"][...] = 123.0
    assert not (optimizer.state_dict()["exp_avg/W_query"] == 123.0).any()


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("exp_avg_sq/b_query"), "missing key 'exp_avg_sq/b_query'"),
    (lambda s: s.update({"momentum_buffer/W_query": np.zeros((3, 4))}),
     "unexpected key 'momentum_buffer/W_query'"),
    (lambda s: s.update({"exp_avg/W_query": np.zeros((4, 3))}),
     r"'exp_avg/W_query' must have shape \(3, 4\), got shape \(4, 3\)"),
    (lambda s: s.update({"exp_avg/b_query": np.zeros(4, np.float32)}),
     "'exp_avg/b_query' must have dtype float64, got dtype float32"),
    (lambda s: s.update({"step": np.array(3.0)}), "'step' must have dtype int64, got dtype float64"),
    (lambda s: s.update({"step": np.array(-1)}), "'step' must be >= 0, got -1"),
    (lambda s: s.update({"exp_avg_sq/W_query": np.full((3, 4), np.nan)}),
     "'exp_avg_sq/W_query' contains NaN"),
])
def test_load_state_dict_refuses_and_changes_nothing(edit, message, rng):
    # oracle: the state before the failed load, bitwise
    params = make_params(rng)
    optimizer = Adam(params)
    optimizer.step({k: rng.normal(size=v.shape) for k, v in params.items()})
    before = optimizer.state_dict()
    other = Adam(make_params(rng))
    for _ in range(3):
        other.step({k: rng.normal(size=v.shape) for k, v in params.items()})
    state = other.state_dict()
    edit(state)
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()
    assert after.keys() == before.keys()
    for key in before:
        assert after[key].tobytes() == before[key].tobytes(), key


def test_load_state_dict_needs_a_mapping(rng):
    with pytest.raises(TypeError, match="state must be a mapping"):
        SGD(make_params(rng), lr=0.1).load_state_dict([("step", np.array(1))])


def test_base_class_has_no_update_rule(rng):
    with pytest.raises(NotImplementedError):
        Optimizer(make_params(rng), lr=0.1).step(
            {k: np.zeros(v.shape) for k, v in make_params(rng).items()})


# ---------------------------------------------------------------- PyTorch parity


TORCH_CASES = [
    # (qkvnp class, torch.optim name, keyword arguments), one comment per case
    (SGD, "SGD", {"lr": 0.05}),  # plain gradient descent
    (SGD, "SGD", {"lr": 0.05, "momentum": 0.9}),  # heavy ball
    (SGD, "SGD", {"lr": 0.05, "momentum": 0.8, "dampening": 0.3}),  # damped momentum
    (SGD, "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),  # Nesterov
    (SGD, "SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}),  # L2 + momentum
    (SGD, "SGD", {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.5, "nesterov": True}),  # all
    (Adam, "Adam", {}),  # defaults, lr=1e-3
    (Adam, "Adam", {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),  # other constants
    (Adam, "Adam", {"lr": 0.05, "weight_decay": 0.1}),  # L2 added to the gradient
    (AdamW, "AdamW", {}),  # defaults, decoupled decay 1e-2
    (AdamW, "AdamW", {"lr": 0.02, "betas": (0.8, 0.99), "weight_decay": 0.3}),  # strong decay
]
# NOTE: torch's CPU kernels fuse some updates (add with alpha, lerp, addcmul use
# FMA), so single steps differ from ours by an ulp in ~10-20% of the entries.
# The cases avoid the regime where that is amplified: with a small beta2 (0.9)
# and a large lr, Adam hops around the optimum with ~lr*sign(g) steps, a chaotic
# map in which 1-ulp differences grow to 1e-9 within 100 steps (measured).


@pytest.mark.parametrize("ours, theirs, kwargs", TORCH_CASES)
def test_trajectories_match_torch_optim(ours, theirs, kwargs, torch, rng):
    # oracle: torch.optim on the same float64 parameters, fed the same gradients
    # (computed in numpy from each side's own current parameters, on a fixed
    # quadratic), for 100 steps; halfway the learning rate is changed on both sides
    params = make_params(rng)
    curvature, offset = make_quadratic(rng, params)
    start = {k: v.copy() for k, v in params.items()}
    torch_params = {k: torch.tensor(v.copy()) for k, v in params.items()}
    optimizer = ours(params, **kwargs)
    torch_optimizer = getattr(torch.optim, theirs)(list(torch_params.values()), **kwargs)
    worst = 0.0
    for step in range(100):
        if step == 50:
            optimizer.lr = optimizer.lr * 0.5
            torch_optimizer.param_groups[0]["lr"] = optimizer.lr
        optimizer.step(quadratic_grads(params, curvature, offset))
        torch_values = {k: v.numpy() for k, v in torch_params.items()}
        for name, grad in quadratic_grads(torch_values, curvature, offset).items():
            torch_params[name].grad = torch.tensor(grad)
        torch_optimizer.step()
        for name in params:
            theirs_now = torch_params[name].numpy()
            scale = np.abs(theirs_now).max()
            worst = max(worst, np.abs(params[name] - theirs_now).max() / scale)
    assert worst < 1e-10, f"max relative deviation from torch.optim.{theirs}: {worst:.3e}"
    # the comparison means something only if the parameters really travelled
    assert max(np.abs(params[k] - start[k]).max() for k in params) > 1e-2


# ---------------------------------------------------------------- Adam's flat update


def adam_per_parameter(params, state, grads, step, lr, betas, eps, decay, decoupled):
    """The oracle: Adam's formula lines written once per parameter, as the docstring gives them.

    Each on 1-D views: numpy 1's value-based casting computes a 0-d float32
    array times a Python float in float64 (numpy 2, like torch, in float32);
    the flat update, on arrays, rounds in the parameter's dtype on both."""
    beta1, beta2 = betas
    for name in params:
        param, m, v, g = (a.reshape(-1) for a in (params[name], state[f"exp_avg/{name}"],
                                                  state[f"exp_avg_sq/{name}"], grads[name]))
        if decay != 0:
            if decoupled:
                param *= 1 - lr * decay
            else:
                g = g + decay * param
        m += (1 - beta1) * (g - m)
        v *= beta2
        v += (1 - beta2) * g * g
        step_size = lr / (1 - beta1**step)
        denom = np.sqrt(v) / (1 - beta2**step) ** 0.5 + eps
        param -= step_size * m / denom


@pytest.mark.parametrize("cls, decay", [(Adam, 0.0), (Adam, 1e-2), (AdamW, 1e-2)])
def test_adam_flat_update_is_the_per_parameter_update_to_the_bit(cls, decay, rng):
    """Oracle: the per-parameter formulas (adam_per_parameter) over 25 steps, bitwise.

    Adam runs each dtype's parameters as one flat array; elementwise
    arithmetic must round each entry as it would alone. Parameters of both
    float dtypes, interleaved, and of several shapes (a scalar, a vector,
    matrices); a state array replaced by the user and a state loaded midway
    are used, not lost."""
    shapes = {"a": (3, 4), "b": (4,), "c": (), "d": (2, 3, 5), "e": (7,)}
    dtypes = {"a": np.float32, "b": np.float64, "c": np.float32, "d": np.float64, "e": np.float32}
    params = {name: rng.normal(size=shape).astype(dtypes[name]) for name, shape in shapes.items()}
    mine = {name: p.copy() for name, p in params.items()}
    state = {f"{buffer}/{name}": np.zeros_like(p) for buffer in ("exp_avg", "exp_avg_sq")
             for name, p in params.items()}
    optimizer = cls(mine, lr=0.01, weight_decay=decay)
    for step in range(1, 26):
        grads = {name: rng.normal(size=p.shape) for name, p in params.items()}  # float64: cast
        cast = {name: g.astype(params[name].dtype) for name, g in grads.items()}
        adam_per_parameter(params, state, cast, step, 0.01, (0.9, 0.999), 1e-8, decay,
                           cls is AdamW)
        optimizer.step(grads)
        if step == 10:  # the user replaces a buffer: the next step must use its values
            state["exp_avg/d"] = state["exp_avg/d"] * 0.5
            optimizer.state["exp_avg/d"] = state["exp_avg/d"].copy()
        if step == 17:  # a loaded state (copies) replaces every buffer
            optimizer.load_state_dict(optimizer.state_dict())
        for name in params:
            assert mine[name].dtype == params[name].dtype
            assert mine[name].tobytes() == params[name].tobytes(), (step, name)
    for key, value in optimizer.state_dict().items():
        if key != "step":
            assert value.tobytes() == state[key].tobytes(), key


def test_adamw_chunks_give_the_same_bits(monkeypatch):
    """Oracle: the update is elementwise, so any chunking gives the bits of one chunk."""
    import qkvnp.optim as optim

    def run(chunk):
        monkeypatch.setattr(optim, "_CHUNK", chunk)
        rng = np.random.default_rng(0)
        params = {"a": rng.normal(size=(7, 5)).astype(np.float32),
                  "b": rng.normal(size=11).astype(np.float32)}
        opt = optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            opt.step({name: rng.normal(size=p.shape).astype(np.float32)
                      for name, p in params.items()})
        return params

    whole, chunked = run(10**6), run(4)  # one chunk; 12 chunks, the last partial
    for name in whole:
        assert whole[name].tobytes() == chunked[name].tobytes()


@pytest.mark.parametrize("cls, decay", [(Adam, 1e-2), (AdamW, 1e-2)])
def test_adam_chunks_on_the_worker_threads_give_the_per_parameter_bits(cls, decay, monkeypatch):
    """Oracle: adam_per_parameter, bitwise. Chunks of 20 entries (four times 5 on two
    threads) cut the parameters anywhere (the first holds three whole and the start of
    a fourth), and the chunk jobs go to the pool's two threads; a transposed (not
    contiguous) parameter is updated in place."""
    import qkvnp.optim as optim
    from qkvnp.kernels import block_sizes, num_threads

    monkeypatch.setattr(optim, "_CHUNK", 5)
    rng = np.random.default_rng(3)
    params = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=2), "c": rng.normal(size=()),
              "t": rng.normal(size=(6, 3)).T, "e": rng.normal(size=13)}
    assert not params["t"].flags.c_contiguous
    oracle = {name: p.copy() for name, p in params.items()}  # C-contiguous copies
    state = {f"{buffer}/{name}": np.zeros(p.shape) for buffer in ("exp_avg", "exp_avg_sq")
             for name, p in params.items()}
    transposed = params["t"]
    optimizer = cls(params, lr=0.01, weight_decay=decay)
    with num_threads(2), block_sizes(min_parallel_entries=0):
        for step in range(1, 6):
            grads = {name: rng.normal(size=p.shape) for name, p in params.items()}
            adam_per_parameter(oracle, state, grads, step, 0.01, (0.9, 0.999), 1e-8, decay,
                               cls is AdamW)
            optimizer.step(grads)
    assert params["t"] is transposed  # in place, not replaced
    for name in params:
        assert params[name].tobytes() == oracle[name].tobytes(), name


def test_adam_goes_to_the_worker_threads_from_min_parallel_entries_on(monkeypatch):
    """Oracle: the setting's definition. A group of ``min_parallel_entries`` entries or
    more hands its chunks to ``_runtime.run`` (the pool), a smaller one updates them in
    the calling thread; one thread never hands off."""
    import qkvnp.optim as optim
    from qkvnp.kernels import _runtime, block_sizes, num_threads

    monkeypatch.setattr(optim, "_CHUNK", 16)  # two chunks of 4 * 16 entries on two threads
    handed = []
    real_run = _runtime.run
    monkeypatch.setattr(_runtime, "run", lambda task, work, flops=None: (
        handed.append(len(work)), real_run(task, work, flops)))
    params = {"w": np.zeros(100), "b": np.zeros(28)}
    grads = {name: np.ones(p.shape) for name, p in params.items()}
    optimizer = AdamW(params, lr=0.1)
    for threads, limit, expected in ((2, 128, [2]), (2, 129, []), (1, 0, [])):
        handed.clear()
        with num_threads(threads), block_sizes(min_parallel_entries=limit):
            optimizer.step(grads)
        assert handed == expected, (threads, limit)


def test_adam_with_the_parameters_as_their_own_gradients_reads_each_before_writing():
    """Oracle: the same step given copies of the parameters as gradients, bitwise.

    The update reads the gradients chunk by chunk; gradients that share memory
    with the parameters it writes (``step(params)``, or one gradient a view of
    another parameter) must be read as they were before the step."""
    rng = np.random.default_rng(4)
    base = rng.normal(size=(4, 6))
    params = {"w": base, "v": rng.normal(size=9)}
    copies = {name: p.copy() for name, p in params.items()}
    mine, theirs = AdamW(params, lr=0.1), AdamW(copies, lr=0.1)
    for _ in range(3):
        theirs.step({"w": copies["v"][:6].repeat(4).reshape(4, 6).copy(), "v": copies["v"].copy()})
        mine.step({"w": np.broadcast_to(params["v"][:6].repeat(4).reshape(4, 6), (4, 6)),
                   "v": params["v"]})
    for name in params:
        assert params[name].tobytes() == copies[name].tobytes(), name


def test_adam_chunk_pieces_cover_every_entry_once():
    """Oracle: counting. Each entry of each parameter lies in exactly one piece,
    at the chunk position its flat index gives."""
    from qkvnp.optim import _CHUNK, _chunk_pieces

    sizes = [1, _CHUNK - 1, 3, 2 * _CHUNK + 5, 1, _CHUNK]
    ends = np.cumsum(sizes).tolist()
    starts = [0] + ends[:-1]
    seen = np.zeros(ends[-1], int)
    for start, stop, pieces in _chunk_pieces(starts, ends, _CHUNK):
        assert 0 < stop - start <= _CHUNK
        for i, lo, hi, at in pieces:
            assert 0 <= lo < hi <= sizes[i]
            assert starts[i] + lo == start + at
            seen[starts[i] + lo:starts[i] + hi] += 1
    assert (seen == 1).all()
