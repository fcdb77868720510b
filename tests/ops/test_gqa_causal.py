"""Grouped-query attention (``enable_gqa``, ``num_kv_heads``) and bottom-right causal masks.

Oracles, per test: central differences (:mod:`qkvnp.gradcheck`, float64,
rtol 1e-6) on every path; a closed form (GQA equals plain attention on keys
and values repeated ``G`` times along the head axis, and the key/value
gradients equal the repeated ones summed over each group); an explicit mask
(``"bottom_right"`` equals the boolean mask ``j <= i + S - T``); the reference
path for the fast and tiled cores (:data:`oracles.PATH_TOLERANCE`); and
PyTorch's ``F.scaled_dot_product_attention(..., enable_gqa=True)`` and
``causal_lower_right`` for outputs and gradients.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkvnp
from qkvnp import functional as F
from qkvnp.gradcheck import check_layer, check_op
from qkvnp.kernels import fast, tiled

from oracles import assert_matches_reference
from strategies import attention_cases, distinct_pair, finite_arrays, masks

CORES = {"reference": F, "fast": fast, "tiled": tiled}
CAUSAL = [False, True, "bottom_right"]


def core_call(path, **kwargs):
    """The forward of ``path``'s core; tiled with small blocks so that several blocks run."""
    if path == "tiled":
        return lambda *a, **k: tiled.attention_forward(*a, block_size=2, **k, **kwargs)
    return lambda *a, **k: CORES[path].attention_forward(*a, **k, **kwargs)


def assert_gradcheck_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


@st.composite
def gqa_cases(draw):
    """``query (B?, H, T, D)``, ``key``/``value`` ``(B?, K, S, .)`` with K | H, a mask, causal."""
    K, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 3]))
    H = K * G
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1)))
    T, S = draw(distinct_pair(1, 4))
    D, Dv = draw(distinct_pair(1, 3))
    mask_shape = draw(st.sampled_from([(T, S), batch + (H, T, S), batch + (1, T, S)]))
    inputs = {"query": draw(finite_arrays(batch + (H, T, D))),
              "key": draw(finite_arrays(batch + (K, S, D))),
              "value": draw(finite_arrays(batch + (K, S, Dv)))}
    options = {"attn_mask": draw(masks(mask_shape)), "is_causal": draw(st.sampled_from(CAUSAL)),
               "enable_gqa": True}
    return inputs, options


# ---------------------------------------------------------------- bottom-right


@pytest.mark.parametrize("T, S", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_bottom_right_is_the_mask_j_le_i_plus_s_minus_t(T, S):
    # Oracle: an explicit boolean mask; the T - S first rows of T > S see no key (output 0).
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, T, 3)), rng.normal(size=(2, S, 3)), rng.normal(size=(2, S, 2))
    allowed = np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T
    np.testing.assert_array_equal(qkvnp.ops.masks.causal_mask(T, S, bottom_right=True), allowed)
    expected, _ = F.attention_forward(q, k, v, allowed)
    for path in CORES:
        out, _ = core_call(path)(q, k, v, is_causal="bottom_right")
        assert out.shape == expected.shape
        assert_matches_reference(out, expected, "out", path)
    assert np.all(expected[:, :max(T - S, 0)] == 0.0)


@pytest.mark.parametrize("path", CORES)
@given(data=st.data())
def test_bottom_right_gradients(path, data):
    # Oracle: central differences, masks and broadcasting of the shared strategy.
    inputs, options = data.draw(attention_cases(), label="case")
    options["is_causal"] = "bottom_right"
    report = check_op(core_call(path), CORES[path].attention_backward, inputs,
                      forward_kwargs=options)
    assert_gradcheck_ok(report)


def test_tiled_skips_the_dead_blocks_of_a_bottom_right_mask():
    # Oracle: counting by hand. T = 4 queries, S = 8 keys, blocks of 2: query block a
    # (rows 2a, 2a+1) sees keys up to 2a + 1 + 4, so key block b is dead iff 2b > 2a + 5.
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(4, 3)), rng.normal(size=(8, 3)), rng.normal(size=(8, 2))
    _, cache = tiled.attention_forward(q, k, v, is_causal="bottom_right", block_size=2)
    expected = np.array([[b <= a + 2 for b in range(4)] for a in range(2)])
    np.testing.assert_array_equal(cache.live, expected)
    _, cache = tiled.attention_forward(q, k, v, is_causal=True, block_size=2)
    np.testing.assert_array_equal(cache.live, [[1, 0, 0, 0], [1, 1, 0, 0]])


