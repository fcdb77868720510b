"""Tests of qkvnp.losses: MSE, cross-entropy and accuracy.

Oracles: closed forms (uniform logits -> log C, a large margin -> 0, a
logit gap of 1e4 -> exactly 1e4), a naive per-row Python loop using
``math.log``/``math.exp``, central differences (``qkvnp.gradcheck``), and
PyTorch autograd (``F.cross_entropy``, ``F.mse_loss``) in float64.
"""
import contextlib
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkvnp.gradcheck import check_op
from qkvnp.losses import (
    accuracy,
    cross_entropy_backward,
    cross_entropy_forward,
    mse_backward,
    mse_forward,
)


def naive_cross_entropy(logits, targets, counted):
    """Slow oracle: -log softmax(z)[y] row by row with the max trick, mean over counted."""
    C = logits.shape[-1]
    rows = logits.reshape(-1, C)
    total, n = 0.0, 0
    for row, y, keep in zip(rows, targets.reshape(-1), counted.reshape(-1)):
        if not keep:
            continue
        top = max(row)
        # (top - z_y) + log(sum): adding top to log(sum) first would round at
        # the magnitude of the logits and lose a near-zero loss
        total += (top - row[y]) + math.log(math.fsum(math.exp(z - top) for z in row))
        n += 1
    return total / n if n else 0.0


