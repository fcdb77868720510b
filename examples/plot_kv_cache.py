"""
Decoding with a KV cache
========================

A decoder produces one token at a time. Recomputing every key and value at
each step is wasteful: :class:`qkvnp.KVCache` keeps the keys and values of
the tokens already seen, and each step projects only the new token. The
outputs equal those of one causal forward over the whole sequence.
"""
import numpy as np

import qkvnp

rng = np.random.default_rng(0)
B, T, E, H = 2, 7, 16, 4
x = rng.standard_normal((B, T, E))  # (B, T, E)
mha = qkvnp.MultiHeadAttention(E, H, rng=0)
mha.eval()  # decoding is inference

full = mha.forward(x, is_causal=True)  # (B, T, E): every token at once

cache = qkvnp.KVCache()
steps = []
for t in range(T):
    steps.append(mha.forward(x[:, t:t + 1], kv_cache=cache))  # (B, 1, E)
decoded = np.concatenate(steps, axis=1)  # (B, T, E)

print("largest difference, cached steps against one causal forward:",
      float(np.abs(decoded - full).max()))

# %%
# Several new tokens at once (a prompt, then one token at a time) work the
# same way: the new queries see the cached keys and each other causally.
cache.reset()
prompt = mha.forward(x[:, :4], kv_cache=cache)  # (B, 4, E)
rest = [mha.forward(x[:, t:t + 1], kv_cache=cache) for t in range(4, T)]
print("prompt + steps equal too:",
      np.allclose(np.concatenate([prompt, *rest], axis=1), full, rtol=0, atol=1e-12))

# %%
# A cache is for inference: asking for a backward after a cached step is an
# error, not a silently wrong gradient.
try:
    mha.backward(rng.standard_normal((B, 1, E)))
except RuntimeError as error:
    print("RuntimeError:", error)

# %%
# What each step sees: step t's query attends to the t + 1 keys cached so
# far, the rows of the causal forward's weights (head 0 of the first input).
_, weights = mha.forward(x, is_causal=True, return_weights=True)  # (B, H, T, T)

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axis = plt.subplots(figsize=(5, 4.5), constrained_layout=True)
    image = axis.imshow(np.where(np.tril(np.ones((T, T), bool)), weights[0, 0], np.nan),
                        cmap="viridis")
    axis.set_xlabel("cached key j")
    axis.set_ylabel("decoding step t (its query)")
    axis.set_title("Step t reads the keys 0..t of the cache")
    figure.colorbar(image, ax=axis, label="attention weight")
    plt.show()
