"""Closed-form and behavioural oracles for attention and both layers.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim, Dv value head dim.

Each test names its oracle in its docstring: a value known in closed form
(one key, equal scores, rows summing to 1, exact zeros), or an invariance the
math guarantees (causality, permutation of keys, a constant added to a row of
scores, -inf float mask = boolean mask, unbatched = batch of one). Upstream
gradients are random, never all ones. Layer tests take the ``impl`` fixture.
"""
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qkvnp
from qkvnp import functional as F

# invariance tests compare two computations that differ in rounding only
RTOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}


def assert_same(a, b, dtype=np.float64, what=""):
    """Equal up to rounding: max|a - b| <= rtol * max(1, max|b|)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    err = np.abs(a - b).max(initial=0.0) / max(1.0, np.abs(b).max(initial=0.0))
    assert err <= RTOL[np.dtype(dtype)], f"{what}: scaled difference {err:.3e}"


class no_float_trouble:
    """Context: any RuntimeWarning or divide/invalid/overflow floating error raises."""

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("error")
        self._errstate = np.errstate(divide="raise", invalid="raise", over="raise")
        self._errstate.__enter__()

    def __exit__(self, *exc):
        self._errstate.__exit__(*exc)
        return self._warnings.__exit__(*exc)


def layers(impl, dtype=np.float64, E=6, H=2, seed=0, bias=True):
    """A SelfAttention (E -> E) and a MultiHeadAttention (E, H) with random biases."""
    rng = np.random.default_rng(seed)
    single = qkvnp.SelfAttention(E, E, qkv_bias=bias, rng=seed, dtype=dtype, impl=impl)
    multi = qkvnp.MultiHeadAttention(E, H, bias=bias, rng=seed, dtype=dtype, impl=impl)
    for layer in (single, multi):
        for name in layer.params:
            if name.startswith("b_"):
                layer.params[name] = rng.normal(size=E).astype(layer.params[name].dtype)
    return single, multi


# ------------------------------------------------------------- closed forms


def test_one_key_returns_its_value():
    """Oracle: with one key, softmax is 1, so every query returns that value; the
    weights do not move, so dquery = dkey = 0 and dvalue = sum over queries of dout."""
    rng = np.random.default_rng(0)
    query, key, value = rng.normal(size=(3, 4, 5)), rng.normal(size=(3, 1, 5)), rng.normal(size=(3, 1, 2))
    out, cache = F.attention_forward(query, key, value, scale=1.7)
    assert out.shape == (3, 4, 2)
    np.testing.assert_array_equal(out, np.broadcast_to(value, (3, 4, 2)))
    dout = rng.normal(size=out.shape)
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    np.testing.assert_array_equal(dquery, 0)
    np.testing.assert_array_equal(dkey, 0)
    assert_same(dvalue, dout.sum(axis=1, keepdims=True))


def test_equal_scores_give_the_mean_of_values():
    """Oracle: identical keys give equal scores, uniform weights 1/S, so the output
    is the mean of the values and dvalue = (1/S) * sum over queries of dout."""
    rng = np.random.default_rng(1)
    S = 5
    key = np.tile(rng.normal(size=(2, 1, 3)), (1, S, 1))  # (2, 1, 3) -> (2, S, 3)
    query, value = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, S, 6))
    out, cache = F.attention_forward(query, key, value)
    assert out.shape == (2, 4, 6)
    assert_same(cache.weights, np.full((2, 4, S), 1 / S))
    assert_same(out, np.broadcast_to(value.mean(axis=1, keepdims=True), out.shape))
    dout = rng.normal(size=out.shape)
    _, _, dvalue = F.attention_backward(dout, cache)
    assert_same(dvalue, np.broadcast_to(dout.sum(axis=1, keepdims=True) / S, dvalue.shape))


@st.composite
def attention_problem(draw):
    """Random shapes and a bool/float mask that often leaves whole rows masked."""
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    T, S, D, Dv = (draw(st.integers(1, 5)) for _ in range(4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask = None
    if mask_kind != "none":
        keep = rng.random(lead + (T, S)) < draw(st.sampled_from([0.3, 0.7]))
        keep[(..., 0, slice(None))] = False  # query 0 attends to nothing
        mask = keep if mask_kind == "bool" else np.where(keep, rng.normal(size=keep.shape), -np.inf)
    return dict(query=rng.normal(size=lead + (T, D)), key=rng.normal(size=lead + (S, D)),
                value=rng.normal(size=lead + (S, Dv)), attn_mask=mask,
                is_causal=draw(st.booleans()), dout=rng.normal(size=lead + (T, Dv)))


@given(attention_problem())
def test_weight_rows_sum_to_one_or_zero_when_fully_masked(p):
    """Oracle: softmax rows sum to 1; a fully masked row is all zeros, its output
    row is 0, and no gradient flows through it (exact zeros), with no warning."""
    with no_float_trouble():
        out, cache = F.attention_forward(p["query"], p["key"], p["value"], p["attn_mask"],
                                         p["is_causal"])
        dquery, dkey, dvalue = F.attention_backward(p["dout"], cache)
    weights = cache.weights
    T, S = weights.shape[-2:]
    allowed = np.ones(weights.shape, dtype=bool)
    if p["attn_mask"] is not None:
        allowed &= np.isfinite(p["attn_mask"]) if p["attn_mask"].dtype.kind == "f" else p["attn_mask"]
    if p["is_causal"]:
        allowed &= np.tril(np.ones((T, S), dtype=bool))
    dead = ~allowed.any(axis=-1)
    assert (weights >= 0).all() and (weights[~allowed] == 0).all()
    assert_same(weights.sum(axis=-1)[~dead], np.ones(int((~dead).sum())))
    assert (weights[dead] == 0).all() and (out[dead] == 0).all() and (dquery[dead] == 0).all()
    # upstream gradient only on the dead rows: nothing reaches key or value
    dout_dead = np.where(dead[..., None], p["dout"], 0.0)
    with no_float_trouble():
        grads_dead = F.attention_backward(dout_dead, cache)
    for grad in grads_dead:
        np.testing.assert_array_equal(grad, 0)
    # and removing the dead rows' upstream gradient changes nothing, bit for bit
    for grad, grad_live in zip((dquery, dkey, dvalue),
                               F.attention_backward(p["dout"] - dout_dead, cache)):
        np.testing.assert_array_equal(grad, grad_live)


def test_multihead_fully_padded_batch_element_gets_no_gradient(impl):
    """Oracle: a batch element whose keys are all padding has zero weights, output
    b_out (0 through the heads, then the output bias) and sends exactly 0 to every
    input and parameter gradient except b_out (which its output row does feed)."""
    rng = np.random.default_rng(3)
    _, mha = layers(impl)
    x = rng.normal(size=(2, 4, 6))
    padding = np.array([[True, True, False, True], [False] * 4])  # True = real token
    dout = np.zeros((2, 4, 6))
    dout[1] = rng.normal(size=(4, 6))  # gradient only on the padded-out element
    with no_float_trouble():
        out, weights = mha.forward(x, key_padding_mask=padding, return_weights=True)
        dx = mha.backward(dout)
    assert weights.shape == (2, 2, 4, 4) and (weights[1] == 0).all()
    np.testing.assert_array_equal(out[1], np.broadcast_to(mha.params["b_out"], (4, 6)))
    np.testing.assert_array_equal(dx, 0)
    for name, grad in mha.grads.items():
        if name == "b_out":
            assert_same(grad, dout.sum(axis=(0, 1)))
        else:
            np.testing.assert_array_equal(grad, 0, err_msg=name)


# ------------------------------------------------------------- invariances


@pytest.mark.parametrize("layer_kind", ["single", "multi"])
def test_causal_future_tokens_do_not_change_the_past(impl, layer_kind):
    """Oracle: under is_causal, outputs 0..t depend on inputs 0..t only, so changing
    later tokens leaves earlier outputs, the gradient of a loss on earlier outputs
    w.r.t. earlier inputs, and every parameter gradient of that loss unchanged."""
    rng = np.random.default_rng(4)
    single, multi = layers(impl)
    layer = single if layer_kind == "single" else multi
    T, t = 6, 3
    x = rng.normal(size=(2, T, 6))
    x_changed = x.copy()
    x_changed[:, t + 1:] = rng.normal(size=(2, T - t - 1, 6)) * 5
    dout = rng.normal(size=(2, T, 6))
    dout[:, t + 1:] = 0  # loss on outputs 0..t only
    results = []
    for inputs in (x, x_changed):
        layer.zero_grad()
        out = layer.forward(inputs, is_causal=True)
        dx = layer.backward(dout)
        results.append((out, dx, {n: g.copy() for n, g in layer.grads.items()}))
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = results
    assert not np.allclose(out_a[:, t + 1:], out_b[:, t + 1:])  # the change is visible later
    assert_same(out_b[:, :t + 1], out_a[:, :t + 1], what="earlier outputs")
    assert_same(dx_b[:, :t + 1], dx_a[:, :t + 1], what="dx of earlier inputs")
    np.testing.assert_array_equal(dx_a[:, t + 1:], 0)  # later inputs do not reach the loss
    for name in grads_a:
        assert_same(grads_b[name], grads_a[name], what=name)


def test_permuting_keys_and_values_together():
    """Oracle: attention sums over keys, an order-free operation: permuting keys,
    values (and the mask's key axis) together leaves the output unchanged,
    dquery unchanged, and permutes dkey and dvalue the same way."""
    rng = np.random.default_rng(5)
    query, key, value = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 6, 4)), rng.normal(size=(2, 6, 5))
    mask = rng.random((3, 6)) < 0.7
    perm = rng.permutation(6)
    dout = rng.normal(size=(2, 3, 5))
    out, cache = F.attention_forward(query, key, value, mask)
    out_p, cache_p = F.attention_forward(query, key[:, perm], value[:, perm], mask[:, perm])
    assert_same(out_p, out)
    assert_same(cache_p.weights, cache.weights[..., perm])
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    dquery_p, dkey_p, dvalue_p = F.attention_backward(dout, cache_p)
    assert_same(dquery_p, dquery)
    assert_same(dkey_p, dkey[:, perm])
    assert_same(dvalue_p, dvalue[:, perm])


@pytest.mark.parametrize("is_causal", [False, True])
def test_float_minus_inf_mask_equals_bool_mask(is_causal):
    """Oracle: a float mask of 0 / -inf and the bool mask True / False remove the
    same keys: same output, weights and gradients (including a fully masked row)."""
    rng = np.random.default_rng(6)
    query, key, value = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 2))
    keep = rng.random((2, 4, 5)) < 0.6
    keep[0, 2] = False
    additive = np.where(keep, 0.0, -np.inf)
    dout = rng.normal(size=(2, 4, 2))
    out_b, cache_b = F.attention_forward(query, key, value, keep, is_causal)
    out_f, cache_f = F.attention_forward(query, key, value, additive, is_causal)
    np.testing.assert_array_equal(out_f, out_b)
    np.testing.assert_array_equal(cache_f.weights, cache_b.weights)
    for grad_f, grad_b in zip(F.attention_backward(dout, cache_f), F.attention_backward(dout, cache_b)):
        np.testing.assert_array_equal(grad_f, grad_b)


def test_constant_added_to_each_score_row_changes_nothing():
    """Oracle: softmax(s + c) = softmax(s) for a constant c per row, so a float
    mask of shape (T, 1) changes neither output nor any gradient."""
    rng = np.random.default_rng(7)
    query, key, value = rng.normal(size=(3, 4, 3)), rng.normal(size=(3, 6, 3)), rng.normal(size=(3, 6, 2))
    row_constant = rng.normal(size=(4, 1)) * 10
    dout = rng.normal(size=(3, 4, 2))
    out, cache = F.attention_forward(query, key, value, is_causal=True)
    out_c, cache_c = F.attention_forward(query, key, value, row_constant, is_causal=True)
    assert_same(out_c, out)
    for grad_c, grad in zip(F.attention_backward(dout, cache_c), F.attention_backward(dout, cache)):
        assert_same(grad_c, grad)


def test_key_bias_gets_zero_gradient(impl):
    """Oracle: b_key adds q . b_key to every score of a query's row, a row constant
    softmax ignores; its gradient is 0 up to rounding (both layers)."""
    rng = np.random.default_rng(8)
    for layer in layers(impl):
        x = rng.normal(size=(2, 5, 6))
        layer.forward(x)
        layer.backward(rng.normal(size=(2, 5, 6)))
        assert np.abs(layer.grads["b_key"]).max() <= 1e-12 * np.abs(layer.grads["b_query"]).max()
        assert np.abs(layer.grads["b_query"]).max() > 1e-3  # the other biases do get gradient


# ------------------------------------------------------------- numerics and dtypes


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_huge_inputs_stay_finite(impl, dtype):
    """Oracle: softmax of huge scores tends to a one-hot row, a finite limit; x * 1e4
    must give finite outputs and gradients (no NaN, no warning) in both layers."""
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(2, 5, 6)) * 1e4).astype(dtype)
    dout = rng.normal(size=(2, 5, 6)).astype(dtype)
    for layer in layers(impl, dtype):
        with no_float_trouble():
            out = layer.forward(x, is_causal=True)
            dx = layer.backward(dout)
        assert out.dtype == dx.dtype == dtype
        assert np.isfinite(out).all() and np.isfinite(dx).all()
        for name, grad in layer.grads.items():
            assert np.isfinite(grad).all(), name


@pytest.mark.parametrize("dtype, factor", [(np.float32, 1e20), (np.float64, 1e200)])
def test_overflowing_scores_stay_finite(dtype, factor):
    """Oracle: scores that overflow to inf still have a one-hot softmax limit; the
    output and dquery, dkey, dvalue must be finite, never NaN (inf - inf)."""
    rng = np.random.default_rng(10)
    query = (rng.normal(size=(2, 4, 3)) * factor).astype(dtype)
    key = (rng.normal(size=(2, 5, 3)) * factor).astype(dtype)
    value = rng.normal(size=(2, 5, 2)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy reports the matmul overflow
        assert not np.isfinite(query @ np.swapaxes(key, -1, -2)).all()  # they do overflow
        out, cache = F.attention_forward(query, key, value, is_causal=True)
        grads = F.attention_backward(rng.normal(size=out.shape).astype(dtype), cache)
    assert out.dtype == dtype and np.isfinite(out).all()
    assert_same(cache.weights.sum(-1), np.ones((2, 4)), dtype)
    for grad in grads:
        assert grad.dtype == dtype and np.isfinite(grad).all()


@pytest.mark.parametrize("in_dtype, compute", [
    (np.float64, np.float64),  # stays
    (np.float32, np.float32),  # stays
    (np.float16, np.float32),  # too short a mantissa for a softmax: computed in float32
    (np.int64, np.float64),    # the seeds' integer example: promoted
    (np.int32, np.float64),
])
def test_sdpa_dtype_rules(in_dtype, compute):
    """Oracle: the documented dtype table; the values equal the float64 result
    of the same (cast) inputs within the compute dtype's rounding."""
    rng = np.random.default_rng(11)
    arrays = [rng.integers(-3, 4, size=s).astype(in_dtype) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3))]
    out, cache = F.attention_forward(*arrays)
    dout = rng.normal(size=out.shape).astype(in_dtype)
    grads = F.attention_backward(dout, cache)
    assert out.dtype == cache.weights.dtype == compute
    assert all(g.dtype == compute for g in grads)
    out64, cache64 = F.attention_forward(*(a.astype(np.float64) for a in arrays))
    grads64 = F.attention_backward(dout.astype(np.float64), cache64)
    assert_same(out, out64, compute)
    for grad, grad64 in zip(grads, grads64):
        assert_same(grad, grad64, compute)


