"""Every hand-derived gradient of qkvnp against central differences (issue 2).

Oracle: central differences of ``<dout, f(x)>`` with a random upstream
gradient ``dout`` (never all ones), computed by :mod:`qkvnp.gradcheck` in
float64; every analytic gradient (each input of each functional op, each
param and input of both layers) must match to a relative error <= 1e-6
(``TOLERANCES[float64]``, absolute floor 1e-3 for entries near zero).
Shapes, masks and options are drawn by the hypothesis strategies of
``tests/strategies.py``.

Exact zeros are asserted with ``== 0.0``, not a tolerance, for every
gradient through a fully masked query row (its weights are exactly 0). The
gradient of ``b_key`` is 0 in exact arithmetic (softmax ignores the constant
``q . b_key`` added to a row) but is computed as a sum whose terms cancel, so
it is asserted to be round-off: at most 1e-12 of ``b_query``'s gradient.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from qkvnp import MultiHeadAttention, SelfAttention
from qkvnp import functional as F
from qkvnp.gradcheck import TOLERANCES, check_function, check_layer, check_op

from strategies import (
    MASK_KINDS,
    attention_cases,
    head_cases,
    linear_cases,
    mha_cases,
    self_attention_cases,
    softmax_cases,
)

# The `impl` fixture only names an implementation: safe to share across examples.
fixture_ok = settings(suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.function_scoped_fixture])


def assert_round_off_zero(grad, reference):
    """``grad`` is 0 up to round-off relative to a same-layer ``reference`` gradient."""
    bound = 1e-12 * max(1.0, float(np.abs(reference).max()))
    assert np.abs(grad).max() <= bound, (np.abs(grad).max(), bound)


def assert_gradients_ok(report):
    """The report certifies float64 gradients to rtol <= 1e-6; else print its table."""
    assert report.dtype == np.float64
    assert report.rtol <= 1e-6
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


def test_default_float64_tolerance_certifies_1e_6():
    # The oracle of every test below is only as strict as this table entry.
    assert TOLERANCES[np.dtype(np.float64)]["central"].rtol <= 1e-6


def dead_rows(attn_mask, is_causal, shape):
    """Bool ``shape[:-1]``: query rows with no key left, computed from the masks alone."""
    keep = np.ones(shape, dtype=bool)
    if attn_mask is not None:
        keep &= (attn_mask if attn_mask.dtype == np.bool_ else attn_mask != -np.inf)
    if is_causal:
        keep &= np.tril(np.ones(shape[-2:], dtype=bool))
    return ~keep.any(axis=-1)


def mask_events(attn_mask, is_causal, scores_shape):
    """Label the example (``--hypothesis-show-statistics``): mask kind, dead rows."""
    kind = "none" if attn_mask is None else attn_mask.dtype.name
    event(f"attn_mask {kind}{', causal' if is_causal else ''}")
    if dead_rows(attn_mask, is_causal, scores_shape).any():
        event("some query row fully masked")


def randomize_biases(layer, seed):
    """Move the (zero-initialised) biases to a generic point, so their paths matter."""
    rng = np.random.default_rng(seed)
    for name, param in layer.params.items():
        if name.startswith("b_"):
            param[...] = rng.normal(size=param.shape)


# ---------------------------------------------------------------- functional ops


@given(linear_cases())
def test_linear_gradients(inputs):
    # x @ W + b with and without bias (then backward returns db=None), any leading dims.
    report = check_op(F.linear_forward, F.linear_backward, inputs)
    assert [row.name for row in report.rows] == list(inputs)
    assert_gradients_ok(report)


@given(softmax_cases())
def test_softmax_gradients_on_any_axis_with_fully_masked_lines(case):
    scores, keep, axis = case

    def forward(scores):
        masked = scores if keep is None else np.where(keep, scores, -np.inf)
        return F.softmax_forward(masked, axis=axis)

    report = check_function(lambda scores: forward(scores)[0], {"scores": scores},
                            lambda dout, scores: {"scores": F.softmax_backward(dout, forward(scores)[1])})
    assert_gradients_ok(report)
    if keep is not None:
        weights, cache = forward(scores)
        dscores = F.softmax_backward(np.random.default_rng(0).normal(size=scores.shape), cache)
        dead = ~keep.any(axis=axis, keepdims=True)
        # Oracle: a removed entry has weight exactly 0, so its gradient is exactly 0.
        assert np.all(weights[~keep] == 0.0) and np.all(dscores[~keep] == 0.0)
        assert np.all(np.where(dead, weights, 0.0) == 0.0)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)  # each kind gets the full example budget
@given(data=st.data())
def test_attention_gradients_with_masks_causal_scale_and_broadcasting(mask_kind, data):
    inputs, options = data.draw(attention_cases(mask_kind), label="case")
    out, cache = F.attention_forward(**inputs, **options)
    mask_events(options["attn_mask"], options["is_causal"],
                out.shape[:-1] + (inputs["key"].shape[-2],))
    report = check_op(F.attention_forward, F.attention_backward, inputs,
                      forward_kwargs=options)
    assert [row.name for row in report.rows] == ["query", "key", "value"]
    assert_gradients_ok(report)


def test_attention_gradients_when_only_value_has_leading_dims():
    # Regression: value (2, S, Dv) against query (T, D) and key (S, D) gives an
    # output (2, T, Dv) larger than the weights (T, S); backward used to reject
    # the dout of the output's shape.
    rng = np.random.default_rng(7)
    inputs = {"query": rng.normal(size=(3, 2)), "key": rng.normal(size=(4, 2)),
              "value": rng.normal(size=(2, 4, 5))}
    out, _ = F.attention_forward(**inputs)
    assert out.shape == (2, 3, 5)
    report = check_op(F.attention_forward, F.attention_backward, inputs,
                      forward_kwargs={"is_causal": True})
    assert_gradients_ok(report)


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_attention_backward_of_one_query_row_is_the_outer_products(dropout_p):
    # With T = 1 the backward's dV = P^T dO and dK = c dS^T Q contract an axis of
    # length 1 (computed as einsum, not matmul, for speed: qkvnp.ops.attention._product).
    # Oracle: the closed form, each entry ONE product (so equal to the bit), for
    # key and value broadcast from leading dims (1,) against the query's (3,);
    # then central differences.
    rng = np.random.default_rng(11)
    inputs = {"query": rng.normal(size=(3, 1, 4)), "key": rng.normal(size=(1, 5, 4)),
              "value": rng.normal(size=(1, 5, 2))}
    options = {"dropout_p": dropout_p, "rng": 3}
    out, cache = F.attention_forward(**inputs, **options)
    dout = rng.normal(size=out.shape)
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    kept = F.dropped_weights(cache)  # (3, 1, 5): the weights after dropout
    expected_dvalue = (kept[:, 0, :, None] * dout[:, 0, None, :]).sum(axis=0, keepdims=True)
    np.testing.assert_array_equal(dvalue, expected_dvalue)
    weights = cache.weights  # before dropout
    dweights = (dout @ np.swapaxes(inputs["value"], -1, -2))  # (3, 1, 5)
    if cache.dropout_mask is not None:
        dweights = dweights * cache.dropout_mask / (1 - dropout_p)
    dscores = weights * (dweights - (weights * dweights).sum(-1, keepdims=True))
    expected_dkey = (dscores[:, 0, :, None] * inputs["query"][:, 0, None, :]
                     * cache.scale).sum(axis=0, keepdims=True)
    np.testing.assert_allclose(dkey, expected_dkey, rtol=1e-13, atol=1e-15)
    report = check_op(F.attention_forward, F.attention_backward, inputs,
                      forward_kwargs={"dropout_p": dropout_p,
                                      "dropout_mask": cache.dropout_mask} if dropout_p else {})
    assert_gradients_ok(report)


@given(attention_cases(), st.booleans(), st.integers(0, 2**16))
def test_attention_backward_key_is_value_sums_the_key_and_value_gradients(case, dropout, seed):
    # One array X as both key and value (attention over raw items): key_is_value=True
    # returns dK + dV from one product. Oracles: the two gradients apart (each
    # checked against central differences above), summed; then central
    # differences of X -> attention(Q, X, X) itself, with any mask, causal,
    # scale, broadcast leading dims and a replayed dropout mask.
    inputs, options = case
    items = inputs["key"]  # (..., S, D): also the value
    query = inputs["query"]
    # the case's mask broadcasts to the scores of (query, key, value); without the
    # value's own leading dims it may not fit those of (query, key, key)
    scores = np.broadcast_shapes(query.shape[:-2], items.shape[:-2]) + (
        query.shape[-2], items.shape[-2])
    mask = options.get("attn_mask")
    assume(mask is None or (np.ndim(mask) <= len(scores) and all(
        m in (1, n) for m, n in zip(np.shape(mask)[::-1], scores[::-1]))))
    if dropout:
        _, drawn = F.attention_forward(query, items, items, **options, dropout_p=0.5, rng=seed)
        options = dict(options, dropout_p=0.5, dropout_mask=drawn.dropout_mask)
    out, cache = F.attention_forward(query, items, items, **options)
    assert cache.key is cache.value  # one array in, one array cached (copied once)
    dout = np.random.default_rng(seed).normal(size=out.shape)
    dquery, ditems, none = F.attention_backward(dout, cache, key_is_value=True)
    dquery_apart, dkey, dvalue = F.attention_backward(dout, cache)
    assert none is None
    np.testing.assert_array_equal(dquery, dquery_apart)
    np.testing.assert_allclose(ditems, dkey + dvalue, rtol=1e-12, atol=1e-12)

    def forward(query, items):
        return F.attention_forward(query, items, items, **options)[0]

    def vjp(dout, query, items):
        _, cache = F.attention_forward(query, items, items, **options)
        dquery, ditems, _ = F.attention_backward(dout, cache, key_is_value=True)
        return {"query": dquery, "items": ditems}

    assert_gradients_ok(check_function(forward, {"query": query, "items": items}, vjp))


def test_attention_backward_key_is_value_refuses_two_arrays_and_keeps_one_through_a_cast():
    # Oracle: the documented contract. Two arrays (even equal ones) are not "one
    # array as key and value": refused, naming the argument. One float32 array
    # cast to the query's float64 is cast once, so it stays one array.
    rng = np.random.default_rng(5)
    query, items = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4))
    out, cache = F.attention_forward(query, items, items.copy())
    with pytest.raises(ValueError, match="key_is_value=True needs the forward's key and value"):
        F.attention_backward(np.ones(out.shape), cache, key_is_value=True)
    with pytest.raises(ValueError, match="key_is_value='factors' is no mode of the reference op"):
        F.attention_backward(np.ones(out.shape), cache, key_is_value="factors")
    with pytest.raises(TypeError, match="key_is_value must be a bool, got str"):
        F.attention_backward(np.ones(out.shape), cache, key_is_value="sum")
    with pytest.raises(TypeError, match="key_is_value must be a bool, got float"):
        F.attention_backward(np.ones(out.shape), cache, key_is_value=1.0)
    items32 = items.astype(np.float32)
    out, cache = F.attention_forward(query, items32, items32)
    assert cache.key.dtype == np.float64 and cache.key is cache.value
    _, ditems, _ = F.attention_backward(np.ones(out.shape), cache, key_is_value=True)
    _, dkey, dvalue = F.attention_backward(np.ones(out.shape), cache)
    np.testing.assert_allclose(ditems, dkey + dvalue, rtol=1e-12, atol=1e-12)
    grouped_items = rng.normal(size=(2, 5, 4))  # K = 2 key/value heads for H = 4
    out, cache = F.attention_forward(rng.normal(size=(4, 3, 4)), grouped_items, grouped_items,
                                     enable_gqa=True)
    with pytest.raises(ValueError, match="key_is_value=True needs an ungrouped cache"):
        F.attention_backward(np.ones(out.shape), cache, key_is_value=True)


@given(attention_cases(), st.integers(0, 2**16))
def test_attention_gradients_through_fully_masked_rows_are_exactly_zero(case, seed):
    # Oracle: a query row with no key left has weights exactly 0, so its output
    # row is 0.0 and the upstream gradient of that row reaches nothing: replacing
    # it by other values leaves every gradient bit for bit unchanged.
    inputs, options = case
    out, cache = F.attention_forward(**inputs, **options)
    S, Dv = inputs["value"].shape[-2:]
    dead = dead_rows(options["attn_mask"], options["is_causal"], out.shape[:-1] + (S,))
    assert out.shape == dead.shape + (Dv,)
    assert np.all(out[dead] == 0.0)
    rng = np.random.default_rng(seed)
    dout = rng.normal(size=out.shape)
    other = dout.copy()
    other[dead] = rng.normal(size=other[dead].shape) * 10
    for grad, grad_other in zip(F.attention_backward(dout, cache),
                                F.attention_backward(other, cache)):
        np.testing.assert_array_equal(grad, grad_other)
    if inputs["query"].shape[:-1] == dead.shape:  # query not broadcast: rows map 1:1
        dquery = F.attention_backward(dout, cache)[0]
        assert np.all(dquery[dead] == 0.0)


@given(head_cases())
def test_split_and_merge_heads_gradients(case):
    x, num_heads = case
    report = check_op(F.split_heads_forward, F.split_heads_backward, {"x": x},
                      forward_kwargs={"num_heads": num_heads})
    assert_gradients_ok(report)
    heads, _ = F.split_heads_forward(x, num_heads)
    report = check_op(F.merge_heads_forward, F.merge_heads_backward, {"x": heads})
    assert_gradients_ok(report)


# ---------------------------------------------------------------- layers


@fixture_ok
@given(self_attention_cases())
def test_self_attention_gradients(impl, case):
    layer = SelfAttention(case["d_in"], case["d_out"], qkv_bias=case["qkv_bias"],
                          rng=case["seed"], impl=impl)
    randomize_biases(layer, case["seed"])
    forward_kwargs = {"attn_mask": case["attn_mask"], "is_causal": case["is_causal"]}
    report = check_layer(layer, case["x"], forward_kwargs=forward_kwargs)
    expected = [f"param {name}" for name in layer.params] + ["input 0"]
    assert [row.name for row in report.rows] == expected
    assert_gradients_ok(report)
    if case["qkv_bias"]:
        # check_layer leaves the grads of its random dout in the layer.
        assert layer.grads["b_key"].shape == (case["d_out"],)
        assert_round_off_zero(layer.grads["b_key"], layer.grads["b_query"])
    out, weights = layer.forward(case["x"], return_weights=True, **forward_kwargs)
    dead = dead_rows(case["attn_mask"], case["is_causal"], weights.shape)
    assert np.all(out[dead] == 0.0)


@pytest.mark.parametrize("kind", ["self", "cross", "key_only"])  # value omitted: value = key
@fixture_ok
@given(data=st.data())
def test_multi_head_attention_gradients(impl, kind, data):
    # Self-, cross- and key-only attention; kdim/vdim; bias or not; attn_mask
    # (T, S) or 4-D, bool or float; key padding (whole sequences padded); causal.
    case = data.draw(mha_cases(kind), label="case")
    layer = MultiHeadAttention(case["embed_dim"], case["num_heads"], bias=case["bias"],
                               kdim=case["kdim"], vdim=case["vdim"], rng=case["seed"],
                               impl=impl)
    randomize_biases(layer, case["seed"])
    forward_kwargs = {name: case[name] for name in ("attn_mask", "is_causal", "key_padding_mask")}
    event(f"{case['kind']}-attention, bias={case['bias']}")
    padding = case["key_padding_mask"]
    event(f"key_padding_mask {'none' if padding is None else 'given'}")
    if padding is not None and padding.ndim == 2 and (~padding).all(axis=-1).any():
        event("a fully padded sequence")
    report = check_layer(layer, *case["inputs"], forward_kwargs=forward_kwargs)
    expected = [f"param {name}" for name in layer.params]
    expected += [f"input {i}" for i in range(len(case["inputs"]))]
    assert [row.name for row in report.rows] == expected
    assert_gradients_ok(report)
    if case["bias"]:
        assert_round_off_zero(layer.grads["b_key"], layer.grads["b_query"])


@fixture_ok
@given(mha_cases(), st.integers(0, 2**16))
def test_multi_head_attention_fully_padded_sequence_is_exactly_zero(impl, case, seed):
    # Oracle: a sequence whose keys are all padding attends to nothing, so its
    # output is exactly b_out (0 without bias) and every input gradient of that
    # sequence is exactly 0.0.
    inputs, attn_mask = case["inputs"], case["attn_mask"]
    if inputs[0].ndim == 2:  # unbatched: make it a batch of one
        inputs = [x[None] for x in inputs]  # (T, E) -> (1, T, E)
        if attn_mask is not None and attn_mask.ndim == 3:
            attn_mask = attn_mask[None]  # (H, T, S) -> (1, H, T, S)
    B, S = inputs[0].shape[0], inputs[-1].shape[-2]
    padding = case["key_padding_mask"]
    padding = np.ones((B, S), dtype=bool) if padding is None else padding.reshape(B, S).copy()
    padding[0] = False  # sequence 0 fully padded
    layer = MultiHeadAttention(case["embed_dim"], case["num_heads"], bias=case["bias"],
                               kdim=case["kdim"], vdim=case["vdim"], rng=case["seed"],
                               impl=impl)
    randomize_biases(layer, case["seed"])
    out = layer.forward(*inputs, attn_mask=attn_mask,
                        is_causal=case["is_causal"], key_padding_mask=padding)
    expected = layer.params.get("b_out", np.zeros(case["embed_dim"]))
    assert out.shape == inputs[0].shape
    assert np.all(out[0] == expected)
    dinputs = layer.backward(np.random.default_rng(seed).normal(size=out.shape))
    dinputs = dinputs if isinstance(dinputs, tuple) else (dinputs,)
    for dx in dinputs:
        if dx is not None:
            assert np.all(dx[0] == 0.0)
    if case["bias"]:
        assert_round_off_zero(layer.grads["b_key"], layer.grads["b_query"])


@fixture_ok
@given(mha_cases(kind="cross"))
def test_multi_head_attention_gradients_direction_mode(impl, case):
    # The random-direction check (<u, vjp> vs a directional difference) must
    # certify the same gradients as the elementwise one.
    layer = MultiHeadAttention(case["embed_dim"], case["num_heads"], bias=case["bias"],
                               kdim=case["kdim"], vdim=case["vdim"], rng=case["seed"],
                               impl=impl)
    randomize_biases(layer, case["seed"])
    forward_kwargs = {name: case[name] for name in ("attn_mask", "is_causal", "key_padding_mask")}
    report = check_layer(layer, *case["inputs"], forward_kwargs=forward_kwargs,
                         mode="direction", num_directions=3)
    assert_gradients_ok(report)
