"""A decoder's pre-norm blocks in training, forward and backward in few numpy calls, one batch share per worker.

Shape key: B batch, T tokens, E embedding, H query heads, K key/value heads,
D head dim, F the MLP's width, N = B T rows, L blocks.

Replaces, for :meth:`qkvnp.models.decoder.Decoder.forward` and ``backward``
over a stack of pre-norm RMSNorm blocks with a gated MLP and plain,
bias-free projections (Llama, Qwen3, Mistral), the layers' calls of the
reference ops one by one: ``rms_norm_forward`` (and QK-norm),
``linear_forward``, ``split_heads_forward``, ``rope_forward`` (layout
``"half"``), the attention core (:mod:`qkvnp.kernels.fast`, as the layer
chooses it), ``merge_heads_forward``, ``gated_mlp_forward``, the residual
sums, and their backwards in reverse order. The same formulas; what differs:

- the query, key and value projections are one product with the three
  weights side by side (``(E, (H + 2K) D)``), gate and up one product
  (``(E, 2F)``), in the forward and in both products of the backward. The
  concatenation is the copy of the weights the layers make anyway (the
  backward differentiates the forward as it ran, whatever an optimizer
  does to the parameters in between);
- RoPE's ``cos`` and ``sin`` are computed once a call (from float64
  angles), in the arrays' dtype, for every block;
- :func:`stack_forward` runs the blocks on each share of the batch in a
  worker thread of :func:`qkvnp.kernels._runtime.run` (BLAS one thread
  each) when the work reaches the ``batch_split_flops`` setting;
  :func:`stack_backward` runs each share's backward likewise and adds the
  parameter gradients of the shares in share order (the same bits whatever
  the threads' timing). Nothing is shared between the workers but the
  read-only inputs; each writes its own rows.

Tested against the layers in ``tests/kernels/test_decoder_train.py``;
``qkvnp.kernels.choose_train_path`` decides when it runs
(``benchmarks/NOTES.md``, "The Qwen3-like decoder").
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import not_finite
from ._runtime import run, run_elementwise, threads_for
from .fast import attention_backward as fast_attention_backward
from .fast import attention_forward as fast_attention_forward
from .pointwise import gated_backward_fused, gated_forward_fused, rms_norm_backward_fused, \
    rms_norm_forward_fused

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import FloatArray

__all__ = ["SPEC_KEYS", "HeadWeights", "BlockWeights", "block_weights", "rope_tables", "block_forward", "block_backward",
           "stack_forward", "stack_backward", "StackCache"]

BlockWeights = namedtuple("BlockWeights", "attn_norm mlp_norm q_norm k_norm W_qkv W_o W_gate_up "
                                          "W_down spec")
BlockWeights.__doc__ = """One block's weights, copied for a call: the norms' gains and the joined projections."""
_BlockCache = namedtuple("_BlockCache", "weights rows norm1 q_norm k_norm rope core merged norm2 "
                                        "rows2 gated hidden")
StackCache = namedtuple("StackCache", "shares caches ropes shape head")
HeadWeights = namedtuple("HeadWeights", "norm eps unit_offset W")
HeadWeights.__doc__ = """The final RMSNorm's gain, eps and unit offset and the head's ``W`` ``(E, V)``, copied for a call."""
StackCache.__doc__ = """What :func:`stack_backward` reads: the shares, each one's block caches, RoPE's tables."""

#: ``spec`` keys of :func:`block_weights`.
SPEC_KEYS = ("num_heads", "num_kv_heads", "eps", "unit_offset", "mlp_eps", "mlp_unit_offset",
             "qk_eps", "qk_unit_offset", "qk_norm", "rope", "scale", "activation")


def block_weights(params: Any, spec: Any) -> BlockWeights:
    """A block's weights for one call: copies, the projections joined (``params``: names as ``DecoderBlock.params``)."""
    p = params
    qk = spec["qk_norm"]
    return BlockWeights(
        p["attn_norm.weight"].copy(), p["mlp_norm.weight"].copy(),
        p["self_attn.q_norm.weight"].copy() if qk else None,
        p["self_attn.k_norm.weight"].copy() if qk else None,
        np.concatenate([p[f"self_attn.{n}_proj.W"] for n in "qkv"], axis=1),  # (E, (H + 2K) D)
        p["self_attn.o_proj.W"].copy(),
        np.concatenate([p["mlp.gate_proj.W"], p["mlp.up_proj.W"]], axis=1),  # (E, 2F)
        p["mlp.down_proj.W"].copy(), dict(spec))