def test_is_causal_values_are_checked():
    # Oracle: the documented values; anything else names the three.
    q = np.ones((2, 3))
    for path in CORES:
        with pytest.raises(TypeError, match='a bool .True: top-left aligned. or "bottom_right"'):
            core_call(path)(q, q, q, is_causal="bottom-right")
    with pytest.raises(TypeError, match="is_causal"):
        qkvnp.MultiHeadAttention(4, 2, rng=0).forward(np.ones((3, 4)), is_causal="top_left")


# ---------------------------------------------------------------- grouped-query attention


@pytest.mark.parametrize("path", CORES)
@given(case=gqa_cases())
def test_gqa_gradients(path, case):
    # Oracle: central differences; K/V broadcast over each group of G query heads.
    inputs, options = case
    report = check_op(core_call(path), CORES[path].attention_backward, inputs,
                      forward_kwargs=options)
    assert [row.name for row in report.rows] == ["query", "key", "value"]
    assert_gradcheck_ok(report)


@pytest.mark.parametrize("path", CORES)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_gqa_is_attention_on_repeated_keys_and_values(path, is_causal):
    # Oracle: the closed form, without qkvnp.ops.gqa: plain attention on K, V repeated G
    # times (np.repeat = torch.repeat_interleave: query head h uses kv head h // G),
    # whose K/V gradients summed over each group are the GQA gradients.
    rng = np.random.default_rng(2)
    B, K, G, T, S = 2, 2, 3, 4, 5
    q, k, v = rng.normal(size=(B, K * G, T, 3)), rng.normal(size=(B, K, S, 3)), rng.normal(size=(B, K, S, 2))
    mask = rng.random((B, K * G, T, S)) > 0.3
    out, cache = core_call(path)(q, k, v, mask, is_causal, enable_gqa=True)
    dout = rng.normal(size=out.shape)
    dq, dk, dv = CORES[path].attention_backward(dout, cache)
    expected, ref_cache = F.attention_forward(q, np.repeat(k, G, axis=1), np.repeat(v, G, axis=1),
                                              mask, is_causal)
    edq, edk, edv = F.attention_backward(dout, ref_cache)
    assert (out.shape, dq.shape, dk.shape, dv.shape) == (expected.shape, q.shape, k.shape, v.shape)
    assert_matches_reference(out, expected, "out", path)
    assert_matches_reference(dq, edq, "dquery", path)
    assert_matches_reference(dk, edk.reshape(B, K, G, S, 3).sum(axis=2), "dkey", path)
    assert_matches_reference(dv, edv.reshape(B, K, G, S, 2).sum(axis=2), "dvalue", path)


def test_gqa_never_repeats_keys_and_values():
    # Oracle: the fast core's cache holds the keys as a view with a zero stride
    # along the group axis (broadcast, not copied G times).
    rng = np.random.default_rng(3)
    q, k = rng.normal(size=(1, 8, 4, 3)), rng.normal(size=(1, 2, 6, 3))
    out, cache = fast.attention_forward(q, k, k, enable_gqa=True)
    assert out.shape == (1, 8, 4, 3)
    assert cache.inner.key.shape == (1, 2, 4, 6, 3) and cache.inner.key.strides[2] == 0
    assert fast.attention_weights(cache).shape == (1, 8, 4, 6)


def test_gqa_needs_enable_gqa_and_a_divisor():
    # Oracle: PyTorch's rules. Mismatched heads without enable_gqa, or a count that
    # does not divide the query's, are refused naming the shapes; one kv head broadcasts.
    q, k = np.ones((8, 3, 4)), np.ones((2, 5, 4))
    for path in CORES:
        call = core_call(path)
        with pytest.raises(ValueError, match="key has 2 heads.*enable_gqa=True"):
            call(q, k, k)
        with pytest.raises(ValueError, match="divide"):
            call(q, np.ones((3, 5, 4)), np.ones((3, 5, 4)), enable_gqa=True)
        with pytest.raises(TypeError, match="enable_gqa must be a bool"):
            call(q, k, k, enable_gqa="yes")
        assert call(q, np.ones((1, 5, 4)), np.ones((1, 5, 4)))[0].shape == (8, 3, 4)  # MQA
    out, weights = qkvnp.scaled_dot_product_attention(q, k, k, enable_gqa=True, return_weights=True)
    assert out.shape == (8, 3, 4) and weights.shape == (8, 3, 5)
    # a value with a batch dim the query and key lack: the weights keep their own dims
    out, weights = qkvnp.scaled_dot_product_attention(q, k, np.ones((3, 2, 5, 4)), enable_gqa=True,
                                                      return_weights=True)
    assert out.shape == (3, 8, 3, 4) and weights.shape == (8, 3, 5)


