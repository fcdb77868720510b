"""The layers' fused LayerNorm and GELU passes, and the checks a composite keeps when it skips its inner ones.

Shape key: B batch, T tokens, E embedding, F hidden width.

Oracles: the reference ops of :mod:`qkvnp.functional` (whose gradients
``tests/ops/test_transformer_ops.py`` checks by central differences and complex
step), float64, with random upstream gradients: the fused passes compute
the same formulas, so they agree to rounding (1e-12 relative). Refusals: a
NaN or inf placed in a parameter must raise, whatever check the layers skip
between their sub-layers.
"""
import warnings

import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp.kernels.pointwise import (gelu_tanh_backward_fused, gelu_tanh_forward_fused,
                                     gelu_tanh_reference_cache, layer_norm_backward_fused,
                                     layer_norm_forward_fused)

RTOL = {np.float64: 1e-12, np.float32: 2e-5}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 6), (2, 1, 4, 16)])  # one row; (B, T, E); 4-D
def test_fused_layer_norm_equals_the_reference_op(shape, dtype, rng):
    x = (rng.normal(size=shape) * 3 + 1).astype(dtype)
    scale = rng.normal(size=shape[-1]).astype(dtype)
    shift = rng.normal(size=shape[-1]).astype(dtype)
    dout = rng.normal(size=shape).astype(dtype)
    expected, ref_cache = F.layer_norm_forward(x, scale, shift)
    out, cache = layer_norm_forward_fused(x, scale, shift, 1e-5)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(out, expected, rtol=RTOL[dtype], atol=RTOL[dtype])
    for got, want in zip(layer_norm_backward_fused(dout, cache),
                         F.layer_norm_backward(dout, ref_cache)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=RTOL[dtype], atol=RTOL[dtype] * 10)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fused_gelu_equals_the_reference_op(dtype, rng):
    x = (rng.normal(size=(3, 4, 10)) * 4).astype(dtype)
    dout = rng.normal(size=x.shape).astype(dtype)
    expected, ref_cache = F.gelu_forward(x, "tanh")
    out, cache = gelu_tanh_forward_fused(x)
    assert out.shape == x.shape and out.dtype == dtype
    np.testing.assert_allclose(out, expected, rtol=RTOL[dtype], atol=RTOL[dtype])
    dx = gelu_tanh_backward_fused(dout, cache)
    assert dx.shape == x.shape and dx.dtype == dtype
    np.testing.assert_allclose(dx, F.gelu_backward(dout, ref_cache), rtol=RTOL[dtype],
                               atol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fused_gelu_and_the_reference_read_each_others_caches(dtype, rng):
    # Oracle: the reference op's backward on its own cache; the fused cache holds
    # s = sigmoid(2u), the reference's t = tanh u, and each backward reads the other's
    x = (rng.normal(size=(4, 5, 12)) * 4).astype(dtype)
    dout = rng.normal(size=x.shape).astype(dtype)
    _, ref_cache = F.gelu_forward(x, "tanh")
    _, cache = gelu_tanh_forward_fused(x)
    assert cache.inner is None and cache.sigmoid.shape == x.shape
    want = F.gelu_backward(dout, ref_cache)
    for got in (gelu_tanh_backward_fused(dout, ref_cache),
                F.gelu_backward(dout, gelu_tanh_reference_cache(cache))):
        assert got.shape == x.shape and got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=RTOL[dtype], atol=RTOL[dtype])
    layer = qkvnp.GELU()
    layer.forward(x, check=False)  # the fused pass; a checked backward reads its cache
    np.testing.assert_allclose(layer.backward(dout), want, rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fused_gelu_tails_give_no_nan_and_no_warning(dtype):
    # Oracle: closed forms in the tails, gelu(x) -> x as x -> +inf, -> -0.0 as x -> -inf
    # (exp(-2u) overflows to inf there: s = 0), and the float64 reference in between
    big = np.finfo(dtype).max ** 0.25  # x^2 finite: the backward's polynomial stays finite
    x = np.array([-big, -1e4, -60.0, -12.0, -3.0, 0.0, 3.0, 60.0, 1e4, big], dtype=dtype)
    dout = np.ones_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, cache = gelu_tanh_forward_fused(x)
        dx = gelu_tanh_backward_fused(dout, cache)
    assert not np.isnan(out).any() and not np.isnan(dx).any()
    assert np.all(out[:3] == 0) and np.all(np.signbit(out[:3]))  # -0.0
    np.testing.assert_array_equal(out[-3:], x[-3:])
    np.testing.assert_array_equal(dx[:3], 0)
    np.testing.assert_array_equal(dx[-3:], 1)
    assert -1e-30 < out[3] <= 0  # -12: the reference's 0.5 x (1 + t) rounds to -0.0 here
    want, want_cache = F.gelu_forward(x[4:7].astype(np.float64), "tanh")  # -3, 0, 3
    np.testing.assert_allclose(out[4:7], want, rtol=RTOL[dtype], atol=RTOL[dtype])
    np.testing.assert_allclose(dx[4:7], F.gelu_backward(np.ones(3), want_cache), rtol=RTOL[dtype],
                               atol=RTOL[dtype])


def test_fused_passes_leave_their_inputs_unchanged(rng):
    x, dout = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 3, 8))
    scale, shift = rng.normal(size=8), rng.normal(size=8)
    before = [a.copy() for a in (x, dout, scale, shift)]
    _, cache = layer_norm_forward_fused(x, scale, shift, 1e-5)
    layer_norm_backward_fused(dout, cache)
    _, cache = gelu_tanh_forward_fused(x)
    gelu_tanh_backward_fused(dout, cache)
    for a, b in zip((x, dout, scale, shift), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("approximate", ["tanh", "none"])  # fused; the reference (erf)
def test_feed_forward_equals_its_ops_line_by_line(approximate, rng):
    ff = qkvnp.FeedForward(6, rng=0, approximate=approximate)
    x, dout = rng.normal(size=(2, 5, 6)), rng.normal(size=(2, 5, 6))
    p = ff.params
    h, c1 = F.linear_forward(x, p["layers.0.W"], p["layers.0.b"])
    g, c2 = F.gelu_forward(h, approximate)
    expected, c3 = F.linear_forward(g, p["layers.2.W"], p["layers.2.b"])
    out = ff.forward(x)
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    dg, dW2, db2 = F.linear_backward(dout, c3)
    dx, dW1, db1 = F.linear_backward(F.gelu_backward(dg, c2), c1)
    np.testing.assert_allclose(ff.backward(dout), dx, rtol=1e-12, atol=1e-14)
    for name, want in (("layers.0.W", dW1), ("layers.0.b", db1), ("layers.2.W", dW2),
                       ("layers.2.b", db2)):
        np.testing.assert_allclose(ff.grads[name], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["ff.layers.0.W", "ff.layers.2.b", "norm2.scale"])
def test_a_block_refuses_a_nan_parameter_inside_it(name, rng):
    # NOTE: the block does not check its inner activations; its output check must
    block = qkvnp.TransformerBlock(8, 2, rng=0)
    block.params[name][0] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        block.forward(rng.normal(size=(2, 3, 8)))


@pytest.mark.parametrize("name", ["trf_blocks.1.ff.layers.0.W", "final_norm.shift",
                                  "out_head.W", "tok_emb.weight"])
def test_a_gpt_refuses_a_nan_or_inf_parameter(name):
    model = qkvnp.GPTModel(11, 8, 8, 2, 2, rng=0)
    model.params[name][...] = np.inf
    with np.errstate(all="ignore"), pytest.raises(ValueError, match="NaN or inf"):
        model.forward(np.array([[1, 2, 3]]))  # (inf - inf in a product may warn first)


def test_a_block_refuses_a_nan_input_naming_it(rng):
    block = qkvnp.TransformerBlock(8, 2, rng=0)
    x = rng.normal(size=(2, 3, 8))
    x[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="x contains NaN"):
        block.forward(x)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., T, 8\)"):
        block.forward(np.ones((3, 7)))


