"""
A GPT with today's attention: GQA, RoPE and a sliding window
============================================================

The book's ``GPTModel`` with the attention of recent models in every block:
two key/value heads for four query heads, rotary positions, a causal window
of 8 tokens and soft-capped scores. It learns sequences that repeat with a
period of 4 (each token equals the one 4 before it, so the window suffices),
then writes through one rolling KV cache per block.
"""
import numpy as np

import qkvnp
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
from qkvnp.optim import AdamW

V, C, PERIOD, WINDOW = 16, 32, 4, 8
model = qkvnp.GPTModel(V, C, 32, 4, 2, rng=0, num_kv_heads=2, rope=True,
                       window=(WINDOW - 1, 0), softcap=30.0)
print(model.trf_blocks[0].att)
rng = np.random.default_rng(1)


def batch(size):
    """Sequences of C + 1 tokens, each the token PERIOD before it."""
    start = rng.integers(0, V, size=(size, PERIOD))
    return np.tile(start, (1, C // PERIOD + 1))[:, :C + 1]  # (B, C + 1)


optimizer = AdamW(model.params, lr=3e-3, weight_decay=0.0)
losses = []
for step in range(1, 201):
    seqs = batch(16)
    model.zero_grad()
    logits = model.forward(seqs[:, :-1])  # (16, C) -> (16, C, V)
    loss, cache = cross_entropy_forward(logits, seqs[:, 1:])
    model.backward(cross_entropy_backward(1.0, cache))
    optimizer.step(model.grads)
    losses.append(float(loss))
    if step in (1, 50, 200):
        print(f"step {step:3d}  loss {float(loss):.3f}  (log V = {np.log(V):.3f})")

# %%
# The training loss: from log V (guessing) to near 0 once the model copies
# the token a period back, which the window of 8 keys covers.

try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
if plt is not None:
    figure, axis = plt.subplots(figsize=(7, 4), constrained_layout=True)
    axis.plot(np.arange(1, len(losses) + 1), losses, lw=1.5, label="training loss")
    axis.axhline(np.log(V), color="gray", ls="--", label=f"log V = {np.log(V):.2f}: a uniform guess")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats)")
    axis.set_title("A GPT with GQA, RoPE, a window and soft-capping learns the period")
    axis.legend()
    plt.show()

# Writing: the prompt holds one period; the model goes on repeating it
model.eval()
prompt = batch(1)[:, :PERIOD + 1]
out = qkvnp.generate(model, prompt, 40)
print("prompt", prompt[0].tolist(), "->", out[0, PERIOD + 1:].tolist())
repeats = np.array_equal(out[0, PERIOD:], out[0, :-PERIOD])
print(f"the continuation repeats the period: {repeats}")

# The caches roll: each block keeps at most WINDOW keys, positions keep counting
caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
steps = [model.decode(out[:, t:t + 1], caches) for t in range(C)]
print(f"after {C} tokens a cache holds {len(caches[0])} keys, first at position "
      f"{caches[0].start}")
full = model.forward(out[:, :C])
error = np.abs(np.concatenate(steps, axis=1) - full).max()
print(f"token by token through the rolling caches vs one forward: {error:.2e}")
assert error < 1e-12 and len(caches[0]) <= WINDOW
