"""A gallery of broken backward passes, and what the checker says about each.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D = E // H head dim, N input and M output features of a linear map.

Every case keeps the correct forward and plants one bug in the backward
only: a forward and backward wrong in the same way pass any gradient check.
Three bugs of popular attention tutorials (a softmax over a single score,
a scale by the embedding size, a softmax over the wrong axis) are mirrored
into the backward; the others are the classic slips of hand-written
backwards. Each case names the
row that must fail and the diagnosis (:mod:`qkvnp.gradcheck.diagnosis`) it
must get; :func:`run_gallery` checks the broken and the correct backward
side by side (``python -m qkvnp gradcheck --gallery``).
"""
import math
import sys
from collections import namedtuple

import numpy as np

from .. import functional as F
from ..ops import variants
from .._checks import declare_complex_step
from .checker import check_op

__all__ = ["Case", "CASES", "HeadsAttentionCache", "heads_attention_forward",
           "sinks_attention_forward", "run_case", "run_gallery"]

Case = namedtuple("Case", "name bug forward broken correct inputs forward_kwargs row diagnosis")
Case.__doc__ = """One broken backward.

name : str, short title.
bug : str, what the broken backward does wrong.
forward : callable, the correct forward ``(out, cache)``.
broken, correct : callable, backwards ``(dout, cache) -> gradients``.
inputs : callable, ``rng -> dict`` of the differentiable inputs.
forward_kwargs : dict.
row : str, the row that must fail.
diagnosis : str, the code it must get.
"""


def _attention_inputs(T=3, S=4, D=4, Dv=3):
    def draw(rng):
        return {"query": rng.normal(size=(2, T, D)), "key": rng.normal(size=(2, S, D)),
                "value": rng.normal(size=(2, S, Dv))}
    return draw


def _single_score(dout, cache):
    """A tutorial's softmax over one score is the constant 1: no gradient reaches q, k."""
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    return np.zeros_like(dquery), np.zeros_like(dkey), dvalue


def _attention_parts(dout, cache, row_sum_axis=-1, weights=None):
    """Attention backward written out, with its softmax reduction axis as a knob."""
    query, key, value, scale = cache.query, cache.key, cache.value, cache.scale
    weights = cache.weights if weights is None else weights
    dvalue = np.swapaxes(weights, -1, -2) @ dout  # (B, S, T) @ (B, T, Dv) -> (B, S, Dv)
    dweights = dout @ np.swapaxes(value, -1, -2)  # (B, T, Dv) @ (B, Dv, S) -> (B, T, S)
    dscores = weights * (dweights - np.sum(weights * dweights, axis=row_sum_axis, keepdims=True))
    dquery = (dscores @ key) * scale  # (B, T, S) @ (B, S, D) -> (B, T, D)
    dkey = (np.swapaxes(dscores, -1, -2) @ query) * scale  # (B, S, T) @ (B, T, D) -> (B, S, D)
    return dquery, dkey, dvalue


def _wrong_axis(dout, cache):
    """A tutorial's softmax over the wrong axis, mirrored: the row sum runs over queries."""
    return _attention_parts(dout, cache, row_sum_axis=-2)


def _flipped_mask(dout, cache):
    """The causal mask applied with the opposite polarity when the weights are rebuilt."""
    query, key, scale = cache.query, cache.key, cache.scale
    T, S = query.shape[-2], key.shape[-2]
    scores = (query @ np.swapaxes(key, -1, -2)) * scale  # (B, T, S)
    flipped = ~np.tril(np.ones((T, S), dtype=bool))  # NOTE: the bug: False = may attend
    weights = F.softmax(np.where(flipped, scores, -np.inf))
    return _attention_parts(dout, cache, weights=weights)


def _key_transposed(dout, cache):
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    return dquery, np.swapaxes(dkey, -1, -2), dvalue  # (B, S, D) -> (B, D, S); S == D here


def _value_sign(dout, cache):
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    return dquery, dkey, -dvalue


def _ones_only(dout, cache):
    """``dvalue = P^T 1``: right only when every upstream gradient is 1."""
    dquery, dkey, _ = F.attention_backward(dout, cache)
    return dquery, dkey, np.swapaxes(cache.weights, -1, -2) @ np.ones_like(dout)


def _softmax_without_row_sum(dweights, cache):
    return cache.weights * dweights


def _bias_averaged(dout, cache):
    """The bias was broadcast over B*T rows; its gradient averages them instead of summing."""
    dx, dW, db = F.linear_backward(dout, cache)
    return dx, dW, db / math.prod(dout.shape[:-1])


def _rope_plus_theta(dout, cache):
    """RoPE's backward rotating by +theta, as the forward, instead of by -theta."""
    cos, sin, layout, _ = cache
    half = dout.shape[-1] // 2
    if layout == "half":  # NOTE: the bug: R(theta) dout where R(theta)^T dout is due
        d1, d2 = dout[..., :half], dout[..., half:]
        return np.concatenate((d1 * cos - d2 * sin, d2 * cos + d1 * sin), axis=-1)
    raise ValueError("the gallery's case uses layout='half'")


