"""
A sliding-window decoder with a bounded KV cache
================================================

With ``window=(W - 1, 0)`` (Mistral's window W) each token sees itself and the
W - 1 before it, so the cache keeps only the last W - 1 keys between steps.
"""
import numpy as np

import qkvnp

E, H, W, STEPS = 32, 4, 16, 2000
layer = qkvnp.MultiHeadAttention(E, H, num_kv_heads=2, rng=0, rope=True, window=(W - 1, 0))
rng = np.random.default_rng(1)
tokens = rng.standard_normal((1, STEPS, E))  # (B, T, E)

cache = qkvnp.KVCache()
outputs, sizes = [], []
for t in range(STEPS):
    outputs.append(layer.forward(tokens[:, t:t + 1], kv_cache=cache))  # (1, 1, E)
    sizes.append(cache.nbytes)
decoded = np.concatenate(outputs, axis=1)  # (1, STEPS, E)

print(f"decoded {STEPS} tokens; cache holds {len(cache)} keys, first position {cache.start}")
print(f"cache bytes after 10, 100, 1000, {STEPS} steps:",
      sizes[9], sizes[99], sizes[999], sizes[-1])
assert len(set(sizes[W:])) == 1, "the cache grew"

# the same outputs as one forward over the whole sequence with the window
full = layer.forward(tokens, is_causal=True)
print(f"full windowed forward on the {layer.last_dispatch.path} path "
      f"({layer.last_dispatch.reason})")
error = np.abs(decoded - full).max()
print(f"largest difference, token by token vs full forward: {error:.2e}")
assert error < 1e-12

# chunks of any size give the same too
cache = qkvnp.KVCache()
chunks = [layer.forward(tokens[:, a:a + 37], kv_cache=cache) for a in range(0, STEPS, 37)]
print(f"chunks of 37: largest difference {np.abs(np.concatenate(chunks, 1) - full).max():.2e}")

# %%
# The cache's bytes stop growing at the window, where a full cache grows
# with every token.

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axis = plt.subplots(figsize=(7, 4), constrained_layout=True)
    steps = np.arange(1, STEPS + 1)
    axis.plot(steps, np.asarray(sizes) / 1024, lw=2, label=f"window of {W}: the last {W - 1} keys")
    axis.plot(steps, sizes[0] * steps / 1024, "--", label="no window: every key (one key's bytes x t)")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("tokens decoded")
    axis.set_ylabel("KV cache (KiB)")
    axis.set_title("A sliding window bounds the KV cache")
    axis.legend()
    plt.show()
