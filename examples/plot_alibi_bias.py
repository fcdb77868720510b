"""
ALiBi's score bias, head by head
================================

Each head penalises the distance between query and key at its own slope,
the paper's geometric sequence, instead of adding position embeddings.
"""
import numpy as np

from qkvnp.ops.positions import alibi_bias, alibi_slopes

H, T = 8, 16
slopes = alibi_slopes(H)  # the paper's geometric sequence 2^(-8h/H)
bias = alibi_bias(T, T, slopes)  # (H, T, T): -slope_h * |i - j|
causal = np.tril(np.ones((T, T), bool))  # a decoder sees j <= i only
shown = np.where(causal, bias, np.nan)  # (H, T, T)

print("slopes:", " ".join(f"{s:.4g}" for s in slopes))
print("head 0, query 5, keys 0..5:", bias[0, 5, :6].round(3).tolist())
print("head 7, query 5, keys 0..5:", bias[7, 5, :6].round(3).tolist())
# the bias depends only on i - j: every diagonal is constant
assert all(np.allclose(np.diagonal(bias[h], -d), -slopes[h] * d) for h in range(H) for d in range(T))

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axes = plt.subplots(2, 4, figsize=(12, 6), constrained_layout=True)
    for h, axis in enumerate(axes.flat):
        image = axis.imshow(shown[h], cmap="viridis", vmin=np.nanmin(shown), vmax=0)
        axis.set_title(f"head {h}, slope {slopes[h]:.3g}")
        axis.set_xlabel("key j")
        axis.set_ylabel("query i")
    figure.colorbar(image, ax=axes, label="bias added to the score")
    figure.suptitle("ALiBi: -slope * (i - j), no position embeddings")
    plt.show()