def sinks_attention_forward(query, key, value, sinks):
    """Attention with one sink logit per batch entry (gpt-oss's sinks)."""
    return F.attention_forward(query, key, value, sinks=sinks)


declare_complex_step(sinks_attention_forward)


def _sinks_backward(dout, cache):
    dquery, dkey, dvalue, _, dsinks = F.attention_backward(dout, cache)
    return dquery, dkey, dvalue, dsinks


def _sink_missing(dout, cache):
    """The backward rebuilds the weights as exp(s) / sum exp(s): the sink left out of the row sum."""
    weights = cache.weights
    total = weights.sum(-1, keepdims=True)  # (B, T, 1), < 1 with a sink
    # NOTE: the bug: renormalised without e^sink; the sink's share is then 0
    weights = np.where(total > 0, weights / np.where(total > 0, total, 1), 0)
    broken = cache._replace(weights=weights, sink_weight=np.zeros_like(cache.sink_weight))
    dquery, dkey, dvalue, _, dsinks = variants.variant_attention_backward(dout, broken)
    return dquery, dkey, dvalue, dsinks


def _rope_inputs(rng):
    return {"x": rng.normal(size=(2, 5, 6))}


def _sinks_inputs(rng):
    inputs = _attention_inputs(S=5)(rng)
    inputs["sinks"] = rng.normal(size=2)
    return inputs


def _layer_norm_without_mean_term(dout, cache):
    """LayerNorm's backward with the mean's term ``- mean(g)`` left out (the variance's kept)."""
    normalized, rstd, scale = cache
    g = dout * scale  # (..., E)
    # NOTE: the bug: rstd * (g - mean(g) - x_hat mean(g x_hat)) without its mean(g)
    dx = rstd * (g - normalized * (g * normalized).mean(axis=-1, keepdims=True))
    _, dscale, dshift = F.layer_norm_backward(dout, cache)
    return dx, dscale, dshift


def _gelu_without_tanh_derivative(dout, cache):
    """The tanh GELU's derivative without the ``x * d(tanh)/dx`` half of the product rule."""
    return dout * 0.5 * (1.0 + cache.inner)  # NOTE: the bug: + 0.5 x (1 - t^2) c (1 + 3 a x^2) lost


HeadsAttentionCache = namedtuple("HeadsAttentionCache",
                                 "query_split key_split value_split attention_cache merge_cache")


def heads_attention_forward(query, key, value, num_heads):
    """Multi-head attention without projections: split, attend with 1/sqrt(D), merge."""
    q_heads, q_split = F.split_heads_forward(query, num_heads)  # (B, T, E) -> (B, H, T, D)
    k_heads, k_split = F.split_heads_forward(key, num_heads)  # (B, S, E) -> (B, H, S, D)
    v_heads, v_split = F.split_heads_forward(value, num_heads)  # (B, S, E) -> (B, H, S, D)
    heads, attention_cache = F.attention_forward(q_heads, k_heads, v_heads)  # (B, H, T, D)
    out, merge_cache = F.merge_heads_forward(heads)  # (B, H, T, D) -> (B, T, E)
    return out, HeadsAttentionCache(q_split, k_split, v_split, attention_cache, merge_cache)


def _heads_backward(dout, cache, embed_scale=False):
    dheads = F.merge_heads_backward(dout, cache.merge_cache)
    dq, dk, dv = F.attention_backward(dheads, cache.attention_cache)
    if embed_scale:  # NOTE: the bug: 1/sqrt(E) where the forward used 1/sqrt(D)
        E = dout.shape[-1]
        dq, dk = (g / cache.attention_cache.scale / math.sqrt(E) for g in (dq, dk))
    return (F.split_heads_backward(dq, cache.query_split),
            F.split_heads_backward(dk, cache.key_split),
            F.split_heads_backward(dv, cache.value_split))


declare_complex_step(heads_attention_forward)


def _heads_inputs(rng):
    return {"query": rng.normal(size=(2, 3, 8)), "key": rng.normal(size=(2, 4, 8)),
            "value": rng.normal(size=(2, 4, 8))}


def _linear_inputs(rng):
    return {"x": rng.normal(size=(2, 3, 4)), "W": rng.normal(size=(4, 5)),
            "b": rng.normal(size=5)}


def _scores_inputs(rng):
    return {"scores": rng.normal(size=(2, 3, 4))}


def _layer_norm_inputs(rng):
    return {"x": rng.normal(size=(2, 3, 5)), "scale": rng.normal(size=5),
            "shift": rng.normal(size=5)}


def _gelu_inputs(rng):
    return {"x": 2.0 * rng.normal(size=(2, 3, 4))}


