"""
Grouped-query attention
=======================

With grouped-query attention (GQA) several query heads share one key/value
head: ``num_kv_heads=K`` key/value heads serve ``num_heads=H`` query heads,
query head ``h`` using key/value head ``h // (H / K)``. ``K = 1`` is
multi-query attention. Fewer key/value heads mean a smaller KV cache.

The check below: GQA equals ordinary multi-head attention whose key and
value heads were repeated, which is what PyTorch's ``enable_gqa=True`` does.
"""
import numpy as np

import qkvnp

rng = np.random.default_rng(1)
B, T, D = 2, 5, 4
H, K = 6, 2  # six query heads, two key/value heads: groups of three
query = rng.standard_normal((B, H, T, D))  # (B, H, T, D)
key = rng.standard_normal((B, K, T, D))  # (B, K, T, D)
value = rng.standard_normal((B, K, T, D))  # (B, K, T, D)

grouped = qkvnp.scaled_dot_product_attention(query, key, value, is_causal=True,
                                             enable_gqa=True)  # (B, H, T, D)
repeated = qkvnp.scaled_dot_product_attention(
    query, np.repeat(key, H // K, axis=1), np.repeat(value, H // K, axis=1),
    is_causal=True)  # (B, H, T, D)
print("GQA against repeated heads, largest difference:",
      float(np.abs(grouped - repeated).max()))

# %%
# Which key/value head each query head reads, and what fewer key/value
# heads save: the cache holds K heads of keys and values a token.

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    reads = np.zeros((H, K))
    reads[np.arange(H), np.arange(H) // (H // K)] = 1  # query head h reads h // (H / K)
    left.imshow(reads, cmap="Blues", aspect="auto")
    left.set_xticks(range(K))
    left.set_yticks(range(H))
    left.set_xlabel("key/value head")
    left.set_ylabel("query head")
    left.set_title(f"{H} query heads share {K} key/value heads")
    counts = [k for k in range(1, H + 1) if H % k == 0]  # the valid K: divisors of H
    right.bar([str(k) for k in counts], [2 * k * D * 8 for k in counts])  # keys and values, float64
    right.set_xlabel("key/value heads K (K = 1: multi-query; K = H: multi-head)")
    right.set_ylabel("KV cache bytes a token, a layer")
    right.set_title("Fewer key/value heads, a smaller cache")
    plt.show()

# %%
# The layer: ``W_key`` and ``W_value`` have ``K * D`` columns instead of
# ``H * D``, and the keys and values are never repeated in memory.
mha = qkvnp.MultiHeadAttention(embed_dim=24, num_heads=H, num_kv_heads=K, rng=0)
print({name: value.shape for name, value in mha.params.items()})

x = rng.standard_normal((B, T, 24))  # (B, T, E)
out = mha.forward(x, is_causal=True)  # (B, T, E)
dx = mha.backward(rng.standard_normal(out.shape))  # (B, T, E)
print("output", out.shape, "input gradient", dx.shape,
      "W_key gradient", mha.grads["W_key"].shape)

# %%
# Its gradients, checked numerically like every other layer's.
from qkvnp.gradcheck import check_layer

report = check_layer(qkvnp.MultiHeadAttention(8, 4, num_kv_heads=2, rng=0),
                     rng.standard_normal((1, 3, 8)), forward_kwargs={"is_causal": True})
print(report.table())