def rope_tables(positions: Any, inverse_frequency: Any, attention_factor: float,
                dtype: Any) -> tuple[FloatArray, FloatArray]:
    """``a cos`` and ``a sin`` ``(B, 1, T, D/2)`` of RoPE's angles (float64), in ``dtype``: ``rope_forward``'s cache."""
    angles = np.asarray(positions, np.float64)[..., None] * inverse_frequency  # (B, 1, T, D/2)
    cos, sin = np.cos(angles), np.sin(angles)
    if attention_factor != 1.0:  # YaRN's: y = a R x
        cos, sin = cos * float(attention_factor), sin * float(attention_factor)
    return cos.astype(dtype), sin.astype(dtype)


def _full_tables(rope, heads):
    """RoPE's tables over whole heads, ``cos`` and ``(-sin, sin)`` of shape ``(B or 1, heads, T, D)``,
    laid out as ``(B or 1, T, heads, D)``: the layout of a projection's rows, so that the
    rotation runs along whole rows (one inner loop of ``heads D``, not ``D/2``)."""
    cos, sin = rope  # (B or 1, 1, T, D/2)
    full = []
    for table in (np.concatenate((cos, cos), -1), np.concatenate((-sin, sin), -1)):
        rows = table.transpose(0, 2, 1, 3)  # (b, 1, T, D) -> (b, T, 1, D)
        rows = np.ascontiguousarray(np.broadcast_to(rows, rows.shape[:2] + (heads,)
                                                    + rows.shape[3:]))  # (b, T, heads, D)
        full.append(rows.transpose(0, 2, 1, 3))  # a view (b, heads, T, D)
    return tuple(full)


def _rotate(x, cos, signed_sin, transpose=False):
    """``R x`` (or ``R^T x``) of ``x`` ``(B, H, T, D)``: ``x cos + (x2, x1) (-sin, sin)`` (``-`` for ``R^T``).

    The output keeps ``x``'s memory layout (a projection's rows)."""
    half = x.shape[-1] // 2
    out = np.multiply(x, cos)  # (B, H, T, D), x's layout
    swapped = np.empty_like(out)
    swapped[..., :half], swapped[..., half:] = x[..., half:], x[..., :half]
    swapped *= signed_sin
    if transpose:  # R^T: (y1 cos + y2 sin, y2 cos - y1 sin)
        out -= swapped
    else:  # R: (x1 cos - x2 sin, x2 cos + x1 sin)
        out += swapped
    return out


def _rows_layout(a):
    """A copy of ``a`` ``(B, H, T, D)`` laid out as ``(B, T, H, D)`` (a projection's rows), as a view ``(B, H, T, D)``."""
    B, H, T, D = a.shape
    out = np.empty((B, T, H, D), a.dtype).transpose(0, 2, 1, 3)
    out[...] = a
    return out


