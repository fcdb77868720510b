"""Fine-tune a model one has (``train --task text --init DIR``): a Hugging Face directory or llm.c file.

Shape key: V the model's vocabulary, T context, r the adapters' rank.

``--init`` names what the run starts from, read as ``generate --model``
reads it (:mod:`qkvnp.apps.generate`): a directory through
:func:`qkvnp.interop.from_hf` and its ``tokenizer.json``
(:class:`qkvnp.interop.Tokenizer`; bytes for a byte model of vocabulary
256 without one), an llm.c ``.bin`` through :func:`qkvnp.interop.load_llmc`
(GPT-2's vocabulary: its tokens come from ``tokenizer.json`` beside the file,
else refused; a byte model's from bytes). The text task's loop, schedule,
evaluations and checkpoints are the same (:mod:`qkvnp.training.text`);
``--context`` is the training window (at most the model's context).

Full fine-tuning trains every parameter. ``--lora-rank r`` puts low-rank
adapters (:func:`qkvnp.layers.apply_lora`, drawn from ``--seed``) on the
linears ``--lora-targets`` names (default ``q_proj,v_proj``) and trains
only them. ``--save-hf OUT`` writes the result, adapters merged
(:func:`qkvnp.layers.merge_lora`), as a directory transformers loads
(:func:`qkvnp.interop.save_hf`), with the tokenizer's files copied.

A checkpoint records ``--init`` (``meta/config``) and the SHA-256 of the
files read from it (``init_sha256``: ``config.json``, the safetensors and
their index, ``tokenizer.json``; or the ``.bin``); a resume against files
that changed is refused before anything is trained.

The bigram baseline of the header counts the token pairs of the training
split (add-one smoothing over ``V``), as the byte task's does over 256.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

__all__ = ["DEFAULT_LORA_TARGETS", "check_init_options", "describe_init", "init_files", "init_digest", "load_init_model",
           "init_tokenizer", "trainable_params", "token_bigram_loss", "check_save_hf",
           "write_hf"]

#: The linears ``--lora-rank`` adapts without ``--lora-targets`` (peft's default for Llama).
DEFAULT_LORA_TARGETS = "q_proj,v_proj"
_DIRECTORY_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
                    "tokenizer.json")
# what --save-hf copies besides the weights and config.json, when --init has them
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")


def check_init_options(config):
    """Refuse the options that would build a model (``ValueError`` naming the first): with
    ``init`` the model's configuration is read from its files."""
    refused = [name for name, value in (("family", config.family), ("kv_heads", config.kv_heads),
                                        ("window", config.window), ("softcap", config.softcap))
               if value is not None] + [name for name in ("rope", "dropout")
                                        if getattr(config, name)]
    if refused:
        raise ValueError(f"--{refused[0].replace('_', '-')} is not an option of --init: the "
                         f"model's configuration is {config.init}'s")
    if config.lora_targets is not None and config.lora_rank is None:
        raise ValueError("--lora-targets names the linears --lora-rank adapts: give --lora-rank")


def describe_init(config, model, tokenizer):
    """The header's model line of an ``init`` run."""
    lora = "" if config.lora_rank is None else (
        f", LoRA rank {config.lora_rank} on {config.lora_targets or DEFAULT_LORA_TARGETS}")
    return (f"{type(model).__name__}({model.config.family}, vocab {model.vocab_size}) from "
            f"{config.init}{lora}; {tokenizer!r}")