CASES = (
    Case("softmax over a single score", "a softmax of one score is constant (a tutorial's bug): "
         "dquery = dkey = 0", F.attention_forward, _single_score, F.attention_backward,
         _attention_inputs(), {}, "query", "zero"),
    Case("scale by the embedding size", "dquery, dkey scaled by 1/sqrt(E) instead of "
         "1/sqrt(D) (H = 2)", heads_attention_forward,
         lambda dout, cache: _heads_backward(dout, cache, embed_scale=True), _heads_backward,
         _heads_inputs, {"num_heads": 2}, "query", "ratio"),
    Case("softmax over the wrong axis", "the softmax backward's row sum runs over the "
         "queries (axis -2)", F.attention_forward, _wrong_axis, F.attention_backward,
         _attention_inputs(), {}, "key", "softmax_axis"),
    Case("softmax without the row-sum term", "dscores = P * dP instead of "
         "P * (dP - rowsum(P * dP))", F.softmax_forward, _softmax_without_row_sum,
         F.softmax_backward, _scores_inputs, {}, "scores", "softmax_axis"),
    Case("mask polarity flipped in the backward", "the backward rebuilds the weights with "
         "the causal mask inverted", F.attention_forward, _flipped_mask, F.attention_backward,
         _attention_inputs(T=4, S=4), {"is_causal": True}, "query", "zero_slices"),
    Case("broadcast bias gradient not summed", "db averaged over the B*T rows the bias was "
         "broadcast to", F.linear_forward, _bias_averaged, F.linear_backward,
         _linear_inputs, {}, "b", "ratio"),
    Case("dK transposed", "dkey returned as (D, S) with S == D", F.attention_forward,
         _key_transposed, F.attention_backward, _attention_inputs(S=4, D=4), {}, "key",
         "transposed"),
    Case("sign flip in the value gradient", "dvalue = -P^T dout", F.attention_forward,
         _value_sign, F.attention_backward, _attention_inputs(), {}, "value", "sign"),
    Case("right only for dout = ones", "dvalue = P^T 1: the upstream gradient's values "
         "ignored", F.attention_forward, _ones_only, F.attention_backward,
         _attention_inputs(), {}, "value", "ones_dout"),
    Case("RoPE backward by +theta", "dx = R(theta) dout, the forward's rotation, instead of "
         "R(-theta) dout", F.rope_forward, _rope_plus_theta, F.rope_backward, _rope_inputs,
         {"positions": np.array([0, 3, 1, 4, 2])}, "x", "rotation"),
    Case("sink missing from the row sum", "the backward's softmax renormalised without "
         "e^sink: the sink's share, and so dsinks, is 0", sinks_attention_forward,
         _sink_missing, _sinks_backward, _sinks_inputs, {}, "sinks", "zero"),
    Case("LayerNorm backward without the mean term", "dx = r (g - x_hat mean(g x_hat)): the "
         "mean's - mean(g) is lost, so dx no longer sums to 0 over a row (LayerNorm, like a "
         "softmax, ignores a constant added along it)", F.layer_norm_forward,
         _layer_norm_without_mean_term, F.layer_norm_backward, _layer_norm_inputs, {}, "x",
         "softmax_axis"),
    Case("GELU derivative without the x d(tanh) part", "gelu'(x) = (1 + t) / 2 only: the "
         "product rule's x (1 - t^2) c (1 + 3a x^2) / 2 is lost (no simpler pattern fits: an "
         "elementwise factor that varies with x)", F.gelu_forward,
         _gelu_without_tanh_derivative, F.gelu_backward, _gelu_inputs, {}, "x", "unknown"),
)


def run_case(case, seed=0, **options):
    """``(broken report, correct report)`` of one case, both at the same point."""
    inputs = case.inputs(np.random.default_rng(seed))
    broken = check_op(case.forward, case.broken, inputs, forward_kwargs=case.forward_kwargs,
                      rng=seed, **options)
    correct = check_op(case.forward, case.correct, inputs, forward_kwargs=case.forward_kwargs,
                       rng=seed, **options)
    return broken, correct


def run_gallery(stream=None, seed=0, **options):
    """Print every case: the bug, the verdict, the diagnosis; return True if all behave.

    A case behaves when its broken backward fails with the expected
    diagnosis on the expected row and its correct backward passes.
    """
    stream = sys.stdout if stream is None else stream
    all_behave = True
    for number, case in enumerate(CASES, 1):
        broken, correct = run_case(case, seed, **options)
        row = broken.row(case.row)
        behaves = (not broken.ok and not row.ok and row.diagnosis == case.diagnosis
                   and correct.ok)
        all_behave &= behaves
        print(f"{number}. {case.name}: {case.bug}", file=stream)
        print(f"   broken backward: {'FAILED' if not broken.ok else 'passed (missed!)'}; "
              f"{case.row}: rel err {row.max_rel_err:.2e}, diagnosis {row.diagnosis} "
              f"(expected {case.diagnosis})", file=stream)
        print(f"   -> {row.detail}", file=stream)
        print(f"   correct backward: {'OK' if correct.ok else 'FAILED'} "
              f"(max rel err {correct.max_rel_err:.1e})", file=stream)
    return all_behave
