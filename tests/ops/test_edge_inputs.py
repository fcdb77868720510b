"""Edge inputs give what the math gives, the same on every path (issue 9).

Oracles: closed forms (a 0-d True mask is no mask, a 0-d False mask masks
every row; with a head dim of 0 every score is 0, so the output is the mean
of the values a row may attend), the reference path (within
``qkvnp.kernels.PATH_TOLERANCES``, scaled by the magnitudes involved), and
PyTorch's SDPA for zero and negative scales (PyTorch's own test of a
negative scale, from its issue 105190).
"""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import qkvnp
from qkvnp import functional as F
from qkvnp import kernels
from qkvnp.kernels import fast, tiled

CORES = {"reference": F, "fast": fast, "tiled": tiled}


def _run(core, q, k, v, dout, **options):
    out, cache = core.attention_forward(q, k, v, **options)
    return (out, *core.attention_backward(dout, cache))


# ---------------------------------------------------------------- masks


@pytest.mark.parametrize("path", sorted(CORES))
@pytest.mark.parametrize("mask", [True, False, np.array(True), np.array(False), np.bool_(True)])
def test_zero_dim_and_python_bool_masks_work_on_every_path(path, mask):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.normal(size=s) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 2), (2, 3, 2)])
    got = _run(CORES[path], q, k, v, dout, attn_mask=mask)
    if bool(mask):  # True everywhere: no mask at all
        want = _run(F, q, k, v, dout)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    else:  # every key forbidden: every row fully masked, output and gradients 0
        for a in got:
            assert not a.any()


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled"])
def test_zero_dim_masks_work_on_the_layers(impl):
    x = np.random.default_rng(1).normal(size=(2, 5, 4))
    for layer in (qkvnp.SelfAttention(4, 3, rng=0, impl=impl),
                  qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl)):
        np.testing.assert_allclose(layer.forward(x, attn_mask=True), layer.forward(x),
                                   rtol=1e-12, atol=1e-12)
        assert layer.backward(np.ones((2, 5, layer.params["W_value"].shape[1]))).shape == x.shape
        out = layer.forward(x, attn_mask=np.array(False))
        expected = layer.params.get("b_out", np.zeros(out.shape[-1]))  # attention output 0
        np.testing.assert_array_equal(out, np.broadcast_to(expected, out.shape))


@pytest.mark.parametrize("path", sorted(CORES))
def test_a_float_mask_that_overflows_the_compute_dtype_is_refused(path):
    """float64 -1e39 is finite, float32 cannot hold it: refused, not turned into -inf."""
    q, k, v = np.ones((2, 3), np.float32), np.ones((3, 3), np.float32), np.ones((3, 3), np.float32)
    mask = np.array([[0.0, -1e39, 0.0]] * 2)  # float64, (T, S) = (2, 3)
    with pytest.raises(ValueError, match=r"attn_mask has values too large for the compute "
                                         r"dtype float32 \(-1e\+39 at index \(0, 1\)"):
        CORES[path].attention_forward(q, k, v, mask)
    ok = np.array([[0.0, -1e30, -np.inf]] * 2)  # finite in float32, and -inf: accepted
    out, _ = CORES[path].attention_forward(q, k, v, ok)
    assert out.dtype == np.float32 and np.isfinite(out).all()


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled"])
@pytest.mark.parametrize("padding", [False, True])
def test_the_mask_rule_is_the_same_with_key_padding(impl, padding):
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0, dtype=np.float32, impl=impl)
    x = np.ones((2, 3, 4), np.float32)
    mask = np.zeros((3, 3))
    mask[0, 1] = -1e39
    options = {"key_padding_mask": np.ones((2, 3), bool)} if padding else {}
    with pytest.raises(ValueError, match="attn_mask has values too large for the compute dtype"):
        layer.forward(x, attn_mask=mask, **options)
    with pytest.raises(ValueError, match=r"attn_mask \(float, added to the scores\) contains "
                                         r"NaN or \+inf"):
        layer.forward(x, attn_mask=np.full((3, 3), np.inf), **options)


# ---------------------------------------------------------------- head dim 0


