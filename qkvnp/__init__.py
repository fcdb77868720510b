"""qkvnp: Q/K/V attention in pure NumPy, with hand-derived backward passes.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim.

``import qkvnp`` imports numpy and nothing else; scipy is imported the first
time a softmax runs, and PyTorch never.
"""
from . import functional, interop
from .ops import positions, variants
from .functional import scaled_dot_product_attention, softmax
from .kernels import get_num_threads, num_threads, set_num_threads
from .layers.kv_cache import KVCache
from .models.generation import generate
from .models.gpt import GPTModel
from .models.decoder import Decoder
from .models.decoder_config import DecoderConfig
from .layers import (GELU, Dropout, Embedding, FeedForward, GatedFeedForward, LayerNorm, Linear,
                     Model, MultiHeadAttention, RMSNorm, SelfAttention, Sequential, SiLU,
                     TransformerBlock)

__version__ = "0.2.0"

__all__ = [
    "functional",
    "interop",
    "positions",
    "variants",
    "softmax",
    "scaled_dot_product_attention",
    "SelfAttention",
    "MultiHeadAttention",
    "Linear",
    "Embedding",
    "Model",
    "KVCache",
    "LayerNorm",
    "RMSNorm",
    "GELU",
    "Dropout",
    "Sequential",
    "FeedForward",
    "SiLU",
    "GatedFeedForward",
    "TransformerBlock",
    "GPTModel",
    "Decoder",
    "DecoderConfig",
    "generate",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "__version__",
]
