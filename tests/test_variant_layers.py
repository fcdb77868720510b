"""MultiHeadAttention with the variants: gradients, decoding, state, dispatch, refusals.

Oracles: central differences and the complex step on every parameter and
input (``rel_bias`` and ``sinks`` included); the full causal windowed forward
for token-by-token and chunked decoding; a fresh layer loaded from the state
dict or a checkpoint for the state; PyTorch autograd in float64 on the same
layer written in torch ops (the book's RoPE, T5's lookup, a sink column).
"""
import os

import numpy as np
import pytest

import qkvnp
from qkvnp import KVCache, MultiHeadAttention
from qkvnp.gradcheck import check_layer
from qkvnp.layers import variant_layer
from qkvnp.ops.positions import relative_position_bucket


def make_layer(seed=0, **options):
    layer = MultiHeadAttention(8, 2, rng=seed, **options)
    rng = np.random.default_rng(seed + 100)
    for name in ("rel_bias", "sinks", "b_query", "b_key", "b_value", "b_out"):
        if name in layer.params:  # non-zero values, so that their gradients are exercised
            layer.params[name][...] = rng.standard_normal(layer.params[name].shape)
    return layer


LAYER_OPTIONS = [
    {"rope": True},
    {"rope": True, "rope_layout": "interleaved", "rope_base": 100.0},
    {"position_bias": "alibi", "softcap": 2.0},
    {"position_bias": "relative", "num_buckets": 6, "max_distance": 8},
    {"sinks": True, "window": (2, 0)},
    {"rope": True, "position_bias": "relative", "sinks": True, "softcap": 3.0, "window": (3, 0),
     "num_kv_heads": 1},  # every variant, multi-query
]


@pytest.mark.parametrize("method", ["central", "complex_step"])
@pytest.mark.parametrize("options", LAYER_OPTIONS)
@pytest.mark.parametrize("is_causal", [True, False])
def test_layer_gradients_match_numerical_derivatives(options, is_causal, method):
    layer = make_layer(**options)
    x = np.random.default_rng(1).standard_normal((2, 5, 8))
    report = check_layer(layer, x, forward_kwargs={"is_causal": is_causal}, method=method)
    assert report.ok, report


@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_cross_attention_with_variants_and_replayed_dropout(method):
    layer = make_layer(position_bias="relative", sinks=True, softcap=2.0, rope=True,
                       dropout=0.3, num_buckets=8)
    rng = np.random.default_rng(2)
    query, key = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 6, 8))
    keep = rng.random((2, 2, 4, 6)) > 0.3
    report = check_layer(layer, query, key, method=method,
                         forward_kwargs={"dropout_mask": keep, "is_causal": "bottom_right"})
    assert report.ok, report


@pytest.mark.parametrize("options", [
    {"window": (3, 0)},  # Mistral's window 4
    {"window": (0, 0), "rope": True},  # each token sees itself only
    {"rope": True, "position_bias": "alibi", "sinks": True, "window": (2, None),
     "num_kv_heads": 1},
    {"rope": True, "position_bias": "relative", "softcap": 1.0, "num_kv_heads": 2},
])
def test_decoding_token_by_token_and_chunked_equals_the_full_forward(options):
    layer = make_layer(**options)
    x = np.random.default_rng(3).standard_normal((2, 11, 8))
    full = layer.forward(x, is_causal=True)
    for chunks in ([(t, t + 1) for t in range(11)], [(0, 4), (4, 5), (5, 11)], [(0, 11)]):
        cache = KVCache()
        out = np.concatenate([layer.forward(x[:, a:b], kv_cache=cache) for a, b in chunks], 1)
        assert out.shape == full.shape
        np.testing.assert_allclose(out, full, rtol=0, atol=1e-13)
        assert cache.start + len(cache) == 11  # positions counted across the steps


def test_windowed_decoding_memory_stays_bounded():
    layer = make_layer(window=(7, 0), rope=True)
    x = np.random.default_rng(4).standard_normal((1, 300, 8))
    cache = KVCache()
    sizes = []
    for t in range(300):
        layer.forward(x[:, t:t + 1], kv_cache=cache)
        assert len(cache) <= 7
        sizes.append(cache.nbytes)
    assert len(set(sizes[16:])) == 1  # no growth after the first steps
    full = layer.forward(x, is_causal=True)
    cache = KVCache()
    last = [layer.forward(x[:, t:t + 1], kv_cache=cache) for t in range(300)][-1]
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=0, atol=1e-13)


