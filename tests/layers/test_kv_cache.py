"""Incremental decoding with ``qkvnp.KVCache`` and ``MultiHeadAttention.forward(x, kv_cache=)``.

Oracle: the full causal forward of the same layer over the whole sequence
(itself checked against central differences and PyTorch): decoding token by
token, or in chunks of several tokens, must give its outputs to 1e-12 in
float64, on every path, with and without grouped-query attention. Errors are
checked against the documented contract (one cache per layer and shape,
inference only).
"""
import numpy as np
import pytest

import qkvnp


def layer_with_biases(impl, num_kv_heads=None, seed=0):
    layer = qkvnp.MultiHeadAttention(12, 6, rng=seed, impl=impl, num_kv_heads=num_kv_heads)
    rng = np.random.default_rng(seed + 1)
    for name, param in layer.params.items():
        if name.startswith("b_"):
            param[...] = rng.normal(size=param.shape)
    return layer


@pytest.mark.parametrize("num_kv_heads", [None, 3, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("chunks", [
    [1] * 9,  # token by token
    [4, 1, 1, 3],  # a prefix of several tokens, then tokens, then a chunk
])
def test_decoding_equals_the_full_causal_forward(impl, num_kv_heads, chunks):
    layer = layer_with_biases(impl, num_kv_heads)
    x = np.random.default_rng(2).normal(size=(2, sum(chunks), 12))
    full = layer.forward(x, is_causal=True)
    cache, outs, start = qkvnp.KVCache(), [], 0
    for n in chunks:
        out = layer.forward(x[:, start:start + n], kv_cache=cache)
        assert out.shape == (2, n, 12)
        outs.append(out)
        start += n
        assert len(cache) == start and cache.key.shape == (2, num_kv_heads or 6, start, 2)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=0, atol=1e-12)
    assert layer.last_dispatch.reason.startswith("kv_cache decoding step")


def test_decoding_with_padding_and_weights():
    # Oracle: the full forward with the same key padding (bool, True = real token);
    # the returned weights are the last rows of the full weights.
    layer = layer_with_biases("fast")
    x = np.random.default_rng(3).normal(size=(2, 5, 12))
    real = np.array([[False, True, True, True, True], [True] * 5])  # left padding
    full, full_weights = layer.forward(x, is_causal=True, key_padding_mask=real,
                                       return_weights=True)
    cache = qkvnp.KVCache()
    layer.forward(x[:, :3], kv_cache=cache, key_padding_mask=real[:, :3])
    out, weights = layer.forward(x[:, 3:], kv_cache=cache, key_padding_mask=real,
                                 return_weights=True)
    np.testing.assert_allclose(out, full[:, 3:], rtol=0, atol=1e-12)
    assert weights.shape == (2, 6, 2, 5)
    np.testing.assert_allclose(weights, full_weights[:, :, 3:], rtol=0, atol=1e-12)
    out, averaged = layer.forward(x[:, :1], kv_cache=qkvnp.KVCache(), return_weights=True,
                                  average_weights=True)
    assert averaged.shape == (2, 1, 1) and np.allclose(averaged, 1.0)


def test_backward_after_a_cached_step_raises():
    # Oracle: the contract: decoding is inference only, and says so.
    layer = layer_with_biases("reference")
    x = np.ones((1, 2, 12))
    layer.forward(x, kv_cache=qkvnp.KVCache())
    with pytest.raises(RuntimeError, match="kv_cache decoding step.*inference only"):
        layer.backward(np.ones((1, 2, 12)))
    layer.forward(x)  # a normal forward trains again
    assert layer.backward(np.ones((1, 2, 12))).shape == (1, 2, 12)


def test_the_cache_refuses_another_layer_or_shape_and_resets():
    # Oracle: the contract: one cache per layer and shape, with clear errors.
    first, second = layer_with_biases("fast"), layer_with_biases("fast", seed=1)
    cache = qkvnp.KVCache()
    assert repr(cache) == "KVCache(empty)" and cache.key is None
    first.forward(np.ones((2, 3, 12)), kv_cache=cache)
    with pytest.raises(ValueError, match="another layer.*one KVCache per layer"):
        second.forward(np.ones((2, 1, 12)), kv_cache=cache)
    with pytest.raises(ValueError, match=r"holds 3 tokens.*\(2, 6, 2\).*\(3, 6, 2\).*reset"):
        first.forward(np.ones((3, 1, 12)), kv_cache=cache)
    with pytest.raises(ValueError, match="key_padding_mask must have shape \\(2, 4\\)"):
        first.forward(np.ones((2, 1, 12)), kv_cache=cache, key_padding_mask=np.ones((2, 1), bool))
    assert len(cache) == 3  # refused calls leave the cache as it was
    with pytest.raises(ValueError, match="self-attention decoding"):
        first.forward(np.ones((2, 1, 12)), np.ones((2, 1, 12)), kv_cache=cache)
    with pytest.raises(TypeError, match="kv_cache must be a qkvnp.KVCache"):
        first.forward(np.ones((2, 1, 12)), kv_cache={})
    cache.reset()
    assert len(cache) == 0
    second.forward(np.ones((3, 1, 12)), kv_cache=cache)
    assert "length=1" in repr(cache)


def test_storage_grows_by_doubling():
    # Oracle: counting: 40 single tokens see three capacities (16, 32, 64), not 25.
    layer = layer_with_biases("reference")
    cache, capacities = qkvnp.KVCache(), set()
    for _ in range(40):
        layer.forward(np.ones((1, 1, 12)), kv_cache=cache)
        capacities.add(cache.key.base.shape[-2])
    assert len(cache) == 40 and capacities == {16, 32, 64}


def test_decoding_never_drops():
    # Oracle: the full forward in evaluation mode: a decoding step draws no dropout,
    # even in training mode, and refuses a dropout mask.
    layer = qkvnp.MultiHeadAttention(12, 6, rng=0, dropout=0.5, num_kv_heads=2)
    x = np.random.default_rng(4).normal(size=(1, 4, 12))
    cache = qkvnp.KVCache()
    assert layer.training
    steps = [layer.forward(x[:, t:t + 1], kv_cache=cache) for t in range(4)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1),
                               layer.eval().forward(x, is_causal=True), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="inference only and drops nothing"):
        layer.forward(x[:, :1], kv_cache=cache, dropout_mask=np.ones((1, 1), bool))


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 3]])
def test_self_attention_decoding_equals_its_full_causal_forward(impl, qkv_bias, chunks):
    """Oracle: the same full causal forward, for the single-head layer (the book's
    CausalAttention): no head axis in its outputs, weights and masks, no output
    projection; the weights of a step are the last rows of the full weights, and
    a (T, S) mask over the cached keys is the full forward's mask's last rows."""
    layer = qkvnp.SelfAttention(3, 4, qkv_bias=qkv_bias, rng=1, impl=impl)
    rng = np.random.default_rng(4)
    for name, param in layer.params.items():
        if name.startswith("b_"):
            param[...] = rng.normal(size=param.shape)
    x = rng.normal(size=(2, sum(chunks), 3))
    keep = rng.random((sum(chunks), sum(chunks))) > 0.3
    np.fill_diagonal(keep, True)  # every query keeps a key
    for mask in (None, keep):
        full, full_weights = layer.forward(x, mask, is_causal=True, return_weights=True)
        cache, start = qkvnp.KVCache(), 0
        for n in chunks:
            step_mask = None if mask is None else mask[start:start + n, :start + n]
            out, weights = layer.forward(x[:, start:start + n], step_mask, kv_cache=cache,
                                         return_weights=True)
            assert out.shape == (2, n, 4) and weights.shape == (2, n, start + n)
            np.testing.assert_allclose(out, full[:, start:start + n], rtol=0, atol=1e-12)
            np.testing.assert_allclose(weights, full_weights[:, start:start + n, :start + n],
                                       rtol=0, atol=1e-12)
            start += n
        assert cache.key.shape == (2, 1, start, 4) and len(cache) == start
    assert layer.last_dispatch.reason.startswith("kv_cache decoding step")


