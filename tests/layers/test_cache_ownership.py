"""Caches own what backward reads, and a backward pairs with one forward.

Oracle: the same forward and backward without the mutation (the gradients
must be bitwise identical), and PyTorch's rules: a caller's in-place edit of
an input after the forward must not change the gradients (PyTorch refuses
it; qkvnp's caches keep their own copies), and a second backward of one
forward is refused unless the first kept the cache (``retain_graph``).
"""
import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp.kernels import fast, tiled

CORES = {"functional": F, "fast": fast, "tiled": tiled}


def _normal(rng, *shape):
    return rng.normal(size=shape)


def _mutate(arrays):
    """Change every array in place, as a careless caller might."""
    for a in arrays:
        if a.dtype == np.bool_:
            a[...] = ~a
        elif a.dtype.kind in "iu":
            a[...] = 0
        else:
            a *= 3.0
            a += 1.0


def _assert_same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("path", sorted(CORES))
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_attention_cores_own_their_inputs_and_mask(path, mask_kind):
    rng = np.random.default_rng(0)
    core = CORES[path]

    def problem():
        r = np.random.default_rng(1)
        q, k, v = _normal(r, 2, 4, 3), _normal(r, 2, 6, 3), _normal(r, 2, 6, 5)
        mask = {"none": None, "bool": r.random((4, 6)) > 0.3,
                "float": np.where(r.random((4, 6)) > 0.3, 0.0, -np.inf)}[mask_kind]
        return q, k, v, mask

    dout = _normal(rng, 2, 4, 5)
    q, k, v, mask = problem()
    out, cache = core.attention_forward(q, k, v, mask)
    want = core.attention_backward(dout, cache)
    q, k, v, mask = problem()
    out, cache = core.attention_forward(q, k, v, mask)
    _mutate([x for x in (q, k, v, mask, out) if x is not None])  # inputs, mask and the output
    _assert_same(core.attention_backward(dout, cache), want)


def test_linear_and_embedding_ops_own_their_inputs():
    rng = np.random.default_rng(2)
    x, W, b, dout = _normal(rng, 3, 4), _normal(rng, 4, 2), _normal(rng, 2), _normal(rng, 3, 2)
    want = F.linear_backward(dout, F.linear_forward(x.copy(), W.copy(), b.copy())[1])
    out, cache = F.linear_forward(x, W, b)
    _mutate([x, W, b, out])
    _assert_same(F.linear_backward(dout, cache), want)
    indices, weight = np.array([[0, 2, 2]]), _normal(rng, 3, 4)
    dout = _normal(rng, 1, 3, 4)
    want = F.embedding_backward(dout, F.embedding_forward(indices.copy(), weight.copy())[1])
    out, cache = F.embedding_forward(indices, weight)
    _mutate([indices, weight, out])
    _assert_same(F.embedding_backward(dout, cache), want)


LAYERS = {
    "SelfAttention": (lambda impl: qkvnp.SelfAttention(4, 4, qkv_bias=True, rng=0, impl=impl),
                      lambda r: (_normal(r, 2, 5, 4),), {"attn_mask": "bool"}),
    "MultiHeadAttention self": (lambda impl: qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl),
                                lambda r: (_normal(r, 2, 5, 4),), {"attn_mask": "float"}),
    "MultiHeadAttention cross": (
        lambda impl: qkvnp.MultiHeadAttention(4, 2, kdim=3, vdim=2, rng=0, impl=impl),
        lambda r: (_normal(r, 2, 5, 4), _normal(r, 2, 6, 3), _normal(r, 2, 6, 2)),
        {"key_padding_mask": True}),
}


def _layer_run(name, impl, mutate, return_weights):
    make, inputs, mask_options = LAYERS[name]
    r = np.random.default_rng(3)
    layer = make(impl)
    args = inputs(r)
    T, S = args[0].shape[-2], args[-1].shape[-2]
    options = {}
    if mask_options.get("attn_mask") == "bool":
        options["attn_mask"] = r.random((T, S)) > 0.3
    elif mask_options.get("attn_mask") == "float":
        options["attn_mask"] = np.where(r.random((T, S)) > 0.3, 0.0, -np.inf)
    if mask_options.get("key_padding_mask"):
        options["key_padding_mask"] = np.array([[True] * S, [True] * (S - 2) + [False] * 2])
    result = layer.forward(*args, return_weights=return_weights, **options)
    out, weights = result if return_weights else (result, None)
    if mutate:
        _mutate([*args, *options.values(), out] + ([weights] if weights is not None else []))
    dx = layer.backward(np.random.default_rng(4).normal(size=out.shape))
    return dx, [layer.grads[k] for k in sorted(layer.grads)]


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers_own_what_backward_reads(impl, name, return_weights):
    """Every input, mask, output and returned weight edited after forward."""
    want_dx, want_grads = _layer_run(name, impl, False, return_weights)
    dx, grads = _layer_run(name, impl, True, return_weights)
    _assert_same(dx, want_dx)
    for got, want in zip(grads, want_grads):
        np.testing.assert_array_equal(got, want)


