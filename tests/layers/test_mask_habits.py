"""PyTorch's mask habits on MultiHeadAttention: (B*H, T, S) masks, averaged weights,
float key padding masks.

Oracle: ``torch.nn.MultiheadAttention`` in float64 with the same weights
(outputs, weights and every gradient, on every path); and, for the
ambiguity rules of 3-D masks, the documented contract and the equivalent
4-D mask.
"""
import numpy as np
import pytest

import qkvnp

from oracles import load_into_torch_mha, torch_mha_param_grads

B, T, S, E, H = 2, 3, 4, 8, 2


def layer_pair(torch, impl, seed=0):
    """Our layer with random biases and torch's with the same parameters."""
    ours = qkvnp.MultiHeadAttention(E, H, kdim=5, vdim=5, rng=seed, impl=impl)
    rng = np.random.default_rng(seed)
    for name, param in ours.params.items():
        if name.startswith("b_"):
            param[...] = rng.normal(size=param.shape)
    theirs = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=5, batch_first=True,
                                         dtype=torch.float64)
    load_into_torch_mha(torch, theirs, ours.params)
    return ours, theirs


def inputs(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, T, E)), rng.normal(size=(B, S, 5)), rng.normal(size=(B, S, 5)),
            rng.normal(size=(B, T, E)))


def compare(torch, ours, theirs, ours_kwargs, torch_kwargs, average):
    """Forward, weights and backward of both layers, float64 to 1e-12."""
    query, key, value, dout = inputs()
    out, weights = ours.forward(query, key, value, return_weights=True, average_weights=average,
                                **ours_kwargs)
    grads = ours.backward(dout)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (query, key, value))
    t_out, t_weights = theirs(tq, tk, tv, need_weights=True, average_attn_weights=average,
                              **torch_kwargs)
    t_out.backward(torch.tensor(dout))
    assert weights.shape == tuple(t_weights.shape)
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(weights, t_weights.detach().numpy(), rtol=0, atol=1e-12)
    for grad, t in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=0, atol=1e-12)
    for name, t_grad in torch_mha_param_grads(theirs, E).items():
        np.testing.assert_allclose(ours.grads[name], t_grad.numpy(), rtol=0, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("average", [False, True])
def test_batch_times_heads_masks_match_torch(torch, impl, average):
    # (B*H, T, S) bool masks, True = attend here and True = ignore in torch; batch b,
    # head h at row b*H + h. Weights are fetched with need_weights=True (the fast path).
    ours, theirs = layer_pair(torch, impl)  # tiled: weights fall back to the fast core
    mask = np.random.default_rng(2).random((B * H, T, S)) > 0.3
    mask[:, :, 0] = True  # no fully masked row: torch's weights would be NaN there
    compare(torch, ours, theirs, {"attn_mask": mask}, {"attn_mask": torch.tensor(~mask)},
            average)


def test_float_key_padding_mask_matches_torch(torch, impl):
    # A float key padding mask is additive in both libraries (no polarity to flip).
    ours, theirs = layer_pair(torch, impl)  # tiled: weights fall back to the fast core
    padding = np.zeros((B, S))
    padding[0, 2:] = -np.inf
    padding[1, 1] = -0.5  # finite values are added too
    float_mask = np.random.default_rng(3).normal(size=(T, S))
    compare(torch, ours, theirs, {"key_padding_mask": padding, "attn_mask": float_mask},
            {"key_padding_mask": torch.tensor(padding), "attn_mask": torch.tensor(float_mask)},
            average=True)


def test_float_and_bool_padding_agree(impl):
    # Oracle: a bool mask (True = real token) and its float form (0 / -inf) give the
    # same outputs on every path, with or without an attention mask of either kind.
    layer = qkvnp.MultiHeadAttention(E, H, rng=0, impl=impl)
    x = np.random.default_rng(4).normal(size=(B, T, E))
    real = np.array([[True, True, False], [True, False, True]])
    additive = np.where(real, 0.0, -np.inf)
    for attn_mask in (None, np.tril(np.ones((T, T), bool)), np.random.default_rng(5).normal(size=(T, T))):
        expected = layer.forward(x, attn_mask=attn_mask, key_padding_mask=real)
        out = layer.forward(x, attn_mask=attn_mask, key_padding_mask=additive)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


def test_three_d_masks_are_read_by_shape():
    # Oracle: the equivalent 4-D mask; and the documented ambiguity rule.
    rng = np.random.default_rng(6)
    x = rng.normal(size=(B, T, E))
    layer = qkvnp.MultiHeadAttention(E, H, rng=0)
    mask = rng.random((B, H, T, T)) > 0.4
    np.testing.assert_array_equal(layer.forward(x, attn_mask=mask.reshape(B * H, T, T)),
                                  layer.forward(x, attn_mask=mask))
    with pytest.raises(ValueError, match=r"\(B\*H, T, S\) = \(4, 3, 3\).*\(B, 1, T, S\)"):
        layer.forward(x, attn_mask=mask[:, 0])  # (B, T, S): ambiguous with B = H, refused
    one_head = qkvnp.MultiHeadAttention(E, 1, rng=0)  # H = 1: (B*1, T, S) is (B, T, S)
    np.testing.assert_array_equal(one_head.forward(x, attn_mask=mask[:, 0]),
                                  one_head.forward(x, attn_mask=mask[:, :1]))


def test_average_weights_is_the_mean_over_heads():
    # Oracle: the per-head weights averaged by numpy; rows still sum to 1.
    layer = qkvnp.MultiHeadAttention(E, H, rng=0, num_kv_heads=1)
    x = np.random.default_rng(7).normal(size=(B, T, E))
    _, per_head = layer.forward(x, return_weights=True)
    _, averaged = layer.forward(x, return_weights=True, average_weights=True)
    assert per_head.shape == (B, H, T, T) and averaged.shape == (B, T, T)
    np.testing.assert_allclose(averaged, per_head.mean(axis=1), rtol=0, atol=1e-15)
    np.testing.assert_allclose(averaged.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
