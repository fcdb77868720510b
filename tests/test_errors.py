"""Bad input raises ValueError/TypeError naming the argument, the expected and
the received shape or type; never AssertionError, IndexError or a silent broadcast.

Oracle: the issue's contract for errors. Each case lists the exception type
and the message fragments it must contain (``match=`` on the first, then all
of them): the argument's name, what was expected, what was received.
"""
import importlib
import re

import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F

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
    # scale must be finite and positive
    (lambda: sdpa(scale=0.0), ["scale", "finite positive", "0.0"]),
    (lambda: sdpa(scale=-1), ["scale", "finite positive", "-1.0"]),
    (lambda: sdpa(scale=np.nan), ["scale", "finite positive", "nan"]),
    (lambda: sdpa(scale=np.inf), ["scale", "finite positive", "inf"]),
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
    check(ValueError, lambda: layer.backward(normal(3, 2)), "backward called before forward")
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
    check(ValueError, lambda: layer.backward(normal(2, 3, 6)), "backward called before forward")
    check(ValueError, lambda: layer.forward(normal(2, 3, 5)), "query", "(..., T, 6)", "(2, 3, 5)")
    check(ValueError, lambda: layer.forward(x, normal(2, 4, 5)), "key", "(..., S, 6)", "(2, 4, 5)")
    check(ValueError, lambda: layer.forward(x, normal(3, 4, 6)), "key", "(2,)", "(3, 4, 6)")
    check(ValueError, lambda: layer.forward(x, normal(2, 4, 6), normal(2, 5, 6)),
          "value", "(2, 4, 6)", "(2, 5, 6)")
    check(ValueError, lambda: layer.forward(x, None, normal(2, 3, 6)), "key must be given")
    check(ValueError, lambda: layer.forward(x, normal(2, 3, 6), np.full((2, 3, 6), np.nan)),
          "value", "NaN or inf")
    # a 3-D mask on batched input is ambiguous ((B, T, S) or (H, T, S)?): refused
    check(ValueError, lambda: layer.forward(x, attn_mask=np.ones((2, 3, 3), bool)),
          "attn_mask", "(T, S) = (3, 3)", "(2, 3, 3)")
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
          "key_padding_mask", "bool", "int64")
    check(TypeError, lambda: layer.forward(x, key_padding_mask=np.zeros((2, 3))),
          "key_padding_mask", "bool", "float64")
    layer.forward(x)
    for shape in [(3, 6), (1, 3, 6), (2, 3, 1)]:
        check(ValueError, lambda: layer.backward(normal(*shape)), "dout", "(2, 3, 6)", str(shape))
    cross = qkvnp.MultiHeadAttention(6, 2, kdim=4, rng=0, impl=impl)
    check(ValueError, lambda: cross.forward(x), "kdim == vdim == embed_dim")


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
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"scale": -1.0}),
    ((np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 2))), {"scale": "0.5"}),
    ((np.full((3, 2), np.nan), np.ones((4, 2)), np.ones((4, 2))), {}),  # NaN input
    ((np.ones((3, 2), complex), np.ones((4, 2)), np.ones((4, 2))), {}),  # complex input
    ((np.ones(2), np.ones((4, 2)), np.ones((4, 2))), {}),  # 1-D query
])
def test_fast_and_tiled_raise_the_reference_errors(module, args, kwargs):
    """Oracle: the reference path raises the same exception with the same message."""
    path = importlib.import_module(f"qkvnp.{module}")
    with pytest.raises((ValueError, TypeError)) as expected:
        F.attention_forward(*args, **kwargs)
    with pytest.raises(expected.type) as actual:
        path.attention_forward(*args, **kwargs)
    assert str(actual.value) == str(expected.value)


@pytest.mark.parametrize("module", ["functional", "fast", "tiled"])
def test_dout_of_another_shape_is_refused_on_every_path(module):
    path = importlib.import_module(f"qkvnp.{module}")
    _, cache = path.attention_forward(np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 5)))
    with pytest.raises(ValueError, match=r"dout must have shape \(3, 5\).*got shape \(3, 4\)"):
        path.attention_backward(np.ones((3, 4)), cache)
