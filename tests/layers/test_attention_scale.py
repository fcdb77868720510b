"""The attention layers' ``scale`` option (T5's 1.0, Gemma's ``query_pre_attn_scalar ** -0.5``).

Shape key: B batch, H heads, K key/value heads, T length, E embedding, D = E // H.

Oracles: PyTorch autograd of the same layer written with
``torch.nn.functional.scaled_dot_product_attention(scale=...)`` (outputs
and every gradient, random upstream gradient, 1e-12 in float64) on each path
a layer can take (reference, tiled, fast and auto, which fall back where
they cannot take a scale, and say so); KV-cache decoding step by step equals
the causal forward; ``scale=1/sqrt(D)`` given equals ``scale=None``; the
complex step of :mod:`qkvnp.gradcheck`; ``scale=None`` leaves the layer
exactly as it was (same outputs bit for bit, ``repr``, ``state_dict``).
"""
import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import check_layer

TOL = 1e-12
PATHS = ["reference", "tiled", "fast", "auto"]


def torch_layer(torch, params, x, num_heads, num_kv_heads, scale, is_causal, out_proj=True):
    """The layer in torch: projections, heads, SDPA with ``scale``, merge, output projection."""
    p = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    xt = torch.tensor(x, requires_grad=True)

    def project(name):
        y = xt @ p["W_" + name]
        return y + p["b_" + name] if "b_" + name in p else y

    def heads(y, n):  # (B, T, n*D) -> (B, n, T, D)
        return y.reshape(y.shape[:-1] + (n, -1)).transpose(-3, -2)

    q, k, v = heads(project("query"), num_heads), heads(project("key"), num_kv_heads), \
        heads(project("value"), num_kv_heads)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, scale=scale, enable_gqa=num_kv_heads != num_heads)
    o = o.transpose(-3, -2).reshape(x.shape[:-1] + (-1,))  # (B, H, T, D) -> (B, T, E)
    if out_proj:
        o = o @ p["W_out"] + p["b_out"]
    return o, xt, p


@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("scale, num_kv_heads", [(1.0, 4), (0.3, 2), (256 ** -0.5, 1)],
                         ids=["t5", "gqa", "gemma-mqa"])
def test_multi_head_attention_scale_matches_torch_sdpa(torch, impl, scale, num_kv_heads):
    rng = np.random.default_rng(0)
    mha = qkvnp.MultiHeadAttention(16, 4, num_kv_heads=num_kv_heads, rng=1, impl=impl,
                                   scale=scale)
    x = rng.standard_normal((2, 6, 16))
    dout = rng.standard_normal((2, 6, 16))
    out = mha.forward(x, is_causal=True)
    dx = mha.backward(dout)
    assert mha.last_dispatch.path in ("reference", "tiled")
    if impl != "reference":
        assert "scale" in mha.last_dispatch.reason
    expected, xt, p = torch_layer(torch, mha.params, x, 4, num_kv_heads, scale, True)
    expected.backward(torch.tensor(dout))
    assert out.shape == expected.shape and dx.shape == x.shape
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=TOL)
    for name, grad in mha.grads.items():
        np.testing.assert_allclose(grad, p[name].grad.numpy(), rtol=0, atol=TOL, err_msg=name)


@pytest.mark.parametrize("impl", PATHS)
def test_self_attention_scale_matches_torch_sdpa(torch, impl):
    rng = np.random.default_rng(2)
    layer = qkvnp.SelfAttention(6, 4, True, rng=3, impl=impl, scale=1.0)
    x = rng.standard_normal((3, 5, 6))
    dout = rng.standard_normal((3, 5, 4))
    out = layer.forward(x, is_causal=False)
    dx = layer.backward(dout)
    expected, xt, p = torch_layer(torch, layer.params, x, 1, 1, 1.0, False, out_proj=False)
    expected.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=TOL)
    for name, grad in layer.grads.items():
        np.testing.assert_allclose(grad, p[name].grad.numpy(), rtol=0, atol=TOL, err_msg=name)


@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("options", [{}, {"rope": True, "window": (3, 0)}, {"softcap": 5.0}],
                         ids=["plain", "rope-window", "softcap"])
