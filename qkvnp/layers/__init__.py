"""Layers: parameters, gradients and the cache of the last forward.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D = E // H head dim. Leading dims are optional: ``(T, E)`` works like
``(B, T, E)``.

The package, module by module:

``base``       :class:`Layer`, the contract every layer keeps (params, grads,
               the cache of the last forward, ``state_dict`` /
               ``load_state_dict``), and :class:`Model`, a container whose
               ``params`` gather the arrays of the layers assigned to its
               attributes, under dotted names
``attention``  :class:`SelfAttention` and :class:`MultiHeadAttention`: they
               check their inputs and ask :mod:`qkvnp.kernels` to run the path
               of their ``impl`` (``last_dispatch`` then says which path ran
               and why)
``attention_base`` what the two share: the dispatch, dropout's generator,
               KV-cache decoding steps, the attention variants' options
``basic``      :class:`Linear` and :class:`Embedding`, which call their op of
               :mod:`qkvnp.functional`
``norms``      :class:`RMSNorm` (also the QK-norm of Qwen3 and Gemma 3)
``transformer`` :class:`LayerNorm`, :class:`GELU`, :class:`Dropout`,
               :class:`Sequential`, :class:`FeedForward` and the book's
               :class:`TransformerBlock` (the GPT is :class:`qkvnp.GPTModel`)
``mlp``        :class:`GatedFeedForward`, the gated MLP of Llama, Qwen,
               Mistral (SwiGLU) and Gemma (GeGLU), and :class:`SiLU`
``tied``       :class:`TiedLinear`, an output head reading an embedding's
               table (GPT-2's tied ``lm_head``)
``lora``       :class:`LoRALinear`, a frozen :class:`Linear` with a trainable
               low-rank update, and :func:`apply_lora` / :func:`merge_lora` /
               :func:`adapter_params`
``moe``        :class:`MoEFeedForward`, a mixture of gated-MLP experts with a
               top-k router
``decoder_block`` :class:`DecoderAttention` and :class:`DecoderBlock`, the
               attention (GQA, QK-norm, RoPE, scale, soft-cap) and the block
               (pre, post or sandwich norms) of :class:`qkvnp.Decoder`

The math is elsewhere (:mod:`qkvnp.functional`, :mod:`qkvnp.kernels`).

dtypes: a layer computes in its ``dtype``. ``forward`` casts its real inputs
to it (ints, bools, float16/32/64 and float128 alike, silently: a float128
input loses its extra precision; Embedding's indices stay integers), and
``backward`` casts ``dout`` the same way. Both refuse non-real arrays
(``TypeError``) and NaN or inf (``ValueError``), naming the argument; a value
that only becomes inf in the cast (float64 1e300 into float32) is refused too.
``backward`` checks ``dout`` once (exact shape, no broadcasting); the ops it
then calls do not check the intermediate gradients again.
"""
from .attention import MultiHeadAttention, SelfAttention
from .base import Layer, LoadResult, Model, xavier_uniform
from .basic import Embedding, Linear
from .decoder_block import DecoderAttention, DecoderBlock
from .mlp import GatedFeedForward, SiLU
from .moe import MoEFeedForward
from .norms import RMSNorm
from .tied import TiedLinear
from .lora import LoRALinear, adapter_grads, adapter_params, apply_lora, merge_lora
from .transformer import GELU, Dropout, FeedForward, LayerNorm, Sequential, TransformerBlock

__all__ = ["Layer", "Model", "LoadResult", "SelfAttention", "MultiHeadAttention", "Linear", "Embedding",
           "xavier_uniform", "LayerNorm", "GELU", "Dropout", "Sequential", "FeedForward",
           "TransformerBlock", "SiLU", "GatedFeedForward", "RMSNorm", "MoEFeedForward",
           "TiedLinear", "LoRALinear", "apply_lora", "merge_lora", "adapter_params",
           "adapter_grads", "DecoderAttention", "DecoderBlock"]
