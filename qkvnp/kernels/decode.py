"""A decoder block's decoding step in few numpy calls (speed only; inference, no cache kept).

Shape key: B batch, T new tokens, S keys (cached + new), E embedding, H query
heads, K key/value heads, G = H / K, D head dim, F the MLP's width.

Replaces, for :meth:`qkvnp.layers.decoder_block.DecoderBlock.decode_step`
of a pre-norm block with RMSNorms and a gated MLP (Llama, Qwen3, Mistral)
or with LayerNorms and the plain tanh-GELU MLP (GPT-2), the reference ops
it runs one by one: ``rms_norm_forward`` (and QK-norm) or
``layer_norm_forward``, ``linear_forward`` (with or without bias),
``split_heads_forward``, ``rope_forward`` (layout ``"half"``; none for
learned positions), ``variant_attention_forward`` (GQA, a boolean keep
mask, no soft-cap), ``merge_heads_forward``, and ``gated_mlp_forward`` or
:class:`qkvnp.FeedForward`'s ``Linear``, ``gelu_forward`` (tanh) and
``Linear``. Same formulas, in the arrays' own dtype throughout (the
reference's RoPE multiplies by float64 angles), without the per-call
checks, caches and layer calls that cost more than the arithmetic at batch
1 (``benchmarks/NOTES.md``, "The decoder's decoding step"). Tested against the reference in
``tests/kernels/test_decode.py``; :func:`qkvnp.kernels.choose_decode_path`
decides when it runs.
"""
from __future__ import annotations

import numpy as np

from .pointwise import gelu_tanh_forward_fused, layer_norm_forward_fused

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable
    from .._typing import FloatArray

__all__ = ["rms_norm_infer", "layer_norm_infer", "rope_infer", "gqa_attention_infer",
           "gated_mlp_infer", "feed_forward_infer", "decode_block_fast"]


def rms_norm_infer(x: FloatArray, weight: FloatArray, eps: float,
                   unit_offset: bool = False) -> FloatArray:
    """``rms_norm_forward``'s output alone: ``x / sqrt(mean(x^2) + eps) * w`` (``w = 1 + weight`` with ``unit_offset``)."""
    dtype = x.dtype.type
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] * dtype(1 / x.shape[-1])  # (..., 1)
    scale = weight + dtype(1) if unit_offset else weight
    return x * (dtype(1) / np.sqrt(mean_square + dtype(eps))) * scale


def layer_norm_infer(x: FloatArray, weight: FloatArray, bias: FloatArray,
                     eps: float) -> FloatArray:
    """``layer_norm_forward``'s output alone: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    :class:`qkvnp.LayerNorm`'s fused pass (``layer_norm_forward_fused``; its
    ``scale`` and ``shift`` are ``weight`` and ``bias``), its cache dropped.
    """
    return layer_norm_forward_fused(x, weight, bias, eps)[0]


