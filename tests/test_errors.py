"""Bad input raises ValueError/TypeError naming the argument, the expected and
the received shape or type; never AssertionError, IndexError or a silent broadcast.

Oracle: the issue's contract for errors. Each case lists the exception type
and the message fragments it must contain (``match=`` on the first, then all
of them): the argument's name, what was expected, what was received.
"""
import functools
import importlib
import re

import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F, losses

rng = np.random.default_rng(0)


def normal(*shape):
    return rng.normal(size=shape)


def check(exc, fn, *fragments):
    """``fn()`` raises exactly ``exc`` (not a subclass stand-in) with every fragment."""
    with pytest.raises(exc, match=re.escape(fragments[0])) as info:
        fn()
    assert type(info.value) is exc, f"raised {type(info.value).__name__}, expected {exc.__name__}"
    message = str(info.value)
    for fragment in fragments[1:]:
        assert fragment in message, f"{fragment!r} missing from: {message}"


def sdpa(query=(2, 3, 4), key=(2, 5, 4), value=(2, 5, 2), **kwargs):
    """Attention on fresh random arrays of the given shapes."""
    return F.attention_forward(normal(*query), normal(*key), normal(*value), **kwargs)


# ------------------------------------------------------------- attention core


@pytest.mark.parametrize("fn, fragments", [
    # query/key head dims differ: D=4 vs 3
    (lambda: sdpa(key=(2, 5, 3)), ["key", "(..., S, 4)", "(2, 5, 3)"]),
    # key/value lengths differ: S=5 vs 6
    (lambda: sdpa(value=(2, 6, 2)), ["value", "(..., 5, Dv)", "(2, 6, 2)"]),
    # leading dims that do not broadcast: 2 vs 3
    (lambda: sdpa(key=(3, 5, 4), value=(3, 5, 2)), ["query", "(2, 3, 4)", "(3, 5, 4)"]),
    # a vector is not a (T, D) matrix
    (lambda: sdpa(query=(4,)), ["query", "(..., T, D)", "(4,)"]),
    # mask (3, 4) does not broadcast to the scores (2, 3, 5)
    (lambda: sdpa(attn_mask=np.ones((3, 4), bool)), ["attn_mask", "(2, 3, 5)", "(3, 4)"]),
    # a mask that broadcasts *up* the scores would silently add a batch dim
    (lambda: sdpa(query=(3, 4), key=(5, 4), value=(5, 2), attn_mask=np.ones((2, 3, 5), bool)),
     ["attn_mask", "(3, 5)", "(2, 3, 5)"]),
    # NaN / inf inputs
    (lambda: F.attention_forward(np.full((3, 4), np.nan), normal(5, 4), normal(5, 2)),
     ["query", "NaN or inf", "finite"]),
    (lambda: F.attention_forward(normal(3, 4), normal(5, 4), np.full((5, 2), np.inf)),
     ["value", "NaN or inf"]),
    (lambda: sdpa(attn_mask=np.full((3, 5), np.nan)), ["attn_mask", "NaN"]),
    (lambda: sdpa(attn_mask=np.full((3, 5), np.inf)), ["attn_mask", "+inf"]),
    # scale must be finite (zero and negative scales are accepted, as PyTorch does: issue 9)
    (lambda: sdpa(scale=-np.inf), ["scale", "finite number", "-inf"]),
    (lambda: sdpa(scale=np.nan), ["scale", "finite number", "nan"]),
    (lambda: sdpa(scale=np.inf), ["scale", "finite number", "inf"]),
])
def test_attention_value_errors(fn, fragments):
    check(ValueError, fn, *fragments)


@pytest.mark.parametrize("fn, fragments", [
    # integer 0/1 masks are ambiguous between the two conventions
    (lambda: sdpa(attn_mask=np.ones((3, 5), int)), ["attn_mask", "bool", "float", "int64", "astype(bool)"]),
    (lambda: sdpa(attn_mask=np.ones((3, 5), np.uint8)), ["attn_mask", "uint8", "astype(bool)"]),
    # non-real inputs name the argument
    (lambda: F.attention_forward(normal(3, 4), np.array([["a"] * 4] * 5), normal(5, 2)),
     ["key", "real numbers", "<U1"]),
    (lambda: F.attention_forward(normal(3, 4) + 0j, normal(5, 4), normal(5, 2)),
     ["query", "real numbers", "complex128"]),
    (lambda: F.attention_forward(normal(3, 4), normal(5, 4), None), ["value", "None"]),
    # scale of a wrong type
    (lambda: sdpa(scale="2"), ["scale", "real number", "str"]),
    (lambda: sdpa(scale=True), ["scale", "real number", "bool"]),
    (lambda: sdpa(scale=np.array([1.0])), ["scale", "real number", "ndarray"]),
    (lambda: sdpa(scale=1j), ["scale", "real number", "complex"]),
    (lambda: sdpa(is_causal="yes"), ["is_causal", "bool", "str"]),
])
def test_attention_type_errors(fn, fragments):
    check(TypeError, fn, *fragments)


