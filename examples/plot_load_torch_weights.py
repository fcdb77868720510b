"""
Loading PyTorch's and the book's weights
========================================

:func:`qkvnp.interop.from_torch` copies a PyTorch ``state_dict`` into a qkvnp
layer, and :func:`qkvnp.interop.to_torch` gives the arrays back under
PyTorch's names. First the multi-head layer of chapter 3 of Sebastian
Raschka's *Build a Large Language Model (From Scratch)* (Manning 2024),
with the weights ``torch.manual_seed(123)`` gives it, stored as numpy arrays
in ``qkvnp.apps.demo`` so that this part runs without PyTorch.
"""
import numpy as np

import qkvnp
from qkvnp.apps.demo import BOOK_MHA_STATE, INPUTS
from qkvnp.interop import from_torch, to_torch

mha = qkvnp.MultiHeadAttention(embed_dim=2, num_heads=2, qdim=3, kdim=3, vdim=3,
                               qkv_bias=False, out_bias=True)
from_torch(mha, BOOK_MHA_STATE, "book.MultiHeadAttention")
context = mha.forward(np.stack([INPUTS, INPUTS]), is_causal=True)  # (2, 6, 3) -> (2, 6, 2)
print(context[0].round(4))  # the book prints [0.3190, 0.4858] first

# %%
# The book's attention weights over "Your journey starts with one step",
# head by head, from the loaded weights: each token attends to itself and
# the tokens before it.
_, weights = mha.forward(np.stack([INPUTS, INPUTS]), is_causal=True,
                         return_weights=True)  # (2, H, 6, 6)
words = "Your journey starts with one step".split()

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axes = plt.subplots(1, 2, figsize=(10, 4.4), constrained_layout=True)
    for h, axis in enumerate(axes):
        image = axis.imshow(weights[0, h], cmap="viridis", vmin=0, vmax=1)
        axis.set_xticks(range(6), words, rotation=45)
        axis.set_yticks(range(6), words)
        axis.set_title(f"head {h} of the book's MultiHeadAttention")
    figure.colorbar(image, ax=axes, label="attention weight")
    plt.show()

# %%
# PyTorch's own ``nn.MultiheadAttention``, and back. Two conventions differ:
# qkvnp stores weights for ``x @ W`` (PyTorch's transposed), and a boolean
# mask is True where a query *may attend* (``nn.MultiheadAttention``'s is
# True where it may not). This part needs PyTorch.
try:
    import torch
except ImportError:
    torch = None
    print("PyTorch is not installed: skipping the comparison with nn.MultiheadAttention")

if torch is not None:
    torch.manual_seed(0)
    torch_mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    mha = qkvnp.MultiHeadAttention(16, 4)
    from_torch(mha, torch_mha.state_dict(), "torch.nn.MultiheadAttention")

    x = np.random.default_rng(0).standard_normal((2, 5, 16))  # (B, T, E)
    causal = np.tril(np.ones((5, 5), bool))  # qkvnp: True = may attend
    y = mha.forward(x, attn_mask=causal)  # (B, T, E)
    x_t = torch.from_numpy(x)
    y_torch, _ = torch_mha(x_t, x_t, x_t, attn_mask=torch.from_numpy(~causal))  # True = blocked
    print("largest difference from PyTorch:", float(np.abs(y - y_torch.detach().numpy()).max()))

    state = to_torch(mha, "torch.nn.MultiheadAttention")
    torch_mha.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    print("round trip:", sorted(state))
