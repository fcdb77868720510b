"""Scores whose partial products overflow while the exact score fits the dtype.

Oracles: exact rational arithmetic (``fractions.Fraction``: the exact
score, rounded once to the dtype, or clipped to its largest finite value
when beyond it, the documented clip), closed forms of a one-hot softmax
(the output is the value of the winning key, the gradients of the queries
and keys are 0), and homogeneity (the gradients of the queries and keys are
linear in the values: the reference on values scaled by a power of two,
scaled back).
"""
import contextlib
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp import kernels
from qkvnp.kernels import fast, tiled
from qkvnp.ops.overflow import clip_overflow, product

CORES = {"reference": F, "fast": fast, "tiled": tiled}


@contextlib.contextmanager
def _quiet():
    """numpy may warn of the overflow it met before the product was recomputed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _exact_score(q_row, k_row, scale, dtype):
    """``scale * q . k`` computed exactly, rounded once to ``dtype``, clipped beyond its range."""
    exact = sum((Fraction(float(a)) * Fraction(float(b)) for a, b in zip(q_row, k_row)),
                Fraction(0)) * Fraction(scale)
    big = float(np.finfo(dtype).max)
    try:
        rounded = float(exact)  # float64, correctly rounded
    except OverflowError:
        return big if exact > 0 else -big
    with np.errstate(over="ignore"):
        rounded = float(np.asarray(rounded).astype(dtype))  # a second rounding only in float32
    return math.copysign(big, rounded) if math.isinf(rounded) else rounded


# ---------------------------------------------------------------- the cores


# q = [1e308, 1e308], k_0 = [10, -9]: q . k_0 = 1e308, partial products +-inf
REPRO = {np.float64: 1e308, np.float32: 3e38}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("path", sorted(CORES))
def test_a_finite_score_with_overflowing_partial_products_is_exact_on_every_core(path, dtype):
    """Oracle: the exact score (7.1e307, or 2.1e38 in float32) beats key 1's 0
    by far: the softmax is one-hot on key 0, the output is its value +1 and
    the gradients of the queries and keys are exactly 0."""
    size = REPRO[dtype]
    q = np.array([[size, size]], dtype)
    k = np.array([[10, -9], [0, 0]], dtype)
    v = np.array([[1], [-1]], dtype)
    dout = np.array([[0.37]], dtype)
    assert _exact_score(q[0], k[0], 1 / math.sqrt(2), dtype) < float(np.finfo(dtype).max)
    with _quiet():
        out, cache = CORES[path].attention_forward(q, k, v)
        dq, dk, dv = CORES[path].attention_backward(dout, cache)
    assert out.shape == (1, 1) and out.dtype == dtype
    assert out[0, 0] == 1.0
    np.testing.assert_array_equal(dq, np.zeros_like(q))
    np.testing.assert_array_equal(dk, np.zeros_like(k))
    np.testing.assert_array_equal(dv, np.array([[0.37], [0]], dtype))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("path", sorted(CORES))
def test_scores_beyond_the_range_get_the_documented_clip_and_the_rest_stay_exact(path, dtype):
    """Oracle, the documented clip: keys 0 and 1 have exact scores beyond the
    dtype's range (21 and 31 times the input size), each clipped to its
    largest finite value, so they tie and share the weight; key 2's exact
    score is beyond -max (weight 0); key 3's score is 0. The output is the
    mean of values 0 and 1. Each score's partial products are +-inf."""
    size = REPRO[dtype]
    q = np.array([[size, size]], dtype)
    k = np.array([[30, -9], [40, -9], [-30, 9], [0, 0]], dtype)
    v = np.array([[2.0], [4.0], [100.0], [-50.0]], dtype)
    with _quiet():
        out, _ = CORES[path].attention_forward(q, k, v)
    assert out.shape == (1, 1)
    assert out[0, 0] == 3.0


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_product_is_exact_where_the_result_fits_and_inf_beyond(dtype):
    """Oracle: exact rational products, per entry, against random magnitudes
    around the float maximum (the clip off: +-inf beyond the range)."""
    rng = np.random.default_rng(3)
    big = float(np.finfo(dtype).max)
    a = (rng.uniform(-1, 1, (4, 3)) * big).astype(dtype)
    b = rng.uniform(-8, 8, (3, 5)).astype(dtype)
    b[:, 0] = [8, -8, 1]  # column 0 cancels its way back below the maximum
    a[0] = [big / 2, big / 2, 0]
    with _quiet():
        got = product(a, b, 0.5)
    assert got.shape == (4, 5) and got.dtype == dtype
    for m in range(4):
        for n in range(5):
            want = _exact_score(a[m], b[:, n], 0.5, dtype)
            if abs(want) == big and not np.isfinite(got[m, n]):
                continue  # beyond the range: inf, which the clip maps to +-max
            np.testing.assert_allclose(got[m, n], want, rtol=4 * np.finfo(dtype).eps,
                                       err_msg=f"entry {(m, n)}")
    assert np.isfinite(got[0, 0]) and got[0, 0] == 0.0  # (big/2)(8) + (big/2)(-8) = 0


