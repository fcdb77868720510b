"""A decoder block's decoding step in few numpy calls (speed only; inference, no cache kept).

Shape key: B batch, T new tokens, S keys (cached + new), E embedding, H query
heads, K key/value heads, G = H / K, D head dim, F the MLP's width.

Replaces, for :meth:`qkvnp.layers.decoder_block.DecoderBlock.decode_step`
of a pre-norm RMSNorm block with a gated MLP (Llama, Qwen3, Mistral), the
reference ops it runs one by one: ``rms_norm_forward`` (and QK-norm),
``linear_forward``, ``split_heads_forward``, ``rope_forward`` (layout
``"half"``), ``variant_attention_forward`` (GQA, a boolean keep mask, no
soft-cap), ``merge_heads_forward`` and ``gated_mlp_forward``. Same formulas,
in the arrays' own dtype throughout (the reference's RoPE multiplies by
float64 angles), without the per-call checks, caches and layer calls that
cost more than the arithmetic at batch 1 (``benchmarks/NOTES.md``, "The
decoder's decoding step"). Tested against the reference in
``tests/kernels/test_decode.py``; :func:`qkvnp.kernels.choose_decode_path`
decides when it runs.
"""
from __future__ import annotations

import numpy as np

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable
    from .._typing import FloatArray

__all__ = ["rms_norm_infer", "rope_infer", "gqa_attention_infer", "gated_mlp_infer",
           "decode_block_fast"]


def rms_norm_infer(x: FloatArray, weight: FloatArray, eps: float,
                   unit_offset: bool = False) -> FloatArray:
    """``rms_norm_forward``'s output alone: ``x / sqrt(mean(x^2) + eps) * w`` (``w = 1 + weight`` with ``unit_offset``)."""
    dtype = x.dtype.type
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] * dtype(1 / x.shape[-1])  # (..., 1)
    scale = weight + dtype(1) if unit_offset else weight
    return x * (dtype(1) / np.sqrt(mean_square + dtype(eps))) * scale


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


def decode_block_fast(x: FloatArray, params: Any, spec: Any, stage: Callable,
                      keep: Any, positions: Any) -> FloatArray:
    """One pre-norm block on the new tokens ``x`` ``(B, T, E)``; returns ``(B, T, E)``.

    ``params``: the block's parameters under its names (``self_attn.q_proj.W``,
    ...); ``spec``: ``num_heads``, ``num_kv_heads``, ``norms`` (each norm's
    ``(eps, unit_offset)`` by its name: ``attn_norm``, ``mlp_norm``, and
    ``self_attn.q_norm``, ``self_attn.k_norm`` with ``qk_norm``),
    ``qk_norm``, ``inverse_frequency`` (None: no RoPE), ``attention_factor``,
    ``scale``, ``activation``;
    ``stage(k, v)`` gives the cached and new keys and values ``(B, K, S, D)``.
    """
    p = params
    B, T, _ = x.shape
    H, K = spec["num_heads"], spec["num_kv_heads"]
    norms = spec["norms"]
    h = rms_norm_infer(x, p["attn_norm.weight"], *norms["attn_norm"])

    def project(name, heads):  # (B, T, E) -> (B, heads, T, D)
        y = h @ p[f"self_attn.{name}.W"]
        if f"self_attn.{name}.b" in p:
            y += p[f"self_attn.{name}.b"]
        return y.reshape(B, T, heads, -1).transpose(0, 2, 1, 3)

    q, k, v = project("q_proj", H), project("k_proj", K), project("v_proj", K)
    if spec["qk_norm"]:
        q = rms_norm_infer(q, p["self_attn.q_norm.weight"], *norms["self_attn.q_norm"])
        k = rms_norm_infer(k, p["self_attn.k_norm.weight"], *norms["self_attn.k_norm"])
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
    h = rms_norm_infer(x, p["mlp_norm.weight"], *norms["mlp_norm"])
    return x + gated_mlp_infer(h, p["mlp.gate_proj.W"], p["mlp.up_proj.W"],
                               p["mlp.down_proj.W"], spec["activation"])
