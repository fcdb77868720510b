"""Dropout on the attention weights: arguments, paths, layers, modes, statistics.

Oracles, test by test: the reference path (:mod:`qkvnp.functional`) for the
fast and tiled cores and layers (``PATH_TOLERANCE``), with the drawn mask
compared bitwise; the forward without dropout for ``p = 0`` (bitwise); the
closed form ``P * Z / (1 - p)`` for the returned weights; central
differences (:mod:`qkvnp.gradcheck`, mask held fixed by replaying it) for
every gradient; binomial bounds (5 standard deviations, fixed seed) for the
kept fraction and the unbiased expectation.

Shape key: B batch, H heads, T query length, S key length, E embedding.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qkvnp
from qkvnp import functional as F
from qkvnp.ops.dropout import Dropout, block_keep, dense_keep
from qkvnp.gradcheck import check_layer, check_op
from qkvnp.kernels import fast, num_threads, tiled

from oracles import assert_matches_reference
from strategies import attention_cases

CORES = {"reference": (F.attention_forward, F.attention_backward),
         "fast": (fast.attention_forward, fast.attention_backward),
         "tiled": (tiled.attention_forward, tiled.attention_backward)}


def qkv(rng, lead=(2, 3), T=5, S=7, D=4, Dv=3):
    return (rng.standard_normal(lead + (T, D)), rng.standard_normal(lead + (S, D)),
            rng.standard_normal(lead + (S, Dv)))


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("core", sorted(CORES))
@pytest.mark.parametrize("kwargs, exc, fragment", [
    ({"dropout_p": 1.0}, ValueError, "dropout_p must be in [0, 1)"),  # drops everything
    ({"dropout_p": -0.1}, ValueError, "dropout_p must be in [0, 1)"),
    ({"dropout_p": float("nan")}, ValueError, "dropout_p must be in [0, 1)"),
    ({"dropout_p": True}, TypeError, "dropout_p must be a float"),
    ({"dropout_p": "0.1"}, TypeError, "dropout_p must be a float"),
    ({"dropout_p": 0.1, "dropout_mask": np.ones((5, 7))}, TypeError, "dropout_mask must be a bool"),
    ({"dropout_mask": np.ones((5, 7), bool)}, ValueError, "needs 0 < dropout_p < 1"),
    ({"dropout_p": 0.1, "dropout_mask": np.ones((4, 7), bool)}, ValueError,
     "dropout_mask must broadcast to the scores' shape (2, 3, 5, 7)"),
    ({"dropout_p": 0.1, "rng": "seed"}, TypeError, "rng must be a numpy.random.Generator"),
])
def test_bad_dropout_arguments_are_refused_naming_them(rng, core, kwargs, exc, fragment):
    with pytest.raises(exc) as info:
        CORES[core][0](*qkv(rng), **kwargs)
    assert fragment in str(info.value)


def test_layers_refuse_a_bad_dropout_and_a_mask_without_dropout(rng):
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        qkvnp.MultiHeadAttention(8, 2, dropout=1.0)
    with pytest.raises(TypeError, match="dropout must be a float"):
        qkvnp.SelfAttention(4, 4, dropout=None)
    with pytest.raises(TypeError):  # keyword-only: the third positional stays bias
        qkvnp.MultiHeadAttention(8, 2, True, None, None, None, np.float64, "auto", 0.1)
    layer = qkvnp.MultiHeadAttention(8, 2, rng=0)
    with pytest.raises(ValueError, match="dropout_mask needs a layer built with 0 < dropout"):
        layer.forward(np.ones((5, 8)), dropout_mask=np.ones((5, 5), bool))


# ---------------------------------------------------------------- p = 0


@pytest.mark.parametrize("core", sorted(CORES))
def test_p_zero_is_bitwise_the_forward_without_dropout(rng, core):
    forward, backward = CORES[core]
    q, k, v = qkv(rng)
    dout = rng.standard_normal((2, 3, 5, 3))
    out, cache = forward(q, k, v, is_causal=True)
    out0, cache0 = forward(q, k, v, is_causal=True, dropout_p=0.0, rng=1)
    assert np.array_equal(out, out0)
    assert cache0.dropout_mask is None
    for a, b in zip(backward(dout, cache), backward(dout, cache0)):
        assert np.array_equal(a, b)


def test_p_zero_layer_and_eval_mode_are_bitwise_the_layer_without_dropout(impl, rng):
    x = rng.standard_normal((2, 6, 8))
    plain = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl)
    zero = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl, dropout=0.0)
    evaluating = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl, dropout=0.5).eval()
    expected = plain.forward(x, is_causal=True)
    assert np.array_equal(zero.forward(x, is_causal=True), expected)
    assert np.array_equal(evaluating.forward(x, is_causal=True), expected)


# ---------------------------------------------------------------- the three paths


@pytest.mark.parametrize("core", ["fast", "tiled"])
@pytest.mark.parametrize("lead_q, lead_k, T, S", [
    ((2, 3), (2, 3), 5, 7),  # small: whole-array calls
    ((2, 1), (1, 3), 6, 4),  # broadcast leading dims
    ((2, 2), (2, 2), 150, 300),  # large enough for the fast core's row chunks and tiled blocks
])
def test_every_core_draws_the_reference_mask_and_matches_it(rng, core, lead_q, lead_k, T, S):
    forward, backward = CORES[core]
    q, k, v = (rng.standard_normal(lead_q + (T, 4)), rng.standard_normal(lead_k + (S, 4)),
               rng.standard_normal(lead_k + (S, 3)))
    attn_mask = rng.random((T, S)) > 0.2
    expected, expected_cache = F.attention_forward(q, k, v, attn_mask, dropout_p=0.3, rng=11)
    out, cache = forward(q, k, v, attn_mask, dropout_p=0.3, rng=11)
    assert np.array_equal(cache.dropout_mask, expected_cache.dropout_mask)  # same draw, bitwise
    assert_matches_reference(out, expected, "out", core)
    dout = rng.standard_normal(out.shape)
    for name, got, want in zip(("dquery", "dkey", "dvalue"), backward(dout, cache),
                               F.attention_backward(dout, expected_cache)):
        assert_matches_reference(got, want, name, core)


def test_fast_weights_are_the_dropped_weights(rng):
    # oracle: the closed form P * Z / (1 - p) of the reference's weights and mask
    q, k, v = qkv(rng)
    out, cache = F.attention_forward(q, k, v, dropout_p=0.25, rng=3)
    weights = F.scaled_dot_product_attention(q, k, v, return_weights=True, dropout_p=0.25,
                                             rng=3)[1]
    np.testing.assert_allclose(weights, cache.weights * cache.dropout_mask / 0.75, rtol=1e-15,
                               atol=0)
    _, fast_cache = fast.attention_forward(q, k, v, dropout_p=0.25, rng=3)
    assert_matches_reference(fast.attention_weights(fast_cache), weights, "weights", "fast")


def test_a_replayed_mask_gives_bitwise_the_same_forward(rng):
    q, k, v = qkv(rng)
    out, cache = F.attention_forward(q, k, v, dropout_p=0.4, rng=5)
    replayed, _ = F.attention_forward(q, k, v, dropout_p=0.4, dropout_mask=cache.dropout_mask)
    assert np.array_equal(out, replayed)
    # a mask that broadcasts (one per key, all heads) is used as given
    key_mask = np.array([True, False, True, True, False, True, True])
    _, cache = F.attention_forward(q, k, v, dropout_p=0.4, dropout_mask=key_mask)
    assert cache.dropout_mask.shape == (1, 7)


@pytest.mark.parametrize("block_size, threads", [((2, 3), 1), ((5, 5), 2), (None, 2), ((64, 16), 1)])
def test_tiled_masks_do_not_depend_on_blocks_or_threads(rng, block_size, threads):
    # oracle: the dense mask of the same key (dense_keep), i.e. the reference's draw
    q, k, v = qkv(rng, T=40, S=50)
    _, expected = F.attention_forward(q, k, v, is_causal=True, dropout_p=0.5, rng=9)
    with num_threads(threads):
        out, cache = tiled.attention_forward(q, k, v, is_causal=True, dropout_p=0.5, rng=9,
                                             block_size=block_size)
    assert np.array_equal(cache.dropout_mask, expected.dropout_mask)
    # linear memory: the cache holds the key, no (T, S) array
    assert all(np.size(field) < 40 * 50 for field in cache if isinstance(field, np.ndarray))
    assert cache.dropout.key is not None and cache.dropout.mask is None


def test_a_block_of_the_mask_is_the_block_of_the_dense_mask():
    dropout = Dropout(0.3, np.uint64(2 ** 63 + 5), None, (2, 3, 9, 11))
    dense = dense_keep(dropout)
    assert dense.shape == (2, 3, 9, 11) and dense.dtype == bool
    for i0, i1, j0, j1 in [(0, 9, 0, 11), (2, 5, 3, 8), (8, 9, 10, 11)]:
        assert np.array_equal(block_keep(dropout, i0, i1, j0, j1), dense[..., i0:i1, j0:j1])


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_one_minus_p(p):
    # oracle: binomial, n = 10**6 entries, within 5 standard deviations (fixed seed)
    n = 1000 * 1000
    keep = dense_keep(Dropout(p, np.uint64(12345), None, (1000, 1000)))
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) < 5 * sigma
    # rows and columns are not correlated with position: each half keeps as much
    assert abs(keep[:500].mean() - keep[500:].mean()) < 10 * sigma
    assert abs(keep[:, ::2].mean() - keep[:, 1::2].mean()) < 10 * sigma


def test_dropout_is_unbiased(rng):
    # oracle: E[P Z / (1 - p)] = P; the mean of 4000 independent masks (one per
    # batch entry of identical inputs) is within 5 standard errors of P
    q, k, v = qkv(rng, lead=(), T=3, S=4)
    p, n = 0.3, 4000
    weights = F.scaled_dot_product_attention(np.broadcast_to(q, (n, 3, 4)), k, v,
                                             return_weights=True, dropout_p=p, rng=0)[1]
    plain = F.scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    standard_error = plain * np.sqrt(p / (1 - p) / n)
    assert np.all(np.abs(weights.mean(axis=0) - plain) < 5 * standard_error + 1e-15)


# ---------------------------------------------------------------- gradients, mask held fixed


@pytest.mark.parametrize("core", sorted(CORES))
@given(data=st.data())
def test_gradients_with_dropout_on_every_core(core, data):
    # oracle: central differences with the mask held fixed (an int seed draws
    # the same mask on every forward of the check; then the mask replayed)
    inputs, options = data.draw(attention_cases(), label="case")
    p = data.draw(st.sampled_from([0.1, 0.5]), label="p")
    forward, backward = CORES[core]
    report = check_op(forward, backward, inputs,
                      forward_kwargs={**options, "dropout_p": p, "rng": 3})
    assert report.ok, "\n" + report.table()
    _, cache = forward(**inputs, **options, dropout_p=p, rng=3)
    report = check_op(forward, backward, inputs, forward_kwargs={
        **options, "dropout_p": p, "dropout_mask": cache.dropout_mask})
    assert report.ok, "\n" + report.table()


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_layer_gradients_with_dropout(impl, kind, rng):
    # oracle: central differences of every parameter and input, mask held fixed
    x = rng.standard_normal((2, 4, 8))
    if kind == "self":
        layer = qkvnp.SelfAttention(8, 6, qkv_bias=True, rng=0, impl=impl, dropout=0.4)
        inputs = (x,)
    else:
        layer = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl, dropout=0.4)
        inputs = (x, rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8)))
    report = check_layer(layer, *inputs, forward_kwargs={"is_causal": kind == "self", "rng": 1})
    assert report.ok, "\n" + report.table()
    mask = rng.random((2, 2, 4, 5)) > 0.5  # a given mask, in evaluation mode
    if kind == "cross":
        report = check_layer(layer.eval(), *inputs, forward_kwargs={"dropout_mask": mask})
        assert report.ok, "\n" + report.table()


# ---------------------------------------------------------------- layers


def test_every_path_of_a_layer_draws_the_same_mask(rng):
    # oracle: the reference path's layer, same seed: masks equal, values within tolerance
    x = rng.standard_normal((2, 6, 8))
    dout = rng.standard_normal((2, 6, 8))
    results = {}
    for impl in ("reference", "fast", "tiled"):
        layer = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl, dropout=0.3)
        out = layer.forward(x, is_causal=True)
        results[impl] = (out, layer.backward(dout), layer.grads)
        assert layer.last_dispatch.path == impl
    for impl in ("fast", "tiled"):
        assert_matches_reference(results[impl][0], results["reference"][0], "out", impl)
        assert_matches_reference(results[impl][1], results["reference"][1], "dx", impl)
        for name, grad in results[impl][2].items():
            assert_matches_reference(grad, results["reference"][2][name], name, impl)


def test_weights_do_not_depend_on_dropout_and_later_layers_keep_their_draws():
    # oracle: layers built without dropout from the same generator
    def build(dropout):
        generator = np.random.default_rng(4)
        first = qkvnp.MultiHeadAttention(8, 2, rng=generator, dropout=dropout)
        second = qkvnp.SelfAttention(8, 4, rng=generator, dropout=dropout)
        return first, second

    for plain, dropped in zip(build(0.0), build(0.2)):
        for name, value in plain.params.items():
            assert np.array_equal(value, dropped.params[name]), name


def test_training_draws_new_masks_and_eval_applies_only_given_masks(impl, rng):
    x = rng.standard_normal((2, 6, 8))
    layer = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl, dropout=0.5)
    assert layer.training and "dropout=0.5" in repr(layer)
    first, second = layer.forward(x), layer.forward(x)
    assert not np.array_equal(first, second)  # a new mask each forward
    assert np.array_equal(layer.forward(x, rng=8), layer.forward(x, rng=8))  # rng= replays
    assert layer.eval() is layer and not layer.training
    plain = layer.forward(x)
    assert np.array_equal(plain, layer.forward(x))  # no drawn dropout in evaluation mode
    mask = rng.random((2, 2, 6, 6)) > 0.5
    masked = layer.forward(x, dropout_mask=mask)
    assert not np.array_equal(masked, plain)  # a given mask applies in evaluation mode
    assert np.array_equal(layer.train().forward(x, dropout_mask=mask), masked)  # and in training


def test_returned_weights_are_after_dropout(rng):
    # oracle: the closed form weights * mask / (1 - p), per head
    x = rng.standard_normal((2, 5, 8))
    layer = qkvnp.MultiHeadAttention(8, 2, rng=0, impl="fast", dropout=0.25).eval()
    _, plain = layer.forward(x, return_weights=True)
    mask = rng.random((2, 2, 5, 5)) > 0.5
    _, dropped = layer.forward(x, return_weights=True, dropout_mask=mask)
    assert dropped.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(dropped, plain * mask / 0.75, rtol=1e-12, atol=1e-15)


def test_model_propagates_train_and_eval_and_gathers_generators():
    from qkvnp.training import AttentionRegressor

    model = AttentionRegressor(8, 2, rng=0, dropout=0.1)
    assert model.training and model.attention.training
    model.eval()
    assert not model.training and not model.attention.training
    model.train()
    assert model.attention.training
    assert list(model.generators()) == ["attention.dropout_rng"]
    assert model.generators()["attention.dropout_rng"] is model.attention.dropout_rng
    with pytest.raises(TypeError, match="mode must be a bool"):
        model.train("yes")


def test_the_docs_dropout_example_runs():
    # oracle: the example's own shapes (the "## Dropout" block of docs/masks.md)
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "masks.md"
    section = page.read_text(encoding="utf-8").split("## Dropout\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace = {}
    exec(compile(block, "docs/masks.md", "exec"), namespace)  # noqa: S102
    assert namespace["weights"].shape == (2, 2, 5, 5) and namespace["out"].shape == (2, 5, 8)
    assert not namespace["mha"].training
