"""qkvnp.optim.clip_grad_norm against torch.nn.utils.clip_grad_norm_ on the same arrays."""
import math

import numpy as np
import pytest

from qkvnp.optim import clip_grad_norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, math.inf])
@pytest.mark.parametrize("max_norm", [0.3, 1e3])  # clipped; left as is (coefficient 1)
def test_matches_torch(torch, norm_type, max_norm):
    rng = np.random.default_rng(0)
    grads = {"W": rng.normal(size=(4, 3)), "b": rng.normal(size=5), "s": rng.normal(size=())}
    tensors = []
    for value in grads.values():
        p = torch.zeros(value.shape, dtype=torch.float64, requires_grad=True)
        p.grad = torch.tensor(value.copy())
        tensors.append(p)
    expected = torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type).item()
    total = clip_grad_norm(grads, max_norm, norm_type)
    assert isinstance(total, float) and abs(total - expected) <= 1e-12 * expected
    for value, p in zip(grads.values(), tensors):
        np.testing.assert_allclose(value, p.grad.numpy(), rtol=1e-12, atol=0)


def test_bad_arguments_and_nonfinite_norms():
    grads = {"W": np.array([1.0, np.inf])}
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(grads, 0.0)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm(grads, 1.0, norm_type=-2)
    with pytest.raises(ValueError, match="error_if_nonfinite"):
        clip_grad_norm(grads, 1.0, error_if_nonfinite=True)
    assert grads["W"][0] == 1.0  # nothing scaled
    assert clip_grad_norm(grads, 1.0) == math.inf