def test_params_state_dict_and_checkpoint_hold_rel_bias_and_sinks(tmp_path):
    from qkvnp.training.checkpoint import load_checkpoint, save_checkpoint

    layer = make_layer(position_bias="relative", sinks=True, num_buckets=10)
    assert layer.params["rel_bias"].shape == (10, 2) and layer.params["sinks"].shape == (2,)
    fresh = MultiHeadAttention(8, 2, rng=5, position_bias="relative", sinks=True, num_buckets=10)
    assert np.all(fresh.params["rel_bias"] == 0) and np.all(fresh.params["sinks"] == 0)
    x = np.random.default_rng(6).standard_normal((2, 5, 8))
    fresh.load_state_dict(layer.state_dict())
    np.testing.assert_array_equal(fresh.forward(x), layer.forward(x))
    history = {"step": [], "loss": [], "accuracy": [], "lr": [], "eval_step": [],
               "eval_loss": [], "eval_accuracy": []}
    path = save_checkpoint(os.path.join(tmp_path, "run.npz"), layer.params, {}, 0,
                           np.random.default_rng(0).bit_generator.state, {}, history)
    again = MultiHeadAttention(8, 2, rng=7, position_bias="relative", sinks=True, num_buckets=10)
    again.load_state_dict(load_checkpoint(path).params)
    np.testing.assert_array_equal(again.forward(x), layer.forward(x))
    layer.zero_grad()
    layer.forward(x, is_causal=True)
    layer.backward(np.random.default_rng(8).standard_normal(x.shape))
    assert np.abs(layer.grads["rel_bias"]).max() > 0 and np.abs(layer.grads["sinks"]).max() > 0


def test_variant_options_keep_the_weights_of_a_seed():
    plain, varied = MultiHeadAttention(8, 2, rng=9), make_layer(9, rope=True, sinks=True)
    for name in ("W_query", "W_key", "W_value", "W_out"):
        np.testing.assert_array_equal(plain.params[name], varied.params[name])


@pytest.mark.parametrize("impl, options, path, words", [
    ("auto", {"rope": True, "softcap": 30.0}, "reference", "rope, softcap with 3 keys"),
    ("fast", {"rope": True}, "reference", "the fast path has none of them"),
    ("tiled", {"rope": True, "softcap": 30.0}, "tiled", "rope, softcap on the tiled path"),
    ("tiled", {"position_bias": "relative"}, "reference",
     "position_bias='relative' run on the reference path only"),
    ("auto", {"window": (1, 0), "position_bias": "alibi"}, "tiled", "skips the blocks"),
])
def test_dispatch_says_which_path_runs_the_variants(impl, options, path, words):
    layer = MultiHeadAttention(8, 2, rng=0, impl=impl, **options)
    layer.forward(np.ones((1, 3, 8)), is_causal=True)
    assert layer.last_dispatch.path == path
    assert words in layer.last_dispatch.reason


