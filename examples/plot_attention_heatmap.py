"""
The attention weights of a six-token sentence
=============================================

The sentence "Your journey starts with one step" as six 3-d embeddings, and
the query, key and value matrices of Sebastian Raschka's *Build a Large
Language Model (From Scratch)* (Manning 2024), chapter 3. Row ``i`` of the
weights is how token ``i`` mixes the values of every token; each row sums to 1.
"""
import numpy as np

import qkvnp
from qkvnp.apps.demo import INPUTS, W_KEY, W_QUERY, W_VALUE, WORDS

layer = qkvnp.SelfAttention(3, 2)
layer.load_state_dict({"W_query": W_QUERY, "W_key": W_KEY, "W_value": W_VALUE})
context, weights = layer.forward(INPUTS, return_weights=True)  # (T, D), (T, T)

print("context vectors (T, D):\n", context.round(4))
print("row sums:", weights.sum(axis=-1).round(6))

# %%
# The same with a causal mask: token ``i`` attends to tokens ``0..i`` only,
# so the upper triangle is 0 and each row still sums to 1.
_, causal = layer.forward(INPUTS, is_causal=True, return_weights=True)  # (T, T)

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), constrained_layout=True)
    for ax, w, title in zip(axes, (weights, causal), ("all tokens", "causal")):
        image = ax.imshow(w, cmap="viridis", vmin=0, vmax=w.max())
        fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
        ax.set_xticks(range(6), WORDS, rotation=45)
        ax.set_yticks(range(6), WORDS)
        ax.set_xlabel("key (attended token)")
        ax.set_title(title)
        for i in range(6):
            for j in range(6):
                ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if w[i, j] < 0.6 * w.max() else "black")
    axes[0].set_ylabel("query (attending token)")
    plt.show()