def block_forward(x: FloatArray, w: BlockWeights, keep: Any,
                  rope: Any) -> tuple[FloatArray, Any]:
    """One pre-norm block on ``x`` ``(B, T, E)``: ``(out (B, T, E), cache)``.

    ``rope``: None, or the queries' and the keys' :func:`_full_tables`
    ``(cos_q, sin_q, cos_k, sin_k)``.
    """
    s = w.spec
    B, T, E = x.shape
    H, K = s["num_heads"], s["num_kv_heads"]
    h, norm1 = rms_norm_forward_fused(x, w.attn_norm, s["eps"], s["unit_offset"])
    rows = h.reshape(B * T, E)  # (B, T, E) -> (N, E)
    qkv = rows @ w.W_qkv  # (N, E) -> (N, (H + 2K) D)
    D = w.W_qkv.shape[1] // (H + 2 * K)
    heads = qkv.reshape(B, T, H + 2 * K, D).transpose(0, 2, 1, 3)  # -> (B, H + 2K, T, D)
    q, k, v = heads[:, :H], heads[:, H:H + K], heads[:, H + K:]
    q_norm = k_norm = None
    if s["qk_norm"]:  # NOTE: QK-norm comes before RoPE (Qwen3, Gemma 3)
        q, q_norm = rms_norm_forward_fused(q, w.q_norm, s["qk_eps"], s["qk_unit_offset"])
        k, k_norm = rms_norm_forward_fused(k, w.k_norm, s["qk_eps"], s["qk_unit_offset"])
    if rope is not None:
        q, k = _rotate(q, *rope[:2]), _rotate(k, *rope[2:])
    out, core = fast_attention_forward(q, k, v, keep, False, s["scale"], enable_gqa=K != H)
    merged = out.transpose(0, 2, 1, 3).reshape(B * T, H * D)  # (B, H, T, D) -> (N, H D)
    attended = (merged @ w.W_o).reshape(B, T, E)  # (N, H D) -> (N, E) -> (B, T, E)
    attended += x  # x + attention(norm(x)) W_o, into the product's own array
    x = attended
    h, norm2 = rms_norm_forward_fused(x, w.mlp_norm, s["mlp_eps"], s["mlp_unit_offset"])
    rows2 = h.reshape(B * T, E)
    gate_up = rows2 @ w.W_gate_up  # (N, E) -> (N, 2F)
    hidden, gated = gated_forward_fused(gate_up, s["activation"])  # (N, 2F) -> (N, F)
    y = (hidden @ w.W_down).reshape(B, T, E)  # (N, F) -> (N, E) -> (B, T, E)
    y += x  # x + mlp(norm(x)), into the product's own array
    return y, _BlockCache(w, rows, norm1, q_norm, k_norm, rope, core, merged, norm2, rows2, gated,
                          hidden)


def block_backward(dy: FloatArray, cache: Any) -> tuple[FloatArray, dict]:
    """Backward of :func:`block_forward`: ``(dx (B, T, E), grads)``, grads under ``DecoderBlock``'s names."""
    c, w = cache, cache.weights
    s = w.spec
    B, T, E = dy.shape
    H, K = s["num_heads"], s["num_kv_heads"]
    grads = {}
    dy_rows = dy.reshape(B * T, E)
    # in the forward this was: y = x + (act(gate) * up) W_down
    grads["mlp.down_proj.W"] = c.hidden.T @ dy_rows  # (F, N) @ (N, E) -> (F, E)
    dhidden = dy_rows @ w.W_down.T  # (N, E) -> (N, F)
    F_ = dhidden.shape[1]
    dgate_up = gated_backward_fused(dhidden, c.gated)  # (N, F) -> (N, 2F): d up = dh act, d gate
    dW_gate_up = c.rows2.T @ dgate_up  # (E, N) @ (N, 2F) -> (E, 2F)
    grads["mlp.gate_proj.W"], grads["mlp.up_proj.W"] = dW_gate_up[:, :F_], dW_gate_up[:, F_:]
    dh = (dgate_up @ w.W_gate_up.T).reshape(B, T, E)  # (N, 2F) -> (N, E) -> (B, T, E)
    dh, grads["mlp_norm.weight"] = rms_norm_backward_fused(dh, c.norm2)
    dh += dy  # dx = dy + dh, into the norm's own array
    dx = dh
    # in the forward this was: x = x + attention(norm(x)) W_o
    dx_rows = dx.reshape(B * T, E)
    grads["self_attn.o_proj.W"] = c.merged.T @ dx_rows  # (H D, N) @ (N, E) -> (H D, E)
    dmerged = dx_rows @ w.W_o.T  # (N, E) -> (N, H D)
    D = dmerged.shape[1] // H
    dout = dmerged.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # -> (B, H, T, D)
    dq, dk, dv = fast_attention_backward(dout, c.core)
    return _backward_heads(dx, dq, dk, dv, c, grads)


