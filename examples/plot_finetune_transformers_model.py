"""
Fine-tune a transformers model in qkvnp, beside PyTorch
=======================================================

A Hugging Face ``Qwen3ForCausalLM`` from a small config, random weights (no download),
float64, tied head, goes into a :class:`qkvnp.Decoder` by :func:`qkvnp.interop.from_hf`
(:doc:`/families`). Both train on the same batches with the same AdamW: qkvnp by its
hand-derived backward, PyTorch by autograd. Without the two, qkvnp trains alone.
"""
import inspect

import numpy as np

import qkvnp
from qkvnp.interop import from_hf
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
from qkvnp.optim import AdamW

settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # AdamW's, both sides
try:
    import torch
    import transformers
except ImportError:
    torch = None
    print("transformers or PyTorch is not installed: qkvnp trains alone, no comparison")
    model = qkvnp.Decoder(qkvnp.DecoderConfig.qwen3(vocab_size=256, emb_dim=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, hidden_dim=128, tie_embeddings=True), rng=0)
else:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        tie_word_embeddings=True, attn_implementation="eager")
    hf_model = transformers.Qwen3ForCausalLM(config).to(torch.float64)
    model = from_hf(hf_model, dtype=np.float64)
    torch_optimizer = torch.optim.AdamW(hf_model.parameters(), **settings)

# %%
# The text is the optimizer's own source, byte by byte, in 30 batches of 8 rows of 33
# bytes; the same AdamW steps on both sides, on the mean cross-entropy of the next
# byte. Step 1 runs the loaded weights: its logits are compared first.
text = np.frombuffer(inspect.getsource(qkvnp.optim).encode(), np.uint8).astype(np.int64)
batches = text[np.random.default_rng(0).integers(0, text.size - 33, (30, 8, 1)) + np.arange(33)]
optimizer, ours, theirs = AdamW(model.params, **settings), [], []
for inputs, targets in ((batch[:, :-1], batch[:, 1:]) for batch in batches):  # (8, 32) each
    model.zero_grad()
    logits = model.forward(inputs)  # (8, 32) -> (8, 32, 256)
    loss, cache = cross_entropy_forward(logits, targets)
    model.backward(cross_entropy_backward(1.0, cache))  # hand-derived, into model.grads
    optimizer.step(model.grads)
    ours.append(float(loss))
    if torch is not None:
        torch_optimizer.zero_grad()
        logits_t = hf_model(torch.from_numpy(inputs)).logits  # (8, 32, 256)
        loss_t = torch.nn.functional.cross_entropy(logits_t.mT, torch.from_numpy(targets))
        loss_t.backward()  # autograd
        torch_optimizer.step()
        if not theirs:  # step 1 runs the loaded weights
            first_gap = np.abs(logits - logits_t.detach().numpy()).max()
        theirs.append(loss_t.item())
print(f"qkvnp's loss: {ours[0]:.4f} at step 1, {ours[-1]:.4f} at step {len(ours)}")
if theirs:
    print("logits at step 1, largest difference from transformers:", first_gap)
    gap = np.abs(np.subtract(ours, theirs))  # (30,)
    print("losses, largest difference from PyTorch:", gap[:10].max(), "(steps 1-10),", gap.max())

# %%
# The curves lie on each other (the same weights, batches and AdamW; derived gradients
# equal to autograd's) up to rounding: transformers runs RoPE, RMSNorm and softmax in
# float32 even here, and each step feeds that into the weights: the gap grows with steps.
try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
else:
    figure, axis = plt.subplots(figsize=(6, 3.5), constrained_layout=True)
    axis.plot(range(1, 31), ours, "o-", label="qkvnp (derived backward)")
    axis.plot(range(1, len(theirs) + 1), theirs, "x--", label="PyTorch (autograd)")
    axis.set(xlabel="step", ylabel="training loss (nats per byte)")
    axis.legend()
    plt.show()