def test_attention_backward_refuses_a_broadcastable_dout():
    """A (1, 3, 2) or (3, 2) dout would broadcast against the (2, 3, 2) output: refused."""
    _, cache = sdpa()
    for shape in [(1, 3, 2), (3, 2), (2, 3, 1), (2, 3, 2, 1)]:
        check(ValueError, lambda: F.attention_backward(normal(*shape), cache),
              "dout", "(2, 3, 2)", str(shape))


def test_other_ops_refuse_bad_shapes():
    """linear, softmax and the head split/merge name their argument and both shapes."""
    check(ValueError, lambda: F.linear_forward(normal(3, 4), normal(5, 2)), "x", "(..., 5)", "(3, 4)")
    check(ValueError, lambda: F.linear_forward(normal(3, 4), normal(4, 2), normal(3)),
          "b", "(2,)", "(3,)")
    check(ValueError, lambda: F.linear_forward(normal(3, 4), normal(4)), "W", "(N, M)", "(4,)")
    _, cache = F.linear_forward(normal(3, 4), normal(4, 2))
    check(ValueError, lambda: F.linear_backward(normal(1, 2), cache), "dout", "(3, 2)", "(1, 2)")
    _, cache = F.softmax_forward(normal(3, 4))
    check(ValueError, lambda: F.softmax_backward(normal(1, 4), cache), "dweights", "(3, 4)", "(1, 4)")
    check(ValueError, lambda: F.split_heads_forward(normal(3, 5), 2), "num_heads", "E=5", "2")
    _, cache = F.split_heads_forward(normal(3, 6), 2)
    # (2, 4, 3) has the right head count but not the forward output's shape (2, 3, 3)
    check(ValueError, lambda: F.split_heads_backward(normal(2, 4, 3), cache), "dout", "(2, 3, 3)", "(2, 4, 3)")
    _, cache = F.merge_heads_forward(normal(2, 3, 3))
    check(ValueError, lambda: F.merge_heads_backward(normal(3, 5), cache), "dout", "(3, 6)", "(3, 5)")


# ------------------------------------------------------------- layers: construction


@pytest.mark.parametrize("fn, exc, fragments", [
    (lambda impl: qkvnp.MultiHeadAttention(6, 4, impl=impl), ValueError,
     ["embed_dim", "divisible by num_heads", "embed_dim=6", "num_heads=4"]),
    (lambda impl: qkvnp.MultiHeadAttention(6, 0, impl=impl), ValueError, ["num_heads", ">= 1", "0"]),
    (lambda impl: qkvnp.MultiHeadAttention(6.0, 2, impl=impl), TypeError, ["embed_dim", "int", "float"]),
    (lambda impl: qkvnp.MultiHeadAttention(6, 2, kdim=0, impl=impl), ValueError, ["kdim", ">= 1", "0"]),
    (lambda impl: qkvnp.SelfAttention(0, 2, impl=impl), ValueError, ["d_in", ">= 1", "0"]),
    (lambda impl: qkvnp.SelfAttention(3, "2", impl=impl), TypeError, ["d_out", "int", "str"]),
    # dtype must be a float dtype (an int dtype used to mean float64 silently)
    (lambda impl: qkvnp.SelfAttention(3, 2, dtype=np.int32, impl=impl), TypeError,
     ["dtype", "float16, float32 or float64", "int32"]),
    (lambda impl: qkvnp.MultiHeadAttention(4, 2, dtype="int64", impl=impl), TypeError,
     ["dtype", "float", "int64"]),
    (lambda impl: qkvnp.MultiHeadAttention(4, 2, dtype=np.complex128, impl=impl), TypeError,
     ["dtype", "float", "complex128"]),
    (lambda impl: qkvnp.SelfAttention(3, 2, dtype="junk", impl=impl), TypeError, ["dtype", "junk"]),
    # rng: a Generator, a non-negative int seed or None
    (lambda impl: qkvnp.SelfAttention(3, 2, rng="abc", impl=impl), TypeError, ["rng", "Generator", "str"]),
    (lambda impl: qkvnp.SelfAttention(3, 2, rng=1.5, impl=impl), TypeError, ["rng", "int seed", "float"]),
    (lambda impl: qkvnp.MultiHeadAttention(4, 2, rng=np.random.RandomState(0), impl=impl), TypeError,
     ["rng", "Generator", "RandomState"]),
    (lambda impl: qkvnp.MultiHeadAttention(4, 2, rng=True, impl=impl), TypeError, ["rng", "bool"]),
    (lambda impl: qkvnp.SelfAttention(3, 2, rng=-1, impl=impl), ValueError, ["rng", ">= 0", "-1"]),
    (lambda impl: qkvnp.SelfAttention(3, 2, impl="cuda"), ValueError, ["impl", "reference", "'cuda'"]),
])
def test_layer_construction_errors(impl, fn, exc, fragments):
    check(exc, lambda: fn(impl), *fragments)


