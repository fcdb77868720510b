"""The fast path (qkvnp.kernels.fast, qkvnp.kernels.mha) against the reference path (qkvnp.functional).

Oracle, unless a test says otherwise: the reference path, which writes every
formula line for line (tests/ops/test_gradients.py checks it against central
differences). Every output and gradient of the fast path must match it within
``qkvnp.kernels.PATH_TOLERANCES[dtype]`` times ``max(1, max|reference array|)`` (the convention of
tests/kernels/test_tiled.py): relative for arrays of magnitude 1 and more, absolute
below, because some true zeros (dquery when all scores of a row are equal,
or with a single key) come out of both paths as different rounding noise of
size 1e-18. Exact zeros that are part of the semantics (fully masked rows)
have their own exact tests.

The fast path processes the (batch, head) dims in blocks, in threads: tests
force several blocks (a small ``fast_block_bytes`` setting) and both one and two threads, so
the threaded code runs even on a one-core machine. Upstream gradients are
random, never all ones.
"""
import contextlib
import functools
import subprocess
import sys
import threading
import warnings
import zlib
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkvnp
from qkvnp import MultiHeadAttention, SelfAttention
from qkvnp import functional as F
from qkvnp import kernels
from qkvnp.kernels import _runtime, buffers, fast, fast_small, mha, projections

from strategies import attention_cases, mha_cases, self_attention_cases
from oracles import PATH_TOLERANCE, assert_matches_reference


assert_close = functools.partial(assert_matches_reference, path="fast")


@contextmanager
def blocks_and_threads(threads, block_bytes, row_block_bytes=1 << 20):
    """Run the fast path with ``threads`` threads, blocks of ``block_bytes`` and
    row chunks of ``row_block_bytes`` (at least 3 rows, so chunks have remainders);
    the layers' projections are split over the threads from 2 rows on."""
    with kernels.num_threads(threads), kernels.block_sizes(
            fast_block_bytes=block_bytes, row_block_bytes=row_block_bytes, min_row_block=3,
            min_split=2, min_parallel_flops=0):  # tiny problems still go to the workers
        yield


# The comparisons with the reference are cheap: run more examples than the profile.
MANY = settings(max_examples=max(100, settings().max_examples))

SPLITS = [
    (1, 1 << 22),  # one thread, whole blocks
    (1, 1),  # one thread, one matrix per block: a serial problem larger than a block goes by blocks
    (2, 1),  # two threads, one (T, S) matrix per block
    (2, 1 << 22),  # two threads, large blocks
    (2, 1, 1),  # two threads, one matrix per block, 3-row chunks (dK, dV accumulate)
]


def core_both_paths(inputs, options, dtype, seed=0):
    """Reference and fast forward+backward with one random upstream gradient.

    Warnings of the fast path are errors; the reference's are not our subject.
    """
    inputs = {name: np.asarray(a).astype(dtype) for name, a in inputs.items()}
    options = dict(options)
    if options.get("attn_mask") is not None and options["attn_mask"].dtype.kind == "f":
        options["attn_mask"] = options["attn_mask"].astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_ref, cache_ref = F.attention_forward(**inputs, **options)
        dout = np.random.default_rng(seed).standard_normal(out_ref.shape).astype(out_ref.dtype)
        expected = (out_ref, *F.attention_backward(dout, cache_ref))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, cache = fast.attention_forward(**inputs, **options)
        actual = (out, *fast.attention_backward(dout, cache))
    return actual, expected, cache, cache_ref


def check_core(inputs, options, dtype=np.float64, seed=0):
    actual, expected, cache, cache_ref = core_both_paths(inputs, options, dtype, seed)
    for name, a, b in zip(("out", "dquery", "dkey", "dvalue"), actual, expected):
        assert_close(a, b, name)
    weights = fast.attention_weights(cache)  # (..., T, S) over all leading dims
    assert_close(weights, np.broadcast_to(cache_ref.weights, weights.shape), "weights")
    return actual


# ---------------------------------------------------------------- the core


@MANY
@given(case=attention_cases(), dtype=st.sampled_from([np.float64, np.float32]),
       split=st.sampled_from(SPLITS))
def test_core_matches_reference(case, dtype, split):
    """Oracle: reference path; broadcast leading dims, bool/float masks with fully
    masked rows, causal, custom scale, T != S, Dv != D (tests/strategies.py)."""
    inputs, options = case
    with blocks_and_threads(*split):
        check_core(inputs, options, dtype)


def random_mask(kind, rng, shape, dtype):
    """None, bool (True = may attend), float (finite with some -inf), or both kinds."""
    if kind == "none":
        return None
    keep = rng.random(shape) > 0.3
    keep[..., 1, :] = False  # a fully masked row (when no causal/bias re-allows it)
    if kind == "bool":
        return keep
    bias = rng.normal(size=shape).astype(dtype)
    return np.where(keep, bias, -np.inf).astype(dtype)  # "float": finite + -inf entries


