"""Small Hugging Face model directories built by the tests themselves (never downloaded).

A byte-level BPE trained here with the ``tokenizers`` package on a short text,
saved as ``tokenizer.json`` beside a model that transformers' ``save_pretrained``
wrote (small config, random weights). Used by tests/apps and tests/training.
"""
import pytest

TEXT = ("The quick brown fox jumps over the lazy dog. Où est la gare? "
        "Numpy arrays hold numbers; attention mixes them.\n") * 30
END = "<|endoftext|>"


def train_tokenizer(directory, text=TEXT, vocab_size=300):
    """Train a byte-level BPE on ``text`` and save ``directory/tokenizer.json``; return it."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def hf_model(family, vocab_size, eos_id, seed=0):
    """A transformers model of ``family`` ("gpt2" or "llama"), random weights, float32, eval."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab_size,
                                         n_positions=64, bos_token_id=eos_id, eos_token_id=eos_id,
                                         attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=48,
                                          max_position_embeddings=64, bos_token_id=eos_id,
                                          eos_token_id=eos_id, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def model_dir(directory, family="gpt2", seed=0, tokenizer=True):
    """``directory`` holding a tokenizer trained here and a ``family`` model saved by
    transformers; returns ``(transformers model, tokenizers.Tokenizer or None)``."""
    directory.mkdir(parents=True, exist_ok=True)
    trained = train_tokenizer(directory) if tokenizer else None
    vocab = trained.get_vocab_size() if trained else 300
    eos = trained.token_to_id(END) if trained else 0
    model = hf_model(family, vocab, eos, seed)
    model.save_pretrained(str(directory))
    return model, trained