# ------------------------------------------------------------- layers: forward / backward


def test_self_attention_bad_inputs(impl):
    layer = qkvnp.SelfAttention(6, 2, rng=0, impl=impl)
    check(RuntimeError, lambda: layer.backward(normal(3, 2)), "backward called before forward")
    check(ValueError, lambda: layer.forward(normal(3, 5)), "x", "(..., T, 6)", "(3, 5)")
    check(ValueError, lambda: layer.forward(normal(6)), "x", "(..., T, 6)", "(6,)")
    check(ValueError, lambda: layer.forward(np.full((3, 6), np.inf)), "x", "NaN or inf")
    check(TypeError, lambda: layer.forward(np.full((3, 6), "a")), "x", "real numbers", "<U1")
    check(ValueError, lambda: layer.forward(normal(2, 3, 6), attn_mask=np.ones((2, 2), bool)),
          "attn_mask", "(2, 3, 3)", "(2, 2)")
    check(TypeError, lambda: layer.forward(normal(2, 3, 6), attn_mask=np.ones((3, 3), np.int8)),
          "attn_mask", "int8", "bool", "float")
    layer.forward(normal(2, 3, 6))
    for shape in [(1, 3, 2), (3, 2), (2, 3, 6)]:
        check(ValueError, lambda: layer.backward(normal(*shape)), "dout", "(2, 3, 2)", str(shape))


def test_multihead_bad_inputs(impl):
    layer = qkvnp.MultiHeadAttention(6, 2, rng=0, impl=impl)
    x = normal(2, 3, 6)
    check(RuntimeError, lambda: layer.backward(normal(2, 3, 6)), "backward called before forward")
    check(ValueError, lambda: layer.forward(normal(2, 3, 5)), "query", "(..., T, 6)", "(2, 3, 5)")
    check(ValueError, lambda: layer.forward(x, normal(2, 4, 5)), "key", "(..., S, 6)", "(2, 4, 5)")
    check(ValueError, lambda: layer.forward(x, normal(3, 4, 6)), "key", "(2,)", "(3, 4, 6)")
    check(ValueError, lambda: layer.forward(x, normal(2, 4, 6), normal(2, 5, 6)),
          "value", "(2, 4, 6)", "(2, 5, 6)")
    check(ValueError, lambda: layer.forward(x, None, normal(2, 3, 6)), "key must be given")
    check(ValueError, lambda: layer.forward(x, normal(2, 3, 6), np.full((2, 3, 6), np.nan)),
          "value", "NaN or inf")
    # a 3-D mask on batched input is PyTorch's (B*H, T, S); (B, T, S) with B = 2, H = 2
    # is ambiguous ((B, T, S) or (H, T, S)?): refused, naming the shapes to use
    check(ValueError, lambda: layer.forward(x, attn_mask=np.ones((2, 3, 3), bool)),
          "attn_mask", "(B*H, T, S) = (4, 3, 3)", "(2, 3, 3)", "(B, 1, T, S)")
    check(ValueError, lambda: layer.forward(x, attn_mask=np.ones((2, 3, 3, 3), bool)),
          "attn_mask", "(2, 2, 3, 3)", "(2, 3, 3, 3)")
    check(TypeError, lambda: layer.forward(x, attn_mask=np.ones((3, 3), int)),
          "attn_mask", "int64", "astype(bool)")
    check(TypeError, lambda: layer.forward(x, attn_mask=np.ones((3, 3), int),
                                           key_padding_mask=np.ones((2, 3), bool)),
          "attn_mask", "int64", "astype(bool)")
    check(ValueError, lambda: layer.forward(x, key_padding_mask=np.ones((2, 4), bool)),
          "key_padding_mask", "(2, 3)", "(2, 4)")
    check(ValueError, lambda: layer.forward(x, key_padding_mask=np.ones((3,), bool)),
          "key_padding_mask", "(2, 3)", "(3,)")
    check(TypeError, lambda: layer.forward(x, key_padding_mask=np.ones((2, 3), int)),
          "key_padding_mask", "bool", "True = real token", "True = pad", "float", "int64")
    # a float key padding mask is additive (0 / -inf): NaN and +inf are refused
    check(ValueError, lambda: layer.forward(x, key_padding_mask=np.full((2, 3), np.nan)),
          "key_padding_mask", "NaN")
    layer.forward(x)
    for shape in [(3, 6), (1, 3, 6), (2, 3, 1)]:
        check(ValueError, lambda: layer.backward(normal(*shape)), "dout", "(2, 3, 6)", str(shape))
    cross = qkvnp.MultiHeadAttention(6, 2, kdim=4, rng=0, impl=impl)
    check(ValueError, lambda: cross.forward(x), "qdim == kdim == vdim", "kdim=4")


