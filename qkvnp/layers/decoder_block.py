"""The attention and the block of today's decoders (GPT-2, Llama, Qwen3, Gemma 3, Mistral).

Shape key: B batch, T new tokens, S keys (past + new), E embedding
(``emb_dim``), H query heads, K key/value heads, D head dim (``head_dim``,
independent of E and H as Qwen3's and Gemma 3's), V vocabulary.

:class:`DecoderAttention` and :class:`DecoderBlock` are :class:`Model`
composites of existing layers (:class:`Linear`, :class:`RMSNorm`,
:class:`LayerNorm`, the feed-forwards) and reference ops
(:func:`qkvnp.functional.split_heads_forward`, ``rope_forward``,
``variant_attention_forward``); each backward calls the sub-layers' and the
ops' backwards in the reverse order of the forward, one line for one line.
:class:`qkvnp.models.decoder.Decoder` stacks the blocks; the derivation of
what is new here is in ``docs/derivations_gpt.md`` ("The decoder of today's
families").
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .. import functional as F
from .._checks import check_bool, check_int, is_real_number, make_rng
from ..kernels import choose_path
from ..kernels.fast import attention_backward as fast_attention_backward
from ..kernels.fast import attention_forward as fast_attention_forward
from ..ops.variants import check_softcap, rope_backward, rope_forward, variant_attention_backward, \
    variant_attention_forward
from ..ops.rope_scaling import rope_inverse_frequency
from .base import Layer, Model
from .basic import Linear
from .mlp import GatedFeedForward
from .norms import RMSNorm
from .tied import TiedLinear
from .transformer import GELU, FeedForward, LayerNorm

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike, FloatArray

__all__ = ["DecoderAttention", "DecoderBlock", "BLOCK_PLACEMENTS", "inference_forward",
           "train_blocks_forward", "train_blocks_backward"]

#: Where :class:`DecoderBlock` puts its norms: before each branch (GPT-2, Llama, Qwen3),
#: after each residual sum (the original transformer), or both sides of each branch (Gemma 3).
BLOCK_PLACEMENTS = ("pre", "post", "sandwich")

AttentionCache = namedtuple("AttentionCache", "q_heads k_heads v_heads q_rope k_rope core merge")


def inference_forward(layer, x):
    """``layer.forward(x)`` keeping nothing for a backward (a decoding step), in it or its sub-layers.

    NOTE: through the layer's own forward, so that a replaced sub-layer (a
    LoRA adapter on ``q_proj``) decodes as it trains; but a plain
    :class:`Linear` (or a tied head) is its product alone, and a feed-forward goes through
    its sub-layers here, since a Linear's forward copies its weights for a
    backward, every token (benchmarks/NOTES.md, "The decoder's decoding step").
    """
    if type(layer) is Linear:
        out = x @ layer.params["W"]  # (..., in) -> (..., out)
        return out + layer.params["b"] if layer.bias else out
    if type(layer) is TiedLinear:  # the embedding table, transposed: (..., E) -> (..., V)
        return x @ layer.embedding.params["weight"].T
    if type(layer) is FeedForward:  # GPT-2's: first, GELU, second
        first, gelu, second = layer.layers
        return inference_forward(second, inference_forward(gelu, inference_forward(first, x)))
    if type(layer) is GatedFeedForward:  # act(x W_gate) * (x W_up), then W_down
        act = inference_forward(layer.act_fn, inference_forward(layer.gate_proj, x))  # (..., F)
        return inference_forward(layer.down_proj, act * inference_forward(layer.up_proj, x))  # (..., E)
    out = layer.forward(x, check=False)
    for sub in [layer] + [sub for _, sub in getattr(layer, "named_layers", lambda: [])()]:
        sub._cache = None
    return out


class DecoderAttention(Model):
    """Causal self-attention with GQA, QK-norm, RoPE, a score scale and a soft-cap.

    Parameters
    ----------
    emb_dim : int
        ``E``.
    num_heads : int
        ``H``.
    head_dim : int
        ``D``; the projections are ``(E, H D)``, ``(E, K D)`` and ``(H D, E)``.
    num_kv_heads : int
        ``K``, a divisor of ``H`` (grouped-query attention when ``K < H``).
    qkv_bias : bool, keyword-only
        Biases of ``q_proj``, ``k_proj``, ``v_proj`` (GPT-2).
    out_bias : bool, keyword-only
        Bias of ``o_proj`` (GPT-2).
    qk_norm : bool, keyword-only
        RMSNorm over each head's ``D`` of the queries and keys, before RoPE
        (Qwen3, Gemma 3): sub-layers ``q_norm`` and ``k_norm``.
    norm_eps : float, keyword-only
        The QK-norm's eps.
    norm_unit_offset : bool, keyword-only
        The QK-norm's ``(1 + weight)`` (Gemma).
    scale : float, keyword-only, optional
        The score scale (default ``1 / sqrt(D)``; Gemma: ``query_pre_attn_scalar ** -0.5``).
    softcap : float, keyword-only, optional
        Gemma 2's attention-logit soft-cap ``softcap * tanh(s / softcap)``.
    rope : bool, keyword-only
        Rotate the queries and keys (layout ``"half"``) by their positions.
    rope_base : float, keyword-only
        RoPE's base (``rope_theta``).
    rope_scaling : mapping, keyword-only, optional
        Hugging Face's rope-scaling mapping (``"linear"``, ``"llama3"``,
        ``"yarn"``), turned into frequencies by
        ``qkvnp.ops.rope_scaling.rope_inverse_frequency``; None: plain RoPE.
    rng : numpy.random.Generator or int, keyword-only, optional
        Seed or Generator of the initial weights.
    dtype : float dtype, keyword-only
        float32 or float64.

    Attributes
    ----------
    q_proj, k_proj, v_proj, o_proj : Linear
        Hugging Face's names (torch stores ``weight = W.T``).
    q_norm, k_norm : RMSNorm
        With ``qk_norm`` only.

    Notes
    -----
    With :math:`n` the QK-norm and :math:`R_p` the rotation of position :math:`p`:
    :math:`q = R_p\\, n(x W_q)`, :math:`k = R_p\\, n(x W_k)`, :math:`v = x W_v`,
    :math:`o = \\mathrm{softmax}(\\mathrm{cap}(c\\, q k^T) + M)\\, v`, :math:`y = o W_o`.
    ``x`` feeds three projections: its gradient is their sum.

    Examples
    --------
    >>> attn = DecoderAttention(8, 4, 2, 2, qk_norm=True, rng=0)
    >>> keep = np.tril(np.ones((3, 3), bool))
    >>> attn.forward(np.ones((1, 3, 8)), keep, np.arange(3)[None, None]).shape
    (1, 3, 8)
    >>> attn.backward(np.ones((1, 3, 8))).shape
    (1, 3, 8)
    """

    supports_complex_step = True

    def __init__(self, emb_dim: int, num_heads: int, head_dim: int, num_kv_heads: int, *,
                 qkv_bias: bool = False, out_bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = 1e-6, norm_unit_offset: bool = False,
                 scale: float | None = None, softcap: float | None = None, rope: bool = True,
                 rope_base: float = 10000.0, rope_scaling: Any = None,
                 rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        self.emb_dim = check_int(emb_dim, "emb_dim", 1)
        self.num_heads = check_int(num_heads, "num_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, got "
                             f"{self.num_kv_heads}")
        if scale is not None and not is_real_number(scale):
            raise TypeError(f"scale must be None (1/sqrt(head_dim)) or a number, got "
                            f"{type(scale).__name__} {scale!r}")
        if scale is not None and not 0 < scale < np.inf:
            raise ValueError(f"scale must be None (1/sqrt(head_dim)) or a positive finite "
                             f"number, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.softcap = check_softcap(softcap)
        self.rope, self.rope_base = check_bool(rope, "rope"), rope_base
        self.qk_norm = bool(qk_norm)
        self.rope_scaling = rope_scaling
        self.inverse_frequency: Any = None  # (D/2,) float64, with RoPE
        self.attention_factor = 1.0
        if rope:
            self.inverse_frequency, self.attention_factor = rope_inverse_frequency(
                head_dim, rope_base, rope_scaling)
        rng = make_rng(rng)
        E, H, K, D = self.emb_dim, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = Linear(E, H * D, qkv_bias, rng=rng, dtype=dtype)
        self.k_proj = Linear(E, K * D, qkv_bias, rng=rng, dtype=dtype)
        self.v_proj = Linear(E, K * D, qkv_bias, rng=rng, dtype=dtype)
        self.o_proj = Linear(H * D, E, out_bias, rng=rng, dtype=dtype)
        if self.qk_norm:
            self.q_norm = RMSNorm(D, norm_eps, unit_offset=norm_unit_offset, dtype=dtype)
            self.k_norm = RMSNorm(D, norm_eps, unit_offset=norm_unit_offset, dtype=dtype)
        self.zero_grad()

    _repr_fields = ("emb_dim", "num_heads", "head_dim", "num_kv_heads", "qk_norm", "scale",
                    "softcap", "rope", "rope_base", "rope_scaling")

    def _rope(self, x, positions):
        """``(x rotated, cache)``, or ``(x, None)`` without RoPE."""
        if not self.rope:
            return x, None
        return rope_forward(x, positions, base=self.rope_base, layout="half",
                            inverse_frequency=self.inverse_frequency,
                            attention_factor=self.attention_factor)

    def _heads(self, x, positions):
        """q ``(B, H, T, D)``, k and v ``(B, K, T, D)`` of ``x`` ``(B, T, E)``, and their caches."""
        q = self.q_proj.forward(x, check=False)  # (B, T, E) -> (B, T, H D)
        k = self.k_proj.forward(x, check=False)  # (B, T, E) -> (B, T, K D)
        v = self.v_proj.forward(x, check=False)  # (B, T, E) -> (B, T, K D)
        q, q_heads = F.split_heads_forward(q, self.num_heads)  # -> (B, H, T, D)
        k, k_heads = F.split_heads_forward(k, self.num_kv_heads)  # -> (B, K, T, D)
        v, v_heads = F.split_heads_forward(v, self.num_kv_heads)  # -> (B, K, T, D)
        if self.qk_norm:  # NOTE: QK-norm comes before RoPE (Qwen3, Gemma 3)
            q = self.q_norm.forward(q, check=False)
            k = self.k_norm.forward(k, check=False)
        q, q_rope = self._rope(q, positions)
        k, k_rope = self._rope(k, positions)
        return q, k, v, (q_heads, k_heads, v_heads, q_rope, k_rope)

    def _core(self, q, k, v, keep):
        """The attention core on the path :func:`qkvnp.kernels.choose_path` picks: ``(out, (path, cache))``.

        Without a soft-cap, a real float run takes the fast dense core of
        :mod:`qkvnp.kernels.fast` when ``choose_path`` says ``"fast"``; otherwise
        (the soft-cap, the complex step, long or overflowing scores) the reference op.
        """
        gqa = self.num_kv_heads != self.num_heads
        if self.softcap is None and q.dtype.kind == k.dtype.kind == v.dtype.kind == "f":
            B, H, T, _ = q.shape
            # NOTE: measured reason: benchmarks/NOTES.md, "The decoder's attention core"
            if choose_path("auto", B * H, T, k.shape[-2], q.dtype).path == "fast":
                out, core = fast_attention_forward(q, k, v, keep, False, self.scale,
                                                   enable_gqa=gqa)
                return out, ("fast", core)
        out, core = variant_attention_forward(q, k, v, keep, False, self.scale,
                                              softcap=self.softcap, enable_gqa=gqa, check=False)
        return out, ("reference", core)

    def forward(self, x: FloatArray, keep: Any, positions: Any) -> FloatArray:
        """``(B, T, E) -> (B, T, E)``.

        Parameters
        ----------
        x : ndarray, shape (B, T, E)
        keep : ndarray of bool, broadcastable to (B, 1, T, T)
            True where query ``i`` may attend key ``j`` (causality, padding
            and a window already folded in by the caller).
        positions : ndarray of int, shape (B, 1, T)
            Each row's positions (RoPE); ignored without RoPE.
        """
        q, k, v, caches = self._heads(x, positions)
        out, core = self._core(q, k, v, keep)  # (B, H, T, D)
        out, merge = F.merge_heads_forward(out)  # (B, H, T, D) -> (B, T, H D)
        q_heads, k_heads, v_heads, q_rope, k_rope = caches
        self._cache = AttentionCache(q_heads, k_heads, v_heads, q_rope, k_rope, core, merge)
        return self.o_proj.forward(out, check=False)  # (B, T, H D) -> (B, T, E)

    def backward(self, dout: FloatArray, retain_cache: bool = False) -> FloatArray:
        """Accumulate every gradient; return ``dx`` ``(B, T, E)``."""
        cache = self._need_cache()
        dout = self.o_proj.backward(dout, retain_cache, check=False)  # (B, T, E) -> (B, T, H D)
        dout = F.merge_heads_backward(dout, cache.merge, check=False)  # -> (B, H, T, D)
        path, core = cache.core
        if path == "fast":
            dq, dk, dv = fast_attention_backward(dout, core)  # qkvnp.kernels.fast
        else:
            dq, dk, dv = variant_attention_backward(dout, core, check=False)[:3]
        if self.rope:
            dq, dk = rope_backward(dq, cache.q_rope), rope_backward(dk, cache.k_rope)
        if self.qk_norm:
            dk = self.k_norm.backward(dk, retain_cache, check=False)
            dq = self.q_norm.backward(dq, retain_cache, check=False)
        dv = F.split_heads_backward(dv, cache.v_heads, check=False)  # (B, K, T, D) -> (B, T, K D)
        dk = F.split_heads_backward(dk, cache.k_heads, check=False)  # (B, K, T, D) -> (B, T, K D)
        dq = F.split_heads_backward(dq, cache.q_heads, check=False)  # (B, H, T, D) -> (B, T, H D)
        dx = self.v_proj.backward(dv, retain_cache, check=False)  # (B, T, K D) -> (B, T, E)
        dx = dx + self.k_proj.backward(dk, retain_cache, check=False)  # x feeds all three
        dx = dx + self.q_proj.backward(dq, retain_cache, check=False)
        self._release_cache(retain_cache)
        return dx

    def decode_step(self, x: FloatArray, kv_cache: Any, keep: Any, positions: Any,
                    window: int | None) -> FloatArray:
        """The new tokens ``x`` ``(B, T, E)`` attending to ``kv_cache`` (inference only).

        ``keep`` ``(B, 1, T, S)`` is over the ``S`` cached and new keys; with
        ``window`` the cache then keeps only the last ``window - 1`` keys
        (all a later token can see). Keeps nothing for a backward; returns
        ``(B, T, E)``.
        """
        def project(layer, heads):  # (B, T, E) -> (B, heads, T, D)
            return F.split_heads_forward(inference_forward(layer, x), heads)[0]

        q, k = project(self.q_proj, self.num_heads), project(self.k_proj, self.num_kv_heads)
        v = project(self.v_proj, self.num_kv_heads)
        if self.qk_norm:
            q, k = inference_forward(self.q_norm, q), inference_forward(self.k_norm, k)
        q, k = self._rope(q, positions)[0], self._rope(k, positions)[0]
        staged = kv_cache.stage(self, k, v)
        out = variant_attention_forward(q, staged.keys, staged.values, keep, False, self.scale,
                                        softcap=self.softcap,
                                        enable_gqa=self.num_kv_heads != self.num_heads,
                                        check=False)[0]  # (B, H, T, D)
        out = F.merge_heads_forward(out)[0]  # (B, H, T, D) -> (B, T, H D)
        y = inference_forward(self.o_proj, out)  # (B, T, H D) -> (B, T, E)
        kv_cache.commit(staged)
        if window is not None:
            kv_cache.keep_last(window - 1)
        return y


class DecoderBlock(Model):
    """One decoder layer: attention and feed-forward branches, residuals, norms placed by ``placement``.

    Parameters
    ----------
    self_attn : DecoderAttention
        The attention branch.
    mlp : Layer
        :class:`~qkvnp.FeedForward` (GPT-2), :class:`~qkvnp.GatedFeedForward`
        (SwiGLU, GeGLU) or :class:`~qkvnp.layers.MoEFeedForward`.
    norms : sequence of Layer
        Two norms (``attn_norm``, ``mlp_norm``) for ``"pre"`` and ``"post"``,
        four for ``"sandwich"`` (then also ``attn_post_norm``, ``mlp_post_norm``).
    placement : {"pre", "post", "sandwich"}
        ``"pre"``: ``x + f(norm(x))``; ``"post"``: ``norm(x + f(x))``;
        ``"sandwich"``: ``x + post_norm(f(norm(x)))`` (Gemma 2 and 3).
    window : int, optional
        The sliding window of this layer's attention (keys ``i - j < window``),
        None for global attention; read by the decoder to build the mask.

    Examples
    --------
    >>> from qkvnp import RMSNorm, GatedFeedForward
    >>> block = DecoderBlock(DecoderAttention(8, 2, 4, 1, rng=0), GatedFeedForward(8, 12, rng=0),
    ...                      [RMSNorm(8), RMSNorm(8)], "pre")
    >>> keep = np.tril(np.ones((3, 3), bool))
    >>> block.forward(np.ones((1, 3, 8)), keep, np.arange(3)[None, None]).shape
    (1, 3, 8)
    """

    supports_complex_step = True

    def __init__(self, self_attn: DecoderAttention, mlp: Layer, norms: Any, placement: str,
                 window: int | None = None) -> None:
        if placement not in BLOCK_PLACEMENTS:
            raise ValueError(f"placement must be one of {BLOCK_PLACEMENTS}, got {placement!r}")
        norms = list(norms)
        if len(norms) != (4 if placement == "sandwich" else 2):
            raise ValueError(f"norms must hold {4 if placement == 'sandwich' else 2} norms for "
                             f"placement {placement!r}, got {len(norms)}")
        self.placement, self.window = placement, window
        self.self_attn, self.mlp = self_attn, mlp
        self.attn_norm, self.mlp_norm = norms[0], norms[1]
        if placement == "sandwich":
            self.attn_post_norm, self.mlp_post_norm = norms[2], norms[3]
        self.zero_grad()

    _repr_fields = ("placement", "window")

    def _branch(self, name, x, keep, positions):
        """The attention (``name="attn"``) or feed-forward branch ``f`` of ``x`` (B, T, E)."""
        if name == "attn":
            return self.self_attn.forward(x, keep, positions)
        return self.mlp.forward(x, check=False)

    def _branch_backward(self, name, dout, retain_cache):
        if name == "attn":
            return self.self_attn.backward(dout, retain_cache)
        return self.mlp.backward(dout, retain_cache, check=False)

    def forward(self, x: FloatArray, keep: Any, positions: Any) -> FloatArray:
        """``(B, T, E) -> (B, T, E)``; ``keep`` and ``positions`` as :class:`DecoderAttention`'s."""
        for name in ("attn", "mlp"):
            norm = getattr(self, f"{name}_norm")
            if self.placement == "post":
                x = norm.forward(x + self._branch(name, x, keep, positions), check=False)
                continue
            h = self._branch(name, norm.forward(x, check=False), keep, positions)
            if self.placement == "sandwich":
                h = getattr(self, f"{name}_post_norm").forward(h, check=False)
            x = x + h
        self._cache = True
        return x

    def backward(self, dout: FloatArray, retain_cache: bool = False) -> FloatArray:
        """Accumulate every gradient; return ``dx`` ``(B, T, E)``."""
        self._need_cache()
        for name in ("mlp", "attn"):  # the reverse of the forward's order
            norm = getattr(self, f"{name}_norm")
            if self.placement == "post":
                # in the forward this was: x = norm(x + f(x))
                dsum = norm.backward(dout, retain_cache, check=False)
                dout = dsum + self._branch_backward(name, dsum, retain_cache)
                continue
            # in the forward this was: x = x + post_norm(f(norm(x)))
            dh = dout
            if self.placement == "sandwich":
                dh = getattr(self, f"{name}_post_norm").backward(dh, retain_cache, check=False)
            dh = self._branch_backward(name, dh, retain_cache)
            dout = dout + norm.backward(dh, retain_cache, check=False)
        self._release_cache(retain_cache)
        return dout

    def decode_step(self, x: FloatArray, kv_cache: Any, keep: Any, positions: Any) -> FloatArray:
        """The block on the new tokens, attending to ``kv_cache`` (inference only).

        The path is :func:`qkvnp.kernels.choose_decode_path`'s: the fused step of
        ``qkvnp.kernels.decode``, or the layers' own calls (the reference).
        """
        if self._decode_path(x, keep) == "fast":
            return self._decode_fast(x, kv_cache, keep, positions)

        def attn(h):
            return self.self_attn.decode_step(h, kv_cache, keep, positions, self.window)

        def norm(layer, h):
            return inference_forward(layer, h)

        def mlp(h):
            return inference_forward(self.mlp, h)

        for name, branch in (("attn", attn), ("mlp", mlp)):
            first = getattr(self, f"{name}_norm")
            if self.placement == "post":
                x = norm(first, x + branch(x))
                continue
            h = branch(norm(first, x))
            if self.placement == "sandwich":
                h = norm(getattr(self, f"{name}_post_norm"), h)
            x = x + h
        return x

    def train_spec(self) -> Any:
        """What ``qkvnp.kernels.decoder_train`` needs of this block (a dict), or why it cannot run it (a str)."""
        attn, mlp = self.self_attn, self.mlp
        norms = [self.attn_norm, self.mlp_norm] + ([attn.q_norm, attn.k_norm] if attn.qk_norm
                                                   else [])
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) + tuple(
            getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        if self.placement != "pre":
            return f"the fused blocks are 'pre' blocks, not {self.placement!r}"
        if not all(type(norm) is RMSNorm for norm in norms) or \
                type(mlp) is not GatedFeedForward:
            return "the fused blocks have RMSNorms and a gated MLP"
        if attn.softcap is not None:
            return "the fused blocks have no attention soft-cap"
        if not all(type(layer) is Linear and not layer.bias for layer in projections):
            return "a projection is not a plain Linear without bias (an adapter, a bias)"
        qk = attn.q_norm if attn.qk_norm else self.attn_norm
        if attn.qk_norm and (attn.k_norm.eps, attn.k_norm.unit_offset) != (qk.eps,
                                                                           qk.unit_offset):
            return "the QK-norms differ"
        return {"num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
                "eps": self.attn_norm.eps, "unit_offset": self.attn_norm.unit_offset,
                "mlp_eps": self.mlp_norm.eps, "mlp_unit_offset": self.mlp_norm.unit_offset,
                "qk_eps": qk.eps, "qk_unit_offset": qk.unit_offset, "qk_norm": attn.qk_norm,
                "rope": attn.rope, "scale": attn.head_dim ** -0.5 if attn.scale is None
                else attn.scale, "activation": getattr(mlp, "activation")}

    def _decode_path(self, x, keep):
        """``"fast"`` or ``"reference"``: :func:`qkvnp.kernels.choose_decode_path` on this block."""
        from ..kernels import choose_decode_path

        kinds = [type(layer) for _, layer in self._norms()]  # the QK-norms after the block's
        norm = {RMSNorm: "rms", LayerNorm: "layer"}.get(kinds[0], "other")
        if kinds[1] is not kinds[0] or any(kind is not RMSNorm for kind in kinds[2:]):
            norm = "other"
        mlp, gated, sublayers = type(self.mlp).__name__, True, ()
        if type(self.mlp) is GatedFeedForward:
            mlp = self.mlp.activation
            sublayers = (self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj)
        elif type(self.mlp) is FeedForward and type(self.mlp.layers[1]) is GELU:
            first, gelu, second = self.mlp.layers
            mlp, gated, sublayers = ("gelu_tanh" if gelu.approximate == "tanh" else "gelu",
                                     False, (first, second))
        # NOTE: measured reason of the fused step: benchmarks/NOTES.md, "The decoder's decoding step"
        attn = self.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) + sublayers
        plain = all(type(layer) is Linear for layer in projections)
        return choose_decode_path(self.placement, norm, mlp, attn.softcap, x.dtype, keep,
                                  plain, gated).path

    def _norms(self):
        """``(name, norm)`` of the block norms and, with QK-norm, the attention's."""
        attn = self.self_attn
        return [("attn_norm", self.attn_norm), ("mlp_norm", self.mlp_norm)] + (
            [("self_attn.q_norm", attn.q_norm), ("self_attn.k_norm", attn.k_norm)]
            if attn.qk_norm else [])

    def _decode_fast(self, x, kv_cache, keep, positions):
        """:func:`qkvnp.kernels.decode.decode_block_fast` on this block's parameters and cache."""
        from ..kernels.decode import decode_block_fast

        attn, gated = self.self_attn, type(self.mlp) is GatedFeedForward
        spec = {"num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
                "norm": "layer" if type(self.attn_norm) is LayerNorm else "rms",
                "norms": {name: (layer.eps, getattr(layer, "unit_offset", False))
                          for name, layer in self._norms()},
                "qk_norm": attn.qk_norm,
                "inverse_frequency": attn.inverse_frequency if attn.rope else None,
                "attention_factor": attn.attention_factor,
                "scale": attn.head_dim ** -0.5 if attn.scale is None else attn.scale,
                "mlp": "gated" if gated else "plain",
                "activation": self.mlp.activation if gated else "gelu_tanh"}
        staged = []

        def stage(k, v):
            staged.append(kv_cache.stage(attn, k, v))
            return staged[0].keys, staged[0].values

        sublayers = (("mlp.gate_proj", self.mlp.gate_proj), ("mlp.up_proj", self.mlp.up_proj),
                     ("mlp.down_proj", self.mlp.down_proj)) if gated else (
            ("mlp.layers.0", self.mlp.layers[0]), ("mlp.layers.2", self.mlp.layers[2]))
        params = {f"{prefix}.{name}": value for prefix, layer in (
            ("self_attn.q_proj", attn.q_proj), ("self_attn.k_proj", attn.k_proj),
            ("self_attn.v_proj", attn.v_proj), ("self_attn.o_proj", attn.o_proj),
            ("attn_norm", self.attn_norm), ("mlp_norm", self.mlp_norm)) + sublayers
            for name, value in layer.params.items()}
        params.update((f"{name}.weight", layer.params["weight"]) for name, layer in self._norms()
                      if name.startswith("self_attn."))
        y = decode_block_fast(x, params, spec, stage, keep, positions)
        kv_cache.commit(staged[0])
        if self.window is not None:
            kv_cache.keep_last(self.window - 1)
        return y