def test_small_layers_own_what_backward_reads():
    for make, x in ((lambda: qkvnp.Linear(4, 3, rng=0), np.arange(8.0).reshape(2, 4)),
                    (lambda: qkvnp.Embedding(5, 3, rng=0), np.array([[1, 4, 1]]))):
        results = []
        for mutate in (False, True):
            layer, xx = make(), x.copy()
            out = layer.forward(xx)
            if mutate:
                _mutate([xx, out])
            layer.backward(np.random.default_rng(5).normal(size=out.shape))
            results.append([layer.grads[k] for k in sorted(layer.grads)])
        for got, want in zip(*results):
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- one backward per forward


ALL_LAYERS = [
    lambda impl: (qkvnp.SelfAttention(4, 4, rng=0, impl=impl), np.ones((2, 3, 4))),
    lambda impl: (qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl), np.ones((2, 3, 4))),
    lambda impl: (qkvnp.Linear(4, 4, rng=0), np.ones((2, 3, 4))),
    lambda impl: (qkvnp.Embedding(5, 4, rng=0), np.array([[1, 2, 3]])),
]


@pytest.mark.parametrize("make", ALL_LAYERS)
def test_second_backward_is_refused_and_accumulates_nothing(make, impl):
    layer, x = make(impl)
    with pytest.raises(RuntimeError, match="backward called before forward"):
        layer.backward(np.ones((2, 3, 4)))
    out = layer.forward(x)
    dout = np.random.default_rng(6).normal(size=out.shape)
    layer.backward(dout)
    once = {k: g.copy() for k, g in layer.grads.items()}
    with pytest.raises(RuntimeError, match="called twice for one forward.*call forward"):
        layer.backward(dout)
    for k in once:  # nothing added by the refused call
        np.testing.assert_array_equal(layer.grads[k], once[k])
    layer.forward(x)  # a new forward makes a backward possible again
    layer.backward(dout)
    for k in once:
        np.testing.assert_allclose(layer.grads[k], 2 * once[k], rtol=1e-12)


@pytest.mark.parametrize("make", ALL_LAYERS)
def test_retain_cache_keeps_it_for_one_more_backward(make, impl):
    layer, x = make(impl)
    out = layer.forward(x)
    dout = np.random.default_rng(7).normal(size=out.shape)
    first = layer.backward(dout, retain_cache=True)
    once = {k: g.copy() for k, g in layer.grads.items()}
    second = layer.backward(dout)  # the same cache, used up now
    _assert_same(second, first)
    for k in once:
        np.testing.assert_allclose(layer.grads[k], 2 * once[k], rtol=1e-12)
    with pytest.raises(RuntimeError, match="called twice"):
        layer.backward(dout)


def test_a_refused_backward_keeps_the_cache():
    """A bad dout is refused before the cache is used up: a good one still works."""
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0)
    out = layer.forward(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="dout"):
        layer.backward(np.full(out.shape, np.nan))
    assert layer.backward(np.ones(out.shape)).shape == out.shape


def test_two_forwards_then_backward_is_the_gradient_of_the_second(impl):
    """Documented: a layer keeps only its last forward's cache."""
    rng = np.random.default_rng(8)
    x1, x2, dout = (rng.normal(size=(2, 3, 4)) for _ in range(3))
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl)
    layer.forward(x2)
    want = layer.backward(dout)
    layer.zero_grad()
    layer.forward(x1)
    layer.forward(x2)
    np.testing.assert_array_equal(layer.backward(dout), want)


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_check_false_keeps_a_composites_own_arrays_uncopied(dropout_p):
    """Oracle: the checked call. check=False (a composite's own, already checked
    arrays) gives the same outputs and gradients, bitwise, and its cache holds
    the caller's very arrays, where the checked call's holds copies."""
    rng = np.random.default_rng(6)
    x, W, b = _normal(rng, 2, 3, 4), _normal(rng, 4, 5), _normal(rng, 5)
    dout = _normal(rng, 2, 3, 5)
    checked_out, checked = F.linear_forward(x, W, b)
    out, cache = F.linear_forward(x, W, b, check=False)
    np.testing.assert_array_equal(out, checked_out)
    assert cache.x is x and cache.W is W and checked.x is not x and checked.W is not W
    _assert_same(F.linear_backward(dout, cache), F.linear_backward(dout, checked))

    q, k, v = _normal(rng, 2, 1, 4), _normal(rng, 2, 6, 4), _normal(rng, 2, 6, 3)
    mask = rng.random((1, 6)) > 0.3
    dout = _normal(rng, 2, 1, 3)
    options = {"attn_mask": mask, "dropout_p": dropout_p, "rng": 4}
    checked_out, checked = F.attention_forward(q, k, v, **options)
    out, cache = F.attention_forward(q, k, v, **options, check=False)
    np.testing.assert_array_equal(out, checked_out)
    assert all(a is b for a, b in zip(cache[:3], (q, k, v)))
    assert not any(a is b for a, b in zip(checked[:3], (q, k, v)))
    _assert_same(F.attention_backward(dout, cache), F.attention_backward(dout, checked))