@pytest.mark.parametrize("name", ["trf_blocks.0.norm2.scale", "trf_blocks.1.ff.layers.2.W",
                                  "final_norm.scale", "out_head.W"])
def test_kv_cache_decoding_refuses_a_nan_parameter(name):
    # NOTE: decoding checks each block's input and output and the logits, not between
    model = qkvnp.GPTModel(11, 8, 8, 2, 2, rng=0).eval()
    model.params[name][...] = np.nan
    caches = [qkvnp.KVCache() for _ in range(2)]
    with np.errstate(all="ignore"), pytest.raises(ValueError, match="NaN or inf"):
        model.decode(np.array([[1, 2, 3]]), caches)


def _gated_whole_passes(gate_up, dhidden, activation):
    """The gated activation as the decoder's block ran it before the chunked pair: whole-array passes.

    Each line is one pass of the former ``silu_forward_fused`` /
    ``gelu_tanh_forward_fused`` + ``act * up`` and of the backward sequence.
    """
    F_ = gate_up.shape[1] // 2
    x, up = gate_up[:, :F_], gate_up[:, F_:]
    kind = x.dtype.type
    c, a, log2e = np.sqrt(2 / np.pi), 0.044715, 1 / np.log(2.0)
    with np.errstate(over="ignore", under="ignore"):
        if activation == "silu":
            s = np.exp(-x)
            s += 1
            np.reciprocal(s, out=s)
        else:
            s = x * x
            s *= kind(-2.0 * log2e * c * a)
            s += kind(-2.0 * log2e * c)
            s *= x
            np.exp2(s, out=s)
            s += 1.0
            np.divide(1.0, s, out=s)
        act = x * s
    hidden = act * up
    dgate_up = np.empty_like(gate_up)
    np.multiply(dhidden, act, out=dgate_up[:, F_:])
    dact = dhidden * up
    if activation == "silu":
        local = np.subtract(1, s, dtype=s.dtype)
        local *= x
        local += 1
        local *= s
    else:
        local = x * x
        local *= kind(6.0 * a * c)
        local += kind(2.0 * c)
        spread = 1.0 - s
        spread *= s
        local *= spread
        local *= x
        local += s
    local *= dact
    dgate_up[:, :F_] = local
    return hidden, act, s, dgate_up


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("chunk", [None, 3])  # the default chunk (one here); 3 rows, a remainder of 2
def test_gated_pair_equals_the_whole_array_passes_bit_for_bit(activation, dtype, chunk, rng,
                                                              monkeypatch):
    """Oracle: the same formulas as whole-array passes (``_gated_whole_passes``), equal bits.

    Row chunks, in-place passes and numpy's buffer size change which memory
    the passes run in, never a value; the extremes (exp overflowing, -0.0) included.
    """
    from qkvnp.kernels import pointwise

    N, F_ = 11, 40
    if chunk is not None:
        monkeypatch.setattr(pointwise, "_GATED_CHUNK", chunk * F_)
    gate_up = (rng.normal(size=(N, 2 * F_)) * 4).astype(dtype)
    gate_up[0, :6] = [-100.0, 100.0, -9.5, 0.0, -0.0, 1e-30]
    dhidden = rng.normal(size=(N, F_)).astype(dtype)
    want_hidden, want_act, want_s, want_dgate_up = _gated_whole_passes(gate_up, dhidden.copy(),
                                                                        activation)
    buffer_size = np.getbufsize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hidden, cache = pointwise.gated_forward_fused(gate_up, activation)
        dgate_up = pointwise.gated_backward_fused(dhidden.copy(), cache)
    assert np.getbufsize() == buffer_size  # numpy's setting restored
    assert hidden.shape == (N, F_) and dgate_up.shape == (N, 2 * F_)
    assert hidden.dtype == dgate_up.dtype == dtype
    for got, want in [(hidden, want_hidden), (cache.act, want_act),
                      (cache.act_cache.sigmoid, want_s), (dgate_up, want_dgate_up)]:
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
