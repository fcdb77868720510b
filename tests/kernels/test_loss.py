"""The fused cross-entropy (``qkvnp.kernels.loss``) against the reference ops it replaces.

Oracles:

- forward: :func:`qkvnp.ops.losses.cross_entropy_probs` (``scipy.special.log_softmax``),
  on the same checked inputs: the loss and the softmax equal up to rounding;
- forward by chunks and threads: the same passes over the whole array at once
  (the kernel before it went by chunks, written out below) and the kernel with
  all rows in one chunk on one thread: the same bits;
- backward: :func:`qkvnp.ops.losses.cross_entropy_backward`, the reference op:
  the same bits (``np.array_equal``), at any chunk size and thread count.
"""
import math

import numpy as np
import pytest

import qkvnp
from qkvnp import losses
from qkvnp.kernels import _runtime
from qkvnp.kernels.loss import cross_entropy_probs_fused
from qkvnp.ops import losses as reference
from qkvnp.ops.losses import CrossEntropyCache, cross_entropy_inputs, cross_entropy_probs


def _inputs(shape, dtype, seed=0, uncounted=True):
    """Checked inputs of a cross-entropy of ``shape`` (..., C): large logits (the shift
    matters), a -100 target and a masked position when ``uncounted``."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=shape) * 10).astype(dtype)
    targets = rng.integers(0, shape[-1], size=shape[:-1])
    mask = None
    if uncounted:
        targets.reshape(-1)[0] = -100  # one ignored position
        mask = np.ones(shape[:-1], bool)
        mask.reshape(-1)[-1] = False  # and one masked
    return cross_entropy_inputs(logits, targets, -100, mask)


def _whole_array_passes(logits, targets, counted, count):
    """The fused forward as whole-array passes, one after the other (no chunks, no threads)."""
    C = logits.shape[-1]
    rows = logits.reshape(-1, C)  # (..., C) -> (N, C)
    positions = np.arange(rows.shape[0])  # (N,)
    top = rows[positions, rows.argmax(axis=1)]  # (N,)
    shifted = rows - top[:, None]  # (N, C)
    picked = shifted[positions, targets.reshape(-1)]  # (N,)
    probs = shifted * logits.dtype.type(1.0 / math.log(2.0))
    with np.errstate(under="ignore"):
        probs = np.exp2(probs)  # (N, C)
    with _runtime.single_threaded_blas():
        sums = probs @ np.ones((C, 1), logits.dtype)  # (N, 1)
    probs /= sums
    picked -= np.log(sums[:, 0])
    loss = -np.sum(picked, where=counted.reshape(-1)) / count if count else 0.0  # ()
    return np.asarray(loss, dtype=logits.dtype), probs.reshape(logits.shape)


def _chunk_bytes(rows, C, dtype):
    """The ``loss_block_bytes`` that makes chunks of ``rows`` rows."""
    return rows * C * np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_fused_equals_the_reference(dtype, rtol):
    inputs = _inputs((3, 5, 7), dtype)
    loss, probs = cross_entropy_probs_fused(*inputs)
    loss_ref, probs_ref = cross_entropy_probs(*inputs)
    assert probs.shape == probs_ref.shape and probs.dtype == probs_ref.dtype == dtype
    assert loss.shape == () and loss.dtype == dtype
    np.testing.assert_allclose(loss, loss_ref, rtol=rtol)
    np.testing.assert_allclose(probs, probs_ref, rtol=rtol, atol=rtol * 1e-3)


# (3, 13) = 39 rows: chunks of 1 row, of 4 and of 7 (neither divides 39), of 38 (a
# last chunk of 1), and all in one chunk; C = 9 (below the row buffer), 300 (numpy's
# buffer set to one row) and 9000 (rows longer than numpy's buffer)
@pytest.mark.parametrize("C", [9, 300, 9000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_bits_do_not_depend_on_the_chunk_size(C, dtype):
    inputs = _inputs((3, 13, C), dtype, seed=C)
    with _runtime.block_sizes(loss_block_bytes=_chunk_bytes(39, C, dtype)):
        loss_whole, probs_whole = cross_entropy_probs_fused(*inputs)
    for rows in (1, 4, 7, 38):
        with _runtime.block_sizes(loss_block_bytes=_chunk_bytes(rows, C, dtype)):
            loss, probs = cross_entropy_probs_fused(*inputs)
        assert probs.shape == probs_whole.shape and loss.shape == ()
        assert np.array_equal(probs, probs_whole), f"probs differ at chunks of {rows} rows"
        assert np.array_equal(loss, loss_whole), (f"loss {loss!r} at chunks of {rows} rows, "
                                                  f"{loss_whole!r} in one chunk")


# (3, 13) = 39 rows: a chunk of 1 row, of 7 (not dividing 39), and all in one chunk
@pytest.mark.parametrize("rows", [1, 7, 39])
@pytest.mark.parametrize("uncounted", [False, True])  # every row counted; a -100 and a mask
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_bits_equal_the_whole_array_passes(dtype, uncounted, rows):
    inputs = _inputs((3, 13, 300), dtype, uncounted=uncounted)
    loss_whole, probs_whole = _whole_array_passes(*inputs)
    with _runtime.block_sizes(loss_block_bytes=_chunk_bytes(rows, 300, dtype)):
        loss, probs = cross_entropy_probs_fused(*inputs)
    assert probs.shape == probs_whole.shape and loss.shape == ()
    assert np.array_equal(probs, probs_whole)
    assert np.array_equal(loss, loss_whole), f"loss {loss!r}, {loss_whole!r} by whole arrays"


class _SpyRun:
    """Stands in for :func:`qkvnp.kernels._runtime.run`: records the chunks it is given,
    then calls the real one."""

    def __init__(self, real):
        self.calls, self.real = [], real

    def __call__(self, task, work, flops=None):
        self.calls.append(list(work))
        return self.real(task, work, flops)


def _on_two_threads(monkeypatch, call, chunk_bytes):
    """``call()`` with the chunks dealt over two worker threads; checks that they were."""
    spy = _SpyRun(_runtime.run)
    monkeypatch.setattr(_runtime, "run", spy)
    with qkvnp.num_threads(2), _runtime.block_sizes(min_parallel_entries=0,
                                                    loss_block_bytes=chunk_bytes):
        result = call()
    assert spy.calls and all(len(chunks) >= 2 for chunks in spy.calls), "no chunks went to run"
    return result


def _poison_the_heap(shape, dtype):
    """Allocate and free an array of NaN of ``shape``, so that a fresh ``np.empty`` of
    that size (taken from the freed block) shows NaN in any row nobody wrote."""
    poison = np.full(shape, np.nan, dtype)
    del poison


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_bits_are_the_same_on_one_and_two_threads(dtype, monkeypatch):
    inputs = _inputs((4, 25, 300), dtype)
    with qkvnp.num_threads(1), _runtime.block_sizes(loss_block_bytes=_chunk_bytes(7, 300, dtype)):
        loss_one, probs_one = cross_entropy_probs_fused(*inputs)
    _poison_the_heap(probs_one.shape, dtype)
    loss_two, probs_two = _on_two_threads(monkeypatch, lambda: cross_entropy_probs_fused(*inputs),
                                          _chunk_bytes(7, 300, dtype))
    assert probs_two.shape == probs_one.shape
    assert np.array_equal(probs_two, probs_one)
    assert np.array_equal(loss_two, loss_one)


def test_each_share_writes_its_own_rows(monkeypatch):
    """Oracle: the whole-array passes. Rows differ (each shifted by its own amount), so a
    share that wrote another's rows, or skipped some (NaN from the poisoned heap), fails."""
    N, C = 50, 300
    logits = np.random.default_rng(1).normal(size=(N, C)) * 5
    logits += np.arange(N)[:, None] * 0.25  # each row its own values
    targets = np.arange(N) % C
    counted = np.ones(N, bool)
    _, expected = _whole_array_passes(logits, targets, counted, N)
    _poison_the_heap((N, C), logits.dtype)
    _, probs = _on_two_threads(monkeypatch,
                               lambda: cross_entropy_probs_fused(logits, targets, counted, N),
                               _chunk_bytes(3, C, logits.dtype))
    wrong = [i for i in range(N) if not np.array_equal(probs[i], expected[i])]
    assert not wrong, f"rows {wrong} are not their own softmax"


