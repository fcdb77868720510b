"""One KV-cache decoding step of an attention layer built with variants (inference only).

Shape key: B batch (any leading dims), H query heads, K key/value heads, T
new tokens, S = cached + T keys, E embedding, D = E // H head dim.

As :func:`qkvnp.layers.kv_cache.cached_forward`, plus the variants of
:mod:`qkvnp.layers.variant_layer`: RoPE at the tokens' positions in the
whole sequence, the position bias in the bottom-right alignment, the sinks,
the soft-cap, the score scale, and a sliding window whose cache is a rolling buffer.
"""
import numpy as np

from .. import functional as F
from ..ops.overflow import check_projection
from .. import kernels
from ..kernels import tiled_variants
from ..kernels._runtime import single_threaded_blas
from .variant_layer import active_variants, position_score_bias
from ..ops.positions import alibi_slopes
from ..ops.masks import fold_key_padding_mask, prepare_mask
from ..ops.variants import check_window

__all__ = ["decode"]


def decode(layer, x, kv_cache, attn_mask, key_padding_mask, need_weights):
    """One decoding step of a variant layer (as :func:`qkvnp.layers.kv_cache.cached_forward`).

    RoPE turns the new tokens by their positions in the whole sequence
    (``kv_cache.start + len(kv_cache) + arange(T)``), so keys are stored
    rotated; the step is causal, bottom-right aligned. With a bounded window
    ``(left, 0)`` only the last ``left`` keys stay cached afterwards: the
    only ones a later query still sees (:meth:`qkvnp.KVCache.keep_last`).

    Returns ``(out, weights, dispatch)``.
    """
    options, params = layer.variants, layer.params
    one_head = "W_out" not in params  # SelfAttention: no head axis in its masks and output
    H = 1 if one_head else layer.num_heads
    D = params["W_query"].shape[1] // H
    K = params["W_key"].shape[1] // D
    batch, T = x.shape[:-2], x.shape[-2]
    past = len(kv_cache)
    S = past + T
    # every check that can refuse the call runs before the cache changes
    window = check_window(options.window, "bottom_right")
    if one_head:  # broadcastable to (..., T, S), as in SelfAttention.forward
        prepare_mask(attn_mask, "bottom_right", batch + (T, S), layer.dtype)
        mask = attn_mask if np.ndim(attn_mask) < 3 else np.asarray(attn_mask)[..., None, :, :]  # (..., 1, T, S)
    else:
        mask = fold_key_padding_mask(attn_mask, key_padding_mask, batch, H, T, S, layer.dtype)
        prepare_mask(mask, "bottom_right", batch + (H, T, S), layer.dtype)
    kv_cache.check(layer, np.empty(batch + (K, T, D), layer.dtype))
    with single_threaded_blas():  # as the layer's forward (qkvnp.layers.dispatch.layer_forward)
        return _step(layer, x, kv_cache, mask, need_weights, window, H, K, T, S, batch)


def _step(layer, x, kv_cache, mask, need_weights, window, H, K, T, S, batch):
    """The step after its checks: projections, RoPE, the cache, attention, output projection."""
    options, params = layer.variants, layer.params
    past = S - T
    heads = []
    for name, n in (("query", H), ("key", K), ("value", K)):
        y = x @ params["W_" + name]  # (..., T, E) @ (E, n*D) -> (..., T, n*D)
        if "b_" + name in params:
            y = y + params["b_" + name]
        check_projection(y, name)
        heads.append(F.split_heads_forward(y, n)[0])  # (..., T, n*D) -> (..., n, T, D)
    q, k, v = heads
    if options.rope:
        positions = kv_cache.start + past + np.arange(T)  # in the whole sequence
        rope = {"base": options.rope_base, "layout": options.rope_layout}
        q = F.rope_forward(q, positions, **rope)[0]  # (..., H, T, D)
        k = F.rope_forward(k, positions, **rope)[0]  # (..., K, T, D), cached rotated
    dispatch = kernels.choose_path(layer.impl, int(np.prod(batch, dtype=np.int64)) * H, T, S,
                                   layer.dtype, need_weights, is_causal=True,
                                   variants=active_variants(options))
    dispatch = dispatch._replace(reason="kv_cache decoding step; " + dispatch.reason)
    # NOTE: staged, not appended: the core below may still refuse the step
    # (keys that overflow, NaN), and a refused step leaves the cache as it was
    staged = kv_cache.stage(layer, k, v)
    keys, values = staged.keys, staged.values  # (..., K, S, D) each
    if dispatch.path == "tiled":  # ALiBi from its slopes, by blocks
        slopes = alibi_slopes(H) if options.position_bias == "alibi" else None
        out_heads, cache = tiled_variants.attention_forward(
            q, keys, values, mask, "bottom_right", enable_gqa=K != H, alibi_slopes=slopes,
            softcap=options.softcap, sinks=params.get("sinks"), window=window,
            scale=options.scale)  # -> (..., H, T, D)
    else:
        score_bias, _ = position_score_bias(params, options, H, T, S, S - T, True, q.dtype)
        out_heads, cache = F.attention_forward(q, keys, values, mask, "bottom_right",
                                               enable_gqa=K != H, score_bias=score_bias,
                                               softcap=options.softcap,
                                               sinks=params.get("sinks"),
                                               window=window,
                                               scale=options.scale)  # -> (..., H, T, D)
    weights = cache.weights if need_weights else None
    kv_cache.commit(staged)  # every check passed
    if window is not None and window[0] is not None:
        kv_cache.keep_last(window[0])  # the next query, at S, sees keys S - left .. S
    merged = F.merge_heads_forward(out_heads)[0]  # (..., H, T, D) -> (..., T, E)
    if "W_out" not in params:  # SelfAttention: one head, no output projection
        return merged, None if weights is None else weights[..., 0, :, :], dispatch
    out = merged @ params["W_out"]  # (..., T, E) @ (E, out) -> (..., T, out)
    if "b_out" in params:
        out = out + params["b_out"]
    return out, weights, dispatch
