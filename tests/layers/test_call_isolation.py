"""One call's state is its own: refused calls, edited parameters and the
gradient checker change no other call's result.

Oracles, each bitwise on every path (``reference``, ``fast``, ``tiled``,
``auto``; every path is deterministic for a given input):

- a refused call changes nothing: the backward after a refused forward
  equals the backward of the accepted forward alone, and a refused decoding
  step leaves the KV cache's length, keys and values as they were;
- parameters edited between a forward and its backward (``load_state_dict``,
  an optimizer step, an in-place write) do not change that backward: it
  equals the backward of a twin layer left unedited (the rule stated in
  :class:`qkvnp.layers.Layer`), and the next forward sees the edit (it
  equals the forward of a layer built with the edited weights);
- :func:`qkvnp.gradcheck.check_layer` between a forward and its backward
  leaves the layer as it found it: the same backward, gradients, training
  mode and Generator state as without the check.
"""
import threading
import warnings

import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import check_function, check_layer
from qkvnp.optim import SGD

PATHS = ["reference", "fast", "tiled", "auto"]


def _grads(layer):
    return {name: g.copy() for name, g in layer.grads.items()}


def _assert_same_grads(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ---------------------------------------------------------------- refused calls


LAYERS = {
    # the repro: (2, 5, 8) tokens, 2 heads (fast: the one-thread kernel)
    "MultiHeadAttention": lambda impl: qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl),
    # cross-attention: the general fused kernel on the fast path too
    "MultiHeadAttention cross": lambda impl: qkvnp.MultiHeadAttention(8, 2, kdim=6, vdim=5,
                                                                      rng=0, impl=impl),
    "SelfAttention": lambda impl: qkvnp.SelfAttention(8, 6, qkv_bias=True, rng=0, impl=impl),
    # training mode: the refused call draws no mask from dropout_rng either
    "MultiHeadAttention dropout": lambda impl: qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl,
                                                                        dropout=0.3),
}


def _inputs(name, rng):
    if name == "MultiHeadAttention cross":
        return [rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 4, 6)), rng.normal(size=(2, 4, 5))]
    return [rng.normal(size=(2, 5, 8))]


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("path", PATHS)
def test_a_refused_forward_leaves_the_previous_cache_whole(path, name):
    """x2 is finite but its projections overflow: the forward is refused
    late (the fast path's projections run before the refusal). The backward
    that follows is that of forward(x1) alone, bit for bit."""
    rng = np.random.default_rng(0)
    inputs = _inputs(name, rng)
    layer = LAYERS[name](path)
    out = layer.forward(*inputs)
    dout = rng.normal(size=out.shape)
    want_dx = layer.backward(dout, retain_cache=True)
    want_grads = _grads(layer)
    layer.zero_grad()
    bad = [x.copy() for x in inputs]
    bad[0][1, 4, :] = 1.5e308
    state = layer.dropout_rng.bit_generator.state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the overflow itself
        with pytest.raises(ValueError, match="the query projection overflowed"):
            layer.forward(*bad)
    assert layer.dropout_rng.bit_generator.state == state
    dx = layer.backward(dout)
    for got, want in zip(dx if isinstance(dx, tuple) else (dx,),
                         want_dx if isinstance(want_dx, tuple) else (want_dx,)):
        if want is None:
            assert got is None
        else:
            np.testing.assert_array_equal(got, want)
    _assert_same_grads(_grads(layer), want_grads)