def test_errors_leave_no_state_behind(impl):
    """A refused forward must not leave a cache from a previous call to be misused:
    backward then still matches the *last successful* forward's output shape."""
    layer = qkvnp.MultiHeadAttention(6, 2, rng=0, impl=impl)
    out = layer.forward(normal(2, 3, 6))
    with pytest.raises(ValueError):
        layer.forward(normal(4, 5, 6), attn_mask=np.ones((9, 9), bool))
    assert layer.backward(normal(*out.shape)).shape == (2, 3, 6)


# ---------------------------------------------------------------- fast and tiled paths


@pytest.mark.parametrize("module", ["fast", "tiled"])
@pytest.mark.parametrize("args, kwargs", [
    ((np.ones((3, 2)), np.ones((4, 3)), np.ones((4, 2))), {}),  # key head dim mismatch
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((5, 2))), {}),  # value length mismatch
    ((np.ones((2, 3, 2)), np.ones((3, 4, 2)), np.ones((4, 2))), {}),  # leading dims
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"attn_mask": np.ones((3, 5), bool)}),
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"attn_mask": np.ones((3, 4), int)}),
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))),
     {"attn_mask": np.full((3, 4), np.inf)}),  # +inf in a float mask
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"is_causal": 1}),
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"scale": -np.inf}),
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"scale": "0.5"}),
    ((np.full((3, 2), np.nan), np.ones((4, 2)), np.ones((4, 2))), {}),  # NaN input
    ((np.ones((3, 2), complex), np.ones((4, 2)), np.ones((4, 2))), {}),  # complex input
    ((np.ones(2), np.ones((4, 2)), np.ones((4, 2))), {}),  # 1-D query
])
def test_fast_and_tiled_raise_the_reference_errors(module, args, kwargs):
    """Oracle: the reference path raises the same exception with the same message."""
    path = _path(module)
    with pytest.raises((ValueError, TypeError)) as expected:
        F.attention_forward(*args, **kwargs)
    with pytest.raises(expected.type) as actual:
        path.attention_forward(*args, **kwargs)
    assert str(actual.value) == str(expected.value)


@pytest.mark.parametrize("module", ["functional", "fast", "tiled"])
def test_dout_of_another_shape_is_refused_on_every_path(module):
    path = _path(module)
    _, cache = path.attention_forward(np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 5)))
    with pytest.raises(ValueError, match=r"dout must have shape \(3, 5\).*got shape \(3, 4\)"):
        path.attention_backward(np.ones((3, 4)), cache)


# ---------------------------------------------------------------- upstream gradients


def _op(forward, backward, *inputs, name="dout"):
    """A functional pair's backward on a fresh forward: (call, argument name, expected shape)."""
    out, cache = forward(*inputs)
    return (lambda d: backward(d, cache)), name, np.shape(out)


