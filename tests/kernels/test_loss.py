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


def test_fused_rows_shared_among_threads_give_the_same_bits():
    """The rows of the fused cross-entropy run by the worker threads: row by row, the same bits."""
    from qkvnp.kernels import block_sizes, num_threads
    from qkvnp.kernels.loss import cross_entropy_probs_fused

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 70, 33)).astype(np.float32)
    targets = rng.integers(0, 33, (4, 70))
    counted = np.ones((4, 70), bool)
    results = []
    for threads in (1, 2):
        with num_threads(threads), block_sizes(min_parallel_flops=0):
            results.append(cross_entropy_probs_fused(logits, targets, counted, counted.sum()))
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])
