"""The fused cross-entropy (``qkvnp.kernels.loss``) against the reference op it replaces.

Oracle: :func:`qkvnp.ops.losses.cross_entropy_probs` (``scipy.special.log_softmax``),
on the same checked inputs: the loss and the softmax equal up to rounding.
"""
import numpy as np
import pytest

from qkvnp.kernels.loss import cross_entropy_probs_fused
from qkvnp.ops.losses import cross_entropy_inputs, cross_entropy_probs


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_fused_equals_the_reference(dtype, rtol):
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(3, 5, 7)) * 10).astype(dtype)  # large logits: the shift matters
    targets = rng.integers(0, 7, size=(3, 5))
    targets[0, 0] = -100  # one ignored position
    inputs = cross_entropy_inputs(logits, targets, -100, None)
    loss, probs = cross_entropy_probs_fused(*inputs)
    loss_ref, probs_ref = cross_entropy_probs(*inputs)
    assert probs.shape == probs_ref.shape and probs.dtype == probs_ref.dtype == dtype
    assert loss.shape == () and loss.dtype == dtype
    np.testing.assert_allclose(loss, loss_ref, rtol=rtol)
    np.testing.assert_allclose(probs, probs_ref, rtol=rtol, atol=rtol * 1e-3)