def train_blocks_forward(blocks: Any, x: FloatArray, keeps: Any, positions: Any,
                         final_norm: Any = None, head: Any = None) -> Any:
    """The blocks on ``x`` ``(B, T, E)`` by ``qkvnp.kernels.decoder_train``: ``(out, cache)``, or None.

    With ``final_norm`` (an RMSNorm) and ``head`` (a plain Linear without
    bias), both run in the kernel's shares too and ``out`` is the logits
    ``(B, T, V)``; their gradients go to them in :func:`train_blocks_backward`.

    None when :func:`qkvnp.kernels.choose_train_path` says ``"reference"``
    (the caller then runs the blocks' own forwards). ``keeps``: one keep mask
    a block; ``positions`` ``(B, 1, T)``. No block keeps a cache: the caller
    keeps the returned one for :func:`train_blocks_backward`.
    """
    from ..kernels import choose_train_path
    from ..kernels import decoder_train as kernel

    blocks = list(blocks)
    specs = [block.train_spec() for block in blocks]
    B, T = x.shape[0], x.shape[1]
    core_paths = [choose_path("auto", B * block.self_attn.num_heads, T, T, x.dtype).path
                  for block in blocks]
    # NOTE: measured reason: benchmarks/NOTES.md, "The Qwen3-like decoder"
    if choose_train_path(specs, x.dtype, keeps, core_paths).path != "fused":
        return None
    weights = _copied_weights(blocks, specs)
    tables, rope = {}, []
    for block in blocks:
        attn = block.self_attn
        key = None if not attn.rope else (attn.inverse_frequency.tobytes(),
                                          attn.attention_factor)
        if key is not None and key not in tables:  # RoPE's tables once a call
            tables[key] = kernel.rope_tables(positions, attn.inverse_frequency,
                                             attn.attention_factor, x.dtype)
        rope.append(None if key is None else tables[key])
    last = None
    if final_norm is not None:
        last = kernel.HeadWeights(final_norm.params["weight"].copy(), final_norm.eps,
                                  final_norm.unit_offset, head.params["W"].copy())
    return kernel.stack_forward(x, weights, keeps, rope, last)


