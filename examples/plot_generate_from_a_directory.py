"""
Run a model directory with NumPy alone
======================================

A download from the Hugging Face hub is a directory: ``config.json``,
``model.safetensors`` and a tokenizer. Here transformers writes one
(``save_pretrained``) for a small Llama with random weights, beside a
byte-level BPE trained on a few lines (nothing is downloaded);
:func:`qkvnp.interop.from_hf` reads it with qkvnp's own safetensors reader and
:func:`qkvnp.generate` continues a prompt (:doc:`/checkpoints`). Without
transformers, qkvnp writes the directory itself (:func:`qkvnp.interop.save_hf`).
"""
import tempfile
from pathlib import Path
import numpy as np

import qkvnp
from qkvnp.interop import from_hf, load_tokenizer, save_hf

workdir = tempfile.TemporaryDirectory()  # removed at exit
directory = Path(workdir.name) / "tiny-llama"
directory.mkdir()
text = "Attention mixes values by the match of queries and keys. " * 40
try:
    import tokenizers
    import torch
    import transformers
except ImportError:
    hf_model, tokenizer = None, None
    print("transformers, tokenizers or PyTorch is not installed: qkvnp writes the directory")
    save_hf(qkvnp.Decoder(qkvnp.DecoderConfig.llama3(vocab_size=256, emb_dim=32, num_layers=2,
            num_heads=4, num_kv_heads=2, hidden_dim=48, context_length=64), rng=0), directory)
else:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(directory / "tokenizer.json"))
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, attn_implementation="eager")
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(str(directory))
print(sorted(path.name for path in directory.iterdir()))

# %%
# qkvnp reads the directory: the config, then each tensor memory-mapped and
# converted straight into the model, in float32 as stored. With a tokenizer the
# prompt is text; the continuation is greedy, the model's most likely token.
model = from_hf(directory, dtype=np.float32)
encode = load_tokenizer(directory).encode if tokenizer else lambda s: list(s.encode())
prompt = np.array([encode("Attention mixes")])  # (1, T)
tokens, logits = qkvnp.generate(model, prompt, 12, return_logits=True)  # (1, T + 12), (1, 12, V)
if tokenizer:
    print("continuation:", repr(load_tokenizer(directory).decode(tokens[0, prompt.shape[1]:])))
if hf_model is not None:
    expected = hf_model.generate(torch.from_numpy(prompt), max_new_tokens=12, do_sample=False,
                                 attention_mask=torch.ones(prompt.shape, dtype=torch.long))
    print("the same tokens as transformers' greedy generate:",
          np.array_equal(tokens, expected.numpy()))

# %%
# Random weights write no sentence; what the figure shows is how sure the model
# was of each token it chose: the softmax probability of the argmax, step by step.
shifted = logits[0] - logits[0].max(axis=-1, keepdims=True)  # (12, V)
chosen = 1 / np.exp(shifted).sum(axis=-1)  # the argmax's probability at each step
try:
    import matplotlib.pyplot as plt
except ImportError:  # the plot is optional
    plt = None
else:
    figure, axis = plt.subplots(figsize=(6, 3), constrained_layout=True)
    axis.bar(range(1, 13), chosen)
    axis.set(xlabel="new token", ylabel="probability of the chosen token")
    plt.show()