def test_nan_is_never_turned_into_a_finite_score():
    """Oracle: NaN propagates through a product, so the scores of a NaN query
    row are NaN, and so is that row's output (the public checks refuse NaN;
    ``check=False`` is the composites' door, which skips them)."""
    assert np.isnan(clip_overflow(np.array([np.nan, np.inf]))[0])
    q = np.array([[np.nan, 1.0], [1.0, 1.0]])
    k = v = np.ones((2, 2))
    with _quiet():
        out, _ = F.attention_forward(q, k, v, check=False)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    for path in sorted(CORES):
        with pytest.raises(ValueError, match="query contains NaN or inf"):
            CORES[path].attention_forward(q, k, v)


@pytest.mark.parametrize("path", sorted(CORES))
def test_gradients_stay_exact_when_products_with_huge_values_overflow(path):
    """Oracle: homogeneity. The gradients of the queries and keys are linear in
    the values and those of the values do not depend on them, so the
    reference on values scaled by 2**-8 (where nothing overflows), scaled
    back, gives them. Here ``dout . v`` has partial products beyond the
    maximum while its exact value is a few units of 1e307."""
    rng = np.random.default_rng(7)
    T, S = 3, 4
    q, k = rng.normal(size=(T, 2)), rng.normal(size=(S, 2))
    a = rng.uniform(0.5, 0.9, S)
    v = 1e308 * np.stack([a, -a + rng.uniform(-0.05, 0.05, S)], axis=-1)  # (S, 2)
    r = rng.uniform(2.5, 3.5, T)
    dout = np.stack([r, r + rng.uniform(-0.1, 0.1, T)], axis=-1)  # (T, 2): r a_s 1e308 overflows
    with _quiet():
        out, cache = CORES[path].attention_forward(q, k, v)
        got = CORES[path].attention_backward(dout, cache)
    out_scaled, cache_scaled = F.attention_forward(q, k, v * 2.0 ** -8)
    dq, dk, dv = F.attention_backward(dout, cache_scaled)
    want = (dq * 2.0 ** 8, dk * 2.0 ** 8, dv)
    np.testing.assert_allclose(out, out_scaled * 2.0 ** 8, rtol=1e-12)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape
        assert np.isfinite(g).all(), f"{path} {name} not finite"
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12 * np.abs(w).max(),
                                   err_msg=f"{path} {name}")


# ---------------------------------------------------------------- the layers


def _identity_cross_layer(impl, dtype):
    """MultiHeadAttention(2, 1) with every projection the identity: the cores' inputs."""
    layer = qkvnp.MultiHeadAttention(2, 1, bias=False, rng=0, dtype=dtype, impl=impl)
    layer.load_state_dict({name: np.eye(2) for name in layer.state_dict()})
    return layer


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_a_layer_is_exact_when_partial_products_of_a_finite_score_overflow(impl, dtype):
    """Oracle: the one-hot closed form of the cores' test, through identity
    projections: the output is key 0's value ``[1, 0]``."""
    size = REPRO[dtype]
    layer = _identity_cross_layer(impl, dtype)
    query = np.array([[[size, size]]], dtype)
    key = np.array([[[10, -9], [0, 0]]], dtype)
    value = np.array([[[1, 0], [-1, 0]]], dtype)
    with _quiet():
        out = layer.forward(query, key, value)
        dquery, dkey, dvalue = layer.backward(np.array([[[0.3, -0.2]]], dtype))
    assert out.shape == (1, 1, 2)
    np.testing.assert_array_equal(out, np.array([[[1, 0]]], dtype))
    np.testing.assert_array_equal(dquery, np.zeros_like(query))
    np.testing.assert_array_equal(dkey, np.zeros_like(key))


def _huge_layer(make, seed=0):
    """A layer whose queries and keys are ~1e154 for inputs ~1e160: scores near 1e308."""
    layer = make()
    for name in ("W_query", "W_key"):
        layer.params[name] *= 2.0 ** -20
    x = np.random.default_rng(seed).normal(size=(2, 5, 8)) * 1e160
    return layer, x