@pytest.mark.parametrize("path", sorted(CORES))
@pytest.mark.parametrize("scale", [None, 2.0, -1.0])
@pytest.mark.parametrize("is_causal", [False, True])
def test_head_dim_zero_gives_the_mean_of_the_values(path, scale, is_causal):
    """Every score is an empty dot product, 0: uniform weights over the allowed keys."""
    rng = np.random.default_rng(2)
    T, S = 3, 4
    q, k = np.zeros((2, T, 0)), np.zeros((2, S, 0))
    v, dout = rng.normal(size=(2, S, 3)), rng.normal(size=(2, T, 3))
    out, dq, dk, dv = _run(CORES[path], q, k, v, dout, is_causal=is_causal, scale=scale)
    allowed = np.tril(np.ones((T, S))) if is_causal else np.ones((T, S))
    weights = allowed / allowed.sum(-1, keepdims=True)  # (T, S)
    np.testing.assert_allclose(out, weights @ v, rtol=1e-12)
    assert dq.shape == (2, T, 0) and dk.shape == (2, S, 0)
    np.testing.assert_allclose(dv, weights.T @ dout, rtol=1e-12)  # dv = P^T dO


# ---------------------------------------------------------------- scale


@pytest.mark.parametrize("path", sorted(CORES))
@pytest.mark.parametrize("scale", [0.0, -0.5, -1 / 0.0001, 3.0])
def test_any_finite_scale_agrees_with_the_reference(path, scale):
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.normal(size=s) for s in [(2, 4, 3), (2, 6, 3), (2, 6, 2), (2, 4, 2)])
    got = _run(CORES[path], q, k, v, dout, is_causal=True, scale=scale)
    want = _run(F, q, k, v, dout, is_causal=True, scale=scale)
    scale_of = [1.0, abs(scale) + 1, abs(scale) + 1, 1.0]  # dq, dk carry the scale
    for a, b, s in zip(got, want, scale_of):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * s * max(1.0, np.abs(b).max()))
    if scale == 0.0:  # all scores 0: uniform weights under the causal mask
        weights = np.tril(np.ones((4, 6)))
        weights /= weights.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[0], weights @ v, rtol=1e-12)


@pytest.mark.parametrize("scale", [-1 / 0.0001, 0.0, -0.3])
def test_negative_and_zero_scales_match_pytorch(torch, scale):
    """PyTorch's test_scaled_dot_product_attention_math_with_negative_scale."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(2, 2, 5, 4)) for _ in range(3))
    got = qkvnp.scaled_dot_product_attention(q, k, v, scale=scale)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (q, k, v)), scale=scale).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- counts given as bools or strings


@pytest.mark.parametrize("value, kind", [(True, "bool"), ("2", "str"), (2.0, "float")])
def test_counts_given_as_bools_or_strings_name_the_argument(value, kind):
    with pytest.raises(TypeError, match=f"num_heads must be an int, got {kind}"):
        F.split_heads_forward(np.ones((3, 4)), num_heads=value)
    with pytest.raises(TypeError, match=f"num_heads must be an int, got {kind}"):
        qkvnp.MultiHeadAttention(4, value)
    with pytest.raises(TypeError, match=f"d_out must be an int, got {kind}"):
        qkvnp.SelfAttention(4, value)


# ---------------------------------------------------------------- extreme magnitudes


@st.composite
def extreme_problems(draw):
    """Random normal inputs times a random magnitude (continuous draws, so that
    two scores do not tie to within rounding: a near-tie at a huge magnitude
    is decided by rounding on any path)."""
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    top = 150 if dtype == np.float64 else 18
    exponent = draw(st.integers(0, top))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    scale = draw(st.sampled_from([None, 1.0, -1.0, 1e-3]))
    is_causal = draw(st.booleans())
    rng = np.random.default_rng(seed)
    T, S, D = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    which = draw(st.sampled_from(["qk", "v", "all"]))
    big = float(10.0 ** exponent)
    q, k, v = (rng.normal(size=s) for s in [(2, T, D), (2, S, D), (2, S, 2)])
    if which in ("qk", "all"):
        q, k = q * big, k * big
    if which in ("v", "all"):
        v = v * big
    dout = rng.normal(size=(2, T, 2))
    return tuple(a.astype(dtype) for a in (q, k, v, dout)) + (scale, is_causal)


def _units(scores, amax, c, T, S):
    """The magnitude each result's rounding is measured in: out, dq, dk, dv."""
    return [scores * amax["v"],
            scores * amax["d"] * amax["v"] * c * amax["k"] * S,
            scores * amax["d"] * amax["v"] * c * amax["q"] * T,
            scores * amax["d"] * T]