def _copied_weights(blocks, specs):
    """Each block's :func:`~qkvnp.kernels.decoder_train.block_weights` (copies), the
    blocks dealt among the worker threads from ``min_parallel_entries`` on."""
    from ..kernels import decoder_train as kernel
    from ..kernels._runtime import run_elementwise

    params = [block.params for block in blocks]
    weights: list = [None] * len(blocks)

    def copy(part):
        for i in part:
            weights[i] = kernel.block_weights(params[i], specs[i])

    run_elementwise(copy, list(range(len(blocks))),
                    sum(value.size for p in params for value in p.values()))
    return weights


def train_blocks_backward(blocks: Any, dout: FloatArray, cache: Any, final_norm: Any = None,
                          head: Any = None, finite_name: str | None = None) -> FloatArray:
    """Backward of :func:`train_blocks_forward` (the same ``final_norm`` and ``head``): each
    block's gradients accumulated; returns ``dx`` ``(B, T, E)``. ``finite_name``: see
    :func:`qkvnp.kernels.decoder_train.stack_backward` (a refusal accumulates nothing)."""
    from ..kernels.decoder_train import stack_backward

    dx, grads = stack_backward(dout, cache, finite_name)
    blocks = list(blocks)
    if cache.head is not None:
        final = grads.pop()
        final_norm._accumulate("weight", final["final_norm.weight"])
        head._accumulate("W", final["head.W"])
    for block, block_grads in zip(blocks, grads):
        for name, grad in block_grads.items():
            path, param = name.rsplit(".", 1)
            layer = block
            for part in path.split("."):
                layer = getattr(layer, part)
            layer._accumulate(param, grad)
    return dx