def init_files(path):
    """The files of ``path`` a run reads (sorted): a directory's config, weights, index and
    tokenizer, or the file itself. ``FileNotFoundError`` if there are none."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init {path} does not exist (a model directory or an llm.c "
                                ".bin file)")
    names = [n for n in os.listdir(path) if n in _DIRECTORY_FILES
             or (n.startswith("model-") and n.endswith(".safetensors"))]
    if "config.json" not in names:
        raise FileNotFoundError(f"--init {path} has no config.json: not a Hugging Face model "
                                "directory")
    return [os.path.join(path, n) for n in sorted(names)]


def init_digest(path):
    """The SHA-256 (hex) of :func:`init_files`' names and bytes, in order."""
    digest = hashlib.sha256()
    for file in init_files(path):
        digest.update(os.path.basename(file).encode("utf-8") + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_init_model(config):
    """The model of ``config.init`` in ``config.dtype``, with its adapters if ``lora_rank``.

    Raises ``ValueError`` naming ``--context`` if the training window exceeds the model's.
    """
    from ..interop import from_hf, load_llmc
    from ..layers.lora import apply_lora

    init_files(config.init)  # refuses a missing path or a directory without config.json
    dtype = np.dtype(config.dtype)
    model = from_hf(config.init, dtype=dtype) if os.path.isdir(config.init) \
        else load_llmc(config.init, dtype=dtype)
    if config.context > model.context_length:
        raise ValueError(f"--context {config.context} exceeds the context of --init "
                         f"{config.init} ({model.context_length} tokens)")
    if config.lora_rank is not None:
        targets = (config.lora_targets or DEFAULT_LORA_TARGETS).split(",")
        apply_lora(model, [t.strip() for t in targets if t.strip()], config.lora_rank,
                   rng=np.random.default_rng(config.seed + 3))
    return model


def init_tokenizer(config, vocab_size):
    """The tokenizer of ``config.init``: its directory's (or the ``.bin``'s directory's)
    ``tokenizer.json``, or bytes for a byte model; ``FileNotFoundError`` otherwise."""
    from ..interop import ByteTokenizer, load_tokenizer

    directory = config.init if os.path.isdir(config.init) else os.path.dirname(config.init)
    if os.path.isfile(os.path.join(directory or ".", "tokenizer.json")):
        tokenizer = load_tokenizer(directory or ".")
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer of --init {config.init} has {tokenizer.vocab_size} "
                             f"ids, more than the model's vocabulary ({vocab_size})")
        return tokenizer
    if vocab_size == 256:
        return ByteTokenizer()
    raise FileNotFoundError(f"--init {config.init} has no tokenizer.json beside it and is no "
                            f"byte model (vocabulary {vocab_size}): its text cannot be tokenized")


def trainable_params(model, config):
    """What the optimizer steps: the adapters with ``lora_rank``, else every parameter."""
    from ..layers.lora import adapter_params

    return adapter_params(model) if config.lora_rank is not None else model.params


def token_bigram_loss(train, inputs, targets, vocab_size):
    """Mean ``-ln p(target | input)`` of a token bigram model fitted on ``train``.

    ``p(b | a) = (n_ab + 1) / (n_a + V)``: the byte task's add-one bigram, with
    the pair counts kept sparse (a ``V x V`` table of a real vocabulary would
    not fit).
    """
    V = int(vocab_size)
    pairs = np.unique(train[:-1].astype(np.int64) * V + train[1:], return_counts=True)
    firsts = np.bincount(train[:-1].astype(np.int64), minlength=V)  # (V,)
    keys = inputs.astype(np.int64).ravel() * V + targets.ravel()
    where = np.minimum(np.searchsorted(pairs[0], keys), len(pairs[0]) - 1)
    n_ab = np.where(pairs[0][where] == keys, pairs[1][where], 0)
    p = (n_ab + 1.0) / (firsts[inputs.ravel()] + V)
    return float(-np.log(p).mean())


def check_save_hf(path):
    """Refuse an ``--save-hf`` that cannot be written (before training): a file, or a missing parent."""
    if path is None:
        return None
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save-hf {path} is a file; it must name a directory to write")
    if not os.path.isdir(parent):
        raise ValueError(f"--save-hf {path}: its parent directory {parent} does not exist")
    return path


def write_hf(model, config, path):
    """Write ``model`` (adapters merged, in place) to ``path`` as transformers loads it, and
    copy ``--init``'s tokenizer files beside it. Returns the names merged."""
    from .._io import atomic_write
    from ..interop import save_hf
    from ..layers.lora import merge_lora

    merged = merge_lora(model)
    save_hf(model, path)
    directory = None if config.init is None else (
        config.init if os.path.isdir(config.init) else os.path.dirname(config.init))
    for name in _TOKENIZER_FILES if directory else ():
        source = os.path.join(directory, name)
        if os.path.isfile(source):
            with open(source, "rb") as f, atomic_write(os.path.join(path, name)) as out:
                out.write(f.read())
    return merged
