"""The decoding step's kernels (qkvnp.kernels.decode) and SiLU's fused passes against the reference ops.

Oracles: the reference ops of qkvnp.functional (rms_norm_forward, layer_norm_forward,
rope_forward, variant_attention_forward with GQA, gated_mlp_forward, linear_forward
and gelu_forward, silu_forward/backward),
and a block's decoding step through its layers' own calls (the reference path,
forced), in float64 to 1e-12 and float32 to 1e-5 relative.
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.kernels import choose_decode_path
from qkvnp.kernels.decode import feed_forward_infer, gated_mlp_infer, gqa_attention_infer, \
    layer_norm_infer, rms_norm_infer, rope_infer
from qkvnp.kernels.pointwise import silu_backward_fused, silu_forward_fused
from qkvnp.layers.kv_cache import KVCache
from qkvnp.models.decoder import Decoder, DecoderConfig
from qkvnp.ops.variants import rope_forward, variant_attention_forward

TOL = {np.float64: 1e-12, np.float32: 1e-5}
DTYPES = [np.float64, np.float32]


def _close(actual, expected, dtype):
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype)
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
    assert error < TOL[dtype], f"relative error {error:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])  # Llama's weight, Gemma's 1 + weight
def test_rms_norm_infer(dtype, unit_offset):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(2, 3, 8)).astype(dtype), rng.normal(size=8).astype(dtype)
    expected = F.rms_norm_forward(x, w, 1e-6, unit_offset=unit_offset)[0]
    _close(rms_norm_infer(x, w, 1e-6, unit_offset), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_infer(dtype):
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(2, 3, 8)) + 3.0).astype(dtype)  # rows off zero mean
    weight, bias = (rng.normal(size=8).astype(dtype) for _ in range(2))
    expected = F.layer_norm_forward(x, weight, bias, 1e-5)[0]
    _close(layer_norm_infer(x, weight, bias, 1e-5), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 16}])
def test_rope_infer(dtype, scaling):  # plain; YaRN's scaled frequencies and attention factor
    from qkvnp.ops.rope_scaling import rope_inverse_frequency

    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 4, 3, 8)).astype(dtype)
    positions = np.array([[[5, 6, 7]], [[0, 1, 2]]])  # (B, 1, T)
    frequency, factor = rope_inverse_frequency(8, 1e6, scaling)
    expected = rope_forward(x, positions, base=1e6, layout="half", inverse_frequency=frequency,
                            attention_factor=factor)[0]
    _close(rope_infer(x, positions, frequency, factor), expected.astype(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])  # one new token; a prompt
def test_gqa_attention_infer(dtype, T):
    rng = np.random.default_rng(2)
    B, H, K, S, D = 2, 4, 2, 6, 8
    q = rng.normal(size=(B, H, T, D)).astype(dtype)
    k, v = (rng.normal(size=(B, K, S, D)).astype(dtype) for _ in range(2))
    keep = np.tril(np.ones((T, S), bool), S - T)[None, None] & \
        np.array([[True] * S, [False] + [True] * (S - 1)])[:, None, None, :]  # causal, a pad key
    expected = variant_attention_forward(q, k, v, keep, False, 0.3, enable_gqa=True)[0]
    _close(gqa_attention_infer(q, k, v, keep, 0.3), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_infer(dtype, activation):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 8)).astype(dtype)
    W_gate, W_up = (rng.normal(size=(8, 12)).astype(dtype) for _ in range(2))
    W_down = rng.normal(size=(12, 8)).astype(dtype)
    expected = F.gated_mlp_forward(x, W_gate, W_up, W_down, activation=activation)[0]
    _close(gated_mlp_infer(x, W_gate, W_up, W_down, activation), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])  # GPT-2's; a FeedForward without biases
def test_feed_forward_infer(dtype, bias):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(2, 3, 8)).astype(dtype)
    W_first = rng.normal(size=(8, 12)).astype(dtype)
    W_second = rng.normal(size=(12, 8)).astype(dtype)
    b_first, b_second = (rng.normal(size=n).astype(dtype) if bias else None for n in (12, 8))
    hidden = F.gelu_forward(F.linear_forward(x, W_first, b_first)[0], "tanh")[0]
    expected = F.linear_forward(hidden, W_second, b_second)[0]
    _close(feed_forward_infer(x, W_first, b_first, W_second, b_second), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_fused(dtype):
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(3, 5)) * 30).astype(dtype)  # both signs, some saturated
    dout = rng.normal(size=(3, 5)).astype(dtype)
    out, cache = F.silu_forward(x)
    fused_out, fused_cache = silu_forward_fused(x)
    _close(fused_out, out, dtype)
    _close(silu_backward_fused(dout, fused_cache), F.silu_backward(dout, cache), dtype)


def test_choose_decode_path_reasons():
    keep = np.ones((1, 1, 1, 2), bool)
    assert choose_decode_path("pre", "rms", "silu", None, np.float64, keep).path == "fast"
    assert choose_decode_path("pre", "layer", "gelu_tanh", None, np.float64, keep,
                              gated=False).path == "fast"  # GPT-2's
    for args in [("post", "rms", "silu", None, np.float64, keep),
                 ("pre", "other", "silu", None, np.float64, keep),
                 ("pre", "rms", "other", None, np.float64, keep),
                 ("pre", "layer", "gelu", None, np.float64, keep, True, False),  # exact GELU
                 ("pre", "layer", "silu", None, np.float64, keep, True, False),
                 ("pre", "rms", "silu", 30.0, np.float64, keep),
                 ("pre", "rms", "silu", None, np.complex128, keep),
                 ("pre", "rms", "silu", None, np.float64, np.zeros((1, 1, 1, 2), bool)),
                 ("pre", "rms", "silu", None, np.float64, keep, False)]:  # LoRA
        dispatch = choose_decode_path(*args)
        assert dispatch.path == "reference" and dispatch.reason.startswith("reference: ")


def test_gpt2_block_decode_path():  # fast with tanh GELU; reference, and why, with erf
    model = Decoder(DecoderConfig.gpt2(vocab_size=40, emb_dim=16, num_layers=1, num_heads=4,
                                       context_length=16), rng=0, dtype=np.float32)
    block, x, keep = model.blocks[0], np.zeros((1, 1, 16), np.float32), np.ones((1, 1, 1, 2), bool)
    assert block._decode_path(x, keep) == "fast"
    block.mlp.layers[1].approximate = "none"  # the erf form
    assert block._decode_path(x, keep) == "reference"
    dispatch = choose_decode_path("pre", "layer", "gelu", None, np.float32, keep, gated=False)
    assert dispatch.reason == "reference: the fast step's plain MLP runs the tanh GELU, not 'gelu'"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3", "mistral", "llama3", "gpt2", "gpt2_padded"])
def test_decode_fast_equals_reference(dtype, family, monkeypatch):
    # QK-norm; a rolling window; llama3 scaling; GPT-2's LayerNorms, biases and plain MLP,
    # and a left-padded batch (pad keys in every step, pad query rows in the prompt)
    sizes = dict(vocab_size=40, emb_dim=16, num_layers=2, num_heads=4)
    llama_sizes = dict(sizes, num_kv_heads=2, hidden_dim=24)
    cfg = {"qwen3": lambda: DecoderConfig.qwen3(head_dim=8, **llama_sizes),
           "mistral": lambda: DecoderConfig.mistral(sliding_window=3, **llama_sizes),
           "llama3": lambda: DecoderConfig.llama3(rope_scaling={
               "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 4}, **llama_sizes),
           "gpt2": lambda: DecoderConfig.gpt2(context_length=16, **sizes),
           "gpt2_padded": lambda: DecoderConfig.gpt2(context_length=16, **sizes)}[family]()
    model = Decoder(cfg, rng=0, dtype=dtype)
    rng = np.random.default_rng(5)
    if family.startswith("gpt2"):  # biases, shifts and scales off their zeros and ones
        for value in model.params.values():
            value += (0.1 * rng.normal(size=value.shape)).astype(dtype)
    ids = rng.integers(0, 40, (2, 7))
    mask = np.ones((2, 7), int)
    if family == "gpt2_padded":
        mask[1, :2] = 0  # the second row's two first tokens are padding
    x, keep = np.zeros((2, 1, 16), dtype), np.ones((2, 1, 1, 2), bool)
    assert all(block._decode_path(x, keep) == "fast" for block in model.blocks)

    def run():
        caches = [KVCache() for _ in range(cfg.num_layers)]
        steps = [model.decode(ids[:, :4], caches, attention_mask=mask[:, :4])[:, -1]]
        steps += [model.decode(ids[:, t:t + 1], caches, attention_mask=mask[:, :t + 1])[:, -1]
                  for t in range(4, 7)]
        return np.stack(steps)

    fast = run()
    from qkvnp.layers.decoder_block import DecoderBlock
    monkeypatch.setattr(DecoderBlock, "_decode_path", lambda self, x, keep: "reference")
    reference = run()
    _close(fast, reference, dtype)
    np.testing.assert_array_equal(fast.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_fused(dtype, unit_offset):
    from qkvnp.kernels.pointwise import rms_norm_backward_fused, rms_norm_forward_fused

    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 3, 4, 8)).astype(dtype).swapaxes(1, 2)  # a view, as split heads give
    w, dout = rng.normal(size=8).astype(dtype), rng.normal(size=(2, 4, 3, 8)).astype(dtype)
    out, cache = F.rms_norm_forward(x, w, 1e-6, unit_offset=unit_offset)
    fused_out, fused_cache = rms_norm_forward_fused(x, w, 1e-6, unit_offset)
    _close(fused_out, out, dtype)
    dx, dweight = F.rms_norm_backward(dout, cache)
    fused_dx, fused_dweight = rms_norm_backward_fused(dout, fused_cache)
    _close(fused_dx, dx, dtype)
    _close(fused_dweight, dweight, dtype)


def test_silu_fused_saturates_without_warning():
    x = np.array([-1000.0, -90.0, 0.0, 90.0, 1000.0], np.float32)  # exp(-x) overflows at -1000
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow is the limit
        out, _ = silu_forward_fused(x)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_allclose(out, [0.0, -90.0 * np.exp(-90.0), 0.0, 90.0, 1000.0], atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_fast_reads_each_norms_own_eps(dtype, monkeypatch):
    """Oracle: the reference path (forced). A block whose attention norm, MLP norm
    and QK-norms each have an eps of their own (large enough to move the output
    far beyond the tolerance): the fast step must read each norm's, as the layers do."""
    cfg = DecoderConfig.qwen3(vocab_size=40, emb_dim=16, num_layers=1, num_heads=4,
                              num_kv_heads=2, hidden_dim=24, head_dim=8)
    model = Decoder(cfg, rng=0, dtype=dtype)
    block = model.blocks[0]
    for norm, eps in ((block.attn_norm, 0.5), (block.mlp_norm, 2.0),
                      (block.self_attn.q_norm, 0.1), (block.self_attn.k_norm, 3.0)):
        norm.eps = eps
    ids = np.random.default_rng(6).integers(0, 40, (2, 5))

    def run():
        return model.decode(ids, [KVCache()])[:, -1]

    fast = run()
    from qkvnp.layers.decoder_block import DecoderBlock
    assert block._decode_path(np.zeros((2, 5, 16), dtype), np.ones((2, 1, 5, 5), bool)) == "fast"
    monkeypatch.setattr(DecoderBlock, "_decode_path", lambda self, x, keep: "reference")
    _close(fast, run(), dtype)
