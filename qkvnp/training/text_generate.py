"""Continue a prompt with a model of ``train --task text`` (``generate --resume CKPT``).

Shape key: T prompt tokens (bytes; a fine-tune's, its model's tokenizer's), V vocabulary.

The checkpoint holds its configuration; the prompt is encoded as UTF-8
bytes, cropped to the model's context, and continued by :func:`qkvnp.generate`.
The command (:mod:`qkvnp.apps.generate`, which defines the options) comes
here for a checkpoint.
"""
import argparse
import sys

import numpy as np

from ..models.generation import generate
from ..interop.tokenizer import ByteTokenizer
from .text import load_text_checkpoint, text_config_of
from .text_init import init_tokenizer

__all__ = ["run"]


def run(args):
    """Print the prompt's continuation; return the exit code.

    A file that is not a text checkpoint (another task's, damaged) is one
    ``error:`` line naming it and the entry, exit status 2.
    """
    try:
        model, checkpoint = load_text_checkpoint(args.resume)
        tokenizer = ByteTokenizer()
        if checkpoint.config.get("init") is not None:  # a fine-tune: its model's tokenizer
            tokenizer = init_tokenizer(text_config_of(checkpoint.config)[0], model.vocab_size)
    except (FileNotFoundError, ValueError, ImportError) as exc:  # CheckpointError is one
        print(f"error: --resume: {exc}", file=sys.stderr)
        return 2
    try:
        text = "\n" if args.prompt is None else args.prompt
        prompt = tokenizer.encode(text)
        if not prompt:
            raise ValueError("--prompt must not be empty")
        idx = np.array(prompt, dtype=np.int64)[None, -model.context_length:]
        temperature = 0.8 if args.temperature is None else args.temperature
        out = generate(model.eval(), idx, args.max_new_tokens, temperature=temperature,
                       top_k=args.top_k, top_p=args.top_p, rng=args.seed)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from None
    continuation = tokenizer.decode(out[0, idx.shape[1]:].tolist())
    sys.stdout.write(text + continuation + "\n")
    return 0
