"""Dropout against PyTorch, with the mask replayed: outputs and every gradient.

Oracle: PyTorch autograd. PyTorch's own dropout mask cannot be fed back into
its SDPA, so the mask is **extracted** from ``torch.nn.functional.dropout``:
with the same seed, shape and dtype, dropout of a tensor of ones draws the
same Bernoulli mask as the dropout of the weights (``Z = dropout(ones) != 0``).
Then

- ``functional.attention_forward`` (each core) is compared with attention
  written in torch with ``torch.nn.functional.dropout`` applied to the
  softmax weights under that seed;
- ``qkvnp.MultiHeadAttention`` with ``torch.nn.MultiheadAttention(dropout=p)``
  in training mode (``need_weights=True``: the path that calls
  ``dropout(attn_output_weights)`` on ``(B*H, T, S)`` weights), weights copied
  over, its mask extracted the same way and given to ours as
  ``dropout_mask``;
- the book's ``CausalAttention`` and ``MultiHeadAttention`` (``nn.Dropout``
  on the weights) in training mode, loaded by ``qkvnp.interop``.

Agreement: ``max|ours - torch| / max(1, max|torch|)`` below 1e-10 in float64
(1e-5 in float32), outputs, weights, input and parameter gradients.
PyTorch is never imported at module level: tests take the ``torch`` fixture.
"""
import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp.kernels import fast, tiled

from oracles import load_into_torch_mha, torch_mha_param_grads

TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}
CORES = {"reference": (F.attention_forward, F.attention_backward),
         "fast": (fast.attention_forward, fast.attention_backward),
         "tiled": (tiled.attention_forward, tiled.attention_backward)}


def assert_close(name, ours, theirs, dtype):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{name}: shape {ours.shape} != {theirs.shape}"
    error = float(np.abs(ours.astype(np.float64) - theirs).max()) / max(1.0, float(np.abs(theirs).max()))
    assert error <= TOLERANCE[np.dtype(dtype)], f"{name}: scaled error {error:.3g}"


def torch_mask(torch, seed, shape, p, dtype):
    """The mask ``torch.nn.functional.dropout`` draws for ``shape`` under ``seed``."""
    torch.manual_seed(seed)
    ones = torch.ones(shape, dtype=getattr(torch, np.dtype(dtype).name))
    return (torch.nn.functional.dropout(ones, p, training=True) != 0).numpy()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("core", sorted(CORES))
@pytest.mark.parametrize("seed", range(3))
def test_attention_with_torch_dropout_mask_matches_torch(torch, core, seed, dtype):
    rng = np.random.default_rng(300 + seed)
    B, H, T, S, D, Dv = 2, 3, int(rng.integers(1, 7)), int(rng.integers(1, 9)), 4, 5
    p = [0.1, 0.5, 0.8][seed]
    q, k, v = (rng.normal(size=shape).astype(dtype)
               for shape in [(B, H, T, D), (B, H, S, D), (B, H, S, Dv)])
    attn_mask = rng.random((T, S)) < 0.8
    is_causal = seed == 1
    dout = rng.normal(size=(B, H, T, Dv)).astype(dtype)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    scores = tq @ tk.transpose(-1, -2) / np.sqrt(D)
    allowed = torch.tensor(attn_mask & (np.tril(np.ones((T, S), bool)) if is_causal else True))
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    weights = torch.nan_to_num(weights)  # fully masked rows: 0, as qkvnp (and torch's SDPA)
    torch.manual_seed(seed)
    dropped = torch.nn.functional.dropout(weights, p, training=True)
    t_out = dropped @ tv
    t_out.backward(torch.tensor(dout))
    mask = torch_mask(torch, seed, (B, H, T, S), p, dtype)

    forward, backward = CORES[core]
    out, cache = forward(q, k, v, attn_mask, is_causal=is_causal, dropout_p=p, dropout_mask=mask)
    assert_close("out", out, t_out, dtype)
    for name, ours, theirs in zip(("dq", "dk", "dv"), backward(dout, cache), (tq, tk, tv)):
        assert_close(name, ours, theirs.grad, dtype)
    assert np.array_equal(np.broadcast_to(cache.dropout_mask, mask.shape), mask)