# ---------------------------------------------------------------- backward


def _cache(shape, dtype, uncounted, seed=0):
    """A cache of the fused forward: softmax, targets with 0 at uncounted rows."""
    inputs = _inputs(shape, dtype, seed=seed, uncounted=uncounted)
    _, probs = cross_entropy_probs_fused(*inputs)
    return CrossEntropyCache(probs, *inputs[1:])


@pytest.mark.parametrize("uncounted", [False, True])  # every row counted; a -100 and a mask
@pytest.mark.parametrize("dloss", [1.0, 0.37, -2.5])  # 1 (the objective), and others
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_bits_equal_the_reference_op(dtype, dloss, uncounted):
    cache = _cache((3, 11, 300), dtype, uncounted)
    expected = reference.cross_entropy_backward(dloss, cache)
    for rows in (1, 4, 33):  # chunks of one row, of 4 (not dividing 33), all rows
        with _runtime.block_sizes(loss_block_bytes=_chunk_bytes(rows, 300, dtype)):
            dlogits = losses.cross_entropy_backward(dloss, cache)
        assert dlogits.shape == expected.shape and dlogits.dtype == expected.dtype == dtype
        assert np.array_equal(dlogits, expected), f"chunks of {rows} rows"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_bits_on_two_threads_equal_the_reference_op(dtype, monkeypatch):
    cache = _cache((4, 25, 300), dtype, uncounted=True)
    expected = reference.cross_entropy_backward(0.37, cache)
    _poison_the_heap(expected.shape, dtype)
    dlogits = _on_two_threads(monkeypatch, lambda: losses.cross_entropy_backward(0.37, cache),
                              _chunk_bytes(7, 300, dtype))
    assert dlogits.shape == expected.shape
    assert np.array_equal(dlogits, expected)