def test_check_false_holds_for_grouped_query_attention(monkeypatch):
    """Oracle: the checked call, as above, with K = 2 key/value heads for
    H = 4 query heads (enable_gqa=True): the same outputs and gradients,
    bitwise; the unchecked cache holds views of the caller's arrays where the
    checked one holds copies; and the unchecked backward does not check dout
    (a count of as_upstream_grad's calls in qkvnp.ops.gqa), as without groups."""
    from qkvnp import _checks
    from qkvnp.ops import gqa

    rng = np.random.default_rng(7)
    q, k, v = _normal(rng, 2, 4, 3, 5), _normal(rng, 2, 2, 6, 5), _normal(rng, 2, 2, 6, 5)
    dout = _normal(rng, 2, 4, 3, 5)
    checked_out, checked = F.attention_forward(q, k, v, enable_gqa=True)
    out, cache = F.attention_forward(q, k, v, enable_gqa=True, check=False)
    np.testing.assert_array_equal(out, checked_out)
    for unchecked_input, checked_input, caller in zip(cache.inner[:3], checked.inner[:3], (q, k, v)):
        assert np.shares_memory(unchecked_input, caller)
        assert not np.shares_memory(checked_input, caller)
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[1])
        return _checks.as_upstream_grad(*args, **kwargs)

    monkeypatch.setattr(gqa, "as_upstream_grad", counting)
    _assert_same(F.attention_backward(dout, cache, check=False), F.attention_backward(dout, checked))
    assert calls == ["dout"]  # the checked call's, once


def test_linear_forward_check_false_skips_only_the_check_and_the_copy():
    """Oracle: the checked forward. ``Linear.forward(x, check=False)`` (a model's
    own array) returns the same output and, after the same backward, the same
    gradients, bitwise; its cache reads ``x`` itself, so an edit of ``x``
    after the forward reaches ``dW`` (``x_edited^T dout``), where the checked
    call's copy keeps the edit out; only the checked call refuses an ``x``
    holding NaN, naming it."""
    rng = np.random.default_rng(9)
    x, dout = _normal(rng, 2, 3, 4), _normal(rng, 2, 3, 6)
    results = {}
    for check in (True, False):
        linear = qkvnp.Linear(4, 6, rng=1)
        out = linear.forward(x, check=check)
        dx = linear.backward(dout)
        results[check] = (out, dx, linear.grads["W"], linear.grads["b"])
        edited = x.copy()
        linear.forward(edited, check=check)
        _mutate([edited])
        linear.zero_grad()
        linear.backward(dout)
        read = x if check else edited  # the checked forward cached its own copy
        np.testing.assert_array_equal(linear.grads["W"],
                                      read.reshape(-1, 4).T @ dout.reshape(-1, 6))
        bad = x.copy()
        bad[1, 2, 3] = np.nan
        if check:
            with pytest.raises(ValueError, match="x"):
                linear.forward(bad)
        else:
            assert np.isnan(linear.forward(bad, check=False)).any()
    _assert_same(results[False], results[True])


def test_basic_layers_backward_check_false_skips_only_the_check():
    """Oracle: the checked backward of the same forward. Linear and Embedding
    with ``check=False`` (a model's own, already checked gradient) accumulate
    the same gradients and return the same dx, bitwise; only the checked call
    refuses a dout holding NaN, naming it."""
    rng = np.random.default_rng(8)
    x, ids = _normal(rng, 2, 3, 4), rng.integers(0, 5, (2, 3))
    dout, demb = _normal(rng, 2, 3, 6), _normal(rng, 2, 3, 4)
    results = {}
    for check in (True, False):
        linear, embedding = qkvnp.Linear(4, 6, rng=1), qkvnp.Embedding(5, 4, rng=2)
        linear.forward(x)
        embedding.forward(ids)
        dx = linear.backward(dout, retain_cache=True, check=check)
        embedding.backward(demb, retain_cache=True, check=check)
        results[check] = tuple(a.copy() for a in (dx, linear.grads["W"], linear.grads["b"],
                                                   embedding.grads["weight"]))
        bad, bad_emb = dout.copy(), demb.copy()
        bad[0, 0, 0] = bad_emb[1, 2, 3] = np.nan
        if check:
            with pytest.raises(ValueError, match="dout"):
                linear.backward(bad)
            with pytest.raises(ValueError, match="dout"):
                embedding.backward(bad_emb)
        else:  # not checked: the NaN goes through, as the functional ops' check=False
            assert np.isnan(linear.backward(bad, check=False)).any()
            embedding.backward(bad_emb, check=False)
            assert np.isnan(embedding.grads["weight"]).any()
    _assert_same(results[False], results[True])
