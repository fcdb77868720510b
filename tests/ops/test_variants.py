"""The attention variants' reference ops: RoPE, score bias, soft-cap, sinks, sliding windows.

Oracles, per test: central differences and the complex step (the gradient
checker), closed forms (a window equals a band mask built by a loop; a huge
soft-cap is no cap; a fully masked row is zero), and PyTorch autograd in
float64 on the same math written in torch ops (``tests/ops/test_variants_torch.py``).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkvnp import functional as F
from qkvnp.gradcheck import check_op
from qkvnp.ops.variants import check_window, window_keep

from strategies import finite_arrays


def draw_inputs(rng, lead=(2, 3), T=4, S=5, D=4, Dv=3, kv_heads=None):
    kv_lead = lead if kv_heads is None else lead[:-1] + (kv_heads,)
    return {"query": rng.standard_normal(lead + (T, D)),
            "key": rng.standard_normal(kv_lead + (S, D)),
            "value": rng.standard_normal(kv_lead + (S, Dv)),
            "score_bias": rng.standard_normal(lead[-1:] + (T, S)),
            "sinks": rng.standard_normal(lead[-1:])}


OPTIONS = [
    {},  # score bias and sinks alone
    {"softcap": 1.5},  # a cap the scores reach
    {"window": (1, 0), "is_causal": True},  # Mistral's window 2
    {"window": (2, 1)},  # a band both sides, no causal mask
    {"window": (None, 1), "is_causal": False},  # unbounded left
    {"window": (1, 0), "is_causal": "bottom_right"},  # decoding's alignment
    {"softcap": 0.7, "window": (2, None), "attn_mask": np.tril(np.ones((4, 5), bool), 1)},
    {"attn_mask": np.where(np.eye(4, 5, dtype=bool), -1.0, 0.5)},  # float mask after the cap
    {"dropout_p": 0.25, "rng": 3, "softcap": 2.0},  # a replayed dropout mask (int seed)
    {"scale": -0.7, "softcap": 1.0},  # negative scale
]


@pytest.mark.parametrize("method", ["central", "complex_step"])
@pytest.mark.parametrize("options", OPTIONS)
def test_variant_attention_gradients_match_numerical_derivatives(options, method):
    inputs = draw_inputs(np.random.default_rng(0))
    report = check_op(F.attention_forward, F.attention_backward, inputs, forward_kwargs=options,
                      method=method)
    assert report.ok, report


@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_grouped_query_variants_gradients(method):
    # 4 query heads over 2 key/value heads; score bias per query head, sinks per query head
    rng = np.random.default_rng(1)
    inputs = draw_inputs(rng, lead=(2, 4), kv_heads=2)
    inputs["score_bias"] = rng.standard_normal((2, 4, 4, 5))
    report = check_op(F.attention_forward, F.attention_backward, inputs, method=method,
                      forward_kwargs={"enable_gqa": True, "softcap": 2.0, "window": (2, 0),
                                      "is_causal": True})
    assert report.ok, report


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_rope_gradients_match_numerical_derivatives(layout, method):
    rng = np.random.default_rng(2)
    inputs = {"x": rng.standard_normal((2, 5, 6))}
    kwargs = {"positions": np.array([3, 0, 7, 1, 2]), "layout": layout, "base": 100.0}
    report = check_op(F.rope_forward, F.rope_backward, inputs, forward_kwargs=kwargs,
                      method=method)
    assert report.ok, report


def test_window_is_the_band_mask_built_by_a_loop():
    rng = np.random.default_rng(3)
    inputs = draw_inputs(rng, T=6, S=9)
    del inputs["score_bias"], inputs["sinks"]
    for window, is_causal in [((2, 0), True), ((1, 3), False), ((0, 0), False),
                              ((3, None), "bottom_right"), ((None, None), False)]:
        T, S = 6, 9
        offset = S - T if is_causal == "bottom_right" else 0
        band = np.zeros((T, S), bool)
        for i in range(T):
            for j in range(S):
                left, right = window
                band[i, j] = ((left is None or j >= i + offset - left)
                              and (right is None or j <= i + offset + right)
                              and (not is_causal or j <= i + offset))
        windowed, cache = F.attention_forward(**inputs, window=window, is_causal=is_causal)
        masked, _ = F.attention_forward(**inputs, attn_mask=band)
        assert windowed.shape == masked.shape
        np.testing.assert_allclose(windowed, masked, rtol=0, atol=1e-15)
        assert np.all(cache.weights[..., ~band] == 0)


def test_huge_softcap_is_no_cap_and_small_one_bounds_the_scores():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    plain, _ = F.attention_forward(q, k, v)
    uncapped, _ = F.attention_forward(q, k, v, softcap=1e8)
    np.testing.assert_allclose(uncapped, plain, rtol=1e-12)
    # closed form: with cap c every score is in [-c, c] and the weights are its softmax
    _, cache = F.attention_forward(q * 100, k, v, softcap=0.5)
    scores = 0.5 * cache.capped
    assert np.all(np.abs(scores) <= 0.5)  # tanh rounds to 1 when saturated
    expected = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    np.testing.assert_allclose(cache.weights, expected, rtol=1e-14)


def test_sinks_closed_form_and_fully_masked_row():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    keep = np.ones((3, 5), bool)
    keep[1] = False  # query 1 sees no key
    out, cache = F.attention_forward(q, k, v, keep, sinks=np.array(0.3))
    scores = q @ k.T / 2.0
    expected = np.exp(scores) / (np.exp(0.3) + np.exp(scores).sum(-1, keepdims=True))
    assert out.shape == (3, 2)
    np.testing.assert_allclose(cache.weights[[0, 2]], expected[[0, 2]], rtol=1e-14)
    assert np.all(cache.weights.sum(-1)[[0, 2]] < 1)  # the sink takes its share
    assert np.all(out[1] == 0) and np.all(cache.weights[1] == 0)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, dbias, dsinks = F.attention_backward(dout, cache)
    assert dbias is None and dsinks.shape == ()
    assert np.all(dq[1] == 0)  # no gradient through the dead row
    # a very negative sink is no sink
    plain, _ = F.attention_forward(q, k, v)
    sunk, _ = F.attention_forward(q, k, v, sinks=np.array(-800.0))
    np.testing.assert_allclose(sunk, plain, rtol=1e-14)


def test_score_bias_gradient_is_summed_to_its_shape():
    rng = np.random.default_rng(6)
    inputs = draw_inputs(rng)
    for shape in [(), (5,), (1, 5), (4, 5), (3, 1, 5), (2, 3, 4, 5)]:
        bias = rng.standard_normal(shape)
        out, cache = F.attention_forward(inputs["query"], inputs["key"], inputs["value"],
                                         score_bias=bias)
        grads = F.attention_backward(rng.standard_normal(out.shape), cache)
        assert grads[3].shape == shape and grads[4] is None


def test_refused_options_name_the_argument():
    q = np.zeros((2, 4))
    with pytest.raises(ValueError, match="right must be 0 or None"):
        F.attention_forward(q, q, q, is_causal=True, window=(2, 1))
    with pytest.raises(ValueError, match="softcap"):
        F.attention_forward(q, q, q, softcap=0.0)
    with pytest.raises(TypeError, match="softcap"):
        F.attention_forward(q, q, q, softcap="30")
    with pytest.raises(TypeError, match="window"):
        F.attention_forward(q, q, q, window=3)
    with pytest.raises(ValueError, match="left side must be >= 0"):
        F.attention_forward(q, q, q, window=(-1, 0))
    with pytest.raises(ValueError, match="score_bias"):
        F.attention_forward(q, q, q, score_bias=np.zeros((3, 2)))
    with pytest.raises(ValueError, match="sinks"):
        F.attention_forward(np.zeros((2, 2, 4)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4)),
                            sinks=np.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        F.attention_forward(q, q, q, sinks=np.array(np.nan))
    with pytest.raises(ValueError, match="D even"):
        F.rope_forward(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="positions"):
        F.rope_forward(np.zeros((2, 4)), np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="layout"):
        F.rope_forward(np.zeros((2, 4)), layout="complex")


def test_rope_scores_depend_only_on_relative_position():
    # closed form: R(a)^T R(b) = R(b - a), so q_m . k_n depends on n - m only
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    for layout in ("half", "interleaved"):
        def score(m, n):
            qm, _ = F.rope_forward(q[None], np.array([m]), layout=layout)
            kn, _ = F.rope_forward(k[None], np.array([n]), layout=layout)
            return float(qm[0] @ kn[0])
        assert abs(score(3, 5) - score(10, 12)) < 1e-12
        assert abs(score(3, 5) - score(5, 3)) > 1e-3  # not symmetric: direction matters


def test_rope_is_a_rotation_and_position_zero_is_identity():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 6))
    out, _ = F.rope_forward(x)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-14)
    np.testing.assert_array_equal(out[:, 0], x[:, 0])


def test_rope_positions_broadcast_per_batch():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 4))
    positions = np.array([[0, 1, 2], [5, 6, 7]])
    out, cache = F.rope_forward(x, positions)
    for b in range(2):
        single, _ = F.rope_forward(x[b], positions[b])
        np.testing.assert_array_equal(out[b], single)
    assert F.rope_backward(rng.standard_normal(out.shape), cache).shape == x.shape


@st.composite
def variant_cases(draw):
    H = draw(st.integers(1, 3))
    T, S, D = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([2, 4]))
    inputs = {"query": draw(finite_arrays((H, T, D))), "key": draw(finite_arrays((H, S, D))),
              "value": draw(finite_arrays((H, S, 2))),
              "score_bias": draw(finite_arrays((H, T, S))), "sinks": draw(finite_arrays((H,)))}
    is_causal = draw(st.sampled_from([False, True, "bottom_right"]))
    left = draw(st.one_of(st.none(), st.integers(0, 3)))
    right = 0 if is_causal else draw(st.one_of(st.none(), st.integers(0, 3)))
    options = {"is_causal": is_causal, "window": draw(st.sampled_from([None, (left, right)])),
               "softcap": draw(st.sampled_from([None, 0.5, 3.0]))}
    return inputs, options


@settings(max_examples=25)
@given(variant_cases(), st.sampled_from(["central", "complex_step"]))
def test_variant_gradients_property(case, method):
    inputs, options = case
    report = check_op(F.attention_forward, F.attention_backward, inputs, forward_kwargs=options,
                      method=method)
    assert report.ok, report


def test_check_window_values():
    assert check_window(None) is None
    assert check_window([4, None]) == (4, None)
    assert window_keep(2, 4, (0, 0), "bottom_right").astype(int).tolist() == [[0, 0, 1, 0],
                                                                             [0, 0, 0, 1]]


# ---------------------------------------------------------------- the tiled core


TILED_OPTIONS = [
    {"window": (3, 0), "is_causal": True},
    {"window": (2, 4)},
    {"window": (5, 0), "is_causal": "bottom_right", "softcap": 1.3},
    {"is_causal": True, "softcap": 0.9},
    {"window": (0, 0)},
    {"window": (4, None), "dropout_p": 0.3, "rng": 5},
    {"attn_mask": np.arange(17) % 3 != 0, "window": (6, 1)},  # a key-padding-like bool mask
    {"attn_mask": np.arange(13)[:, None] != 4, "window": (2, 2)},  # query 4 fully masked
    {"window": (1, 0), "is_causal": True, "attn_mask": np.where(np.eye(13, 17) > 0, -1.5, 0.0)},
]


@pytest.mark.parametrize("options", TILED_OPTIONS)
@pytest.mark.parametrize("block_size", [(4, 5), (13, 3), (1, 17)])
def test_tiled_variants_equal_the_reference(options, block_size):
    # oracle: the reference ops; ALiBi against alibi_bias added as a score bias
    from qkvnp.kernels import tiled_variants
    from qkvnp.ops.positions import alibi_bias, alibi_slopes

    rng = np.random.default_rng(10)
    B, H, T, S = 2, 3, 13, 17
    q, k, v = (rng.standard_normal((B, H, n, d)) for n, d in ((T, 4), (S, 4), (S, 3)))
    bias, sinks = rng.standard_normal((T, S)), rng.standard_normal(H)
    offset = S - T if options.get("is_causal") == "bottom_right" else 0
    alibi = alibi_bias(T, S, alibi_slopes(H), offset)
    out, cache = F.attention_forward(q, k, v, score_bias=bias + alibi, sinks=sinks, **options)
    tiled, tiled_cache = tiled_variants.attention_forward(
        q, k, v, score_bias=bias, alibi_slopes=alibi_slopes(H), sinks=sinks,
        block_size=block_size, **options)
    dout = rng.standard_normal(out.shape)
    expected = F.attention_backward(dout, cache)
    got = tiled_variants.attention_backward(dout, tiled_cache)
    assert tiled.shape == out.shape
    np.testing.assert_allclose(tiled, out, rtol=0, atol=1e-13)
    expected = expected[:3] + (expected[3].sum(axis=0), expected[4])  # (H, T, S) -> (T, S)
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)


def test_tiled_window_visits_only_the_band():
    # closed form: query block [i0, i1) sees keys [i0 - left, i1 - 1] under a causal window
    from qkvnp.kernels.tiled_variants import band_key_range

    for i0 in range(0, 4096, 128):
        lo, hi = band_key_range(i0, i0 + 128, 4096, 0, (255, 0), True)
        assert (lo, hi) == (max(0, i0 - 255), i0 + 128)
    assert band_key_range(0, 4, 10, 6, (1, None), "bottom_right") == (5, 10)
    assert band_key_range(0, 4, 10, 0, (1, 2), False) == (0, 6)
    assert band_key_range(8, 10, 10, 0, (0, 0), False) == (8, 10)


def test_tiled_variants_defer_huge_scores_to_the_reference():
    # oracle: the reference ops, which clip overflowing scores exactly
    from qkvnp.kernels import tiled_variants
    from qkvnp.ops.variants import VariantCache

    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((5, 4)) * 1e154, rng.standard_normal((6, 4)), rng.standard_normal((6, 2))
    with np.errstate(over="ignore"):
        out, cache = tiled_variants.attention_forward(q, k, v, window=(2, 2), sinks=np.array(0.1))
        expected, _ = F.attention_forward(q, k, v, window=(2, 2), sinks=np.array(0.1))
    assert isinstance(cache, VariantCache)
    np.testing.assert_array_equal(out, expected)
    grads = tiled_variants.attention_backward(rng.standard_normal(out.shape), cache)
    assert all(np.isfinite(g).all() for g in grads if g is not None)


@settings(max_examples=30)
@given(variant_cases(), st.integers(1, 4), st.integers(1, 4))
def test_tiled_variants_property(case, block_q, block_k):
    # oracle: the reference ops at the same point, any block sizes, every option drawn
    from qkvnp.kernels import tiled_variants

    inputs, options = case
    out, cache = F.attention_forward(**inputs, **options)
    tiled, tiled_cache = tiled_variants.attention_forward(**inputs, **options,
                                                          block_size=(block_q, block_k))
    assert tiled.shape == out.shape
    np.testing.assert_allclose(tiled, out, rtol=0, atol=1e-12)
    dout = np.random.default_rng(0).standard_normal(out.shape)
    for ours, theirs in zip(tiled_variants.attention_backward(dout, tiled_cache),
                            F.attention_backward(dout, cache)):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-11)


def _grouped_and_repeated(attention_forward, attention_backward, q, k, v, dout, **per_head):
    """The grouped call's outputs and gradients, and the same of the call on k/v repeated G times."""
    G = q.shape[1] // k.shape[1]
    out, cache = attention_forward(q, k, v, enable_gqa=True, **per_head)
    grads = attention_backward(dout, cache)
    k_rep, v_rep = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # (B, K, S, D) -> (B, H, S, D)
    out_rep, cache_rep = attention_forward(q, k_rep, v_rep, **per_head)
    dq, dk, dv, dbias, dsinks = attention_backward(dout, cache_rep)
    B, H, S = k_rep.shape[:3]
    dk, dv = (d.reshape(B, H // G, G, S, -1).sum(axis=2) for d in (dk, dv))  # sum over each group
    return (out,) + tuple(grads), (out_rep, dq, dk, dv, dbias, dsinks)


@pytest.mark.parametrize("path", ["reference", "tiled"])
@pytest.mark.parametrize("sinks", [
    np.array([[3.0], [-3.0]]),  # (B, 1): one sink per batch entry, the case
    np.array([[0.5, -1.0, 2.0, 0.0], [-2.0, 1.5, 0.3, -0.7]]),  # (B, H): per batch and head
    np.array([[[1.0]], [[-1.0]]]),  # (B, 1, 1): the head axis of 1 after a batch axis of 1
])
def test_gqa_per_batch_sinks_reach_their_group(path, sinks):
    """Oracle: the same call with k/v repeated along the head axis (np.repeat), where every
    query head has its own key/value head: outputs, dq, dv, dk summed over each group, dsinks."""
    from qkvnp.kernels import tiled_variants

    ops = {"reference": (F.attention_forward, F.attention_backward),
           "tiled": (tiled_variants.attention_forward, tiled_variants.attention_backward)}[path]
    rng = np.random.default_rng(38)
    q, k, v = rng.standard_normal((2, 4, 3, 4)), rng.standard_normal((2, 2, 3, 4)), \
        rng.standard_normal((2, 2, 3, 4))
    dout = rng.standard_normal((2, 4, 3, 4))
    if sinks.ndim == 3:
        q = q[:, None]  # (B, H, T, D) -> (B, 1, H, T, D): sinks (B, 1, 1) per batch entry
        k, v, dout = k[:, None], v[:, None], dout[:, None]
        sinks = sinks.reshape(2, 1, 1)
        grouped = ops[0](q, k, v, enable_gqa=True, sinks=sinks)
        k_rep, v_rep = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
        repeated = ops[0](q, k_rep, v_rep, sinks=sinks)
        assert grouped[0].shape == repeated[0].shape == (2, 1, 4, 3, 4)
        np.testing.assert_allclose(grouped[0], repeated[0], rtol=0, atol=1e-13)
        dsinks, dsinks_rep = ops[1](dout, grouped[1])[4], ops[1](dout, repeated[1])[4]
        assert dsinks.shape == dsinks_rep.shape == (2, 1, 1)
        np.testing.assert_allclose(dsinks, dsinks_rep, rtol=0, atol=1e-13)
        return
    got, expected = _grouped_and_repeated(*ops, q, k, v, dout, sinks=sinks)
    for name, ours, theirs in zip(("out", "dq", "dk", "dv", "dscore_bias", "dsinks"), got,
                                  expected):
        if theirs is None:
            assert ours is None, name
            continue
        assert ours.shape == theirs.shape, name
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-13, err_msg=name)


def test_gqa_per_batch_alibi_slopes_reach_their_group():
    """Oracle: the tiled call with k/v repeated along the head axis (np.repeat); slopes of
    shape (B, 1) are one slope per batch entry, as sinks of that shape are."""
    from qkvnp.kernels import tiled_variants

    rng = np.random.default_rng(39)
    q, k, v = rng.standard_normal((2, 4, 5, 4)), rng.standard_normal((2, 2, 5, 4)), \
        rng.standard_normal((2, 2, 5, 4))
    slopes = np.array([[2.0], [0.01]])  # (B, 1)
    out, _ = tiled_variants.attention_forward(q, k, v, enable_gqa=True, alibi_slopes=slopes)
    expected, _ = tiled_variants.attention_forward(q, np.repeat(k, 2, axis=1),
                                                   np.repeat(v, 2, axis=1), alibi_slopes=slopes)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-13)