def _backward_heads(dx, dq, dk, dv, c, grads):
    """The rest of :func:`block_backward`: RoPE, QK-norm, the joined projection, the first norm."""
    w = c.weights
    s = w.spec
    B, T, E = dx.shape
    H, K = s["num_heads"], s["num_kv_heads"]
    D = dq.shape[-1]
    rope = c.rope
    dq, dk = _rows_layout(dq), _rows_layout(dk)  # the rows' layout: RoPE and QK-norm along rows
    if rope is not None:
        dq = _rotate(dq, *rope[:2], transpose=True)
        dk = _rotate(dk, *rope[2:], transpose=True)
    if s["qk_norm"]:
        dq, grads["self_attn.q_norm.weight"] = rms_norm_backward_fused(dq, c.q_norm)
        dk, grads["self_attn.k_norm.weight"] = rms_norm_backward_fused(dk, c.k_norm)
    dqkv = np.empty((B, T, H + 2 * K, D), dx.dtype)  # (B, T, H + 2K, D)
    heads = dqkv.transpose(0, 2, 1, 3)  # a view (B, H + 2K, T, D)
    heads[:, :H], heads[:, H:H + K], heads[:, H + K:] = dq, dk, dv
    dqkv = dqkv.reshape(B * T, (H + 2 * K) * D)  # (N, (H + 2K) D)
    dW = c.rows.T @ dqkv  # (E, N) @ (N, (H + 2K) D) -> (E, (H + 2K) D)
    grads["self_attn.q_proj.W"] = dW[:, :H * D]
    grads["self_attn.k_proj.W"] = dW[:, H * D:(H + K) * D]
    grads["self_attn.v_proj.W"] = dW[:, (H + K) * D:]
    dh = (dqkv @ w.W_qkv.T).reshape(B, T, E)  # (N, (H + 2K) D) -> (N, E) -> (B, T, E)
    dh, grads["attn_norm.weight"] = rms_norm_backward_fused(dh, c.norm1)
    dx += dh
    return dx, grads


def _shares(x, weights):
    """Slices of the batch, one per worker thread when the step's products reach ``batch_split_flops``."""
    B, T, E = x.shape
    flops = 6 * B * T * sum(w.W_qkv.size + w.W_o.size + w.W_gate_up.size + w.W_down.size
                            for w in weights)  # the products of forward and backward
    weight = 1.5 if x.itemsize == 8 else 1.0  # float64 (see batch_split_flops)
    threads = min(threads_for(flops * weight, "batch_split_flops"), B)
    bounds = [B * i // threads for i in range(threads + 1)]
    return tuple(slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))


def _share_of(a, share):
    """Rows ``share`` of ``a`` ``(B, ...)``, or ``a`` itself when it broadcasts over the batch
    (a leading 1, or no batch axis: a ``(T, S)`` keep mask)."""
    return a if a is None or np.ndim(a) < 4 or np.shape(a)[0] == 1 else a[share]