def test_backward_with_no_counted_position_is_zero():
    """Oracle: the reference op (all zeros, as its docstring says)."""
    cache = _cache((2, 3, 5), np.float32, uncounted=False)
    cache = cache._replace(counted=np.zeros_like(cache.counted), count=0)
    dlogits = losses.cross_entropy_backward(1.0, cache)
    assert dlogits.shape == (2, 3, 5) and dlogits.dtype == np.float32
    assert np.array_equal(dlogits, reference.cross_entropy_backward(1.0, cache))
    assert not dlogits.any()


@pytest.mark.parametrize("dloss", [np.ones(2), np.nan, np.inf, 1j, None, "1"])
def test_backward_refuses_dloss_as_the_reference_does(dloss):
    """Oracle: the reference op's error, type and message."""
    cache = _cache((2, 5), np.float32, uncounted=False)
    with pytest.raises((TypeError, ValueError)) as expected:
        reference.cross_entropy_backward(dloss, cache)
    with pytest.raises(expected.type, match=f"^{__import__('re').escape(str(expected.value))}$"):
        losses.cross_entropy_backward(dloss, cache)


def test_complex_probs_take_the_reference_backward():
    """Oracle: the reference op, on the complex probabilities of the complex step."""
    cache = _cache((2, 5), np.float64, uncounted=False)
    cache = cache._replace(probs=cache.probs + 1e-20j)
    expected = reference.cross_entropy_backward(1.0, cache)
    dlogits = losses.cross_entropy_backward(1.0, cache)
    assert dlogits.dtype == expected.dtype == np.complex128
    assert np.array_equal(dlogits, expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_in_the_last_chunk_refuses_the_logits(threads, bad, monkeypatch):
    """Oracle: the reference forward's whole-array test, the same ValueError naming
    logits. The chunks test their rows themselves (``check_finite``): one entry in the
    last chunk, -inf included (whose shifted exponential would be a plain 0)."""
    logits = np.random.default_rng(0).normal(size=(4, 25, 300)).astype(np.float32)
    targets = np.zeros((4, 25), np.int64)
    logits[-1, -1, -1] = bad
    with pytest.raises(ValueError, match="^logits contains NaN or inf") as expected:
        reference.cross_entropy_forward(logits, targets)
    spy = _SpyRun(_runtime.run)
    monkeypatch.setattr(_runtime, "run", spy)
    with qkvnp.num_threads(threads), _runtime.block_sizes(
            min_parallel_entries=0, loss_block_bytes=_chunk_bytes(7, 300, np.float32)):
        with pytest.raises(ValueError) as refused:
            losses.cross_entropy_forward(logits, targets)
    assert str(refused.value) == str(expected.value)
    assert (len(spy.calls) == 1) == (threads == 2), "the chunks did not go to the threads"


def test_complex_logits_are_tested_finite_before_the_reference():
    """The gradient checker's complex step keeps the reference path, and its test."""
    from qkvnp._checks import complex_step_mode

    logits = np.zeros((2, 3), complex)
    logits[1, 2] = np.nan
    with complex_step_mode(), pytest.raises(ValueError, match="^logits contains NaN or inf"):
        losses.cross_entropy_forward(logits, np.zeros(2, np.int64))


def test_no_rows_give_the_reference_results():
    """Oracle: the reference ops on logits of shape (0, C): loss 0, empty softmax and gradient."""
    logits, targets = np.zeros((0, 5), np.float32), np.zeros(0, np.int64)
    loss, cache = losses.cross_entropy_forward(logits, targets)
    loss_ref, cache_ref = reference.cross_entropy_forward(logits, targets)
    assert cache.probs.shape == cache_ref.probs.shape == (0, 5)
    assert loss == loss_ref == 0 and loss.dtype == loss_ref.dtype
    dlogits = losses.cross_entropy_backward(1.0, cache)
    assert dlogits.shape == (0, 5) and dlogits.dtype == np.float32