@pytest.mark.parametrize("variants", [
    {},  # plain attention: qkvnp.layers.kv_cache.cached_forward
    {"rope": True, "window": (3, 0)},  # the variants' decoding step, a rolling buffer
    {"window": (3, 0), "softcap": 30.0},  # the same, without RoPE's own input check
], ids=["plain", "rope-window", "window-softcap"])
@pytest.mark.parametrize("layer_kind", ["MultiHeadAttention", "SelfAttention"])
@pytest.mark.parametrize("path", PATHS)
def test_a_refused_decoding_step_leaves_the_kv_cache_as_it_was(path, layer_kind, variants):
    """A step whose keys overflow to inf, or holding NaN, is refused, and the cache keeps its
    length, keys and values; the next valid step gives the output of one
    causal forward over the whole sequence (oracle: that forward)."""
    layer = (qkvnp.MultiHeadAttention(8, 2, rng=0, impl=path, **variants)
             if layer_kind == "MultiHeadAttention"
             else qkvnp.SelfAttention(8, 8, rng=0, impl=path, **variants))
    x = np.random.default_rng(1).normal(size=(1, 5, 8))
    cache = qkvnp.KVCache()
    layer.forward(x[:, :3], kv_cache=cache)
    length, key, value = len(cache), cache.key.copy(), cache.value.copy()
    nan_token = x[:, 3:4].copy()
    nan_token[0, 0, 2] = np.nan
    # finite tokens whose projections overflow to inf (refused after the projections,
    # named as an overflow), and NaN (at once)
    for token, message in ((np.full((1, 1, 8), 1.5e308), "projection overflowed"),
                           (np.full((1, 2, 8), -1e308), "projection overflowed"),
                           (nan_token, "NaN or inf")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(ValueError, match=message):
                layer.forward(token, kv_cache=cache)
        assert len(cache) == length
        np.testing.assert_array_equal(cache.key, key)
        np.testing.assert_array_equal(cache.value, value)
    steps = [layer.forward(x[:, t:t + 1], kv_cache=cache) for t in (3, 4)]
    # a window (left, 0) keeps the last `left` keys between steps
    assert len(cache) == (5 if "window" not in variants else variants["window"][0])
    whole = layer.forward(x, is_causal=True)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole[:, 3:], rtol=1e-12,
                               atol=1e-12)


# ---------------------------------------------------------------- edited parameters


def _edit_load_state_dict(layer, name):
    layer.load_state_dict({**layer.state_dict(), name: 2 * layer.params[name]})


def _edit_in_place(layer, name):
    layer.params[name] *= 2


def _edit_optimizer_step(layer, name):
    grads = {key: np.zeros_like(p) for key, p in layer.params.items()}
    grads[name] = -layer.params[name]  # SGD lr 1: p - lr * g = 2 p
    SGD(layer.params, lr=1.0).step(grads)


EDITS = {"load_state_dict": _edit_load_state_dict, "in place": _edit_in_place,
         "optimizer step": _edit_optimizer_step}

