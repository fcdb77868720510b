"""
Train a tiny byte-level GPT for about a minute and read what it writes
======================================================================

The book's chapter 4 GPT, in NumPy, every gradient hand-derived: a
two-block model of width 64 learns the standard library's Python sources
byte by byte, and writes some after each stretch of training. The bigram
baseline (byte pair counts, add-one smoothing) is the bar: a model that
reads its context must go below it.
"""
import qkvnp
from qkvnp.training.text import TextConfig, train_text

config = TextConfig(steps=600, eval_every=200, sample_every=200, sample_length=160,
                    corpus_bytes=500_000)
model, history, _ = train_text(config)

prompt = b"def "
import numpy as np  # noqa: E402

idx = np.frombuffer(prompt, dtype=np.uint8).astype(np.int64)[None]
out = qkvnp.generate(model.eval(), idx, 200, temperature=0.8, top_k=40, rng=0)
print(bytes(out[0].astype(np.uint8).tolist()).decode("utf-8", "replace"))