def _layer(layer, *inputs):
    """A layer's backward after one forward: (call, argument name, expected shape)."""
    out = layer.forward(*inputs)
    # retain_cache: some tests call the backward of one forward twice
    return functools.partial(layer.backward, retain_cache=True), "dout", out.shape


def _path(module):
    """The module of a path or op by short name: the kernels live in qkvnp.kernels."""
    kernel = module in ("fast", "tiled", "mha", "reference")
    return importlib.import_module(f"qkvnp.kernels.{module}" if kernel else f"qkvnp.{module}")


# Every backward a user can call, but the attention layers' (below, on each impl):
# a setup that runs the forward and returns (backward(d), argument name, shape).
UPSTREAM_ENTRY_POINTS = {
    "functional.linear_backward": lambda: _op(
        F.linear_forward, F.linear_backward, normal(2, 3, 4), normal(4, 5), normal(5)),
    "functional.softmax_backward": lambda: _op(
        F.softmax_forward, F.softmax_backward, normal(3, 4), name="dweights"),
    "functional.attention_backward": lambda: _op(
        F.attention_forward, F.attention_backward, normal(2, 3, 4), normal(2, 5, 4), normal(2, 5, 2)),
    "functional.split_heads_backward": lambda: _op(
        F.split_heads_forward, F.split_heads_backward, normal(2, 3, 6), 2),
    "functional.merge_heads_backward": lambda: _op(
        F.merge_heads_forward, F.merge_heads_backward, normal(2, 2, 3, 3)),
    "fast.attention_backward": lambda: _op(
        _path("fast").attention_forward, _path("fast").attention_backward,
        normal(2, 3, 4), normal(2, 5, 4), normal(2, 5, 2)),
    "tiled.attention_backward": lambda: _op(
        _path("tiled").attention_forward, _path("tiled").attention_backward,
        normal(2, 3, 4), normal(2, 5, 4), normal(2, 5, 2)),
    "functional.embedding_backward": lambda: _op(
        F.embedding_forward, F.embedding_backward,
        np.array([[1, 0, 1]]), normal(3, 4)),
    "Linear.backward": lambda: _layer(qkvnp.Linear(4, 3, rng=0), normal(2, 5, 4)),
    "Embedding.backward": lambda: _layer(qkvnp.Embedding(5, 4, rng=0), np.array([[1, 2, 1]])),
    "losses.mse_backward": lambda: _op(
        losses.mse_forward, losses.mse_backward, normal(3, 2), normal(3, 2),
        name="dloss"),
    "losses.cross_entropy_backward": lambda: _op(
        losses.cross_entropy_forward, losses.cross_entropy_backward,
        normal(3, 4), np.array([0, 3, 1]), name="dloss"),
}

# The attention layers, on each impl (the fast and tiled ones check in kernels.mha.backward).
ATTENTION_LAYER_ENTRY_POINTS = {
    "SelfAttention": lambda impl: _layer(qkvnp.SelfAttention(6, 4, rng=0, impl=impl), normal(2, 3, 6)),
    "MultiHeadAttention self": lambda impl: _layer(
        qkvnp.MultiHeadAttention(6, 2, rng=0, impl=impl), normal(2, 3, 6)),
    "MultiHeadAttention cross": lambda impl: _layer(
        qkvnp.MultiHeadAttention(6, 2, kdim=4, vdim=5, rng=0, impl=impl),
        normal(2, 3, 6), normal(2, 4, 4), normal(2, 4, 5)),
}


def _with_last(value):
    """Finite random entries but the last one: a check of the first entry alone misses it."""
    def make(shape):
        d = np.array(normal(*shape))
        d.flat[-1] = value
        return d
    return make


BAD_UPSTREAM = [
    # (make(shape) -> upstream gradient, exception, message fragments; {name} is the argument)
    pytest.param(lambda s: np.full(s, np.nan), ValueError,
                 ["{name} contains NaN or inf", "finite"], id="nan"),
    pytest.param(lambda s: np.full(s, np.inf), ValueError, ["{name} contains NaN or inf"], id="+inf"),
    pytest.param(lambda s: np.full(s, -np.inf), ValueError, ["{name} contains NaN or inf"], id="-inf"),
    pytest.param(_with_last(np.nan), ValueError, ["{name} contains NaN or inf"], id="last-nan"),
    pytest.param(_with_last(-np.inf), ValueError, ["{name} contains NaN or inf"], id="last--inf"),
    # numpy would drop the imaginary part with a mere ComplexWarning
    pytest.param(lambda s: np.array(normal(*s)) + 1j, TypeError,
                 ["{name} must hold real numbers", "complex128"], id="complex"),
    # numpy would fail inside a matmul with a message that names nothing
    pytest.param(lambda s: np.full(s, 1.0, dtype=object), TypeError,
                 ["{name} must hold real numbers", "object"], id="object"),
    pytest.param(lambda s: np.full(s, "1"), TypeError, ["{name} must hold real numbers", "<U1"],
                 id="str"),
]