def test_self_attention_decoding_is_inference_only_and_checked():
    # Oracle: the contract, as for MultiHeadAttention.
    layer = qkvnp.SelfAttention(3, 4, rng=0, dropout=0.5)
    cache = qkvnp.KVCache()
    layer.forward(np.ones((1, 2, 3)), kv_cache=cache)
    with pytest.raises(RuntimeError, match="SelfAttention.backward after a kv_cache decoding"):
        layer.backward(np.ones((1, 2, 4)))
    with pytest.raises(ValueError, match="dropout_mask cannot be given with kv_cache"):
        layer.forward(np.ones((1, 1, 3)), kv_cache=cache, dropout_mask=np.ones((1, 3), bool))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., T, 3\)"):
        layer.forward(np.ones((1, 1, 5)), kv_cache=cache)
    with pytest.raises(ValueError, match="attn_mask"):
        layer.forward(np.ones((1, 1, 3)), np.ones((1, 2), bool), kv_cache=cache)  # S is 3
    with pytest.raises(ValueError, match="another layer"):
        qkvnp.SelfAttention(3, 4, rng=1).forward(np.ones((1, 1, 3)), kv_cache=cache)
    assert len(cache) == 2  # refused calls leave the cache as it was
    layer.forward(np.ones((1, 2, 3)))  # a normal forward trains again
    assert layer.backward(np.ones((1, 2, 4))).shape == (1, 2, 3)