@pytest.mark.parametrize("layer_dtype, compute", [
    (np.float64, np.float64), (np.float32, np.float32), (np.float16, np.float32)])
@pytest.mark.parametrize("x_dtype", [np.float64, np.float32, np.int64])
def test_layer_dtype_rules(impl, layer_dtype, compute, x_dtype):
    """Oracle: a layer computes in its own dtype (float16 -> float32): params, grads,
    output and dx all have it, whatever the input's dtype (integers included)."""
    rng = np.random.default_rng(12)
    x = rng.integers(-2, 3, size=(2, 4, 6)).astype(x_dtype)
    for layer in layers(impl, layer_dtype):
        out = layer.forward(x)
        dx = layer.backward(rng.normal(size=out.shape))
        assert out.dtype == dx.dtype == compute
        assert all(p.dtype == compute for p in layer.params.values())
        assert all(g.dtype == compute for g in layer.grads.values())


def test_unbatched_equals_batch_of_one(impl):
    """Oracle: the leading dims are optional, so (T, E) gives exactly the (1, T, E) result."""
    rng = np.random.default_rng(13)
    x, dout = rng.normal(size=(5, 6)), rng.normal(size=(5, 6))
    query, key, value = rng.normal(size=(4, 3)), rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    out, cache = F.attention_forward(query, key, value, is_causal=True)
    out1, cache1 = F.attention_forward(query[None], key[None], value[None], is_causal=True)
    assert out.shape == (4, 2) and out1.shape == (1, 4, 2)
    assert_same(out1[0], out)
    grads = F.attention_backward(dout[:4, :2], cache)
    for grad, grad1 in zip(grads, F.attention_backward(dout[None, :4, :2], cache1)):
        assert_same(grad1[0], grad)
    for layer in layers(impl):
        out = layer.forward(x, is_causal=True)
        dx = layer.backward(dout)
        grads = {n: g.copy() for n, g in layer.grads.items()}
        layer.zero_grad()
        out1 = layer.forward(x[None], is_causal=True)
        dx1 = layer.backward(dout[None])
        assert out.shape == (5, 6) and out1.shape == (1, 5, 6)
        assert_same(out1[0], out)
        assert_same(dx1[0], dx)
        for name in grads:
            assert_same(layer.grads[name], grads[name], what=name)