TILED_LAYER_CASES = [
    ({"window": (5, 0), "rope": True, "num_kv_heads": 1}, True),
    ({"window": (5, 0), "rope": True, "num_kv_heads": 1}, "bottom_right"),
    ({"position_bias": "alibi", "softcap": 2.0, "sinks": True}, True),
    ({"position_bias": "alibi", "softcap": 2.0, "sinks": True}, False),
    ({"position_bias": "alibi", "softcap": 2.0, "sinks": True}, "bottom_right"),
    ({"window": (3, 2), "sinks": True, "rope": True, "rope_layout": "interleaved"}, False),
    ({"window": (4, 0), "position_bias": "alibi", "dropout": 0.3, "num_kv_heads": 1}, True),
    ({"window": (4, 0), "position_bias": "alibi", "dropout": 0.3, "num_kv_heads": 1}, False),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("options, is_causal", TILED_LAYER_CASES)
def test_tiled_path_equals_the_reference_path(options, is_causal, dtype):
    from qkvnp.kernels import PATH_TOLERANCES

    tol = PATH_TOLERANCES[np.dtype(dtype)]
    results = []
    rng = np.random.default_rng(12)
    query, key = rng.standard_normal((2, 37, 8)), rng.standard_normal((2, 45, 8))
    dout = rng.standard_normal((2, 37, 8))
    replay = {}
    if options.get("dropout"):  # the same replayed mask on both paths
        replay["dropout_mask"] = rng.random((2, 2, 37, 45)) > 0.3
    for impl in ("reference", "tiled"):
        layer = make_layer(dtype=dtype, impl=impl, **options)
        out = layer.forward(query, key, is_causal=is_causal, **replay)
        assert layer.last_dispatch.path == impl
        grads = layer.backward(dout)
        results.append((out, grads[0], grads[1], dict(layer.grads)))
    (out, dquery, dkey, grads), (tiled_out, tiled_dq, tiled_dk, tiled_grads) = results
    for ours, theirs in [(tiled_out, out), (tiled_dq, dquery), (tiled_dk, dkey)] + [
            (tiled_grads[name], grads[name]) for name in grads]:
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert np.abs(ours - theirs).max() <= tol * max(1.0, np.abs(theirs).max())


def test_refused_options_and_refused_steps_change_nothing():
    with pytest.raises(ValueError, match="head dim"):
        MultiHeadAttention(6, 2, rope=True)
    with pytest.raises(ValueError, match="position_bias"):
        MultiHeadAttention(8, 2, position_bias="t5")
    with pytest.raises(TypeError, match="rope must be a bool"):
        MultiHeadAttention(8, 2, rope="yes")
    with pytest.raises(ValueError, match="softcap"):
        MultiHeadAttention(8, 2, softcap=-1.0)
    with pytest.raises(ValueError, match="rope_layout"):
        MultiHeadAttention(8, 2, rope=True, rope_layout="complex")
    layer = make_layer(window=(2, 1))
    x = np.random.default_rng(10).standard_normal((1, 4, 8))
    layer.forward(x)  # not causal: a window both sides is fine
    with pytest.raises(ValueError, match="right must be 0 or None"):
        layer.forward(x, is_causal=True)
    cache = KVCache()
    with pytest.raises(ValueError, match="right must be 0 or None"):
        layer.forward(x[:, :1], kv_cache=cache)
    assert len(cache) == 0 and cache.key is None  # the refused step changed nothing
    decoder = make_layer(window=(2, 0))
    cache = KVCache()
    decoder.forward(x[:, :3], kv_cache=cache)
    before = (len(cache), cache.start, cache.key.copy())
    with pytest.raises(ValueError):
        decoder.forward(x[:, :1], kv_cache=cache, attn_mask=np.ones((5, 5), bool))
    assert (len(cache), cache.start) == before[:2]
    np.testing.assert_array_equal(cache.key, before[2])


def test_layer_matches_torch_autograd(torch):
    layer = make_layer(rope=True, position_bias="relative", sinks=True, softcap=2.5,
                       window=(2, 0), num_buckets=6, max_distance=8)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 6, 8))
    out = layer.forward(x, is_causal=True)
    dout = rng.standard_normal(out.shape)
    layer.zero_grad()
    dx = layer.backward(dout)
    p = {name: torch.tensor(value, requires_grad=True) for name, value in layer.params.items()}
    xt = torch.tensor(x, requires_grad=True)
    T, H, D = 6, 2, 4

    def heads(y):
        return y.reshape(2, T, H, D).transpose(1, 2)

    q = heads(xt @ p["W_query"] + p["b_query"])
    k = heads(xt @ p["W_key"] + p["b_key"])
    v = heads(xt @ p["W_value"] + p["b_value"])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(torch.cat([angles, angles], 1)), torch.sin(torch.cat([angles, angles], 1))

    def rope(t):
        return t * cos + torch.cat((-t[..., D // 2:], t[..., :D // 2]), -1) * sin

    q, k = rope(q), rope(k)
    buckets = torch.tensor(relative_position_bucket(T, T, 6, 8, bidirectional=False))
    scores = q @ k.transpose(-1, -2) / 2.0 + p["rel_bias"][buckets].permute(2, 0, 1)
    scores = 2.5 * torch.tanh(scores / 2.5)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    keep = torch.tensor((j <= i) & (j >= i - 2))
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = p["sinks"][:, None, None].expand(2, H, T, 1)
    weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    merged = (weights @ v).transpose(1, 2).reshape(2, T, 8)
    expected = merged @ p["W_out"] + p["b_out"]
    expected.backward(torch.tensor(dout))

    def close(ours, theirs):
        theirs = theirs.detach().numpy()
        assert np.shape(ours) == theirs.shape
        assert np.abs(ours - theirs).max() <= 1e-10 * max(1.0, np.abs(theirs).max())

    close(out, expected)
    close(dx, xt.grad)
    for name in layer.params:
        close(layer.grads[name], p[name].grad)


def test_weights_requested_run_on_the_reference_path():
    layer = make_layer(window=(2, 0), sinks=True)
    out, weights = layer.forward(np.ones((1, 5, 8)), is_causal=True, return_weights=True)
    assert layer.last_dispatch.path == "reference" and "weights requested" in layer.last_dispatch.reason
    assert weights.shape == (1, 2, 5, 5)
    assert np.all(weights.sum(-1) < 1)  # the sinks take their share
    assert np.all(np.triu(weights[0, 0], 1) == 0) and np.all(np.tril(weights[0, 0], -3) == 0)


@pytest.mark.parametrize("method", ["central", "complex_step"])
@pytest.mark.parametrize("options", [
    {"rope": True, "sinks": True, "window": (2, 0)},
    {"position_bias": "relative", "num_buckets": 6, "softcap": 2.0},
    {"position_bias": "alibi", "sinks": True, "impl": "tiled"},
])
def test_self_attention_with_variants(options, method):
    layer = qkvnp.SelfAttention(6, 4, rng=0, **options)
    rng = np.random.default_rng(13)
    for name in ("sinks", "rel_bias"):
        if name in layer.params:
            assert layer.params[name].shape == {"sinks": (1,), "rel_bias": (6, 1)}[name]
            layer.params[name][...] = rng.standard_normal(layer.params[name].shape)
    x = rng.standard_normal((2, 7, 6))
    keep = rng.random((2, 7, 7)) > 0.2  # (B, T, S): no head axis
    report = check_layer(layer, x, method=method,
                         forward_kwargs={"is_causal": True, "attn_mask": keep})
    assert report.ok, report
    full = layer.forward(x, is_causal=True)
    cache = KVCache()
    steps = np.concatenate([layer.forward(x[:, t:t + 1], kv_cache=cache) for t in range(7)], 1)
    assert steps.shape == full.shape
    np.testing.assert_allclose(steps, full, rtol=0, atol=1e-13)
    _, weights = layer.forward(x, is_causal=True, return_weights=True)
    assert weights.shape == (2, 7, 7)


def test_public_names():
    assert qkvnp.functional.rope_forward is qkvnp.ops.variants.rope_forward
    assert callable(qkvnp.ops.positions.alibi_slopes)


@pytest.mark.parametrize("impl", ["reference", "tiled"])
@pytest.mark.parametrize("options", [
    {"rope": True, "position_bias": "relative", "sinks": True},  # learned bias and sinks summed over shares
    {"softcap": 30.0, "position_bias": "alibi", "window": (3, 2)},
])
def test_the_batch_split_equals_the_whole_batch(options, impl):
    """Oracle: the same layer on the whole batch in one thread (no split).

    With two threads and ``batch_split_flops=0`` each worker runs a share of
    the batch; a per-sample bool mask (one row fully masked) is sliced with it.
    """
    from qkvnp import kernels

    if impl == "tiled" and options.get("position_bias") == "relative":
        options = {"rope": True, "sinks": True}  # rel_bias runs on the reference path only
    rng = np.random.default_rng(21)
    x, dout = rng.standard_normal((5, 9, 8)), rng.standard_normal((5, 9, 8))
    mask = rng.random((5, 1, 9, 9)) > 0.3
    mask[2, 0, 4] = False  # a fully masked row
    results = []
    for threads in (1, 2):
        layer = MultiHeadAttention(8, 2, rng=0, impl=impl, **options)
        with kernels.num_threads(threads), kernels.block_sizes(batch_split_flops=0):
            out = layer.forward(x, attn_mask=mask)
            split = isinstance(layer._cache, variant_layer.SplitVariantCache)
            dx = layer.backward(dout)
        assert split == (threads == 2)
        results.append((out, dx, dict(layer.grads)))
    (out, dx, grads), (split_out, split_dx, split_grads) = results
    assert sorted(split_grads) == sorted(grads)
    for ours, theirs in [(split_out, out), (split_dx, dx)] + [
            (split_grads[name], grads[name]) for name in grads]:
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12 * max(1.0, np.abs(theirs).max()))
