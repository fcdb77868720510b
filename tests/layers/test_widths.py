"""MultiHeadAttention with qdim, out_dim, qkv_bias and out_bias (the book's layer).

Oracles: central differences (:func:`qkvnp.gradcheck.check_layer`, float64,
random upstream gradients) on every path; the reference path for the fast
and tiled ones (:func:`oracles.assert_matches_reference`); the scores
themselves for :func:`qkvnp.kernels.mha.projected_score_bound`; the seeded draws of a
layer built before these options existed (same order, same values).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkvnp import MultiHeadAttention
from qkvnp.gradcheck import check_layer
from qkvnp.kernels.mha import projected_score_bound

from oracles import assert_matches_reference
from strategies import finite_arrays, mha_cases

# (E, H, qdim, kdim, vdim, out_dim, qkv_bias, out_bias, kind)
CASES = [
    (2, 2, 3, 3, 3, 2, False, True, "self"),  # the book's chapter 3 layer
    (4, 2, 3, 3, 3, 5, True, False, "self"),  # input biases without an output bias
    (6, 3, 2, 5, 4, 3, False, False, "cross"),  # every width different, no biases
    (4, 1, 5, 3, 3, 7, True, True, "key_only"),  # value = key
]


def make_inputs(case, seed=0):
    E, H, qdim, kdim, vdim, out_dim, qkv_bias, out_bias, kind = case
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((2, 4, qdim))
    key, value = rng.standard_normal((2, 5, kdim)), rng.standard_normal((2, 5, vdim))
    return {"self": (query,), "key_only": (query, key), "cross": (query, key, value)}[kind]


def make_layer(case, impl):
    E, H, qdim, kdim, vdim, out_dim, qkv_bias, out_bias, _ = case
    layer = MultiHeadAttention(E, H, qdim=qdim, kdim=kdim, vdim=vdim, out_dim=out_dim,
                               qkv_bias=qkv_bias, out_bias=out_bias, rng=1, impl=impl)
    rng = np.random.default_rng(2)
    for name, value in layer.params.items():
        if name.startswith("b_"):
            value[...] = rng.standard_normal(value.shape)  # nonzero biases
    return layer


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_central_differences_on_every_path(impl, case):
    layer = make_layer(case, impl)
    inputs = make_inputs(case)
    E, _, qdim, kdim, vdim, out_dim, qkv_bias, out_bias, kind = case
    assert layer.forward(*inputs).shape == (2, 4, out_dim)
    expected = {"W_query": (qdim, E), "W_key": (kdim, E), "W_value": (vdim, E),
                "W_out": (E, out_dim)}
    expected.update({f"b_{r}": (E,) for r in ("query", "key", "value") if qkv_bias})
    expected.update({"b_out": (out_dim,)} if out_bias else {})
    assert {name: value.shape for name, value in layer.params.items()} == expected
    report = check_layer(layer, *inputs, forward_kwargs={"is_causal": True})
    assert report.ok, "\n" + report.table()


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gradients_with_drawn_widths_and_biases(impl, data):
    """Oracle: central differences, on mha_cases' masks and kinds with drawn
    qdim, out_dim, qkv_bias and out_bias (self-attention: qdim = kdim = vdim)."""
    case = data.draw(mha_cases(), label="case")
    qdim, out_dim = data.draw(st.integers(1, 6), "qdim"), data.draw(st.integers(1, 6), "out_dim")
    inputs = list(case["inputs"])
    inputs[0] = data.draw(finite_arrays(inputs[0].shape[:-1] + (qdim,)), "query")
    kdim, vdim = case["kdim"], case["vdim"]
    if case["kind"] == "self":
        kdim = vdim = qdim
    layer = MultiHeadAttention(case["embed_dim"], case["num_heads"], kdim=kdim, vdim=vdim,
                               qdim=qdim, out_dim=out_dim, qkv_bias=data.draw(st.booleans()),
                               out_bias=data.draw(st.booleans()), rng=case["seed"], impl=impl)
    forward_kwargs = {name: case[name] for name in ("attn_mask", "is_causal", "key_padding_mask")}
    report = check_layer(layer, *inputs, forward_kwargs=forward_kwargs)
    assert report.ok, "\n" + report.table()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["fast", "tiled"])
def test_fused_paths_match_the_reference(case, path):
    reference, other = make_layer(case, "reference"), make_layer(case, path)
    inputs = make_inputs(case, seed=3)
    dout = np.random.default_rng(4).standard_normal((2, 4, case[5]))
    expected = reference.forward(*inputs, is_causal=True)
    assert_matches_reference(other.forward(*inputs, is_causal=True), expected, "out", path)
    assert other.last_dispatch.path == path
    dexpected, dactual = reference.backward(dout), other.backward(dout)
    if case[-1] == "self":  # one input, one gradient
        dexpected, dactual = (dexpected,), (dactual,)
    for i, (a, b) in enumerate(zip(dactual, dexpected)):
        if b is not None:
            assert_matches_reference(a, b, f"dinput {i}", path)
    for name, grad in reference.grads.items():
        assert_matches_reference(other.grads[name], grad, name, path)


@pytest.mark.parametrize("case", CASES)
def test_score_bound_bounds_the_scores_with_other_widths(case):
    """Oracle: the scores computed from the projections, per head."""
    layer = make_layer(case, "reference")
    inputs = make_inputs(case, seed=5)
    p, E, H = layer.params, layer.embed_dim, layer.num_heads
    query, key = inputs[0], inputs[1] if len(inputs) > 1 else inputs[0]
    q = (query @ p["W_query"] + p.get("b_query", 0)) / np.sqrt(E // H)  # (2, 4, E), scaled
    k = key @ p["W_key"] + p.get("b_key", 0)  # (2, S, E)
    bound = projected_score_bound(q.reshape(-1, E), k.reshape(-1, E), E // H)
    scores = np.einsum("bthd,bshd->bhts", q.reshape(2, 4, H, E // H), k.reshape(2, -1, H, E // H))
    assert np.abs(scores).max() <= bound


def test_self_attention_needs_equal_input_widths_not_embed_dim():
    layer = MultiHeadAttention(4, 2, qdim=3, kdim=3, vdim=3, rng=0)  # 3 != E = 4 is fine
    assert layer.forward(np.ones((6, 3))).shape == (6, 4)
    with pytest.raises(ValueError, match="needs qdim == kdim == vdim, got qdim=3, kdim=4, vdim=4"):
        MultiHeadAttention(4, 2, qdim=3, rng=0).forward(np.ones((6, 3)))
    with pytest.raises(ValueError, match=r"query.*\(\.\.\., T, 3\)"):
        layer.forward(np.ones((6, 4)))
    with pytest.raises(ValueError, match="qdim"):
        MultiHeadAttention(4, 2, qdim=0)
    with pytest.raises(TypeError):
        MultiHeadAttention(4, 2, True, None, None, None, np.float64, "auto", 3)  # keyword-only


def test_defaults_draw_the_same_weights_and_print_as_before():
    """Oracle: the draws of the constructor before qdim/out_dim, in its order."""
    layer = MultiHeadAttention(8, 2, rng=0)
    rng = np.random.default_rng(0)
    bound = np.sqrt(6.0 / 16)
    for name in ("W_query", "W_key", "W_value", "W_out"):
        assert np.array_equal(layer.params[name], rng.uniform(-bound, bound, size=(8, 8))), name
    assert repr(layer) == "MultiHeadAttention(embed_dim=8, num_heads=2, bias=True, dtype=float64, impl='auto')"
    book = MultiHeadAttention(2, 2, qdim=3, kdim=3, vdim=3, qkv_bias=False, out_bias=True)
    assert repr(book) == ("MultiHeadAttention(embed_dim=2, num_heads=2, bias=True, kdim=3, vdim=3, "
                          "dtype=float64, impl='auto', qdim=3, qkv_bias=False)")