def _layer_oracle(layer, x, causal=False):
    """The layer's output with exact scores: exact projections, exact scores (Fractions)."""
    to_fractions = np.vectorize(lambda a: Fraction(float(a)), otypes=[object])
    x_exact = to_fractions(x)
    q, k, v = (x_exact @ to_fractions(layer.params["W_" + name]) for name in ("query", "key", "value"))
    H = getattr(layer, "num_heads", 1)
    D = q.shape[-1] // H
    rounded = np.vectorize(float, otypes=[np.float64])
    out = np.empty(x.shape[:-1] + (q.shape[-1],))
    for b in range(x.shape[0]):
        for h in range(H):
            heads = slice(h * D, (h + 1) * D)
            # scores exact from exact projections: _exact_score takes floats, so the
            # dot product is done here in Fractions and rounded (or clipped) once
            out[b, :, heads] = _attention_of_exact(q[b, :, heads], k[b, :, heads],
                                                   rounded(v[b, :, heads]), 1 / math.sqrt(D),
                                                   causal)
    if "W_out" in layer.params:
        out = out @ layer.params["W_out"]
    return out


def _attention_of_exact(q, k, v, scale, causal):
    """``softmax(scale q k^T) v`` with ``q, k`` of Fractions: each score rounded once, clipped."""
    big = float(np.finfo(np.float64).max)
    T, S = q.shape[0], k.shape[0]
    scores = np.empty((T, S))
    for t in range(T):
        for s in range(S):
            exact = sum(q[t] * k[s], Fraction(0)) * Fraction(scale)
            try:
                scores[t, s] = float(exact)
            except OverflowError:
                scores[t, s] = big if exact > 0 else -big
    if causal:
        scores[np.arange(S)[None, :] > np.arange(T)[:, None] + S - T] = -np.inf
    with np.errstate(over="ignore"):  # -max - max -> -inf: weight 0
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


LAYERS = {
    "mha": lambda impl: qkvnp.MultiHeadAttention(8, 2, bias=False, rng=0, impl=impl),
    "self": lambda impl: qkvnp.SelfAttention(8, 8, rng=0, impl=impl),
}


@pytest.mark.parametrize("layer_name", sorted(LAYERS))
@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_layers_with_inputs_near_1e160_match_exact_scores(impl, layer_name):
    """Oracle: :func:`_layer_oracle` (exact projections and scores, each score
    rounded once or clipped). At these sizes scores run from ~1e300 to beyond
    the maximum, and many a finite one has partial products beyond it."""
    layer, x = _huge_layer(lambda: LAYERS[layer_name](impl))
    want = _layer_oracle(layer, x)
    with _quiet():
        got = layer.forward(x)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("layer_name", sorted(LAYERS))