def _check_refused(setup, make, exc, fragments):
    backward, name, shape = setup
    check(exc, lambda: backward(make(shape)), *(f.format(name=name) for f in fragments))


@pytest.mark.parametrize("make, exc, fragments", BAD_UPSTREAM)
@pytest.mark.parametrize("entry", sorted(UPSTREAM_ENTRY_POINTS))
def test_backward_refuses_a_bad_upstream_gradient(entry, make, exc, fragments):
    """Oracle: the contract of forward inputs (as_float_array), applied to the
    upstream gradient: NaN/inf is a ValueError, a non-real dtype a TypeError,
    both naming the argument."""
    _check_refused(UPSTREAM_ENTRY_POINTS[entry](), make, exc, fragments)


@pytest.mark.parametrize("make, exc, fragments", BAD_UPSTREAM)
@pytest.mark.parametrize("entry", sorted(ATTENTION_LAYER_ENTRY_POINTS))
def test_attention_layer_backward_refuses_a_bad_upstream_gradient(impl, entry, make, exc, fragments):
    """Same oracle on each impl; a refused backward accumulates nothing into grads."""
    backward, name, shape = setup = ATTENTION_LAYER_ENTRY_POINTS[entry](impl)
    layer = backward.func.__self__
    _check_refused(setup, make, exc, fragments)
    for grad_name, grad in layer.grads.items():
        assert not grad.any(), f"{grad_name} changed by a refused backward"
    dx = layer.backward(normal(*shape))  # the cache is intact: a valid dout still works
    assert all(np.isfinite(d).all() for d in (dx if isinstance(dx, tuple) else (dx,)) if d is not None)