@pytest.mark.parametrize("path", CORES)
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("T, S", [(4, 6), (6, 4)])
def test_gqa_and_bottom_right_match_torch(torch, path, is_causal, T, S):
    # Oracle: PyTorch's SDPA with enable_gqa=True and causal_lower_right, float64.
    from torch.nn.attention.bias import causal_lower_right

    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(2, 6, T, 4)), rng.normal(size=(2, 2, S, 4)), rng.normal(size=(2, 2, S, 3))
    out, cache = core_call(path)(q, k, v, is_causal=is_causal, enable_gqa=True)
    dout = rng.normal(size=out.shape)
    grads = CORES[path].attention_backward(dout, cache)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    mask = None
    if is_causal == "bottom_right":
        mask = torch.tensor(np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T)
        if T <= S:  # torch's causal_lower_right gives NaN rows for T > S; qkvnp gives 0
            mask = causal_lower_right(T, S)
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=mask, is_causal=is_causal is True, enable_gqa=True)
    expected.backward(torch.tensor(dout))
    dead = np.zeros(T, bool) if is_causal != "bottom_right" else np.arange(T) < T - S
    expected_out = np.where(dead[:, None], 0.0, expected.detach().numpy())  # torch: 0 or NaN
    assert out.shape == expected_out.shape
    np.testing.assert_allclose(out, expected_out, rtol=0, atol=1e-12)
    for name, grad, t in zip(("dquery", "dkey", "dvalue"), grads, (tq, tk, tv)):
        torch_grad = np.nan_to_num(t.grad.numpy())
        assert grad.shape == torch_grad.shape
        np.testing.assert_allclose(grad, torch_grad, rtol=0, atol=1e-12, err_msg=name)


# ---------------------------------------------------------------- the layer: num_kv_heads


@st.composite
def gqa_layer_cases(draw):
    """A ``MultiHeadAttention(E, H, num_kv_heads=K)`` case (G = 1: plain multi-head)."""
    K, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    H = K * G
    D = draw(st.integers(1, 2))
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1)))
    cross = draw(st.booleans())
    T, S = draw(distinct_pair(1, 4)) if cross else (draw(st.integers(1, 4)),) * 2
    inputs = [draw(finite_arrays(batch + (T, H * D)))]
    if cross:
        inputs += [draw(finite_arrays(batch + (S, 3))), draw(finite_arrays(batch + (S, 2)))]
    return {"E": H * D, "H": H, "K": K, "inputs": inputs, "cross": cross,
            "bias": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
            "attn_mask": draw(masks(draw(st.sampled_from([(T, S), batch + (H, T, S)])))),
            "is_causal": draw(st.sampled_from(CAUSAL))}


@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.function_scoped_fixture])
@given(case=gqa_layer_cases())
def test_gqa_layer_gradients(impl, case):
    # Oracle: central differences of every parameter and input, on every path.
    layer = qkvnp.MultiHeadAttention(case["E"], case["H"], bias=case["bias"],
                                     kdim=3 if case["cross"] else None,
                                     vdim=2 if case["cross"] else None,
                                     rng=case["seed"], impl=impl, num_kv_heads=case["K"])
    E_kv = case["K"] * (case["E"] // case["H"])
    assert layer.params["W_key"].shape[1] == layer.params["W_value"].shape[1] == E_kv
    for name, param in layer.params.items():  # biases at a generic point
        if name.startswith("b_"):
            param[...] = np.random.default_rng(case["seed"]).normal(size=param.shape)
    report = check_layer(layer, *case["inputs"], forward_kwargs={
        "attn_mask": case["attn_mask"], "is_causal": case["is_causal"]})
    assert_gradcheck_ok(report)


def torch_gqa_layer(torch, params, x, H, is_causal):
    """The GQA layer in torch autograd: projections, SDPA(enable_gqa=True), out projection."""
    p = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    xt = torch.tensor(x, requires_grad=True)
    B, T, E = x.shape

    def heads(y):
        return y.reshape(B, T, -1, E // H).transpose(1, 2)  # (B, T, n*D) -> (B, n, T, D)

    q = heads(xt @ p["W_query"] + p["b_query"])
    k = heads(xt @ p["W_key"] + p["b_key"])
    v = heads(xt @ p["W_value"] + p["b_value"])
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                         enable_gqa=True)
    out = o.transpose(1, 2).reshape(B, T, E) @ p["W_out"] + p["b_out"]
    return out, xt, p


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_gqa_layer_matches_torch(torch, impl, num_kv_heads):
    # Oracle: the same layer written with torch ops and SDPA(enable_gqa=True), float64.
    rng = np.random.default_rng(5)
    layer = qkvnp.MultiHeadAttention(16, 4, rng=6, impl=impl, num_kv_heads=num_kv_heads)
    for name, param in layer.params.items():
        if name.startswith("b_"):
            param[...] = rng.normal(size=param.shape)
    x = rng.normal(size=(2, 5, 16))
    out = layer.forward(x, is_causal=True)
    dout = rng.normal(size=out.shape)
    dx = layer.backward(dout)
    expected, xt, p = torch_gqa_layer(torch, layer.params, x, 4, is_causal=True)
    expected.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=1e-12)
    for name in layer.params:
        np.testing.assert_allclose(layer.grads[name], p[name].grad.numpy(), rtol=0, atol=1e-12,
                                   err_msg=name)