def test_kv_cache_decoding_with_scale_equals_the_causal_forward(impl, options):
    x = np.random.default_rng(4).standard_normal((2, 7, 8))
    mha = qkvnp.MultiHeadAttention(8, 2, num_kv_heads=1, rng=5, impl=impl, scale=0.9, **options)
    full = mha.forward(x, is_causal=True)
    cache = qkvnp.KVCache()
    steps = [mha.forward(x[:, :3], kv_cache=cache)] + [
        mha.forward(x[:, t:t + 1], kv_cache=cache) for t in range(3, 7)]
    assert "scale" in mha.last_dispatch.reason or impl == "reference"
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=TOL)


@pytest.mark.parametrize("impl", PATHS)
def test_explicit_default_scale_equals_none_and_another_differs(impl):
    # 1/sqrt(D) given is the default itself (Gemma's query_pre_attn_scalar = D): every path kept
    x = np.random.default_rng(6).standard_normal((2, 5, 8))
    layer = qkvnp.MultiHeadAttention(8, 2, rng=7, impl=impl)
    plain = layer.forward(x, is_causal=True)
    explicit = qkvnp.MultiHeadAttention(8, 2, rng=7, impl=impl, scale=4 ** -0.5)
    assert explicit.variants is None and repr(explicit) == repr(layer)
    assert np.array_equal(explicit.forward(x, is_causal=True), plain)
    assert explicit.last_dispatch == layer.last_dispatch
    other = qkvnp.MultiHeadAttention(8, 2, rng=7, impl=impl, scale=1.0)
    assert np.max(np.abs(other.forward(x, is_causal=True) - plain)) > 1e-3


def test_scale_none_changes_nothing():
    x = np.random.default_rng(8).standard_normal((2, 5, 8))
    for impl in PATHS:
        old = qkvnp.MultiHeadAttention(8, 2, rng=9, impl=impl)
        new = qkvnp.MultiHeadAttention(8, 2, rng=9, impl=impl, scale=None)
        assert repr(old) == repr(new) and new.variants is None
        assert old.state_dict().keys() == new.state_dict().keys()
        assert np.array_equal(old.forward(x, is_causal=True), new.forward(x, is_causal=True))
        assert old.last_dispatch == new.last_dispatch
    scaled = qkvnp.MultiHeadAttention(8, 2, rng=9, scale=0.7)
    assert repr(scaled).endswith("scale=0.7)")
    assert scaled.state_dict().keys() == old.state_dict().keys()


def test_block_and_gpt_forward_the_scale():
    block = qkvnp.TransformerBlock(8, 2, rng=0, scale=1.0)
    assert block.att.variants.scale == 1.0
    model = qkvnp.GPTModel(11, 6, 8, 2, 2, rng=0, scale=0.25)
    assert all(b.att.variants.scale == 0.25 for b in model.trf_blocks)
    # the oracle: the same model on the reference path, whose layer the torch tests above certify
    ids = np.array([[1, 5, 2, 9]])
    scaled = qkvnp.GPTModel(11, 6, 8, 2, 2, rng=0, scale=0.3, impl="reference").forward(ids)
    for impl in ("tiled", "fast", "auto"):
        other = qkvnp.GPTModel(11, 6, 8, 2, 2, rng=0, scale=0.3, impl=impl).forward(ids)
        np.testing.assert_allclose(other, scaled, rtol=0, atol=TOL)
    plain = qkvnp.GPTModel(11, 6, 8, 2, 2, rng=0).forward(ids)
    assert np.max(np.abs(scaled - plain)) > 1e-6


def test_scale_complex_step_certificate():
    layer = qkvnp.MultiHeadAttention(4, 2, num_kv_heads=1, rng=0, impl="reference", scale=0.7)
    x = np.random.default_rng(1).standard_normal((2, 3, 4))
    report = check_layer(layer, x, forward_kwargs={"is_causal": True}, method="complex_step")
    assert report.ok, report


@pytest.mark.parametrize("scale, error", [(0.0, ValueError), (-1.0, ValueError),
                                          (float("inf"), ValueError), (float("nan"), ValueError),
                                          ("1", TypeError), (True, TypeError),
                                          (np.array(1.0), TypeError)])
def test_bad_scale_refused_by_name(scale, error):
    for build in (lambda: qkvnp.MultiHeadAttention(8, 2, scale=scale),
                  lambda: qkvnp.SelfAttention(8, 4, scale=scale),
                  lambda: qkvnp.GPTModel(11, 6, 8, 2, 1, scale=scale)):
        with pytest.raises(error, match="scale must be None"):
            build()