def test_return_weights_shapes(impl):
    """Oracle: the documented shapes, (..., T, S) for the core and (..., H, T, S)
    for MultiHeadAttention, with rows summing to 1."""
    rng = np.random.default_rng(14)
    out, weights = qkvnp.scaled_dot_product_attention(
        rng.normal(size=(2, 3, 4, 5)), rng.normal(size=(2, 3, 6, 5)), rng.normal(size=(2, 3, 6, 7)),
        return_weights=True)
    assert out.shape == (2, 3, 4, 7) and weights.shape == (2, 3, 4, 6)
    single, multi = layers(impl, E=6, H=3)
    out, weights = single.forward(rng.normal(size=(2, 5, 6)), return_weights=True)
    assert out.shape == (2, 5, 6) and weights.shape == (2, 5, 5)
    out, weights = multi.forward(rng.normal(size=(2, 4, 6)), rng.normal(size=(2, 7, 6)),
                                 return_weights=True)
    assert out.shape == (2, 4, 6) and weights.shape == (2, 3, 4, 7)
    out, weights = multi.forward(rng.normal(size=(4, 6)), return_weights=True)  # unbatched
    assert out.shape == (4, 6) and weights.shape == (3, 4, 4)
    assert_same(weights.sum(axis=-1), np.ones((3, 4)))


@pytest.mark.parametrize("module", ["functional", "fast", "tiled"])
def test_no_keys_means_attending_to_nothing(module):
    """Definition: with S = 0 every query row is fully masked (no key to attend
    to): output 0 and zero gradients, the same on every path, no warning."""
    import importlib

    path = importlib.import_module("qkvnp.functional" if module == "functional" else f"qkvnp.kernels.{module}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, cache = path.attention_forward(np.ones((2, 3, 2)), np.ones((2, 0, 2)),
                                            np.ones((2, 0, 4)))
        dquery, dkey, dvalue = path.attention_backward(np.ones((2, 3, 4)), cache)
    assert out.shape == (2, 3, 4) and not out.any()
    assert dquery.shape == (2, 3, 2) and not dquery.any()
    assert dkey.shape == (2, 0, 2) and dvalue.shape == (2, 0, 4)