@pytest.mark.parametrize("q_shape, k_shape, v_shape, mask_shape", [
    ((2, 3, 17, 8), (2, 3, 23, 8), (2, 3, 23, 5), (2, 3, 17, 23)),  # B, H, T != S, Dv != D
    ((4, 9, 6), (1, 11, 6), (4, 11, 3), (9, 11)),  # key broadcast over the batch
    ((3, 2, 7, 4), (2, 7, 4), (3, 1, 7, 4), (3, 1, 7, 7)),  # value broadcast over heads
    ((33, 16), (40, 16), (40, 16), (33, 40)),  # no leading dims: one block
    ((2, 4, 64, 32), (2, 4, 64, 32), (2, 4, 64, 32), (1, 4, 64, 64)),  # larger, square
])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_core_random_configurations(q_shape, k_shape, v_shape, mask_shape, mask_kind,
                                    is_causal, dtype):
    """Oracle: reference path, standard normal inputs, every split of the work."""
    # NOTE: crc32, not hash(): hash() of a str changes with each process's
    # PYTHONHASHSEED, which made these inputs differ from run to run
    rng = np.random.default_rng(zlib.crc32(repr((q_shape, mask_kind, is_causal)).encode()))
    inputs = {"query": rng.normal(size=q_shape), "key": rng.normal(size=k_shape),
              "value": rng.normal(size=v_shape)}
    options = {"attn_mask": random_mask(mask_kind, rng, mask_shape, dtype), "is_causal": is_causal}
    for split in SPLITS:
        with blocks_and_threads(*split):
            check_core(inputs, options, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("dropout", [False, True])
def test_serial_forward_threaded_backward(dtype, dropout):
    """Oracle: reference path. A problem whose forward runs serially (and keeps
    the normalised weights, cache ``inv_sum=None``) while its backward, twice
    the flops, goes to the threads: the threaded backward must read the
    weights as ``E = P, r = 1``. With a replayed dropout mask too."""
    rng = np.random.default_rng(7)
    G, T, S, D, Dv = 6, 9, 11, 4, 3
    inputs = {"query": rng.normal(size=(2, 3, T, D)), "key": rng.normal(size=(2, 3, S, D)),
              "value": rng.normal(size=(2, 3, S, Dv))}
    options = {"is_causal": True}
    if dropout:
        options.update(dropout_p=0.25, dropout_mask=rng.random((2, 3, T, S)) > 0.25)
    forward_flops = 2 * G * T * S * (D + Dv + 2)
    backward_flops = 4 * G * T * S * (D + Dv + 1)
    assert forward_flops < forward_flops + 1 <= backward_flops
    with kernels.num_threads(2), kernels.block_sizes(min_parallel_flops=forward_flops + 1):
        actual, expected, cache, _ = core_both_paths(inputs, options, dtype)
    assert cache.inv_sum is None  # the forward did normalise
    for name, a, b in zip(("out", "dquery", "dkey", "dvalue"), actual, expected):
        assert_close(a, b, name)


def test_fully_masked_rows_are_exact_zeros():
    """Definition: a query with no key left has output 0 and sends no gradient
    anywhere (exactly, not round-off), without a warning."""
    rng = np.random.default_rng(1)
    query, key, value = rng.normal(size=(2, 3, 5, 4)), rng.normal(size=(2, 3, 6, 4)), rng.normal(size=(2, 3, 6, 2))
    keep = np.ones((2, 3, 5, 6), bool)
    keep[0, 1, 2] = False
    keep[1, :, 4] = False
    dout = rng.normal(size=(2, 3, 5, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, cache = fast.attention_forward(query, key, value, keep)
        dquery, dkey, dvalue = fast.attention_backward(dout, cache)
    assert out.shape == (2, 3, 5, 2)
    assert np.all(out[0, 1, 2] == 0) and np.all(out[1, :, 4] == 0)
    assert np.all(dquery[0, 1, 2] == 0) and np.all(dquery[1, :, 4] == 0)
    # the dead rows contribute nothing to dkey/dvalue: same as dropping them from dout
    dout_dead = dout.copy()
    dout_dead[0, 1, 2] = dout_dead[1, :, 4] = 1e3
    _, dkey2, dvalue2 = fast.attention_backward(dout_dead, cache)
    assert np.array_equal(dkey, dkey2) and np.array_equal(dvalue, dvalue2)


def test_no_keys_at_all_gives_zeros():
    """Definition (as qkvnp.functional and qkvnp.kernels.tiled): every query
    attends to nothing, so output and dquery are 0."""
    out, cache = fast.attention_forward(np.ones((3, 2)), np.ones((0, 2)), np.ones((0, 4)))
    assert out.shape == (3, 4) and np.all(out == 0)
    dquery, dkey, dvalue = fast.attention_backward(np.ones((3, 4)), cache)
    assert dquery.shape == (3, 2) and np.all(dquery == 0)
    assert dkey.shape == (0, 2) and dvalue.shape == (0, 4)


def test_no_queries():
    """Oracle: reference path; T = 0 gives empty outputs and zero key gradients."""
    rng = np.random.default_rng(4)
    check_core({"query": rng.normal(size=(2, 0, 3)), "key": rng.normal(size=(2, 5, 3)),
                "value": rng.normal(size=(2, 5, 2))}, {"is_causal": True})


@pytest.mark.parametrize("dtype, factor", [(np.float32, 1e20), (np.float64, 1e200),
                                           (np.float32, 1e4), (np.float64, 1e150)])
def test_huge_inputs_stay_finite(dtype, factor):
    """Oracle: softmax of huge scores tends to a one-hot row; outputs and gradients
    stay finite, without a warning, also when the scores overflow to inf."""
    rng = np.random.default_rng(10)
    query = (rng.normal(size=(2, 4, 3)) * factor).astype(dtype)
    key = (rng.normal(size=(2, 5, 3)) * factor).astype(dtype)
    value = rng.normal(size=(2, 5, 2)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, cache = fast.attention_forward(query, key, value, is_causal=True)
        grads = fast.attention_backward(rng.normal(size=out.shape).astype(dtype), cache)
    assert out.dtype == dtype and np.isfinite(out).all()
    weights = fast.attention_weights(cache)
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-6)
    for grad in grads:
        assert grad.dtype == dtype and np.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("magnitude", [1.0, 3.0, 8.0])
def test_loose_row_max_bounds_take_the_exact_path(dtype, magnitude):
    """Oracle: reference path. With scale=1 and inputs of norm ~8*magnitude the
    Cauchy-Schwarz bound on the row max is tens of bits above the max, so
    blocks must switch to the exact max (else the exponentials are subnormal:
    imprecise and 100x slower); the tiny blocks mix both kinds."""
    rng = np.random.default_rng(11)
    inputs = {"query": rng.normal(size=(2, 3, 24, 16)) * magnitude,
              "key": rng.normal(size=(2, 3, 30, 16)) * magnitude,
              "value": rng.normal(size=(2, 3, 30, 5))}
    for split in SPLITS:
        with blocks_and_threads(*split):
            for is_causal in (False, True):
                if dtype == np.float64:
                    check_core(inputs, {"scale": 1.0, "is_causal": is_causal}, dtype)
                else:
                    check_float32_core_against_float64(inputs, {"scale": 1.0,
                                                                "is_causal": is_causal})


def check_float32_core_against_float64(inputs, options):
    """Oracle: the float64 reference. Scores of magnitude ``m`` carry a
    rounding error of about ``m`` float32 epsilons before the softmax (the
    gradients inherit it), so both float32 paths are held to
    ``max(PATH_TOLERANCE, eps * m)`` of the float64 result: as close as the
    scores' own rounding allows, which two float32 paths need not be to each
    other (the OpenBLAS of numpy 1.24 rounds them 3e-5 apart at m = 1107)."""
    actual, reference32, _, _ = core_both_paths(inputs, options, np.float32)
    exact = core_both_paths(inputs, options, np.float64)[1]  # the reference's, float64
    scores = np.einsum("...td,...sd->...ts", inputs["query"], inputs["key"]) * options["scale"]
    tol = max(PATH_TOLERANCE[np.dtype(np.float32)],
              np.finfo(np.float32).eps * float(np.abs(scores).max()))
    for path, result in (("fast", actual), ("reference", reference32)):
        for name, a, b in zip(("out", "dquery", "dkey", "dvalue"), result, exact):
            error = np.abs(a.astype(np.float64) - b)
            scale = max(1.0, float(np.abs(b).max()))
            worst = np.unravel_index(np.argmax(error), error.shape)
            assert error[worst] <= tol * scale, (
                f"{name}: float32 {path} {a[worst]!r} vs float64 reference {b[worst]!r} at "
                f"{worst}, error {error[worst]:.3g} > {tol:.3g} * {scale:.3g}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case, shifted_passes", [
    ("moderate", 0),  # the unshifted exponentials are usable: no bound computed
    ("large", 1),  # unshifted, exp(100) overflows float32 (exp(800) float64): shifted
    ("low", 1),  # a float mask of -40 (-800 float64): unshifted row sums underflow
    ("dead", 0),  # a fully masked row (row sum 0) beside usable ones: unshifted
    ("large, dead", 1),  # the same row beside overflowing ones: shifted
])
def test_whole_array_core_tries_unshifted_scores_first(monkeypatch, dtype, case,
                                                       shifted_passes):
    """Oracle: the reference core. A serial problem with few scores keeps the
    weights P, which do not depend on the shift: its first try exponentiates
    the scores as they are, and only rows whose sums leave the usable range
    take the second, shifted try (one pass of |q| max|k| row bounds). Rows
    that the mask removes entirely (row sum 0) keep either try usable, and
    every case stays on the whole-array core (it keeps P: inv_sum None)."""
    calls = []
    shifted_exp = fast_small._shifted_exp
    monkeypatch.setattr(fast_small, "_shifted_exp",
                        lambda *args: calls.append(1) or shifted_exp(*args))
    rng = np.random.default_rng(12)
    direction = rng.normal(size=3)
    direction /= np.linalg.norm(direction)
    # parallel queries and keys of norm ~sqrt(big): scores near `big`, spread by the noise
    big = (100.0 if dtype == np.float32 else 800.0) if case.startswith("large") else 1.0
    query = np.sqrt(big) * (direction + 0.01 * rng.normal(size=(2, 4, 3)))
    key = np.sqrt(big) * (direction + 0.01 * rng.normal(size=(2, 5, 3)))
    options = {"scale": 1.0, "is_causal": True}
    if case == "low":
        options["attn_mask"] = np.full((4, 5), -40.0 if dtype == np.float32 else -800.0)
    if case.endswith("dead"):
        options["attn_mask"] = np.ones((4, 5), bool)
        options["attn_mask"][2] = False  # query 2 attends to nothing: weights 0, output 0
    inputs = {"query": query, "key": key, "value": rng.normal(size=(2, 5, 2))}
    check_core(inputs, options, dtype)
    assert len(calls) == shifted_passes
    _, _, cache, _ = core_both_paths(inputs, options, dtype)
    assert cache.inv_sum is None  # the whole-array core's weights, not the blocked core's


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("split", [(1, 1 << 22), (2, 1, 1)], ids=["whole-array", "blocked"])
def test_causal_scores_are_masked_after_the_exponential(monkeypatch, dtype, split):
    """Oracle: the reference core. Under a causal mask the fast core
    exponentiates the scores unmasked and multiplies by the mask's 0 / 1
    factors (numpy's exp takes a slow path on -inf). Here every query's
    masked key (key 5, after all 5 queries) scores about 100 (800 in float64),
    whose exponential overflows: the whole-array core's unshifted row sums are
    NaN (inf * 0), its shifted try's bound (set by key 5) leaves the visible
    scores' sums below 2**-24, so its third try takes the exact row max of
    the masked scores, as the reference does (one shifted pass per call), with
    the masked weights exactly 0 and the weights kept. The blocked core's
    bound covers every score."""
    calls = []
    shifted_exp = fast_small._shifted_exp
    monkeypatch.setattr(fast_small, "_shifted_exp",
                        lambda *args: calls.append(1) or shifted_exp(*args))
    rng = np.random.default_rng(13)
    big = 100.0 if dtype == np.float32 else 800.0
    query = rng.normal(size=(2, 5, 3))
    query[..., 0] = np.sqrt(big)  # every query has a large first coordinate
    key = 0.1 * rng.normal(size=(2, 6, 3))
    key[:, 5, 0] = np.sqrt(big)  # only key 5 (masked for every query) shares it
    inputs = {"query": query, "key": key, "value": rng.normal(size=(2, 6, 2))}
    options = {"scale": 1.0, "is_causal": True}
    with blocks_and_threads(*split):
        check_core(inputs, options, dtype)
        _, _, cache, _ = core_both_paths(inputs, options, dtype)
    weights = fast.attention_weights(cache)
    assert (weights[..., 5] == 0).all() and np.isfinite(weights).all()
    if split[0] == 1:  # the whole-array core answered from the exact row max itself
        assert len(calls) == 2 and cache.inv_sum is None


def test_causal_factors_are_the_shared_causal_mask_as_0_and_1():
    """Oracle: the boolean causal mask. Only the shared causal masks (either
    alignment) have factors and a diagonal offset (query i sees keys j <= i +
    offset); any other additive mask is added as before."""
    from qkvnp.ops.masks import additive_mask, causal_factors, causal_mask, causal_mask_offset

    for T, S in ((3, 5), (5, 3), (4, 4)):
        for bottom_right in (False, True):
            allowed = causal_mask(T, S, bottom_right=bottom_right)
            for dtype in (np.float32, np.float64):
                mask = additive_mask(None, allowed, dtype)
                factors = causal_factors(mask, dtype)
                assert factors.dtype == dtype and not factors.flags.writeable
                assert np.array_equal(factors, allowed.astype(dtype))
                other = np.float16 if dtype == np.float32 else np.float32
                assert causal_factors(mask, other) is None
                offset = causal_mask_offset(mask, dtype)
                assert np.array_equal(allowed, np.arange(S) <= np.arange(T)[:, None] + offset)
                assert causal_mask_offset(mask, other) is None
    user_keep = np.tril(np.ones((3, 5), bool))  # the same pattern, but the user's array
    assert causal_factors(additive_mask(None, user_keep, np.float64), np.float64) is None
    assert causal_mask_offset(additive_mask(None, user_keep, np.float64), np.float64) is None
    assert causal_factors(np.zeros((3, 5)), np.float64) is None
    assert causal_factors(None, np.float64) is None
    assert causal_mask_offset(None, np.float64) is None


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("is_causal, T, S", [(True, 23, 23), (True, 17, 30), ("bottom_right", 17, 30),
                                             ("bottom_right", 30, 17)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_causal_row_chunks_skip_the_keys_no_row_sees(monkeypatch, dtype, threads, is_causal, T, S,
                                                     dropout_p):
    """Oracle: the reference core, and the triangle's area. Under a causal
    mask the blocked core goes by chunks of ``causal_row_block`` rows and
    computes, for each chunk, only the keys its last row sees, storing them
    packed (fast._packed). The numerators it skips are never written: the
    score buffer starts full of NaN here, so a gradient or weight that read
    one, or read a packed chunk as a plain one, would be NaN. The backward
    takes the forward's chunks even when the setting changes in between."""
    monkeypatch.setattr(fast, "recycled_empty", lambda shape, dtype: np.full(shape, np.nan, dtype))
    seen = {"forward": 0, "backward": 0}
    counting = threading.Lock()  # the workers call the spies concurrently: += is not atomic
    for name, index, kind in (("_forward_rows", 0, "forward"), ("_backward_rows", 5, "backward")):
        def spy(*args, _wrapped=getattr(fast, name), _index=index, _kind=kind):
            with counting:
                seen[_kind] += args[_index].shape[-2] * min(args[-1], args[_index].shape[-1])
            return _wrapped(*args)
        monkeypatch.setattr(fast, name, spy)
    rng = np.random.default_rng(7)
    inputs = {"query": rng.normal(size=(2, T, 5)), "key": rng.normal(size=(2, S, 5)),
              "value": rng.normal(size=(2, S, 3))}
    options = {"is_causal": is_causal}
    if dropout_p:
        options.update(dropout_p=dropout_p, dropout_mask=rng.random((2, T, S)) >= dropout_p)
    settings_ = dict(row_block_bytes=1 << 20, min_row_block=1, min_parallel_flops=0,
                     fast_block_bytes=1)
    with kernels.num_threads(threads), kernels.block_sizes(causal_row_block=4, **settings_):
        out, cache = fast.attention_forward(**{n: a.astype(dtype) for n, a in inputs.items()},
                                            **options)
    assert cache.chunk_rows == 4
    offset = S - T if is_causal == "bottom_right" else 0
    # each chunk of 4 rows computes the keys before its end + offset (all of them if none)
    stops = [min(start + 4, T) for start in range(0, T, 4)]
    chunks = [(stop - start) * (min(S, stop + offset) if stop + offset > 0 else S)
              for start, stop in zip(range(0, T, 4), stops)]
    assert seen["forward"] == 2 * sum(chunks) < 2 * T * S
    with kernels.num_threads(threads), kernels.block_sizes(causal_row_block=7, **settings_):
        dout = rng.normal(size=out.shape).astype(dtype)
        grads = fast.attention_backward(dout, cache)
    assert seen["backward"] == seen["forward"]  # the forward's chunks, not 7 rows
    ref_inputs = {n: a.astype(dtype) for n, a in inputs.items()}
    out_ref, cache_ref = F.attention_forward(**ref_inputs, **options)
    for name, a, b in zip(("out", "dquery", "dkey", "dvalue"), (out, *grads),
                          (out_ref, *F.attention_backward(dout, cache_ref))):
        assert_close(a, b, name)
    weights = fast.attention_weights(cache)
    assert_close(weights, F.dropped_weights(cache_ref), "weights")
    above = np.arange(S) > np.arange(T)[:, None] + offset  # keys after each query's diagonal
    assert (weights[..., above] == 0).all()


def test_packed_chunks_share_the_rows_memory_or_fall_back_to_a_strided_view():
    """Oracle: numpy's own views. A (R, live) chunk of contiguous (R, S) rows
    is packed in their first R * live entries; rows that are not contiguous
    (or all S keys) give the plain strided view, whichever reader asks."""
    rows = np.arange(24.0).reshape(1, 4, 6)  # (G, R, S)
    packed = fast._packed(rows, 3)
    assert packed.shape == (1, 4, 3) and np.shares_memory(packed, rows)
    packed[...] = np.arange(12.0).reshape(1, 4, 3)
    assert np.array_equal(rows.reshape(-1)[:12], np.arange(12.0))  # packed, row after row
    assert np.array_equal(rows.reshape(-1)[12:], np.arange(12.0, 24.0))  # the rest untouched
    every_other = np.arange(48.0).reshape(1, 4, 12)[..., ::2]  # rows not contiguous
    assert np.array_equal(fast._packed(every_other, 3), every_other[..., :3])
    whole = fast._packed(rows, 6)  # every key: the rows themselves
    assert whole.strides == rows.strides and np.array_equal(whole, rows)


def test_one_key_returns_its_value():
    """Closed form: with a single key every query's output is that key's value
    (to a few ulps: the fast path computes it as ``(e * v) / e``)."""
    value = np.array([[3.0, -5.0, 0.5]])
    out, _ = fast.attention_forward(np.random.default_rng(0).normal(size=(4, 7, 2)),
                                    np.ones((1, 2)), value)
    assert out.shape == (4, 7, 3)
    np.testing.assert_allclose(out, np.broadcast_to(value, (4, 7, 3)), rtol=4 * np.finfo(float).eps)


def test_float16_is_computed_in_float32():
    """Oracle: reference path, which computes float16 in float32."""
    rng = np.random.default_rng(5)
    inputs = {name: rng.normal(size=shape).astype(np.float16)
              for name, shape in (("query", (3, 4, 2)), ("key", (3, 5, 2)), ("value", (3, 5, 2)))}
    actual = check_core(inputs, {}, np.float16)
    assert all(a.dtype == np.float32 for a in actual)


def test_editing_the_output_in_place_does_not_change_the_gradients():
    """Oracle: the same backward before the caller scribbles on ``out``."""
    rng = np.random.default_rng(6)
    out, cache = fast.attention_forward(*(rng.normal(size=(2, 5, 3)) for _ in range(3)))
    dout = rng.normal(size=out.shape)
    before = fast.attention_backward(dout, cache)
    out *= 100.0
    after = fast.attention_backward(dout, cache)
    for a, b in zip(after, before):
        assert np.array_equal(a, b)


def test_recycled_score_buffers_are_never_shared():
    """A score buffer is reused only when nothing refers to it: two live caches,
    or a caller's slice of one, keep their own; gradients match those of
    caches computed alone (oracle: the same call without recycling)."""
    kernels.release_buffers()  # (buffers that live arrays still use stay in the pool)
    pooled = len(buffers._SPARE)
    rng = np.random.default_rng(13)
    problems = [[rng.normal(size=(2, 6, 3)) for _ in range(3)] for _ in range(3)]
    douts = [rng.normal(size=(2, 6, 3)) for _ in range(3)]
    with kernels.block_sizes(recycle_bytes=0):
        expected = [fast.attention_backward(d, fast.attention_forward(*p)[1])
                    for p, d in zip(problems, douts)]
    with kernels.block_sizes(recycle_min_bytes=1):
        _, first = fast.attention_forward(*problems[0])
        piece = first.exp_scores[1]  # a caller's view keeps the buffer busy
        _, second = fast.attention_forward(*problems[1])
        assert not np.shares_memory(first.exp_scores, second.exp_scores)
        del first
        _, third = fast.attention_forward(*problems[2])
        assert not np.shares_memory(piece, third.exp_scores)
        for got, want in zip(fast.attention_backward(douts[1], second), expected[1]):
            assert np.array_equal(got, want)
        for got, want in zip(fast.attention_backward(douts[2], third), expected[2]):
            assert np.array_equal(got, want)
        del piece, second, third
        # three score buffers, and the backwards' (T, S) scratch, freed after each
        allocated = len(buffers._SPARE)
        assert allocated == pooled + 4
        _, fourth = fast.attention_forward(*problems[0])  # now a free buffer is reused
        assert len(buffers._SPARE) == allocated
        for got, want in zip(fast.attention_backward(douts[0], fourth), expected[0]):
            assert np.array_equal(got, want)
        del fourth
    kernels.release_buffers()
    assert len(buffers._SPARE) == pooled


class _Owner:
    """Something a buffer may be kept for (a layer, in the library)."""


@pytest.mark.parametrize("setting", ["recycle_bytes", "recycle_unowned_bytes"])
def test_the_buffer_pool_keeps_at_most_recycle_bytes_of_free_buffers(setting):
    """Oracle: the setting. 100 buffers of distinct sizes (2 MiB + i * 8 bytes),
    each dropped after its call, leave at most 16 MiB of free buffers in the
    pool: ``recycle_bytes`` for those taken for a live owner (a layer),
    ``recycle_unowned_bytes`` for the others; a buffer whose array is alive
    is never dropped nor handed out again; ``release_buffers`` drops every free one."""
    kernels.release_buffers()
    pooled = list(buffers._SPARE)  # buffers live arrays of other tests still use
    kept = sum(b.nbytes for b in pooled)
    size = 2 << 20
    owner = _Owner()
    scope = kernels.buffer_owner(owner) if setting == "recycle_bytes" else contextlib.nullcontext()
    with kernels.block_sizes(recycle_min_bytes=1 << 20, **{setting: 16 << 20}), scope:
        alive = buffers.recycled_empty((size // 8,), np.float64)
        alive[:] = 7.0
        for i in range(100):
            buffer = buffers.recycled_empty((size // 8 + i,), np.float64)
            assert not np.shares_memory(buffer, alive)
            del buffer
            free = sum(b.nbytes for b in buffers._SPARE) - kept - alive.nbytes
            assert free <= 16 << 20, f"{free / 2**20:.1f} MiB of free buffers after {i + 1}"
        again = buffers.recycled_empty((size // 8,), np.float64)  # alive's size: a new one
        assert not np.shares_memory(again, alive) and (alive == 7.0).all()
        assert any(b is alive.base for b in buffers._SPARE)  # in use: kept
        del again
        kernels.release_buffers()
        others = [id(b) for b in buffers._SPARE if b is not alive.base]
        assert others == [id(b) for b in pooled]
    del alive
    kernels.release_buffers()
    assert [id(b) for b in buffers._SPARE] == [id(b) for b in pooled]


def test_a_deleted_layer_leaves_at_most_the_unowned_bound_in_the_buffer_pool():
    """Oracle: the bytes of the pool's buffers (counted on the pool itself) and
    tracemalloc's current traced memory, before the layer and after it is deleted:
    16 causal calls at T = 1536-1551 (a score buffer of a new size each, about
    300 MiB in all while the layer lives) leave at most ``recycle_unowned_bytes``
    (8 MiB) in the pool, on the fast and the auto paths, and at most that plus the
    causal masks' own cache (``CAUSAL_CACHE_BYTES``) traced; before, the pool kept
    them (up to ``recycle_bytes``, 512 MiB) and an idle worker the last one."""
    import gc
    import tracemalloc

    from qkvnp.ops.masks import CAUSAL_CACHE_BYTES

    bound = kernels.get_block_sizes()["recycle_unowned_bytes"]
    assert bound <= 8 << 20
    rng = np.random.default_rng(9)
    for impl in ("fast", "auto"):
        gc.collect()
        kernels.release_buffers()
        held_before = sum(b.nbytes for b in buffers._SPARE)
        tracemalloc.start()
        try:
            traced_before = tracemalloc.get_traced_memory()[0]
            layer = qkvnp.MultiHeadAttention(32, 2, rng=0, dtype=np.float32, impl=impl)
            for T in range(1536, 1552):
                out = layer.forward(rng.normal(size=(1, T, 32)).astype(np.float32),
                                    is_causal=True)
            assert sum(b.nbytes for b in buffers._SPARE) - held_before > 100 << 20  # used
            del layer, out
            gc.collect()
            held = sum(b.nbytes for b in buffers._SPARE) - held_before
            traced = tracemalloc.get_traced_memory()[0] - traced_before
        finally:
            tracemalloc.stop()
        assert held <= bound, f"{impl}: the pool holds {held / 2**20:.1f} MiB"
        limit = bound + CAUSAL_CACHE_BYTES + (1 << 20)  # 1 MiB: small objects made meanwhile
        assert traced <= limit, f"{impl}: {traced / 2**20:.1f} MiB still traced"


def test_blas_thread_count_is_restored_even_on_error():
    """The threaded section pins BLAS to one thread and must always restore it."""
    blas = _runtime.openblas_thread_functions()
    if not blas:
        pytest.skip("numpy's OpenBLAS not found: fast path runs without Python threads")
    get, _ = blas
    before = get()
    with blocks_and_threads(2, 1):
        fast.attention_forward(*(np.ones((4, 3, 2)) for _ in range(3)))
        assert get() == before

        def failing(part):
            raise RuntimeError("worker failure")

        with pytest.raises(RuntimeError, match="worker failure"):
            _runtime.run(failing, [(0,), (1,), (2,)])
    assert get() == before


@pytest.mark.parametrize("split", ["rows", "cols"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_matmul(split, threads):
    """Oracle: numpy's matmul; the pieces tile the product (odd sizes, strided operands)."""
    rng = np.random.default_rng(12)
    a = rng.normal(size=(7, 9)).T  # (9, 7), transposed view
    b = rng.normal(size=(7, 11))[:, ::2]  # (7, 6), strided view
    with blocks_and_threads(threads, 1):
        np.testing.assert_allclose(_runtime.matmul(a, b, split=split), a @ b, rtol=1e-14)
        out = np.full((9, 6), np.nan)
        assert _runtime.matmul(a, b, out, split=split) is out
        np.testing.assert_allclose(out, a @ b, rtol=1e-14)


class _CountingNumpy:
    """numpy, but ``matmul`` records OpenBLAS's thread count at each call."""

    def __init__(self, get):
        self.get, self.counts = get, []

    def matmul(self, *args, **kwargs):
        self.counts.append(self.get())
        return np.matmul(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(np, name)


def test_projection_runs_on_blas_threads_only_where_asked_and_large(monkeypatch):
    """Oracle: OpenBLAS's own count during each product, and numpy's product.

    ``blas_threads=True`` from ``blas_thread_flops`` on: as many BLAS threads as
    the kernels', capped by the count before the section pinned BLAS to one;
    never in a worker; back to one after the product."""
    blas = _runtime.openblas_thread_functions()
    if not blas:
        pytest.skip("numpy's OpenBLAS not found: its thread count cannot be steered")
    get, _ = blas
    counting = _CountingNumpy(get)
    monkeypatch.setattr(_runtime, "np", counting)
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(40, 30)), rng.normal(size=(30, 20))  # 48,000 flops
    limit = 2 * 40 * 30 * 20

    def product(**kwargs):
        counting.counts.clear()
        got = _runtime.matmul(a, b, **kwargs)
        np.testing.assert_allclose(got, a @ b, rtol=1e-13)
        return counting.counts[:]

    with kernels.blas_threads(3), kernels.num_threads(2):
        with kernels.block_sizes(blas_thread_flops=limit), _runtime.single_threaded_blas():
            assert product(blas_threads=True) == [2]  # min(2 kernel threads, 3 before the pin)
            assert get() == 1  # the section's pin again
            assert product() == [1]  # not asked: below min_parallel_flops, one thread
            # a worker's product: one thread. The two shares run at once, so the
            # counts are read after both end (a share reading the shared list
            # while the other appends would see both counts)
            counting.counts.clear()
            shares = [None, None]

            def share(part):
                (index,) = part
                shares[index] = _runtime.matmul(a, b, blas_threads=True)

            with kernels.block_sizes(min_parallel_flops=0):
                _runtime.run(share, [0, 1])
            assert counting.counts == [1, 1]
            for got in shares:
                np.testing.assert_allclose(got, a @ b, rtol=1e-13)
        with kernels.block_sizes(blas_thread_flops=limit + 1), _runtime.single_threaded_blas():
            assert product(blas_threads=True) == [1]  # below the setting
        assert get() == 3
    with kernels.blas_threads(1), kernels.num_threads(2):  # as the training loop runs
        with kernels.block_sizes(blas_thread_flops=limit), _runtime.single_threaded_blas():
            assert product(blas_threads=True) == [1]


def test_a_large_job_of_one_block_runs_on_blas_threads(monkeypatch):
    """Oracle: OpenBLAS's own count inside each task, against the rule of
    ``_runtime.run``: one block from ``min_parallel_flops`` on cannot be shared,
    so its products get the kernels' threads (capped by the count before the
    pin); below the setting, in a worker, or without a flops estimate, one;
    two blocks go to the workers at one each; back to one after, even on error."""
    blas = _runtime.openblas_thread_functions()
    if not blas:
        pytest.skip("numpy's OpenBLAS not found: its thread count cannot be steered")
    get, _ = blas
    seen = []

    def task(part):
        seen.append(get())

    def counts(work, flops):
        seen.clear()
        _runtime.run(task, work, flops)
        return seen[:]

    with kernels.blas_threads(3), kernels.num_threads(2), \
            kernels.block_sizes(min_parallel_flops=1000), _runtime.single_threaded_blas():
        assert counts([0], 1000) == [2]  # min(2 kernel threads, 3 before the pin)
        assert get() == 1
        assert counts([0], 999) == [1]  # below the setting
        assert counts([0], None) == [1]  # no estimate: as before
        assert counts([0, 1], 1000) == [1, 1]  # shared: each worker at one
        inner = []

        def worker_share(part):
            got = []
            _runtime.run(lambda one: got.append(get()), [0], 1000)
            inner.append(got)

        _runtime.run(worker_share, [0, 1], 1000)
        assert inner == [[1], [1]]  # in a worker: its share is one core's already
        assert get() == 1

        def failing(part):
            raise RuntimeError("one-block failure")

        with pytest.raises(RuntimeError, match="one-block failure"):
            _runtime.run(failing, [0], 1000)
        assert get() == 1
    with kernels.blas_threads(1), kernels.num_threads(2), \
            kernels.block_sizes(min_parallel_flops=1000), _runtime.single_threaded_blas():
        assert counts([0], 1000) == [1]  # as the training loop runs: BLAS stays at one


def test_layer_projections_take_blas_threads_only_beside_a_serial_core():
    """Oracle: the cache's flag against the core's backward flops and the setting.

    A pooled core after BLAS-threaded projections ran 1.2-1.45x slower (their
    threads spin): the flag is set only where the core runs serially."""
    layer = MultiHeadAttention(64, 4, rng=0)
    x = np.random.default_rng(0).normal(size=(2, 32, 64))
    core_flops = 4 * 2 * 4 * 32 * 32 * (2 * 16 + 1)  # the core's backward, the larger pass
    with kernels.num_threads(2):
        for threshold, expected in ((core_flops + 1, True), (core_flops, False)):
            # blas_thread_flops below the projections' 1.6 MFLOP: the general kernel
            # (below it, the layer runs on one thread in mha_small, no flag)
            with kernels.block_sizes(min_parallel_flops=threshold, batch_split_flops=1 << 40,
                                     blas_thread_flops=1 << 20):
                layer.forward(x)
                assert layer._cache.blas_threads is expected
                layer.backward(np.ones_like(x))
    with kernels.num_threads(1), kernels.block_sizes(blas_thread_flops=1 << 20):  # no pool
        layer.forward(x)
        assert layer._cache.blas_threads is True


def test_blocks_cover_every_group_once():
    """Blocks are index tuples over leading dims: together they tile ``lead``."""
    for lead in [(), (1,), (5,), (2, 3), (1, 8), (3, 1, 4)]:
        for block_bytes in (1, 100, 1 << 30):
            with blocks_and_threads(2, block_bytes):
                blocks = _runtime.blocks(lead, 64, 2)
            seen = np.zeros(lead, int)
            for idx in blocks:
                seen[idx] += 1
            assert np.all(seen == 1), (lead, block_bytes, blocks)


def test_import_does_not_load_scipy():
    code = "import sys, qkvnp.kernels.fast; print('scipy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- the layers


def layer_pair(cls, impl="fast", **kwargs):
    """The same layer (same seed, same params) on the reference and on ``impl``."""
    return cls(**kwargs, impl="reference"), cls(**kwargs, impl=impl)


def run_layer(layer, inputs, kwargs, dout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference's own warnings are not our subject
        out = layer.forward(*inputs, **kwargs)
        dinputs = layer.backward(dout)
    dinputs = dinputs if isinstance(dinputs, tuple) else (dinputs,)
    return out, [d for d in dinputs if d is not None]


def check_layers(reference, other, inputs, kwargs, seed=0):
    out_ref, dinputs_ref = run_layer(reference, inputs, kwargs,
                                     dout := np.random.default_rng(seed).standard_normal(
                                         reference.forward(*inputs, **kwargs).shape
                                     ).astype(reference.dtype))
    out, dinputs = run_layer(other, inputs, kwargs, dout)
    assert_close(out, out_ref, "out")
    assert len(dinputs) == len(dinputs_ref)
    for i, (a, b) in enumerate(zip(dinputs, dinputs_ref)):
        assert_close(a, b, f"dinput{i}")
    assert reference.grads.keys() == other.grads.keys()
    for name in reference.grads:
        assert_close(other.grads[name], reference.grads[name], name)


def batch_split(split):
    """The layers split their batch over the threads (``split``) or never do."""
    return kernels.block_sizes(batch_split_flops=0 if split else 1 << 62)


def threads_or_one(serial):
    """``serial``: one thread and the default settings, where a self-attention
    layer this small runs in :mod:`qkvnp.kernels.mha_small`; else two threads,
    tiny blocks and every job shared (:func:`blocks_and_threads`), where it
    runs on the general kernel of :mod:`qkvnp.kernels.mha`."""
    return kernels.num_threads(1) if serial else blocks_and_threads(2, 1)


@MANY
@given(case=mha_cases(), dtype=st.sampled_from([np.float64, np.float32]), split=st.booleans(),
       serial=st.booleans())
def test_multi_head_layer_matches_reference(case, dtype, split, serial):
    """Oracle: the reference layer; self, cross and key-only attention, masks,
    key padding with fully padded sequences, causal, with and without bias,
    with and without the batch split over the threads (a batch of 2 splits),
    or on one thread (self-attention then runs in mha_small)."""
    kw = {k: case[k] for k in ("embed_dim", "num_heads", "bias", "kdim", "vdim", "seed")}
    kw["rng"] = kw.pop("seed")
    reference, other = layer_pair(MultiHeadAttention, dtype=dtype, **kw)
    inputs = [x.astype(dtype) for x in case["inputs"]]
    mask = case["attn_mask"]
    kwargs = {"attn_mask": mask, "is_causal": case["is_causal"],
              "key_padding_mask": case["key_padding_mask"]}
    with threads_or_one(serial), batch_split(split):
        check_layers(reference, other, inputs, kwargs)


@MANY
@given(case=self_attention_cases(), dtype=st.sampled_from([np.float64, np.float32]),
       split=st.booleans(), serial=st.booleans())
def test_self_attention_layer_matches_reference(case, dtype, split, serial):
    """Oracle: the reference layer (single head, no output projection), on
    the general kernel or on one thread (mha_small)."""
    reference, other = layer_pair(SelfAttention, d_in=case["d_in"], d_out=case["d_out"],
                                  qkv_bias=case["qkv_bias"], rng=case["seed"], dtype=dtype)
    kwargs = {"attn_mask": case["attn_mask"], "is_causal": case["is_causal"]}
    with threads_or_one(serial), batch_split(split):
        check_layers(reference, other, [case["x"].astype(dtype)], kwargs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", ["causal", "bool mask", "float mask", "no bias", "weights",
                                  "self-attention layer", "two batch dims"])
def test_one_thread_layer_runs_and_matches_reference(dtype, case):
    """Oracle: the reference layer, and the cache's type for where the call ran.

    A self-attention layer whose every step runs on one thread in whole
    arrays takes mha_small (SmallLayerCache). Each layer runs three
    forward+backward calls on inputs of changing shapes, so that the second
    reuses the first's buffers and the third cannot; gradients accumulate
    over the three. Fed the same shapes, the general kernel (forced by
    blas_thread_flops=0) gives the same results within the path tolerance."""
    rng = np.random.default_rng(5)
    batch, E, H = ((2, 3) if case == "two batch dims" else (4,)), 8, 2
    if case == "self-attention layer":
        make = functools.partial(layer_pair, SelfAttention, d_in=E, d_out=6, qkv_bias=True)
    else:
        make = functools.partial(layer_pair, MultiHeadAttention, embed_dim=E, num_heads=H,
                                 bias=case != "no bias")
    calls = []
    for T in (5, 5, 7):
        kwargs = {"is_causal": True} if case in ("causal", "two batch dims") else {}
        if case == "bool mask":
            kwargs["attn_mask"] = np.tril(np.ones((T, T), bool), 1)
        if case in ("float mask", "self-attention layer"):
            kwargs["attn_mask"] = rng.normal(size=(T, T)) - 2 * np.triu(np.ones((T, T)), 2)
        calls.append((rng.normal(size=batch + (T, E)).astype(dtype), kwargs))
    results = []
    for settings_ in ({}, {"blas_thread_flops": 0}):
        reference, other = make(rng=3, dtype=dtype)
        for x, kwargs in calls:
            T = x.shape[-2]
            with kernels.num_threads(1), kernels.block_sizes(**settings_):
                check_layers(reference, other, [x], kwargs, seed=T)
                small = isinstance(other._used_cache, kernels.mha_small.SmallLayerCache)
                assert small == (not settings_)
                assert other.last_dispatch.path == "fast"
                if case == "weights":
                    _, weights = other.forward(x, return_weights=True, **kwargs)
                    _, expected = reference.forward(x, return_weights=True, **kwargs)
                    assert_close(weights, expected, "weights")
                    weights[...] = 0  # a copy: the cache's weights are intact
                    other.backward(np.ones(x.shape[:-1] + (E,), dtype))
                    reference.backward(np.ones(x.shape[:-1] + (E,), dtype))
        results.append({name: grad.copy() for name, grad in other.grads.items()})
    for name, grad in results[0].items():
        assert_close(grad, results[1][name], name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", ["self", "key_only", "cross", "gqa", "dropout", "weights",
                                  "two batch dims", "per-head mask", "self-attention layer"])
@pytest.mark.parametrize("inner_threads", [False, True])
def test_batch_split_matches_reference(dtype, case, inner_threads):
    """Oracle: the reference layer. The layer's batch split over two threads
    (``batch_split_flops=0``): an uneven batch of 3 (shares of 1 and 2), masks
    with and without the batch dim, grouped-query heads, a replayed dropout
    mask, the weights returned; ``inner_threads``: the core and the
    projections would thread too (``min_parallel_flops=0``), and run serially
    in the worker that holds the share. Gradients accumulate over two calls."""
    rng = np.random.default_rng(11)
    batch, T, S, E, H = ((3, 2) if case == "two batch dims" else (3,)), 6, 6, 8, 4
    kw = {"embed_dim": E, "num_heads": H, "rng": 5, "dtype": dtype}
    if case == "gqa":
        kw["num_kv_heads"] = 2
    if case == "dropout":
        kw["dropout"] = 0.25
    if case == "self-attention layer":
        reference, other = layer_pair(SelfAttention, d_in=E, d_out=E, qkv_bias=True, rng=5,
                                      dtype=dtype)
    else:
        reference, other = layer_pair(MultiHeadAttention, **kw)
    inputs = [rng.normal(size=batch + (T, E)).astype(dtype)]
    if case in ("key_only", "cross"):
        S = 9
        inputs.append(rng.normal(size=batch + (S, E)).astype(dtype))
    if case == "cross":
        inputs.append(rng.normal(size=batch + (S, E)).astype(dtype))
    kwargs = {}
    if case == "per-head mask":
        kwargs["attn_mask"] = rng.random(batch + (H, T, S)) > 0.4
    elif case == "self-attention layer":
        kwargs["attn_mask"] = rng.random(batch + (T, S)) > 0.4
    elif case in ("key_only", "cross"):
        kwargs["key_padding_mask"] = rng.random(batch + (S,)) > 0.3
    else:
        kwargs["is_causal"] = True
    if case == "dropout":
        kwargs["dropout_mask"] = rng.random(batch + (H, T, S)) > 0.25
    if case == "weights":
        kwargs["return_weights"] = True
    settings_ = {"min_parallel_flops": 0, "min_split": 2} if inner_threads else {}
    with kernels.num_threads(2), kernels.block_sizes(batch_split_flops=0, **settings_):
        if case == "weights":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, w_ref = reference.forward(*inputs, **kwargs)
                _, w = other.forward(*inputs, **kwargs)
            assert_close(w, w_ref, "weights")
            kwargs.pop("return_weights")
        check_layers(reference, other, inputs, kwargs)
        assert other._used_cache.shares == (slice(0, 1), slice(1, 3))  # it did split
        check_layers(reference, other, inputs, kwargs, seed=1)  # grads accumulate


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_batch_split_draws_the_dropout_mask_of_an_unsplit_call(impl):
    """Oracle: the same layer on ``impl`` without the split, with a Generator
    in the same state: a drawn dropout mask is drawn for the whole batch
    (one draw) and each share replays its part, so the outputs, the
    gradients and the Generator's state afterwards are those of one call."""
    rng = np.random.default_rng(12)
    x, dout = rng.normal(size=(4, 6, 8)), rng.normal(size=(4, 6, 8))
    runs = []
    for split in (True, False):
        layer = MultiHeadAttention(8, 2, rng=3, dropout=0.3, impl="fast" if split else impl)
        generator = np.random.default_rng(99)
        with kernels.num_threads(2), batch_split(split), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = layer.forward(x, is_causal=True, rng=generator)
            dx = layer.backward(dout)
        if split:
            assert len(layer._used_cache.shares) == 2  # it did split
        runs.append((out, dx, layer.grads, generator.bit_generator.state))
    (out, dx, grads, state), (out_ref, dx_ref, grads_ref, state_ref) = runs
    assert state == state_ref
    assert_close(out, out_ref, "out")
    assert_close(dx, dx_ref, "dx")
    for name in grads_ref:
        assert_close(grads[name], grads_ref[name], name)


def test_batch_split_refuses_a_bad_mask_before_any_work():
    """Oracle: the error contract. A mask whose batch dim fits neither the
    batch (4) nor a share (2) is refused whole, naming the mask, and the
    layer's previous cache survives for its backward."""
    layer = MultiHeadAttention(8, 2, rng=0)
    x = np.ones((4, 5, 8))
    with kernels.num_threads(2), batch_split(True):
        layer.forward(x)
        with pytest.raises(ValueError, match="mask"):
            layer.forward(x, attn_mask=np.ones((2, 2, 5, 5), bool))
        assert layer.backward(np.ones((4, 5, 8))).shape == (4, 5, 8)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batch_split_with_one_share_on_the_blocked_core(dtype, monkeypatch):
    """Oracle: the reference layer. One batch entry's keys point against its
    queries: every score is -20.6, so the whole-array core's unshifted try has
    row sums below 2**-24 and its shifted try, with the bound |q| max|k| =
    20.6, exponentials of -41; its exact-max try is made to fail here as an
    overflowing score makes it (NaN), so that share falls back to the blocked core,
    which keeps numerators and 1 / rowsum, while the other share keeps the
    normalised weights; each share's backward reads its own. The share that
    falls back has run the one-thread layer of mha_small first (its sizes
    qualify), which hands it to the general kernel when the core refuses."""
    E = 2
    reference, other = layer_pair(MultiHeadAttention, embed_dim=E, num_heads=1, bias=False,
                                  rng=0, dtype=dtype)
    weights = {"W_query": np.eye(E), "W_key": -np.eye(E), "W_value": np.eye(E),
               "W_out": np.eye(E)}
    for layer in (reference, other):
        layer.load_state_dict(weights)
    x = np.random.default_rng(3).normal(size=(2, 5, E))
    x[0] = [5.4, 0.0]  # queries (5.4, 0) / sqrt(2), keys (-5.4, 0): scores -20.6
    monkeypatch.setattr(fast_small, "_exact_shifted_exp",
                        lambda query, key, mask, exp_scores: exp_scores.fill(np.nan))
    with kernels.num_threads(2), kernels.block_sizes(batch_split_flops=0):
        check_layers(reference, other, [x.astype(dtype)], {"is_causal": True})
        assert other._used_cache.shares == (slice(0, 1), slice(1, 2))
        blocked, whole_array = other._used_cache.caches
        assert isinstance(blocked, kernels.mha.FusedLayerCache)  # the general kernel (share 0)
        assert blocked.core_cache.inv_sum is not None  # numerators and 1 / rowsum kept ...
        assert isinstance(whole_array, kernels.mha_small.SmallLayerCache)  # ... the weights (1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["self", "key_only", "cross"])
def test_multi_head_layer_larger_shapes(dtype, kind):
    """Oracle: the reference layer at sizes where the blocks hold several heads
    and both threads have work: (B, T, S, E, H) = (3, 40, 24, 32, 4), causal,
    padding; gradients accumulate over two backward calls."""
    rng = np.random.default_rng(7)
    B, T, S, E, H = 3, 40, (40 if kind == "self" else 24), 32, 4
    reference, other = layer_pair(MultiHeadAttention, embed_dim=E, num_heads=H, rng=3,
                                  dtype=dtype, kdim=E if kind == "self" else 12,
                                  vdim=E if kind == "self" else (12 if kind == "key_only" else 20))
    inputs = [rng.normal(size=(B, T, E)).astype(dtype)]
    if kind != "self":
        inputs.append(rng.normal(size=(B, S, 12)).astype(dtype))
    if kind == "cross":
        inputs.append(rng.normal(size=(B, S, 20)).astype(dtype))
    padding = rng.random((B, S)) > 0.2
    kwargs = {"is_causal": kind == "self", "key_padding_mask": padding}
    with blocks_and_threads(2, 1 << 14):
        check_layers(reference, other, inputs, kwargs)
        check_layers(reference, other, inputs, kwargs, seed=1)  # grads accumulate


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", ["self", "key_only", "cross", "gqa", "no bias", "dropout",
                                  "tiled", "self-attention layer", "mixed"])
def test_projections_with_fewer_rows_than_features_multiply_the_weights_apart(
        monkeypatch, dtype, case):
    """Oracle: the reference layer. With fewer rows (B * L) than input features
    (projections.weights_apart), each projection matrix multiplies on its own and the
    query's scale is applied to its outputs and gradients; every kind of input
    projection and the tiled core, gradients accumulated over two calls. The
    spy checks which way each projection ran ("mixed": 2 * 5 query rows
    >= 8 features fused, 2 * 3 key rows < 12 features apart)."""
    rng = np.random.default_rng(12)
    batch, T, S, E, H = (1,), 5, 7, 16, 4
    kdim, vdim = 12, 20
    if case == "mixed":
        batch, T, S, E, H = (2,), 5, 3, 8, 2
    kw = {"embed_dim": E, "num_heads": H, "rng": 4, "dtype": dtype}
    if case in ("key_only", "cross", "mixed"):
        kw.update(kdim=kdim, vdim=kdim if case != "cross" else vdim)
    if case == "gqa":
        kw["num_kv_heads"] = 2
    if case == "no bias":
        kw["bias"] = False
    if case == "dropout":
        kw["dropout"] = 0.25
    impl = "tiled" if case == "tiled" else "fast"
    if case == "self-attention layer":
        reference, other = layer_pair(SelfAttention, d_in=E, d_out=E, qkv_bias=True, rng=4,
                                      dtype=dtype)
    else:
        reference, other = layer_pair(MultiHeadAttention, impl=impl, **kw)
    for name in reference.params:
        if name.startswith("b_"):  # not the zeros they start as
            reference.params[name][...] = other.params[name][...] = rng.normal(
                size=reference.params[name].shape)
    inputs = [rng.normal(size=batch + (T, E)).astype(dtype)]
    if case in ("key_only", "cross", "mixed"):
        inputs.append(rng.normal(size=batch + (S, kdim)).astype(dtype))
    if case == "cross":
        inputs.append(rng.normal(size=batch + (S, vdim)).astype(dtype))
    kwargs = {"is_causal": True} if len(inputs) == 1 else {
        "key_padding_mask": rng.random(batch + (S,)) > 0.3}
    if case == "dropout":
        kwargs["dropout_mask"] = rng.random(batch + (H, T, T)) > 0.25
    ran = []
    real = projections.weights_apart
    monkeypatch.setattr(projections, "weights_apart", lambda *shape: ran.append(real(*shape)) or ran[-1])
    with kernels.num_threads(1):  # not mha_small: its own fused product serves tiny self-attention
        monkeypatch.setattr(mha.mha_small, "applies", lambda *args: False)
        check_layers(reference, other, inputs, kwargs)
        check_layers(reference, other, inputs, kwargs, seed=1)  # grads accumulate
    assert ran == 2 * ([False, True] if case == "mixed" else [True] * len(inputs)), ran


def test_in_place_parameter_updates_are_seen():
    """Oracle: the reference layer after the same in-place SGD step; the fused
    projection matrix is rebuilt on each call, never served stale."""
    rng = np.random.default_rng(8)
    reference, other = layer_pair(MultiHeadAttention, embed_dim=8, num_heads=2, rng=0)
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    for layer in (reference, other):
        layer.forward(x)
        layer.backward(dout)
        for name, param in layer.params.items():
            param -= 0.5 * layer.grads[name]  # in place, as optimizers do
    assert_close(other.forward(x), reference.forward(x), "out after the step")


@pytest.mark.parametrize("impl", ["fast", "tiled"])
def test_return_weights_match_reference(impl):
    """Oracle: reference weights; the tiled path computes them densely on request."""
    rng = np.random.default_rng(9)
    reference, other = layer_pair(MultiHeadAttention, impl=impl, embed_dim=6, num_heads=3, rng=0)
    x = rng.normal(size=(2, 4, 6))
    out_ref, weights_ref = reference.forward(x, is_causal=True, return_weights=True)
    out, weights = other.forward(x, is_causal=True, return_weights=True)
    assert_close(out, out_ref, "out")
    assert_close(weights, weights_ref, "weights")


def test_auto_dispatch():
    """``impl="auto"``: fast below the length and memory thresholds, tiled above,
    fast again when the weights are asked for."""
    def resolve(*args):
        return kernels.choose_path(*args).path

    sizes = kernels.get_block_sizes()
    assert resolve("auto", 8, 128, 128, np.float32, False) == "fast"
    assert resolve("auto", 8, 128, sizes["tiled_min_length"], np.float32, False) == "tiled"
    big = sizes["dense_weights_budget"] // (4 * 128 * 128) + 1
    assert resolve("auto", big, 128, 128, np.float32, False) == "tiled"
    assert resolve("auto", big, 128, 128, np.float32, True) == "fast"
    assert resolve("reference", big, 128, 128, np.float32, False) == "reference"
    # and the layers follow it: a lowered threshold makes auto run the tiled core
    with kernels.block_sizes(tiled_min_length=4):
        mha = MultiHeadAttention(4, 2, rng=0)
        mha.forward(np.ones((1, 5, 4)))
        assert mha._cache.path == "tiled"
        mha.forward(np.ones((1, 3, 4)))
        assert mha._cache.path == "fast"


def test_bad_impl_names_the_choices():
    with pytest.raises(ValueError, match=r"impl must be one of .*'fast'.*got 'quick'"):
        MultiHeadAttention(4, 2, impl="quick")


def test_one_thread_runs_a_problem_larger_than_a_block_by_blocks(monkeypatch):
    """Oracle: the block contract (``fast_block_bytes``) and the reference layer.
    On one thread (``set_num_threads(1)``, or a worker's share of a layer's
    batch) the whole-array kernels get at most one block's scores at a time:
    whole-array passes over more ran out of cache and allocated temporaries of
    the problem's size."""
    seen = []
    for name in ("small_forward", "small_backward"):
        kernel = getattr(fast, name)

        def recording(*args, kernel=kernel, **kwargs):
            exp_scores = args[5] if kernel is fast.small_forward else args[4]
            seen.append(exp_scores.nbytes)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(fast, name, recording)
    rng = np.random.default_rng(13)
    reference, other = layer_pair(MultiHeadAttention, embed_dim=8, num_heads=2, rng=1)
    x = rng.normal(size=(2, 16, 8))  # scores: 2 * 2 * 16 * 16 * 8 bytes = 8 KiB
    with kernels.num_threads(1), kernels.block_sizes(fast_block_bytes=4096):
        check_layers(reference, other, [x], {"is_causal": True})
    assert seen and max(seen) <= 4096  # blocks of two (16, 16) matrices


def test_the_cached_columns_of_ones_and_zeros_stay_small():
    """Oracle: the bound in fast_small. Columns of many distinct lengths (as a
    decoding loop's growing key count gives) leave at most 64 + 16 columns of
    at most CACHED_COLUMN entries cached; every column is right and read-only."""
    from qkvnp.kernels import fast_small

    for n in (1, 7, fast_small.CACHED_COLUMN, fast_small.CACHED_COLUMN + 1, 100_000):
        for make, value in ((fast_small._ones, 1.0), (fast_small._zeros_column, 0.0)):
            column = make(n, np.dtype(np.float32))
            assert column.shape == (n, 1) and column.dtype == np.float32
            assert (column == value).all() and not column.flags.writeable
    for n in range(fast_small.CACHED_COLUMN - 100, fast_small.CACHED_COLUMN + 400):
        fast_small._ones(n, np.dtype(np.float64))
    info = fast_small._cached_ones.cache_info()
    assert info.currsize <= 64 and fast_small._cached_zeros.cache_info().currsize <= 16
    # a short column is the cached one; a long one is made anew, never kept
    f64 = np.dtype(np.float64)
    assert fast_small._ones(64, f64) is fast_small._ones(64, f64)
    assert fast_small._ones(100_000, f64) is not fast_small._ones(100_000, f64)
    assert fast_small._zeros_column(100_000, f64) is not fast_small._zeros_column(100_000, f64)
    # the longest kept column has CACHED_COLUMN entries: 64 of them fit in 2 MiB
    assert 64 * fast_small.CACHED_COLUMN * 8 <= 2 << 20


@pytest.mark.parametrize("core_large", [False, True])
def test_blas_section_keeps_the_batch_whole_unless_the_core_uses_the_pool(core_large):
    """Oracle: the reference layer, and the shares the layer kept. Inside a
    ``blas_section`` (a model whose products run on OpenBLAS's threads), a layer
    whose core is below ``min_parallel_flops`` keeps its batch whole, where
    outside it the same call splits; a core at or above it still splits."""
    reference, other = layer_pair(MultiHeadAttention, embed_dim=8, num_heads=2, rng=0,
                                  dtype=np.float64)
    x = np.random.default_rng(5).normal(size=(4, 6, 8))
    settings_ = dict(batch_split_flops=0, min_parallel_flops=0 if core_large else 1 << 40)
    with kernels.num_threads(2), kernels.block_sizes(**settings_):
        check_layers(reference, other, [x], {"is_causal": True})
        outside = other._used_cache.shares
        with kernels._runtime.blas_section():
            check_layers(reference, other, [x], {"is_causal": True})
            inside = getattr(other._used_cache, "shares", None)
    assert outside == (slice(0, 2), slice(2, 4))
    assert inside == (outside if core_large else None)  # None: one share, the plain cache


def test_gpt_model_runs_its_blocks_in_a_blas_section(monkeypatch):
    """Oracle: the section flag seen by the blocks' attention kernel. The book's
    GPT enters a ``blas_section`` when its largest product reaches
    ``min_parallel_flops`` (its products on OpenBLAS's threads), and a
    single-threaded BLAS section below it."""
    from qkvnp import GPTModel

    seen = []
    original = kernels.mha._batch_shares
    monkeypatch.setattr(kernels.mha, "_batch_shares", lambda *a: (
        seen.append(kernels._runtime.in_blas_section()), original(*a))[1])
    model = GPTModel.from_config({"vocab_size": 16, "context_length": 8, "emb_dim": 8,
                                  "n_heads": 2, "n_layers": 1, "drop_rate": 0.0,
                                  "qkv_bias": False}, rng=0)
    ids = np.zeros((2, 8), int)
    for threshold, expected in ((1, True), (1 << 40, False)):
        seen.clear()
        with kernels.block_sizes(min_parallel_flops=threshold):
            model.forward(ids)
        assert seen and all(flag == expected for flag in seen)
