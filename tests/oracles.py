"""Helpers shared by the tests that compare against an oracle.

- The reference path :mod:`qkvnp.functional` is the oracle of the fast and
  tiled paths: :data:`PATH_TOLERANCE` and :func:`assert_matches_reference`.
- PyTorch's ``nn.MultiheadAttention`` is an oracle of the layers:
  :func:`load_into_torch_mha` copies qkvnp's parameters into it and
  :func:`torch_mha_param_grads` reads its gradients back in qkvnp's names and
  ``x @ W`` layout (PyTorch stores the transposes).

Importing this module does not import PyTorch.
"""
import numpy as np

# Largest error allowed against the reference path, relative to
# max(1, max|reference array|), keyed by dtype (issue 4): relative for arrays of
# magnitude 1 and more, absolute below (true zeros come out of two paths as
# different rounding noise).
PATH_TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}


def assert_matches_reference(actual, expected, name, path):
    """Shape and dtype first, then values; reports the worst index and both values."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    if expected.size == 0:
        return
    error = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    scale = max(1.0, float(np.abs(expected).max()))
    worst = np.unravel_index(np.argmax(error), error.shape)
    tol = PATH_TOLERANCE[expected.dtype]
    assert error[worst] <= tol * scale, (
        f"{name}: {path} {actual[worst]!r} vs reference {expected[worst]!r} at index "
        f"{worst}, error {error[worst]:.3g} > {tol:g} * {scale:.3g}"
    )


def load_into_torch_mha(torch, layer, params):
    """Copy qkvnp ``MultiHeadAttention`` params into a torch layer of the same shape."""
    p = {name: torch.tensor(value) for name, value in params.items()}
    with torch.no_grad():
        if layer._qkv_same_embed_dim:
            layer.in_proj_weight.copy_(torch.cat([p["W_query"].T, p["W_key"].T, p["W_value"].T]))
        else:
            layer.q_proj_weight.copy_(p["W_query"].T)
            layer.k_proj_weight.copy_(p["W_key"].T)
            layer.v_proj_weight.copy_(p["W_value"].T)
        layer.out_proj.weight.copy_(p["W_out"].T)
        if layer.in_proj_bias is not None:
            layer.in_proj_bias.copy_(torch.cat([p["b_query"], p["b_key"], p["b_value"]]))
            layer.out_proj.bias.copy_(p["b_out"])


def torch_mha_param_grads(layer, E):
    """A torch ``nn.MultiheadAttention``'s parameter gradients in qkvnp's names and layout."""
    if layer._qkv_same_embed_dim:
        w = layer.in_proj_weight.grad
        grads = {"W_query": w[:E].T, "W_key": w[E:2 * E].T, "W_value": w[2 * E:].T}
    else:
        grads = {"W_query": layer.q_proj_weight.grad.T, "W_key": layer.k_proj_weight.grad.T,
                 "W_value": layer.v_proj_weight.grad.T}
    grads["W_out"] = layer.out_proj.weight.grad.T
    if layer.in_proj_bias is not None:
        b = layer.in_proj_bias.grad
        grads.update(b_query=b[:E], b_key=b[E:2 * E], b_value=b[2 * E:],
                     b_out=layer.out_proj.bias.grad)
    return grads
