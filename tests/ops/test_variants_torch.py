"""The variants against PyTorch: autograd in float64 on the same math, flex_attention, the book's RoPE.

Oracles: PyTorch autograd of the score pipeline written in torch ops (bias,
``c * tanh(s / c)``, masks, a sink logit concatenated to each row as gpt-oss's
reference does), to 1e-10 of the largest entry on the output and on every
gradient; ``torch.nn.attention.flex_attention`` (forward only: its backward
does not run on CPU) with ``score_mod``/``mask_mod``; RoPE against the book's
Llama functions (``compute_rope_params``/``apply_rope``, rotate-half) and
Meta's original complex-multiplication RoPE (interleaved), written out in torch.
T5's buckets against the ``transformers`` formula, written out in torch.
"""
import math

import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.ops.positions import alibi_bias, alibi_slopes, relative_position_bucket

torch = None  # PyTorch, set for each test by the fixture below


@pytest.fixture(autouse=True)
def _use_torch(torch):
    """conftest's ``torch``: skipped without PyTorch (one summary line), an error in CI."""
    globals()["torch"] = torch

TOL = 1e-10


def close(ours, theirs):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert np.shape(ours) == theirs.shape
    scale = max(1.0, float(np.abs(theirs).max(initial=0.0)))
    assert float(np.abs(ours - theirs).max(initial=0.0)) <= TOL * scale


def band_by_loop(T, S, window, is_causal):
    offset = S - T if is_causal == "bottom_right" else 0
    keep = np.ones((T, S), bool)
    for i in range(T):
        for j in range(S):
            if window is not None:
                left, right = window
                keep[i, j] &= (left is None or j >= i + offset - left)
                keep[i, j] &= (right is None or j <= i + offset + right)
            if is_causal:
                keep[i, j] &= j <= i + offset
    return keep


def torch_attention(q, k, v, scale, bias, softcap, keep, sinks):
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~torch.as_tensor(keep), float("-inf"))
    if sinks is None:
        return torch.softmax(scores, -1) @ v
    column = sinks[:, None, None].expand(scores.shape[:-1] + (1,))
    weights = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]  # gpt-oss's sink
    return weights @ v


CASES = [
    {"softcap": None, "window": None, "is_causal": False, "sinks": True},
    {"softcap": 1.5, "window": None, "is_causal": True, "sinks": False},
    {"softcap": 30.0, "window": (2, 0), "is_causal": True, "sinks": True},
    {"softcap": None, "window": (1, 2), "is_causal": False, "sinks": True},
    {"softcap": 0.8, "window": (3, 0), "is_causal": "bottom_right", "sinks": True},
]


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_every_gradient_match_torch_autograd(case):
    rng = np.random.default_rng(0)
    B, H, T, S, D, Dv = 2, 3, 5, 7, 4, 3
    arrays = {"query": rng.standard_normal((B, H, T, D)), "key": rng.standard_normal((B, H, S, D)),
              "value": rng.standard_normal((B, H, S, Dv)),
              "score_bias": rng.standard_normal((H, T, S)), "sinks": rng.standard_normal(H)}
    if not case["sinks"]:
        del arrays["sinks"]
    out, cache = F.attention_forward(**arrays, is_causal=case["is_causal"],
                                     softcap=case["softcap"], window=case["window"])
    dout = rng.standard_normal(out.shape)
    grads = F.attention_backward(dout, cache)
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in arrays.items()}
    keep = band_by_loop(T, S, case["window"], case["is_causal"])
    expected = torch_attention(tensors["query"], tensors["key"], tensors["value"], 1 / 2.0,
                               tensors["score_bias"], case["softcap"], keep, tensors.get("sinks"))
    expected.backward(torch.tensor(dout))
    close(out, expected)
    names = ["query", "key", "value", "score_bias", "sinks"]
    for name, grad in zip(names, grads):
        if name in tensors:
            close(grad, tensors[name].grad)
        else:
            assert grad is None


# torch warns that eager flex_attention materialises the scores: what this oracle wants
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_alibi_and_softcap_forward_match_flex_attention():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    rng = np.random.default_rng(1)
    B, H, T, S, D = 1, 4, 6, 6, 4
    q, k, v = (rng.standard_normal((B, H, n, D)) for n in (T, S, S))
    slopes = torch.tensor(alibi_slopes(H))
    cap, left = 2.5, 2

    def score_mod(score, b, h, i, j):
        return cap * torch.tanh((score - slopes[h] * (i - j).abs()) / cap)

    def mask_mod(b, h, i, j):
        return (j <= i) & (j >= i - left)

    try:
        block_mask = flex.create_block_mask(mask_mod, None, None, T, S, device="cpu")
        expected = flex.flex_attention(*(torch.tensor(a) for a in (q, k, v)), score_mod=score_mod,
                                       block_mask=block_mask)
    except Exception as error:  # noqa: BLE001 - flex's CPU support varies by build
        pytest.skip(f"flex_attention does not run here: {error}")
    out, _ = F.attention_forward(q, k, v, is_causal=True, window=(left, 0), softcap=cap,
                                 score_bias=alibi_bias(T, S, alibi_slopes(H)))
    close(out, expected)


def book_compute_rope_params(head_dim, theta_base=10_000, context_length=4096):
    # the book's Llama chapter (LLMs-from-scratch ch05/07), written out
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                     [: head_dim // 2] / head_dim))
    positions = torch.arange(context_length, dtype=torch.float64)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def book_apply_rope(x, cos, sin):
    batch_size, num_heads, seq_len, head_dim = x.shape
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    cos, sin = cos[:seq_len, :][None, None], sin[:seq_len, :][None, None]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def meta_apply_rotary(x, theta=10_000.0):
    # Meta's original Llama: pairs (2i, 2i+1) as complex numbers times e^{i m theta_i}
    T, D = x.shape[-2:]
    freqs = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64)[: D // 2] / D))
    freqs_cis = torch.polar(torch.ones(T, D // 2, dtype=torch.float64),
                            torch.outer(torch.arange(T, dtype=torch.float64), freqs))
    x_complex = torch.view_as_complex(x.reshape(x.shape[:-1] + (D // 2, 2)))
    return torch.view_as_real(x_complex * freqs_cis).flatten(-2)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_matches_the_book_and_meta_with_gradients(layout):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 9, 8))
    out, cache = F.rope_forward(x, base=500.0, layout=layout)
    dout = rng.standard_normal(out.shape)
    dx = F.rope_backward(dout, cache)
    xt = torch.tensor(x, requires_grad=True)
    if layout == "half":
        cos, sin = book_compute_rope_params(8, theta_base=500.0, context_length=16)
        expected = book_apply_rope(xt, cos, sin)
    else:
        expected = meta_apply_rotary(xt, theta=500.0)
    expected.backward(torch.tensor(dout))
    close(out, expected)
    close(dx, xt.grad)


def t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    # transformers' T5Attention._relative_position_bucket, written out
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (torch.log(relative_position.float() / max_exact)
                            / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return relative_buckets + torch.where(is_small, relative_position, if_large)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 40), (8, 20)])
@pytest.mark.parametrize("T, S, offset", [(300, 300, 0), (3, 500, 497)])
def test_relative_buckets_match_t5(bidirectional, num_buckets, max_distance, T, S, offset):
    relative = torch.arange(S)[None, :] - (torch.arange(T)[:, None] + offset)
    expected = t5_bucket(relative, bidirectional, num_buckets, max_distance).numpy()
    ours = relative_position_bucket(T, S, num_buckets, max_distance, bidirectional, offset=offset)
    assert ours.shape == expected.shape
    np.testing.assert_array_equal(ours, expected)