EDITED_LAYERS = {
    # many rows: the fused projections (fast: the one-thread kernel)
    "self": (lambda impl: qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl),
             lambda r: [r.normal(size=(2, 5, 8))]),
    # fewer rows (3) than input features (40): each weight multiplies apart
    "cross, few rows": (lambda impl: qkvnp.MultiHeadAttention(8, 2, qdim=40, kdim=40, vdim=40,
                                                              rng=0, impl=impl),
                        lambda r: [r.normal(size=(1, 3, 40)), r.normal(size=(1, 3, 40)),
                                   r.normal(size=(1, 3, 40))]),
    "SelfAttention": (lambda impl: qkvnp.SelfAttention(8, 6, qkv_bias=True, rng=0, impl=impl),
                      lambda r: [r.normal(size=(2, 5, 8))]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("case", sorted(EDITED_LAYERS))
@pytest.mark.parametrize("path", PATHS)
def test_parameters_edited_between_forward_and_backward(path, case, edit):
    """The backward differentiates the forward as it ran: after every
    parameter is doubled between forward and backward, the backward equals
    the unedited twin's; the next forward equals that of the edited weights."""
    make, inputs = EDITED_LAYERS[case]
    rng = np.random.default_rng(2)
    x = inputs(rng)
    layer, twin = make(path), make(path)
    out = layer.forward(*x)
    twin.forward(*x)
    dout = rng.normal(size=out.shape)
    for name in layer.params:
        EDITS[edit](layer, name)
    dx, want_dx = layer.backward(dout), twin.backward(dout)
    for got, want in zip(dx if isinstance(dx, tuple) else (dx,),
                         want_dx if isinstance(want_dx, tuple) else (want_dx,)):
        np.testing.assert_array_equal(got, want)
    _assert_same_grads(_grads(layer), _grads(twin))
    twin.load_state_dict({name: 2 * p for name, p in twin.params.items()})
    np.testing.assert_array_equal(layer.forward(*x), twin.forward(*x))  # the edit is seen


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_linear_backward_reads_the_weights_of_its_forward(edit):
    """Oracle: dx = dout W^T with the forward's W, dW = x^T dout (closed forms)."""
    rng = np.random.default_rng(3)
    layer = qkvnp.Linear(4, 3, rng=0)
    x, dout = rng.normal(size=(5, 4)), rng.normal(size=(5, 3))
    W = layer.params["W"].copy()
    layer.forward(x)
    EDITS[edit](layer, "W")
    dx = layer.backward(dout)
    np.testing.assert_allclose(dx, dout @ W.T, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(layer.grads["W"], x.T @ dout, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------- the gradient checker


@pytest.mark.parametrize("path", PATHS)
def test_check_layer_leaves_the_layer_as_it_found_it(path):
    """check_layer between a forward and its backward: the backward, the
    gradients (a first backward's, accumulated), the training mode and the
    dropout Generator's state are those of the same calls without it."""
    rng = np.random.default_rng(4)
    x1, x2, d1, d2 = (rng.normal(size=(2, 3, 4)) for _ in range(4))
    results = []
    for with_check in (False, True):
        layer = qkvnp.MultiHeadAttention(4, 2, rng=0, impl=path, dropout=0.25)
        layer.forward(x1, is_causal=True)
        layer.backward(d1)
        layer.forward(x2, is_causal=True)  # training mode: draws a mask from dropout_rng
        state = layer.dropout_rng.bit_generator.state
        if with_check:
            check_layer(layer, rng.normal(size=(2, 3, 4)), forward_kwargs={"rng": 5})
            check_layer(layer, rng.normal(size=(2, 3, 4)), replay_dropout=True)  # the copy's Generator
            assert layer.training
            assert layer.dropout_rng.bit_generator.state == state
        results.append((layer.backward(d2), _grads(layer)))
    (dx, grads), (want_dx, want_grads) = results[1], results[0]
    np.testing.assert_array_equal(dx, want_dx)
    _assert_same_grads(grads, want_grads)


def test_check_layer_leaves_another_threads_cache_alone():
    """A forward in another thread awaits its backward while check_layer
    runs: that backward still differentiates its own forward (oracle: the
    same pair without the check)."""
    rng = np.random.default_rng(6)
    x, dout = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0)
    layer.forward(x)
    want = layer.backward(dout)
    got, ready, checked = {}, threading.Event(), threading.Event()

    def pair():
        layer.forward(x)
        ready.set()
        checked.wait()
        got["dx"] = layer.backward(dout)

    thread = threading.Thread(target=pair)
    thread.start()
    ready.wait()
    check_layer(layer, rng.normal(size=(2, 3, 4)))
    checked.set()
    thread.join()
    np.testing.assert_array_equal(got["dx"], want)


def test_a_complex_gradient_is_refused_not_cast():
    """A vjp returning complex gradients is refused with a TypeError naming
    the input, as a non-float output is, and never reaches a ComplexWarning."""
    def fun(x):
        return np.sin(x)

    def vjp(dout, x):
        return {"x": (dout * np.cos(x)).astype(complex)}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ComplexWarning would fail the test
        with pytest.raises(TypeError, match="gradient of 'x' must hold real numbers.*complex"):
            check_function(fun, {"x": np.linspace(0.1, 1.0, 4)}, vjp)