@settings(max_examples=max(40, settings().max_examples), deadline=None)
@given(extreme_problems())
def test_paths_agree_or_stay_finite_at_extreme_magnitudes(problem):
    """Below sqrt(finfo.max) the paths agree within the path tolerance, in units
    of the magnitudes involved (a score's rounding is eps * |score|, and moves
    the output by that times |v|); beyond it they defer to the reference. Where
    the reference is finite, so is every path."""
    q, k, v, dout, scale, is_causal = problem
    dtype = q.dtype
    tol = kernels.PATH_TOLERANCES[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reference may warn of overflow
        want = _run(F, q, k, v, dout, is_causal=is_causal, scale=scale)
    amax = {name: float(np.abs(a.astype(np.float64)).max()) for name, a in
            zip("qkvd", (q, k, v, dout))}
    c = abs(scale) if scale is not None else 1 / np.sqrt(q.shape[-1])
    scores = max(1.0, c * amax["q"] * amax["k"] * q.shape[-1])
    with np.errstate(over="ignore"):
        units = _units(scores, amax, c, q.shape[-2], k.shape[-2])
    finite = [bool(np.isfinite(a).all()) for a in want]
    for path in ("fast", "tiled"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the fast paths handle overflow silently
            got = _run(CORES[path], q, k, v, dout, is_causal=is_causal, scale=scale)
        for name, a, b, unit, ok in zip(("out", "dq", "dk", "dv"), got, want, units, finite):
            assert a.shape == b.shape and a.dtype == b.dtype
            if ok:
                assert np.isfinite(a).all(), f"{path} {name} not finite where the reference is"
                error = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0))
                assert error <= tol * max(1.0, unit) or not np.isfinite(unit), (
                    f"{path} {name}: error {error:.3g} > {tol:g} * {unit:.3g}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("path", ["fast", "tiled"])
def test_the_overflow_screen_answers_as_the_exact_bound(dtype, path, monkeypatch):
    """Oracle: the exact bound ``|scale| max|q_t| max|k_s|``, row norms in float64.

    One nonzero entry per row makes the cheap screen (``|scale| D max|q|
    max|k|``) exceed the exact bound D = 16 times: at half the limit the
    screen is over it and the exact bound under (the fast core, no
    fallback), at twice the limit both are over (the reference's result, as
    the path defers to it); far below the limit the row norms are never
    computed at all."""
    from qkvnp import _checks

    limit = float(np.sqrt(np.finfo(dtype).max))
    T, D = 5, 16
    eye = np.zeros((T, D))
    eye[np.arange(T), np.arange(T)] = 1.0  # one nonzero per row: |q_t| = max|q|
    value = np.random.default_rng(12).normal(size=(T, 3)).astype(dtype)
    for ratio, over in ((0.5, False), (2.0, True)):
        size = np.sqrt(ratio * limit)  # scale 1: the exact bound is size**2 = ratio * limit
        q, k = (eye * size).astype(dtype), (eye * size).astype(dtype)
        exact = np.linalg.norm(q.astype(np.float64), axis=-1).max() * np.linalg.norm(
            k.astype(np.float64), axis=-1).max()
        assert (exact >= limit) == over and D * size * size >= limit  # the screen is over
        assert _checks.core_scores_may_overflow(q, k, 1.0) == over
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the reference may warn of overflow
            out, cache = CORES[path].attention_forward(q, k, value, scale=1.0)
        deferred = type(cache) is F.AttentionCache  # the reference's own cache
        assert deferred == over, f"ratio {ratio}: deferred to the reference {deferred}"

    def refuse(x):
        raise AssertionError("row norms computed below the screen")

    monkeypatch.setattr(_checks, "row_norm_max", refuse)
    small = eye.astype(dtype)
    assert _checks.core_scores_may_overflow(small, small, 1.0) is False