def stack_forward(x: FloatArray, weights: Any, keeps: Any, ropes: Any,
                  head: Any = None) -> tuple[FloatArray, Any]:
    """The blocks in order on ``x`` ``(B, T, E)``, each share of the batch in a worker: ``(out, StackCache)``.

    ``weights``: one :func:`block_weights` a block; ``keeps``: block ``l``'s
    keep mask ``(B or 1, 1, T, T)`` or ``(T, T)`` (every row seeing a key); ``ropes``: block
    ``l``'s ``(cos, sin)`` ``(B or 1, 1, T, D/2)`` (:func:`rope_tables`) or None;
    ``head``: a :class:`HeadWeights`, the final norm and the head run in the
    shares too (the output is then the logits ``(B, T, V)``), or None.

    NOTE: the head in the shares, not on OpenBLAS's own threads: after a
    product on those, their spinning threads slowed the split backward that
    follows by half (benchmarks/NOTES.md, "The Qwen3-like decoder").
    """
    shares = _shares(x, weights)
    out = np.empty(x.shape[:-1] + ((x.shape[-1],) if head is None else (head.W.shape[1],)),
                   x.dtype)  # each share writes its rows
    full: dict = {}  # RoPE's tables over whole heads, once a call for blocks that share them
    for rope, w in zip(ropes, weights):
        key = (id(rope), w.spec["num_heads"], w.spec["num_kv_heads"])
        if rope is not None and key not in full:
            full[key] = _full_tables(rope, key[1]) + _full_tables(rope, key[2])
    ropes = [None if rope is None else full[(id(rope), w.spec["num_heads"],
                                             w.spec["num_kv_heads"])]
             for rope, w in zip(ropes, weights)]
    caches: list = [None] * len(shares)

    def task(work):
        for i, share in work:
            h, mine = x[share], []
            for w, keep, rope in zip(weights, keeps, ropes):
                part = None if rope is None else tuple(_share_of(t, share) for t in rope)
                h, cache = block_forward(h, w, _share_of(keep, share), part)
                mine.append(cache)
            caches[i] = mine
            if head is None:
                out[share] = h
                continue
            h, norm = rms_norm_forward_fused(h, head.norm, head.eps, head.unit_offset)
            rows = h.reshape(-1, h.shape[-1])  # (b, T, E) -> (b T, E)
            mine.append((norm, rows))
            T = h.shape[1]
            logits = out.reshape(-1, out.shape[-1])[share.start * T:share.stop * T]  # (b T, V), a view
            np.matmul(rows, head.W, out=logits)  # (b T, E) @ (E, V) -> (b T, V)

    run(task, list(enumerate(shares)))
    return out, StackCache(shares, caches, ropes, x.shape, head)


def stack_backward(dout: FloatArray, cache: Any,
                   finite_name: str | None = None) -> tuple[FloatArray, list]:
    """Backward of :func:`stack_forward`: ``(dx (B, T, E), grads)``, one dict a block
    (and, with a head, a last one: ``head.W`` and ``final_norm.weight``).

    Each share's blocks backward in its worker; the shares' parameter
    gradients are added in share order after all have finished.
    ``finite_name``: None, or the argument name under which each share first
    tests its rows of ``dout`` finite (for a caller that skipped the
    whole-array test): a NaN or inf raises ``ValueError``
    (:func:`qkvnp._checks.not_finite`) once every share has ended, with no
    gradient returned.
    """
    dx = np.empty(cache.shape, dout.dtype)
    results: list = [None] * len(cache.shares)

    head = cache.head

    def task(work):
        for i, share in work:
            d, grads, mine = dout[share], [], cache.caches[i]
            if finite_name is not None and not np.isfinite(d).all():
                raise not_finite(finite_name)
            if head is not None:  # in the forward this was: z = rms_norm(x) W
                (norm, rows), mine = mine[-1], mine[:-1]
                d_rows = d.reshape(-1, d.shape[-1])  # (b, T, V) -> (b T, V)
                final = {"head.W": rows.T @ d_rows}  # (E, b T) @ (b T, V) -> (E, V)
                d = (d_rows @ head.W.T).reshape(d.shape[:-1] + (rows.shape[1],))  # (b, T, E)
                d, final["final_norm.weight"] = rms_norm_backward_fused(d, norm)
                grads.append(final)
            for block_cache in reversed(mine):
                d, block_grads = block_backward(d, block_cache)
                grads.append(block_grads)
            dx[share], results[i] = d, grads[::-1]

    run(task, list(enumerate(cache.shares)))
    total = results[0]  # each block's gradients are this call's own arrays
    if len(results) > 1:
        _add_shares(total, results[1:])
    return dx, total


def _add_shares(total, rest):
    """Add each later share's gradients into ``total``'s, in share order (the same sums
    whatever the timing), the arrays dealt among the worker threads, largest first."""
    names = sorted(((block, name) for block, grads in enumerate(total) for name in grads),
                   key=lambda item: -total[item[0]][item[1]].size)

    def add(part):
        for block, name in part:
            for more in rest:
                total[block][name] += more[block][name]

    entries = sum(grads[name].size for grads in total for name in grads)
    run_elementwise(add, names, entries * len(rest))