@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_kv_cache_decoding_near_1e160_equals_the_full_causal_forward(impl, layer_name):
    """Oracle: :func:`_layer_oracle` under the causal mask, which both the
    token-by-token decoding and the full causal forward must give."""
    layer, x = _huge_layer(lambda: LAYERS[layer_name](impl), seed=1)
    want = _layer_oracle(layer, x, causal=True)
    cache = qkvnp.KVCache()
    with _quiet():
        full = layer.forward(x, is_causal=True)
        steps = np.concatenate([layer.forward(x[:, t:t + 1], kv_cache=cache)
                                for t in range(x.shape[1])], axis=1)
    scale = np.abs(want).max()
    assert steps.shape == full.shape == want.shape
    np.testing.assert_allclose(full, want, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(steps, want, rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_a_layer_with_values_near_the_float_maximum_is_exact(impl):
    """Oracle: homogeneity in ``W_value``. SelfAttention's output is linear in
    ``W_value``, so the reference layer with ``W_value`` scaled by 2**-8,
    scaled back, gives it. The positive values reach ~1e308 and the scores
    are equal: the fast cores' unnormalised sums of the values overflow,
    so the calls go to the reference, and the dispatch says why. (The
    backward is left out: its input gradient ``dv W_value^T`` is itself
    near the float maximum here.)"""
    rng = np.random.default_rng(11)
    x = rng.uniform(0.5, 1.0, size=(2, 5, 8))
    layer = qkvnp.SelfAttention(8, 8, rng=0, impl=impl)
    layer.params["W_query"][...] = 0.0  # equal scores: each output is the mean of the values
    layer.params["W_value"] = np.abs(layer.params["W_value"]) * 3e307  # positive values
    oracle = qkvnp.SelfAttention(8, 8, rng=0, impl="reference")
    oracle.load_state_dict({**layer.state_dict(), "W_value": layer.params["W_value"] * 2.0 ** -8})
    with _quiet():
        out = layer.forward(x)
    want = oracle.forward(x) * 2.0 ** 8
    assert out.shape == want.shape
    assert np.abs(want).max() > float(np.finfo(np.float64).max) / 5  # a sum of 5 overflows
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    if impl != "reference":
        assert layer.last_dispatch.path == "reference"
        assert "values reach" in layer.last_dispatch.reason


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled", "auto"])
@pytest.mark.parametrize("options", [{}, {"rope": True}, {"window": (1, 0)}],
                         ids=["plain", "rope", "window"])
def test_a_projection_that_overflows_is_refused_as_such(impl, options):
    """Oracle: x = 1.5e308 and weights of ones make x @ W = 4 x = inf while x and
    W are finite: the error names the projection, not a "query" or RoPE "x"
    the user never passed; a key or value input alone overflowing names its
    projection; a decoding step says the same and leaves its cache empty."""
    x = np.full((1, 3, 4), 1.5e308)
    small = np.ones((1, 3, 4))
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl, **options)
    for role in ("query", "key", "value"):
        layer.params["W_" + role][...] = 1.0
    with _quiet():
        with pytest.raises(ValueError, match="the query projection overflowed: x @ W_query"):
            layer.forward(x, is_causal=True)
        with pytest.raises(ValueError, match="the key projection overflowed"):
            layer.forward(small, x, small)
        cache = qkvnp.KVCache()
        with pytest.raises(ValueError, match="the query projection overflowed"):
            layer.forward(x, kv_cache=cache)
        assert len(cache) == 0 and cache.key is None
        with pytest.raises(ValueError, match="the value projection overflowed"):
            layer.forward(small, small, x)
        single = qkvnp.SelfAttention(4, 4, rng=0, impl=impl, **options)
        single.params["W_query"][...] = 1.0
        with pytest.raises(ValueError, match="the query projection overflowed"):
            single.forward(x)


# ---------------------------------------------------------------- the variant path


def _variant_ops():
    from qkvnp.kernels import tiled_variants

    return {"reference": (F.attention_forward, F.attention_backward),
            "tiled": (tiled_variants.attention_forward, tiled_variants.attention_backward)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("path", ["reference", "tiled"])
@pytest.mark.parametrize("variant", [
    {"window": (None, None)},  # unbounded: no variant at all, oracle the plain path
    {"sinks": np.array(-50.0)},  # a sink far below the winner: the plain path's one-hot
    {"softcap": 3.0},  # exact scores capped: closed form softmax([3, 0])
])
def test_variant_path_keeps_exact_scores_when_partial_products_overflow(path, dtype, variant):
    """Oracle: the plain path on the same inputs (q . k_0 = 7.1e307 exactly, partial products
    +-inf; the output is key 0's value 1.0, dq = dk = 0) where the variant changes nothing at
    this point; with a soft-cap, the exact scores capped, softmax([3, 0]): out = tanh(3 / 2)."""
    size = REPRO[dtype]
    q = np.array([[size, size]], dtype)
    k = np.array([[10, -9], [0, 0]], dtype)
    v = np.array([[1], [-1]], dtype)
    dout = np.array([[0.37]], dtype)
    forward, backward = _variant_ops()[path]
    with _quiet():
        out, cache = forward(q, k, v, **variant)
        grads = backward(dout, cache)
        plain, plain_cache = F.attention_forward(q, k, v)
        plain_grads = F.attention_backward(dout, plain_cache)
    assert out.shape == (1, 1) and out.dtype == dtype
    assert all(np.isfinite(g).all() for g in grads if g is not None)
    if "softcap" in variant:
        np.testing.assert_allclose(out, [[math.tanh(1.5)]], rtol=1e-6 if dtype == np.float32 else 1e-15)
        np.testing.assert_array_equal(grads[0], np.zeros_like(q))  # tanh' = 0 at key 0, k_1 = 0
        return
    np.testing.assert_array_equal(out, plain)
    for ours, theirs in zip(grads[:3], plain_grads):
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("path", ["reference", "tiled"])
@pytest.mark.parametrize("variant", [{}, {"window": (1, 1)}, {"softcap": 1e30}])
def test_an_overflowing_score_bias_is_treated_as_a_float_mask(path, dtype, variant):
    """Oracle: the same values passed as attn_mask to the plain path (a sum beyond the float
    maximum is clipped to it): score 0.6 max + bias 0.6 max on key 0 wins, the output is
    key 0's value 1.0 (NaN before), and dq, dk, dv equal the mask call's; dscore_bias is the
    one-hot softmax's, 0. The window covers both keys and the soft-cap keeps key 0 ahead."""
    big = float(np.finfo(dtype).max)
    q = np.array([[1, 0]], dtype)
    k = np.array([[0.6 * big * math.sqrt(2), 0], [0, 0]], dtype)  # scores (0.6 max, 0)
    v = np.array([[1], [-1]], dtype)
    bias = np.array([[0.6 * big, 0]], dtype)
    dout = np.array([[0.37]], dtype)
    forward, backward = _variant_ops()[path]
    with _quiet():
        out, cache = forward(q, k, v, score_bias=bias, **variant)
        grads = backward(dout, cache)
        masked, masked_cache = F.attention_forward(q, k, v, attn_mask=bias)  # the plain path
        masked_grads = F.attention_backward(dout, masked_cache)
    assert out.shape == (1, 1)
    np.testing.assert_array_equal(masked, [[1]])
    np.testing.assert_array_equal(out, masked)
    for ours, theirs in zip(grads[:3], masked_grads[:3]):
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(grads[3], np.zeros_like(bias))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("variant", [{"window": (None, None)}, {"softcap": 3.0},
                                     {"rope": True}], ids=["window", "softcap", "rope"])
def test_a_variant_layer_is_exact_when_partial_products_of_a_finite_score_overflow(
        impl, dtype, variant):
    """Oracle: the plain layer's closed form through identity projections (key 0's value
    [1, 0], dquery = dkey = 0); with a soft-cap, softmax([3, 0]): out = [tanh(3 / 2), 0]. RoPE
    at positions 0 turns nothing (query 0, key 0; key 1 is 0)."""
    size = REPRO[dtype]
    layer = qkvnp.MultiHeadAttention(2, 1, bias=False, rng=0, dtype=dtype, impl=impl, **variant)
    for name in ("W_query", "W_key", "W_value", "W_out"):
        layer.params[name] = np.eye(2, dtype=dtype)
    query = np.array([[[size, size]]], dtype)
    key = np.array([[[10, -9], [0, 0]]], dtype)
    value = np.array([[[1, 0], [-1, 0]]], dtype)
    with _quiet():
        out = layer.forward(query, key, value)
        dquery, dkey, dvalue = layer.backward(np.array([[[0.3, -0.2]]], dtype))
    assert out.shape == (1, 1, 2)
    expected = math.tanh(1.5) if "softcap" in variant else 1.0
    np.testing.assert_allclose(out, np.array([[[expected, 0]]], dtype),
                               rtol=1e-6 if dtype == np.float32 else 1e-15)
    np.testing.assert_array_equal(dquery, np.zeros_like(query))
    if "softcap" not in variant:
        np.testing.assert_array_equal(dkey, np.zeros_like(key))
    assert np.isfinite(dkey).all() and np.isfinite(dvalue).all()


@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_a_layers_overflowing_relative_bias_is_treated_as_a_float_mask(impl):
    """Oracle: the plain op with the layer's bias (rel_bias read at the buckets) as attn_mask,
    through identity projections: outputs and dquery, dkey, dvalue equal; rel_bias's gradient
    is the one-hot softmax's, 0."""
    big = float(np.finfo(np.float64).max)
    layer = qkvnp.MultiHeadAttention(2, 1, bias=False, rng=0, impl=impl,
                                     position_bias="relative", num_buckets=4, max_distance=4)
    for name in ("W_query", "W_key", "W_value", "W_out"):
        layer.params[name] = np.eye(2)
    layer.params["rel_bias"][0, 0] = 0.6 * big  # bucket 0: j - i = 0, key 0 for query 0
    query = np.array([[[1.0, 0]]])
    key = np.array([[[0.6 * big * math.sqrt(2), 0], [0, 0]]])
    value = np.array([[[1.0, 0], [-1, 0]]])
    dout = np.array([[[0.3, -0.2]]])
    mask = np.array([[0.6 * big, 0]])
    with _quiet():
        out = layer.forward(query, key, value)
        grads = layer.backward(dout)
        expected, cache = F.attention_forward(query, key, value, attn_mask=mask)
        expected_grads = F.attention_backward(dout, cache)
    assert out.shape == (1, 1, 2)
    np.testing.assert_array_equal(out, expected)
    for ours, theirs in zip(grads, expected_grads):
        np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(layer.grads["rel_bias"], np.zeros((4, 1)))