def rope_infer(x: FloatArray, positions: Any, inverse_frequency: Any,
               attention_factor: float = 1.0) -> FloatArray:
    """``rope_forward(x, positions, layout="half", inverse_frequency=..., attention_factor=...)``'s output in ``x``'s dtype.

    x ``(B, H, T, D)``, positions ``(B, 1, T)``, ``inverse_frequency`` ``(D/2,)``
    (``qkvnp.ops.rope_scaling.rope_inverse_frequency``: plain or scaled).
    """
    D = x.shape[-1]
    angles = np.asarray(positions, np.float64)[..., None] * inverse_frequency  # (B, 1, T, D/2)
    cos, sin = np.cos(angles), np.sin(angles)
    if attention_factor != 1.0:  # YaRN's: y = a R x
        cos, sin = cos * float(attention_factor), sin * float(attention_factor)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]  # (B, H, T, D) -> 2 x (B, H, T, D/2)
    out = np.empty_like(x)
    np.subtract(x1 * cos, x2 * sin, out=out[..., :D // 2])
    np.add(x2 * cos, x1 * sin, out=out[..., D // 2:])
    return out


def gqa_attention_infer(q: FloatArray, k: FloatArray, v: FloatArray, keep: Any,
                        scale: float) -> FloatArray:
    """``softmax(scale q k^T, keep) v`` with ``K`` key/value heads shared by ``G`` query heads each.

    q ``(B, H, T, D)``, k and v ``(B, K, S, D)``, keep ``(B, 1, T, S)`` with a
    key in every row (the caller checks) -> ``(B, H, T, D)``. The ``G`` query
    heads of a key head are stacked as rows of one product, never copying k or v.
    """
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    dtype = q.dtype.type
    rows = q.reshape(B, K, G * T, D)  # (B, H, T, D) -> (B, K, G T, D)
    scores = np.matmul(rows, k.swapaxes(-1, -2))  # (B, K, G T, S)
    scores *= dtype(scale)
    scores = scores.reshape(B, K, G, T, S)
    scores[~np.broadcast_to(keep[:, :, None], scores.shape)] = -np.inf  # the keys it may not see
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(B, K, G * T, S), v)  # (B, K, G T, D)
    return out.reshape(B, H, T, D)


def gated_mlp_infer(x: FloatArray, W_gate: FloatArray, W_up: FloatArray, W_down: FloatArray,
                    activation: str) -> FloatArray:
    """``gated_mlp_forward``'s output: ``(act(x W_gate) * (x W_up)) W_down``, act SiLU or tanh-GELU."""
    dtype = x.dtype.type
    gate = x @ W_gate  # (..., E) -> (..., F)
    if activation == "silu":
        with np.errstate(over="ignore"):  # exp(-x) -> inf below -88 (float32): silu -> -0
            gate /= dtype(1) + np.exp(-gate)
    else:
        inner = dtype(np.sqrt(2 / np.pi)) * (gate + dtype(0.044715) * gate * gate * gate)
        gate *= dtype(0.5) * (dtype(1) + np.tanh(inner))
    gate *= x @ W_up
    return gate @ W_down  # (..., F) -> (..., E)


def feed_forward_infer(x: FloatArray, W_first: FloatArray, b_first: FloatArray | None,
                       W_second: FloatArray, b_second: FloatArray | None) -> FloatArray:
    """:class:`qkvnp.FeedForward`'s output: ``gelu(x W_first + b_first) W_second + b_second``.

    The tanh GELU (GPT-2's ``gelu_new``) by :class:`qkvnp.GELU`'s own pass
    (``gelu_tanh_forward_fused``); a bias of None is none.
    """
    hidden = x @ W_first  # (..., E) -> (..., F)
    if b_first is not None:
        hidden += b_first
    out = gelu_tanh_forward_fused(hidden)[0] @ W_second  # (..., F) -> (..., E)
    if b_second is not None:
        out += b_second
    return out


def decode_block_fast(x: FloatArray, params: Any, spec: Any, stage: Callable,
                      keep: Any, positions: Any) -> FloatArray:
    """One pre-norm block on the new tokens ``x`` ``(B, T, E)``; returns ``(B, T, E)``.

    ``params``: the block's parameters under its names (``self_attn.q_proj.W``,
    ``attn_norm.weight`` or ``attn_norm.scale`` and ``.shift``,
    ``mlp.gate_proj.W`` or ``mlp.layers.0.W`` and ``.b``, ...; a bias that is
    absent is none); ``spec``: ``num_heads``, ``num_kv_heads``, ``norm``
    (the block norms' kind, ``"rms"`` or ``"layer"``), ``norms`` (each
    norm's name -> ``(eps, unit_offset)``, ``unit_offset`` RMSNorm's; the
    QK-norms are RMSNorms), ``qk_norm``, ``inverse_frequency`` (None: no
    RoPE), ``attention_factor``, ``scale``, ``mlp`` (``"gated"`` or
    ``"plain"``) and ``activation`` (the gated MLP's; the plain one's is
    tanh-GELU); ``stage(k, v)`` gives the cached and new keys and values
    ``(B, K, S, D)``.
    """
    p = params
    B, T, _ = x.shape
    H, K = spec["num_heads"], spec["num_kv_heads"]

    def norm(name, h, kind):  # (..., E) -> (..., E)
        eps, unit_offset = spec["norms"][name]
        if kind == "layer":
            return layer_norm_infer(h, p[f"{name}.scale"], p[f"{name}.shift"], eps)
        return rms_norm_infer(h, p[f"{name}.weight"], eps, unit_offset)

    h = norm("attn_norm", x, spec["norm"])

    def project(name, heads):  # (B, T, E) -> (B, heads, T, D)
        y = h @ p[f"self_attn.{name}.W"]
        if f"self_attn.{name}.b" in p:
            y += p[f"self_attn.{name}.b"]
        return y.reshape(B, T, heads, -1).transpose(0, 2, 1, 3)

    q, k, v = project("q_proj", H), project("k_proj", K), project("v_proj", K)
    if spec["qk_norm"]:
        q, k = norm("self_attn.q_norm", q, "rms"), norm("self_attn.k_norm", k, "rms")
    if spec["inverse_frequency"] is not None:
        frequency, factor = spec["inverse_frequency"], spec["attention_factor"]
        q, k = rope_infer(q, positions, frequency, factor), rope_infer(k, positions, frequency,
                                                                       factor)
    keys, values = stage(k, v)  # (B, K, S, D)
    out = gqa_attention_infer(q, keys, values, keep, spec["scale"])  # (B, H, T, D)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B, H, T, D) -> (B, T, H D)
    attn = out @ p["self_attn.o_proj.W"]  # (B, T, H D) -> (B, T, E)
    if "self_attn.o_proj.b" in p:
        attn += p["self_attn.o_proj.b"]
    x = x + attn
    h = norm("mlp_norm", x, spec["norm"])
    if spec["mlp"] == "plain":
        return x + feed_forward_infer(h, p["mlp.layers.0.W"], p.get("mlp.layers.0.b"),
                                      p["mlp.layers.2.W"], p.get("mlp.layers.2.b"))
    return x + gated_mlp_infer(h, p["mlp.gate_proj.W"], p["mlp.up_proj.W"],
                               p["mlp.down_proj.W"], spec["activation"])
