"""
Train a tiny byte-level GPT and read what it writes
===================================================

The book's chapter 4 GPT in NumPy, every gradient derived by hand
(:doc:`/gpt_guide`): a two-block model of width 48 learns the standard
library's Python sources byte by byte. The bar is the bigram baseline (byte
pair counts of the training split, add-one smoothing), scored on the same
held-out positions: a model that reads its context must go below it. A few
hundred steps clear it; ``python -m qkvnp train --task text`` trains longer.
"""
import io
import re

import numpy as np

import qkvnp
from qkvnp.training.text import TextConfig, train_text

config = TextConfig(corpus_bytes=300_000, context=32, emb_dim=48, num_heads=4,
                    num_layers=2, steps=600, lr=5e-3, eval_every=100,
                    sample_every=600, sample_length=60)
log = io.StringIO()
model, history, _ = train_text(config, stream=log)
print(log.getvalue(), end="")  # the run's report: data, model, baseline, losses, a sample

# %%
# The held-out loss against the baseline's
# ----------------------------------------
# ``history`` rows are ``[step, train loss, held-out loss]``; the baseline is
# the one the run printed.

baseline = float(re.search(r"bigram baseline .* held-out loss (\d+\.\d+)", log.getvalue())[1])
steps, held = [row[0] for row in history], [row[2] for row in history]
print(f"held-out loss {held[0]:.3f} at step {steps[0]}, {held[-1]:.3f} at step {steps[-1]}; "
      f"bigram baseline {baseline:.3f}")
print("the held-out loss went down:", held[-1] < held[0])
print("the GPT ends below the bigram baseline:", held[-1] < baseline)

# %%
# What it writes
# --------------
# Sampling with temperature and top-k from a prompt of raw bytes, decoding
# through the blocks' KV caches.

prompt = b"def "
idx = np.frombuffer(prompt, dtype=np.uint8).astype(np.int64)[None]  # (1, 4)
out = qkvnp.generate(model.eval(), idx, 120, temperature=0.8, top_k=20, rng=0)  # (1, 124)
print(bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", "replace"))

try:
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
if plt is not None:
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(steps, held, "o-", label="GPT, held-out")
    ax.axhline(baseline, color="gray", linestyle="--", label="bigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.legend()
    fig.tight_layout()
