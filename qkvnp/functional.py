"""Every differentiable op of qkvnp as a pair of pure functions: the public entry to the ops.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim (of queries and keys), Dv head dim of values, N input features,
M output features. ``...`` stands for any leading dims (possibly none).

Each op ``name`` has ``name_forward(inputs) -> (out, cache)`` and
``name_backward(dout, cache) -> gradients``, one gradient per differentiable
input, with that input's shape and (compute) dtype. The cache is a small named
tuple holding exactly what the backward reads. The derivations are in
``docs/derivations.md``.

Every public backward checks its upstream gradient once
(:func:`qkvnp._checks.as_upstream_grad`: exact shape, real dtype, cast to the
compute dtype, finite) and then runs the math. Composite backwards
(attention's softmax, the reference layers of :mod:`qkvnp.layers.reference`)
pass ``check=False`` for the gradients they computed themselves, so that
``dout`` is checked once; ``linear_forward`` and ``attention_forward`` take
``check=False`` too, for the arrays a model computed itself
(:class:`qkvnp.training.KVRecallModel`).

This is the *reference* path: every formula is written line for line, with
scipy's softmax, so that it reads like the math and serves as the oracle.
Each op lives in its own module of ``qkvnp.ops``, forward beside backward:

======================================================================  ========================
``linear_*``                                                            ``qkvnp.ops.linear``
``softmax``, ``softmax_*``                                              ``qkvnp.ops.softmax``
``attention_*``, ``dropped_weights``, ``scaled_dot_product_attention``  ``qkvnp.ops.attention``
``sum_to_shape``, ``column_sums``                                       ``qkvnp.ops.reductions``
``split_heads_*``, ``merge_heads_*``                                    ``qkvnp.ops.heads``
``embedding_*``                                                         ``qkvnp.ops.embedding``
``rope_*``                                                              ``qkvnp.ops.variants``
``rope_inverse_frequency`` (linear, llama3, yarn)                       ``qkvnp.ops.rope_scaling``
``layer_norm_*``                                                        ``qkvnp.ops.layer_norm``
``rms_norm_*`` (RMSNorm and QK-norm)                                    ``qkvnp.ops.rms_norm``
``gelu_*``                                                              ``qkvnp.ops.gelu``
``silu_*``                                                              ``qkvnp.ops.silu``
``gated_mlp_*``                                                         ``qkvnp.ops.gated_mlp``
``activation_dropout_*``                                                ``qkvnp.ops.dropout``
``softcap_*`` (final-logit soft-cap)                                    ``qkvnp.ops.softcap``
``residual_add_*``                                                      ``qkvnp.ops.residual``
``router_*``, ``load_balancing_loss_*``                                 ``qkvnp.ops.moe``
======================================================================  ========================
"""
from __future__ import annotations

from .ops.attention import (AttentionCache, attention_backward, attention_forward,
                            dropped_weights, scaled_dot_product_attention)
from .ops.dropout import (ActivationDropoutCache, activation_dropout_backward,
                          activation_dropout_forward)
from .ops.embedding import (EmbeddingCache, embedding_backward, embedding_backward_factored,
                            embedding_forward)
from .ops.gated_mlp import GatedMLPCache, gated_mlp_backward, gated_mlp_forward
from .ops.gelu import GeluCache, gelu_backward, gelu_forward
from .ops.heads import (HeadsCache, merge_heads_backward, merge_heads_forward,
                        split_heads_backward, split_heads_forward)
from .ops.layer_norm import LayerNormCache, layer_norm_backward, layer_norm_forward
from .ops.linear import LinearCache, linear_backward, linear_forward
from .ops.reductions import column_sums, sum_to_shape
from .ops.rms_norm import RMSNormCache, rms_norm_backward, rms_norm_forward
from .ops.moe import (LoadBalancingLossCache, RouterCache, load_balancing_loss_backward,
                      load_balancing_loss_forward, router_backward, router_forward)
from .ops.rope_scaling import rope_inverse_frequency
from .ops.residual import ResidualCache, residual_add_backward, residual_add_forward
from .ops.silu import SiluCache, silu_backward, silu_forward
from .ops.softcap import SoftcapCache, softcap_backward, softcap_forward
from .ops.softmax import SoftmaxCache, softmax, softmax_backward, softmax_forward
from .ops.variants import rope_backward, rope_forward

__all__ = [
    "softmax", "softmax_forward", "softmax_backward", "SoftmaxCache",
    "linear_forward", "linear_backward", "LinearCache",
    "attention_forward", "attention_backward", "AttentionCache", "dropped_weights",
    "scaled_dot_product_attention",
    "sum_to_shape", "column_sums",
    "split_heads_forward", "split_heads_backward", "merge_heads_forward",
    "merge_heads_backward", "HeadsCache",
    "embedding_forward", "embedding_backward", "embedding_backward_factored", "EmbeddingCache",
    "rope_forward", "rope_backward", "rope_inverse_frequency",
    "layer_norm_forward", "layer_norm_backward", "LayerNormCache",
    "rms_norm_forward", "rms_norm_backward", "RMSNormCache",
    "gelu_forward", "gelu_backward", "GeluCache",
    "silu_forward", "silu_backward", "SiluCache",
    "softcap_forward", "softcap_backward", "SoftcapCache",
    "gated_mlp_forward", "gated_mlp_backward", "GatedMLPCache",
    "activation_dropout_forward", "activation_dropout_backward", "ActivationDropoutCache",
    "residual_add_forward", "residual_add_backward", "ResidualCache",
    "router_forward", "router_backward", "RouterCache",
    "load_balancing_loss_forward", "load_balancing_loss_backward", "LoadBalancingLossCache",
]