@pytest.fixture
def upstream_checks(monkeypatch):
    """Counts the calls of as_upstream_grad made from every module that uses it.

    Every module of the package is imported first, so that one added later
    cannot escape the count."""
    import pkgutil
    import sys

    from qkvnp import _checks

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[1])
        return _checks.as_upstream_grad(*args, **kwargs)

    for info in pkgutil.walk_packages(qkvnp.__path__, "qkvnp."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    users = [module for name, module in sorted(sys.modules.items())
             if name.startswith("qkvnp.") and module is not _checks
             and getattr(module, "as_upstream_grad", None) is _checks.as_upstream_grad]
    assert {"qkvnp.kernels.mha", "qkvnp.kernels.mha_small", "qkvnp.ops.losses"} <= {
        module.__name__ for module in users}
    for module in users:
        monkeypatch.setattr(module, "as_upstream_grad", counting)
    return calls


@pytest.mark.parametrize("entry", sorted(UPSTREAM_ENTRY_POINTS))
def test_each_backward_checks_its_upstream_gradient_once(entry, upstream_checks):
    """Oracle: a count of the helper's calls. Once, not zero (unchecked) and not
    again on intermediate gradients (a second pass would cost time and, on an
    overflowed intermediate, blame the user's finite dout)."""
    backward, name, shape = UPSTREAM_ENTRY_POINTS[entry]()
    backward(normal(*shape))
    assert upstream_checks == [name]


@pytest.mark.parametrize("entry", sorted(ATTENTION_LAYER_ENTRY_POINTS))
def test_each_attention_layer_checks_its_upstream_gradient_once(impl, entry, upstream_checks):
    backward, name, shape = ATTENTION_LAYER_ENTRY_POINTS[entry](impl)
    backward(normal(*shape))
    assert upstream_checks == [name]


@pytest.mark.parametrize("kv_heads", [None, 1])  # the one-thread layer; the general kernel (GQA)
def test_a_layer_split_over_the_threads_checks_its_upstream_gradient_once(kv_heads, upstream_checks):
    """Oracle: the count, with the batch split forced (each share's backward
    reads the rows of the whole dout checked before the shares start)."""
    from qkvnp import kernels

    layer = qkvnp.MultiHeadAttention(8, 2, num_kv_heads=kv_heads, rng=0, impl="fast")
    x = normal(4, 5, 8)
    with kernels.num_threads(2), kernels.block_sizes(batch_split_flops=0):
        layer.forward(x)
        shares = layer._cache.caches
        assert len(shares) == 2  # it did split, each share on the kernel named above
        assert all(isinstance(share, kernels.mha.FusedLayerCache) == (kv_heads == 1)
                   for share in shares)
        layer.backward(normal(*x.shape))
    assert upstream_checks == ["dout"]


def test_upstream_gradient_of_the_right_dtype_is_not_copied():
    """The fast path relies on it: the helper hands back the very array it got."""
    from qkvnp._checks import as_upstream_grad

    for dtype in (np.float32, np.float64):
        dout = normal(2, 3).astype(dtype)
        assert as_upstream_grad(dout, "dout", (2, 3), dtype) is dout


def test_a_cast_that_overflows_is_refused_naming_the_argument():
    """float64 1e300 is finite but inf in float32: refused, not silently inf."""
    layer = qkvnp.Linear(4, 3, rng=0, dtype=np.float32)
    layer.forward(normal(2, 4))
    check(ValueError, lambda: layer.backward(np.full((2, 3), 1e300)),
          "dout has values too large for float32", "float64")


@pytest.mark.parametrize("layer_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dout_dtype", [
    np.float32, np.float64,  # the other float dtype is cast, as documented
    np.float16, np.int64,  # ints and half floats too
    np.longdouble,  # float128 (or float64 on some platforms): cast like a forward input
])
def test_upstream_gradients_of_another_real_dtype_are_cast(impl, layer_dtype, dout_dtype):
    """Oracle: the same backward fed the gradient already cast to the layer dtype
    (identical results: the check did not become stricter than documented)."""
    rng_ = np.random.default_rng(3)
    x = rng_.normal(size=(2, 3, 6))
    dout = rng_.integers(-3, 4, size=(2, 3, 6)).astype(dout_dtype)  # exact in every dtype
    results = []
    for d in (dout, dout.astype(layer_dtype)):
        for layer in (qkvnp.MultiHeadAttention(6, 2, rng=0, dtype=layer_dtype, impl=impl),
                      qkvnp.SelfAttention(6, 6, rng=0, dtype=layer_dtype, impl=impl),
                      qkvnp.Linear(6, 6, rng=0, dtype=layer_dtype)):
            layer.forward(x)
            dx = layer.backward(d)
            assert dx.dtype == layer_dtype
            results.append([dx] + [layer.grads[k] for k in sorted(layer.grads)])
    half = len(results) // 2
    for got, want in zip(results[:half], results[half:]):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("entry", sorted(UPSTREAM_ENTRY_POINTS))
def test_backwards_cast_a_float32_upstream_gradient(entry):
    """Oracle: the same backward fed the gradient already in float64."""
    backward, _, shape = UPSTREAM_ENTRY_POINTS[entry]()
    dout = np.array(normal(*shape)).astype(np.float32)
    got, want = backward(dout), backward(dout.astype(np.float64))
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for a, b in zip(got, want):
        if b is not None:
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- float128


LONGDOUBLE = str(np.dtype(np.longdouble))
needs_wide_longdouble = pytest.mark.skipif(
    np.finfo(np.longdouble).bits <= 64, reason="np.longdouble is float64 on this platform")


def wide(*shape):
    return normal(*shape).astype(np.longdouble)


@needs_wide_longdouble
@pytest.mark.parametrize("fn, name", [
    (lambda: qkvnp.scaled_dot_product_attention(wide(2, 3), normal(2, 3), normal(2, 3)), "query"),
    (lambda: F.attention_forward(normal(2, 3), wide(2, 3), normal(2, 3)), "key"),
    (lambda: F.attention_forward(normal(2, 3), normal(2, 3), wide(2, 3)), "value"),
    (lambda: F.linear_forward(wide(2, 3), normal(3, 2)), "x"),
    (lambda: F.linear_forward(normal(2, 3), wide(3, 2)), "W"),
    # (b is cast to the dtype of x and W, like an int b: no error)
    (lambda: F.softmax_forward(wide(2, 3)), "scores"),
    (lambda: F.embedding_forward(np.array([0]), wide(2, 3)), "weight"),
    (lambda: losses.mse_forward(wide(3), normal(3)), "pred"),
    (lambda: losses.cross_entropy_forward(wide(2, 3), np.array([0, 1])), "logits"),
])
def test_float128_inputs_name_the_argument(fn, name):
    """Oracle: the issue's wording, '<name> must be float16, float32 or float64'."""
    check(TypeError, fn, f"{name} must be float16, float32 or float64", LONGDOUBLE)


def test_compute_dtype_names_the_argument():
    from qkvnp._checks import compute_dtype

    check(TypeError, lambda: compute_dtype(np.float32, np.complex64, names=("a", "b")),
          "b must hold real numbers", "complex64")
    if np.finfo(np.longdouble).bits > 64:
        check(TypeError, lambda: compute_dtype(np.float32, np.longdouble, names=("a", "b")),
              "b must be float16, float32 or float64", LONGDOUBLE)
    assert compute_dtype(np.float16, np.int64, names=("a", "b")) == np.float32


def test_linear_layer_checks_each_input_once(monkeypatch):
    """Oracle: a count of as_float_array's calls by argument name in the layer
    and the op behind it: x, W and b once each (the op used to check x again
    and copy W on every call); and the parameters' contract: NaN in W or b is
    a ValueError naming it, as before."""
    from qkvnp import _checks
    from qkvnp.layers import basic
    from qkvnp.ops import linear

    calls = []

    def counting(x, name, *args, **kwargs):
        calls.append(name)
        return _checks.as_float_array(x, name, *args, **kwargs)

    for module in (basic, linear):
        monkeypatch.setattr(module, "as_float_array", counting)
    layer = qkvnp.Linear(4, 3, rng=0)
    x = normal(2, 4)
    out = layer.forward(x)
    assert sorted(calls) == ["W", "b", "x"]
    np.testing.assert_array_equal(out, x @ layer.params["W"] + layer.params["b"])
    for name in ("W", "b"):
        layer = qkvnp.Linear(4, 3, rng=0)
        layer.params[name].flat[0] = np.nan
        check(ValueError, lambda: layer.forward(x), f"{name} contains NaN or inf")


# ---------------------------------------------------------------- constructors: keywords, bools


@pytest.mark.parametrize("build", [
    # PyTorch's third positional is dropout, the book's context_length: was bias=True, silently
    lambda: qkvnp.MultiHeadAttention(16, 4, 0.1),
    lambda: qkvnp.MultiHeadAttention(16, 4, True),  # every argument after num_heads
    lambda: qkvnp.SelfAttention(3, 2, False, 0),  # rng: keyword-only after the book's qkv_bias
    lambda: qkvnp.Linear(3, 2, True, 0),  # rng after nn.Linear's positional bias
    lambda: qkvnp.Embedding(10, 4, 0),
])
def test_arguments_after_the_sizes_are_keyword_only(build):
    # oracle: Python's own refusal of an extra positional argument
    with pytest.raises(TypeError, match="positional argument"):
        build()


@pytest.mark.parametrize("build, name", [
    (lambda: qkvnp.MultiHeadAttention(16, 4, bias=0.1), "bias"),
    (lambda: qkvnp.MultiHeadAttention(16, 4, qkv_bias=1), "qkv_bias"),
    (lambda: qkvnp.MultiHeadAttention(16, 4, out_bias="yes"), "out_bias"),
    (lambda: qkvnp.SelfAttention(3, 2, 0.1), "qkv_bias"),  # the book's third positional
    (lambda: qkvnp.SelfAttention(3, 2, qkv_bias=None), "qkv_bias"),
    (lambda: qkvnp.Linear(3, 2, 0.0), "bias"),
])
def test_a_bias_flag_that_is_not_a_bool_names_its_keyword(build, name):
    # was: bool(value), so 0.1 meant True and 0.0 False
    with pytest.raises(TypeError, match=rf"^{name} must be a bool"):
        build()


def test_bias_flags_take_bools_and_the_books_positional_qkv_bias():
    # oracle: the parameters each flag adds
    assert set(qkvnp.SelfAttention(3, 2, True).params) >= {"b_query", "b_key", "b_value"}
    assert "b_query" not in qkvnp.SelfAttention(3, 2, np.False_).params
    layer = qkvnp.MultiHeadAttention(4, 2, bias=False, out_bias=np.True_)
    assert "b_out" in layer.params and "b_query" not in layer.params
    assert "b" not in qkvnp.Linear(3, 2, False).params