@contextlib.contextmanager
def no_warnings():
    """Context in which any warning (numpy RuntimeWarning included) is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------- mse


def test_mse_closed_form_value_and_gradient(rng):
    # oracle: mean of squares and 2 (p - t) / N written out by hand
    pred = rng.normal(size=(3, 4))
    target = rng.normal(size=(3, 4))
    loss, cache = mse_forward(pred, target)
    assert loss.shape == () and loss.dtype == np.float64
    np.testing.assert_allclose(loss, ((pred - target) ** 2).sum() / 12, rtol=1e-15)
    dpred = mse_backward(0.5, cache)
    assert dpred.shape == pred.shape
    np.testing.assert_allclose(dpred, 0.5 * 2 * (pred - target) / 12, rtol=1e-15)


def test_mse_float32_stays_float32(rng):
    # oracle: the compute-dtype rule of qkvnp._checks (float32 in, float32 out)
    pred = rng.normal(size=(5,)).astype(np.float32)
    loss, cache = mse_forward(pred, np.zeros(5, np.float32))
    assert loss.dtype == np.float32
    assert mse_backward(np.float32(1), cache).dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float64, np.float32])  # tolerances from gradcheck's table
def test_mse_gradcheck(dtype, rng):
    # oracle: central differences
    report = check_op(mse_forward, mse_backward, {"pred": rng.normal(size=(2, 3, 4))},
                      forward_kwargs={"target": rng.normal(size=(2, 3, 4))}, dtype=dtype)
    assert report.ok, report.table()


def test_mse_matches_torch(torch, rng):
    # oracle: torch.nn.functional.mse_loss and its autograd gradient, float64
    pred = rng.normal(size=(4, 3, 2))
    target = rng.normal(size=(4, 3, 2))
    dloss = 1.7
    loss, cache = mse_forward(pred, target)
    pred_t = torch.tensor(pred, requires_grad=True)
    loss_t = torch.nn.functional.mse_loss(pred_t, torch.tensor(target))
    (loss_t * dloss).backward()
    np.testing.assert_allclose(loss, loss_t.item(), rtol=1e-12)
    np.testing.assert_allclose(mse_backward(dloss, cache), pred_t.grad.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("target_shape", [(3, 1), (3, 4, 1), (4,)])  # broadcastable, refused
def test_mse_refuses_broadcasting(target_shape):
    with pytest.raises(ValueError, match=r"target must have the shape of pred \(3, 4\)"):
        mse_forward(np.zeros((3, 4)), np.zeros(target_shape))


def test_mse_bad_inputs():
    with pytest.raises(ValueError, match="pred must have at least one entry"):
        mse_forward(np.zeros((0, 3)), np.zeros((0, 3)))
    with pytest.raises(ValueError, match="pred contains NaN"):
        mse_forward(np.array([np.nan]), np.array([0.0]))
    with pytest.raises(TypeError, match="target must hold real numbers"):
        mse_forward(np.zeros(2), np.array(["a", "b"]))
    _, cache = mse_forward(np.zeros(2), np.ones(2))
    with pytest.raises(ValueError, match=r"dloss must be a scalar .* got shape \(2,\)"):
        mse_backward(np.ones(2), cache)


# ---------------------------------------------------------------- cross-entropy: closed forms


@pytest.mark.parametrize("shape", [(5,), (7, 5), (2, 3, 5), (1, 2)])  # scalar target, rows, (B, T), C=2
def test_uniform_logits_give_log_C(shape, rng):
    # oracle: softmax of equal logits is 1/C, so the loss is log C and dlogits = (1/C - onehot)/n
    C = shape[-1]
    logits = np.full(shape, 3.25)
    targets = rng.integers(0, C, size=shape[:-1])
    loss, cache = cross_entropy_forward(logits, targets)
    assert loss.shape == ()
    np.testing.assert_allclose(loss, np.log(C), rtol=1e-15)
    n = targets.size
    expected = (np.full(shape, 1.0 / C) - np.eye(C)[targets]) / n
    dlogits = cross_entropy_backward(1.0, cache)
    assert dlogits.shape == shape
    np.testing.assert_allclose(dlogits, expected, rtol=1e-14, atol=1e-17)


def test_large_margin_gives_zero_loss_and_gradient():
    # oracle: -log(1 / (1 + (C-1) e^-100)) ~ (C-1) e^-100 ~ 1e-43
    targets = np.array([[0, 3], [2, 1]])
    logits = 100.0 * np.eye(4)[targets]
    loss, cache = cross_entropy_forward(logits, targets)
    assert 0 <= loss < 1e-40
    assert np.abs(cross_entropy_backward(1.0, cache)).max() < 1e-40
    assert accuracy(logits, targets) == 1.0


@pytest.mark.parametrize("big", [1e4, 1e8, 1e300])  # far beyond exp's float64 range (709)
def test_huge_logits_are_finite_and_exact(big):
    # oracle: logits (big, 0): -log softmax = log(1 + e^-big) ~ 0 for the big class,
    # big + log(1 + e^-big) = big for the other; equal huge logits give log 2
    with no_warnings():
        loss, cache = cross_entropy_forward(np.array([[big, 0.0], [big, 0.0], [big, big]]),
                                            np.array([0, 1, 1]))
        dlogits = cross_entropy_backward(1.0, cache)
    np.testing.assert_allclose(loss, (0.0 + big + np.log(2)) / 3, rtol=1e-15)
    expected = np.array([[0.0, 0.0], [1.0, -1.0], [0.5, -0.5]]) / 3
    np.testing.assert_allclose(dlogits, expected, rtol=1e-15, atol=1e-300)


def test_matches_naive_loop(rng):
    # oracle: the per-row Python loop above
    logits = rng.normal(scale=3.0, size=(4, 6, 9))
    targets = rng.integers(0, 9, size=(4, 6))
    mask = rng.random((4, 6)) < 0.7
    loss, _ = cross_entropy_forward(logits, targets, mask=mask)
    np.testing.assert_allclose(loss, naive_cross_entropy(logits, targets, mask), rtol=1e-13)


@pytest.mark.parametrize("layout", ["fortran", "transposed", "strided"])
def test_any_memory_layout_gives_the_same_loss_and_gradient(layout, rng):
    """Oracle: the same logits in C order, to rounding (scipy's log_softmax
    sums a strided row in another order). The loss picks each row's target
    and the backward subtracts the one-hot in place through a (rows, C)
    reshape, which must see every layout's entries (and write into the
    gradient it returns, not into a copy: that would be off by 1/n)."""
    logits = rng.normal(size=(4, 6, 9))
    targets = rng.integers(0, 9, size=(4, 6))
    other = {"fortran": np.asfortranarray(logits),
             "transposed": np.ascontiguousarray(logits.T).T,
             "strided": np.repeat(logits, 2, axis=-1)[..., ::2]}[layout]
    assert not other.flags.c_contiguous
    for mask in (None, rng.random((4, 6)) < 0.7):
        want, want_cache = cross_entropy_forward(logits, targets, mask=mask)
        got, got_cache = cross_entropy_forward(other, targets, mask=mask)
        np.testing.assert_allclose(got, want, rtol=1e-14)
        np.testing.assert_allclose(cross_entropy_backward(1.0, got_cache),
                                   cross_entropy_backward(1.0, want_cache), rtol=0, atol=1e-15)


def test_ignore_index_equals_the_loss_of_the_kept_rows(rng):
    # oracle: the mean over the kept rows only, computed without ignore_index;
    # ignored positions may hold any integer (here -100 and 999, out of range)
    logits = rng.normal(size=(6, 4))
    targets = np.array([1, -100, 3, 999, 0, 2])
    kept = np.array([0, 2, 4, 5])
    loss, cache = cross_entropy_forward(logits, targets, ignore_index=-100,
                                        mask=targets != 999)
    loss_kept, cache_kept = cross_entropy_forward(logits[kept], targets[kept])
    np.testing.assert_allclose(loss, loss_kept, rtol=1e-15)
    dlogits = cross_entropy_backward(1.0, cache)
    np.testing.assert_allclose(dlogits[kept], cross_entropy_backward(1.0, cache_kept), rtol=1e-15)
    assert not dlogits[[1, 3]].any()


def test_mask_and_ignore_index_combine_by_and(rng):
    # oracle: a mask equal to (mask & targets != ignore_index) gives the same result
    logits = rng.normal(size=(3, 5, 4))
    targets = rng.integers(0, 4, size=(3, 5))
    mask = rng.random((3, 5)) < 0.6
    both, cache_both = cross_entropy_forward(logits, targets, ignore_index=2, mask=mask)
    folded, cache_folded = cross_entropy_forward(logits, targets, mask=mask & (targets != 2))
    assert both == folded
    np.testing.assert_array_equal(cross_entropy_backward(0.3, cache_both),
                                  cross_entropy_backward(0.3, cache_folded))


@pytest.mark.parametrize("case", ["all_ignored", "all_masked", "empty"])
def test_no_counted_position_gives_zero_loss_and_gradient(case, rng):
    # oracle: the definition (0, not torch's 0/0 = NaN); no warning may be raised
    logits = rng.normal(size=(0, 3) if case == "empty" else (4, 3))
    targets = np.full(logits.shape[:-1], -1)
    kwargs = {"all_ignored": {"ignore_index": -1},
              "all_masked": {"mask": np.zeros(4, bool)},
              "empty": {}}[case]
    with no_warnings():
        loss, cache = cross_entropy_forward(logits, targets, **kwargs)
        dlogits = cross_entropy_backward(1.0, cache)
        acc = accuracy(logits, targets, **kwargs)
    assert loss.shape == () and loss == 0.0
    assert dlogits.shape == logits.shape and not dlogits.any()
    assert math.isnan(acc)


def test_dloss_scales_the_gradient(rng):
    # oracle: linearity of the backward in dloss
    logits = rng.normal(size=(5, 3))
    _, cache = cross_entropy_forward(logits, rng.integers(0, 3, size=5))
    np.testing.assert_allclose(cross_entropy_backward(np.array(-2.5), cache),
                               -2.5 * cross_entropy_backward(1.0, cache), rtol=1e-15)


def test_float32_logits_stay_float32(rng):
    # oracle: the compute-dtype rule; values agree with float64 to float32 precision
    logits = rng.normal(size=(6, 5))
    targets = rng.integers(0, 5, size=6)
    loss32, cache32 = cross_entropy_forward(logits.astype(np.float32), targets)
    loss64, cache64 = cross_entropy_forward(logits, targets)
    assert loss32.dtype == np.float32
    dlogits32 = cross_entropy_backward(1.0, cache32)
    assert dlogits32.dtype == np.float32
    np.testing.assert_allclose(loss32, loss64, rtol=1e-6)
    np.testing.assert_allclose(dlogits32, cross_entropy_backward(1.0, cache64), atol=1e-7)


@pytest.mark.parametrize("kwargs", [
    {},  # every position counted
    {"ignore_index": 1},  # some targets ignored
    {"mask": np.array([[True, False, True], [False, True, True]])},  # a boolean mask
])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])  # tolerances from gradcheck's table
def test_cross_entropy_gradcheck(kwargs, dtype, rng):
    # oracle: central differences
    targets = np.array([[0, 1, 3], [1, 2, 1]])
    report = check_op(cross_entropy_forward, cross_entropy_backward,
                      {"logits": rng.normal(size=(2, 3, 4))},
                      forward_kwargs={"targets": targets, **kwargs}, dtype=dtype)
    assert report.ok, report.table()


@pytest.mark.parametrize("shape", [(7, 5), (2, 6, 4)])  # (N, C) and (B, T, C)
def test_cross_entropy_matches_torch(shape, torch, rng):
    # oracle: F.cross_entropy(reduction="mean", ignore_index=-100) and autograd, float64;
    # torch wants the class axis second, so (B, T, C) is permuted to (B, C, T)
    logits = rng.normal(scale=4.0, size=shape)
    targets = rng.integers(0, shape[-1], size=shape[:-1])
    targets.reshape(-1)[::3] = -100
    dloss = 0.7
    loss, cache = cross_entropy_forward(logits, targets, ignore_index=-100)
    logits_t = torch.tensor(logits, requires_grad=True)
    moved = logits_t if logits.ndim == 2 else logits_t.permute(0, 2, 1)
    loss_t = torch.nn.functional.cross_entropy(moved, torch.tensor(targets), ignore_index=-100)
    (loss_t * dloss).backward()
    np.testing.assert_allclose(loss, loss_t.item(), rtol=1e-12)
    np.testing.assert_allclose(cross_entropy_backward(dloss, cache), logits_t.grad.numpy(),
                               rtol=1e-12, atol=1e-15)


@given(
    rows=st.integers(1, 6),
    C=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e5]),
)
def test_cross_entropy_properties(rows, C, seed, scale):
    # oracles: the naive loop; the loss is >= 0; each counted gradient row sums to 0
    # (softmax sums to 1, the one-hot too); uncounted rows are 0
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=scale, size=(rows, C))
    targets = rng.integers(0, C, size=rows)
    mask = rng.random(rows) < 0.7
    loss, cache = cross_entropy_forward(logits, targets, mask=mask)
    assert loss >= 0
    # NOTE: a near-zero loss, log(1 + e^-margin), is computed (here and in torch)
    # as log(sum) with sum in [1, C]: its error is absolute, a few eps, not relative
    np.testing.assert_allclose(loss, naive_cross_entropy(logits, targets, mask), rtol=1e-12,
                               atol=4 * np.finfo(np.float64).eps)
    dlogits = cross_entropy_backward(1.0, cache)
    assert np.isfinite(dlogits).all()
    np.testing.assert_allclose(dlogits.sum(axis=-1), 0.0, atol=1e-15)
    assert not dlogits[~mask].any()


# ---------------------------------------------------------------- cross-entropy: bad input


def test_targets_must_be_integers():
    with pytest.raises(TypeError, match="targets must hold integer class indices.*float64"):
        cross_entropy_forward(np.zeros((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="targets must hold integer class indices.*bool"):
        cross_entropy_forward(np.zeros((2, 3)), np.array([True, False]))
    with pytest.raises(TypeError, match="targets must be an integer array"):
        cross_entropy_forward(np.zeros((2, 3)), None)


@pytest.mark.parametrize("bad_target", [3, -1])  # C = 3, and a negative index
def test_out_of_range_target_is_named(bad_target):
    with pytest.raises(ValueError, match=rf"targets must be class indices in \[0, 3\).*got "
                                         rf"{bad_target} at index \(1,\)"):
        cross_entropy_forward(np.zeros((2, 3)), np.array([0, bad_target]))


def test_shape_and_type_errors_name_the_argument():
    logits = np.zeros((2, 4, 3))
    targets = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"targets must have shape \(2, 4\) .* got shape \(4, 2\)"):
        cross_entropy_forward(logits, targets.T)
    with pytest.raises(ValueError, match=r"mask must have the shape of targets \(2, 4\), got shape \(4,\)"):
        cross_entropy_forward(logits, targets, mask=np.ones(4, bool))
    with pytest.raises(TypeError, match="mask must be bool .* got dtype int64"):
        cross_entropy_forward(logits, targets, mask=np.ones((2, 4), np.int64))
    with pytest.raises(TypeError, match="ignore_index must be an int or None, got float"):
        cross_entropy_forward(logits, targets, ignore_index=-100.0)
    with pytest.raises(ValueError, match="logits contains NaN or inf"):
        cross_entropy_forward(np.full((2, 3), np.inf), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"logits must have shape \(..., C\) with C >= 1"):
        cross_entropy_forward(np.zeros((2, 0)), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"logits must have shape \(..., C\)"):
        cross_entropy_forward(np.float64(1.0), np.int64(0))


# ---------------------------------------------------------------- accuracy


def test_accuracy_closed_forms():
    # oracle: counting by hand
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 5.0], [1.0, 1.0, 0.0], [0.0, 0.0, 9.0]])
    targets = np.array([0, 1, 0, 2])  # hit, miss, tie -> class 0 (hit), hit
    assert accuracy(logits, targets) == 0.75
    assert accuracy(logits, targets, ignore_index=1) == 1.0
    assert accuracy(logits, targets, mask=np.array([False, True, False, True])) == 0.5
    assert isinstance(accuracy(logits, targets), float)


def test_accuracy_validates_like_the_loss():
    with pytest.raises(ValueError, match="targets must be class indices"):
        accuracy(np.zeros((2, 3)), np.array([0, 5]))


def test_importing_losses_and_optim_costs_numpy_only():
    # oracle: sys.modules of a fresh interpreter; scipy is imported when a loss runs
    code = ("import sys, qkvnp.losses, qkvnp.optim; "
            "print(sorted(m for m in ('scipy', 'torch', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def _scipy_cross_entropy(logits, targets, counted):
    """Oracle: the reference path, scipy's log_softmax, the target's entry, mean over counted."""
    from scipy.special import log_softmax

    log_probs = log_softmax(logits, axis=-1)  # (..., C)
    picked = np.take_along_axis(log_probs, np.where(counted, targets, 0)[..., None], -1)[..., 0]
    count = counted.sum()
    return (-picked[counted].sum() / count if count else 0.0), np.exp(log_probs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", ["plain", "huge", "ignore_index", "mask", "none_counted"])
def test_fused_real_path_equals_scipy_log_softmax(case, dtype, rng):
    # Oracle: scipy.special.log_softmax (the path complex logits keep), to rounding
    logits = (rng.normal(size=(3, 6, 11)) * 5).astype(dtype)
    targets = rng.integers(0, 11, size=(3, 6))
    counted = np.ones((3, 6), dtype=bool)
    kwargs = {}
    if case == "huge":  # rows at +-1e30, one row spanning both, one huge entry in a normal row
        logits[0, 0], logits[0, 1] = 1e30, -1e30
        logits[0, 2, :4], logits[0, 3, 2] = 1e30, -1e30
        targets[0, 2] = 5  # a target 1e30 below its row's top: loss 1e30
    elif case == "ignore_index":
        targets[1] = -100
        counted[1] = False
        kwargs = {"ignore_index": -100}
    elif case == "mask":
        counted = rng.random((3, 6)) < 0.5
        kwargs = {"mask": counted}
    elif case == "none_counted":
        counted[...] = False
        kwargs = {"mask": counted}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fused passes warn no more than the reference
        loss, cache = cross_entropy_forward(logits, targets, **kwargs)
        dlogits = cross_entropy_backward(1.5, cache)
    want_loss, want_probs = _scipy_cross_entropy(logits, targets, counted)
    assert loss.shape == () and loss.dtype == dtype
    rtol = {np.float64: 1e-13, np.float32: 1e-5}[dtype]
    np.testing.assert_allclose(loss, want_loss, rtol=rtol)
    assert cache.probs.shape == logits.shape and cache.probs.dtype == dtype
    np.testing.assert_allclose(cache.probs, want_probs, rtol=rtol, atol=rtol * 1e-3)
    onehot = np.eye(11, dtype=dtype)[np.where(counted, targets, 0)]
    want_grad = np.where(counted[..., None], 1.5 * (want_probs - onehot) / max(counted.sum(), 1), 0)
    assert dlogits.shape == logits.shape and dlogits.dtype == dtype
    np.testing.assert_allclose(dlogits, want_grad, rtol=rtol, atol=rtol * 1e-3)