@pytest.mark.parametrize("seed", range(3))
def test_multihead_with_torch_dropout_matches_torch(torch, impl, seed):
    rng = np.random.default_rng(400 + seed)
    B, T, S, E, H, p = 2, int(rng.integers(2, 6)), int(rng.integers(2, 7)), 8, 2, [0.2, 0.5, 0.1][seed]
    layer = qkvnp.MultiHeadAttention(E, H, rng=seed, impl=impl, dropout=p)
    for name, value in layer.params.items():
        if name.startswith("b_"):
            value[...] = rng.normal(size=value.shape)
    query, key = rng.normal(size=(B, T, E)), rng.normal(size=(B, S, E))
    dout = rng.normal(size=(B, T, E))

    t_layer = torch.nn.MultiheadAttention(E, H, dropout=p, batch_first=True, dtype=torch.float64)
    load_into_torch_mha(torch, t_layer, layer.params)
    t_layer.train()
    tq, tk = torch.tensor(query, requires_grad=True), torch.tensor(key, requires_grad=True)
    torch.manual_seed(seed)
    t_out, t_weights = t_layer(tq, tk, tk, need_weights=True, average_attn_weights=False)
    t_out.backward(torch.tensor(dout))
    mask = torch_mask(torch, seed, (B * H, T, S), p, np.float64).reshape(B, H, T, S)

    if impl == "tiled":  # the tiled path never builds the weights
        out = layer.forward(query, key, dropout_mask=mask)
    else:
        out, weights = layer.forward(query, key, return_weights=True, dropout_mask=mask)
        assert_close("weights", weights, t_weights, np.float64)  # after dropout, as torch's
    assert layer.last_dispatch.path == impl
    dquery, dkey, _ = layer.backward(dout)
    assert_close("out", out, t_out, np.float64)
    assert_close("dquery", dquery, tq.grad, np.float64)
    assert_close("dkey", dkey, tk.grad, np.float64)
    for name, grad in torch_mha_param_grads(t_layer, E).items():
        assert_close(name, layer.grads[name], grad, np.float64)


@pytest.mark.parametrize("name", ["CausalAttention", "MultiHeadAttention"])
def test_book_layers_with_dropout_match_torch(torch, impl, name):
    """The book's layers in training mode with dropout 0.5 (weights loaded by
    ``qkvnp.interop``, the book's ``nn.Dropout`` mask extracted and replayed)."""
    from book_layers import INPUTS, book_layers
    from qkvnp.interop import from_torch, to_torch

    p, num_heads, seed = 0.5, 2, 7
    args = (3, 4, 6, p) + ((num_heads,) if name == "MultiHeadAttention" else ())
    torch.manual_seed(123)
    module = book_layers(torch)[name](*args).double().train()
    if name == "MultiHeadAttention":
        layer = qkvnp.MultiHeadAttention(embed_dim=4, num_heads=num_heads, qdim=3, kdim=3, vdim=3,
                                         qkv_bias=False, out_bias=True, impl=impl, dropout=p)
        shape = (2, num_heads, 6, 6)
    else:
        layer = qkvnp.SelfAttention(3, 4, impl=impl, dropout=p)
        shape = (2, 6, 6)
    from_torch(layer, module.state_dict(), "book." + name)
    x = np.stack([INPUTS, INPUTS[::-1]])  # (2, 6, 3)
    dout = np.random.default_rng(0).standard_normal((2, 6, 4))
    x_torch = torch.tensor(x, requires_grad=True)
    torch.manual_seed(seed)
    out_torch = module(x_torch)
    out_torch.backward(torch.tensor(dout))
    mask = torch_mask(torch, seed, shape, p, np.float64)
    assert 0 < mask.mean() < 1

    out = layer.forward(x, is_causal=True, dropout_mask=mask)
    assert_close("output", out, out_torch, np.float64)
    assert_close("input gradient", layer.backward(dout), x_torch.grad, np.float64)
    for name_, value in layer.params.items():  # the gradients, in torch's names and layout
        value[...] = layer.grads[name_]
    grads = to_torch(layer, "book." + name)
    for torch_name, parameter in module.named_parameters():
        assert_close(f"grad {torch_name}", grads[torch_name], parameter.grad, np.float64)