def test_num_kv_heads_is_checked_and_shown():
    # Oracle: the documented contract (a positive divisor of num_heads, keyword-only).
    with pytest.raises(ValueError, match="num_kv_heads must be a positive divisor of num_heads=4, got 3"):
        qkvnp.MultiHeadAttention(8, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match="num_kv_heads must be an int"):
        qkvnp.MultiHeadAttention(8, 4, num_kv_heads=2.0)
    layer = qkvnp.MultiHeadAttention(8, 4, num_kv_heads=2, bias=True)
    assert "num_kv_heads=2" in repr(layer)
    assert "num_kv_heads" not in repr(qkvnp.MultiHeadAttention(8, 4))
    assert layer.params["W_key"].shape == (8, 4) and layer.params["b_value"].shape == (4,)
    assert layer.num_parameters() == 8 * 8 * 2 + 8 * 4 * 2 + 8 * 2 + 4 * 2


# ---------------------------------------------------------------- with dropout


@pytest.mark.parametrize("path", CORES)
def test_gqa_with_dropout_is_attention_on_repeated_keys_and_values(path):
    # Oracle: the closed form with the same mask: plain reference attention on K, V
    # repeated G times, with the (..., H, T, S) dropout mask the grouped forward drew.
    rng = np.random.default_rng(8)
    B, K, G, T, S = 2, 2, 2, 3, 5
    q, k, v = rng.normal(size=(B, K * G, T, 3)), rng.normal(size=(B, K, S, 3)), rng.normal(size=(B, K, S, 2))
    out, cache = core_call(path)(q, k, v, is_causal="bottom_right", enable_gqa=True,
                                 dropout_p=0.4, rng=5)
    drop = cache.dropout_mask
    assert drop.shape == (B, K * G, T, S) and 0 < drop.mean() < 1
    dout = rng.normal(size=out.shape)
    dq, dk, dv = CORES[path].attention_backward(dout, cache)
    expected, ref_cache = F.attention_forward(q, np.repeat(k, G, axis=1), np.repeat(v, G, axis=1),
                                              is_causal="bottom_right", dropout_p=0.4,
                                              dropout_mask=drop)
    edq, edk, edv = F.attention_backward(dout, ref_cache)
    assert_matches_reference(out, expected, "out", path)
    assert_matches_reference(dq, edq, "dquery", path)
    assert_matches_reference(dk, edk.reshape(B, K, G, S, 3).sum(axis=2), "dkey", path)
    assert_matches_reference(dv, edv.reshape(B, K, G, S, 2).sum(axis=2), "dvalue", path)
    same, _ = F.attention_forward(q, k, v, is_causal="bottom_right", enable_gqa=True,
                                  dropout_p=0.4, rng=5)  # every path draws the same mask
    assert_matches_reference(out, same, "out, same seed", path)


def test_gqa_layer_with_dropout_same_mask_and_gradients_on_every_path():
    # Oracle: the reference layer with the same seed (the same drawn mask on every
    # path), and central differences with the mask held fixed.
    rng = np.random.default_rng(9)
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    results = {}
    for impl in CORES:
        layer = qkvnp.MultiHeadAttention(8, 4, rng=0, impl=impl, dropout=0.3, num_kv_heads=2)
        out = layer.forward(x, is_causal=True, rng=4)
        results[impl] = (out, layer.backward(dout), layer.grads)
        report = check_layer(layer, x, forward_kwargs={"is_causal": True, "rng": 1})
        assert_gradcheck_ok(report)
    for impl in ("fast", "tiled"):
        for name, got, expected in zip(("out", "dx"), results[impl][:2], results["reference"][:2]):
            assert_matches_reference(got, expected, name, impl)
        for name, grad in results[impl][2].items():
            assert_matches_reference(grad, results["reference"][2][name], name, impl)
