"""
Dropout with a replayed mask
============================

Dropout zeroes attention weights at random during training and scales the
kept ones by ``1 / (1 - p)``. A drawn mask can be handed back: the same mask
gives the same output, which is how a gradient is checked through dropout
and how qkvnp is compared with PyTorch.
"""
import numpy as np

import qkvnp
from qkvnp import functional as F

rng = np.random.default_rng(0)
x = rng.standard_normal((1, 4, 6, 8))  # (B, H, T, D)

out, cache = F.attention_forward(x, x, x, dropout_p=0.25, rng=7)  # (B, H, T, D)
mask = cache.dropout_mask  # (B, H, T, T) bool, True = keep
print("kept:", f"{mask.mean():.0%}", "of the weights")

again, _ = F.attention_forward(x, x, x, dropout_p=0.25, dropout_mask=mask)
print("the replayed mask gives the same output:", np.array_equal(out, again))

# The mask, head by head: white entries are kept (and scaled by 1 / (1 - p)),
# dark ones dropped; a replay hands the forward this very array.

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axes = plt.subplots(1, 4, figsize=(12, 3.4), constrained_layout=True)
    for h, axis in enumerate(axes):
        axis.imshow(mask[0, h], cmap="gray", vmin=0, vmax=1)
        axis.set_title(f"head {h}: {mask[0, h].mean():.0%} kept")
        axis.set_xlabel("key")
        axis.set_ylabel("query")
    figure.suptitle("A dropout mask on the attention weights (p = 0.25), drawn once and replayed")
    plt.show()

# %%
# The same seed draws the same mask on every path, so the fast and tiled
# kernels agree with the reference ops under dropout too.
mha = qkvnp.MultiHeadAttention(8, 2, rng=0, dropout=0.25)  # training mode
xs = rng.standard_normal((2, 5, 8))  # (B, T, E)
outs = {}
for impl in ("reference", "fast", "tiled"):
    mha.impl = impl
    outs[impl] = mha.forward(xs, rng=3)  # (B, T, E)
print("fast vs reference:", float(np.abs(outs["fast"] - outs["reference"]).max()))
print("tiled vs reference:", float(np.abs(outs["tiled"] - outs["reference"]).max()))

# %%
# Checking the gradient through dropout: hold the mask fixed (a seed draws
# the same mask on every forward of the check).
from qkvnp.gradcheck import check_layer

mha.impl = "auto"
print(check_layer(mha, xs, forward_kwargs={"rng": 3}).table())

# %%
# In evaluation mode no mask is drawn.
mha.eval()
print("eval mode, drawn dropout off:", np.array_equal(mha.forward(xs, rng=3),
                                                      mha.forward(xs, rng=4)))
