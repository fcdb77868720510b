"""Continue a prompt (``python -m qkvnp generate``): a model directory, an llm.c file, a checkpoint.

Shape key: T prompt tokens, V vocabulary.

What ``--model`` names decides how it is read:

=================================  ==============================================
``--model``                        model, tokens
=================================  ==============================================
a directory                        :func:`qkvnp.interop.from_hf` (``config.json``
                                   and safetensors); its ``tokenizer.json``
                                   (:class:`qkvnp.interop.Tokenizer`), or bytes for
                                   a byte model (vocabulary 256)
a ``.bin`` file                    :func:`qkvnp.interop.load_llmc`; ids in
                                   (``--ids``, or the prompt's bytes as ids) and
                                   ids out, unless ``--tokenizer DIR``
another file (or ``--resume``)     a checkpoint of ``train --task text``
                                   (:mod:`qkvnp.training.text_generate`)
=================================  ==============================================

Text is printed as it comes: each token's text once its characters are
whole (:class:`qkvnp.interop.StreamDecoder`). Greedy by default
(``--temperature 0``); ``--temperature``, ``--top-k``, ``--top-p`` and
``--seed`` are :func:`qkvnp.generate`'s. A text checkpoint keeps its
command's defaults (temperature 0.8).
"""
import argparse
import os
import sys

import numpy as np

__all__ = ["add_arguments", "run"]


def add_arguments(parser):
    """The options of ``generate``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH",
                        help="a Hugging Face model directory (config.json, model.safetensors, "
                             "tokenizer.json), an llm.c .bin file, or a text checkpoint")
    source.add_argument("--resume", metavar="CKPT", help="a checkpoint of train --task text")
    parser.add_argument("--prompt", default=None,
                        help="the text to continue (default: a newline)")
    parser.add_argument("--ids", default=None, metavar="'I J K'",
                        help="the prompt as token ids, instead of --prompt; ids are printed")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="the directory whose tokenizer.json to use (default: --model's)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap --prompt as a user message in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="how many tokens to write after the prompt (default 200)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="0 = greedy (default 0 for --model; 0.8 for a text checkpoint)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K likeliest tokens only (default: all)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="sample among the likeliest tokens holding P of the probability "
                             "(nucleus sampling, P in (0, 1]; default: all)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="the sampling generator's seed (default 0)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="the model's dtype for --model DIR or .bin (default float32)")


def _error(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


def _is_text_checkpoint(path):
    return os.path.isfile(path) and not path.endswith(".bin")


def _load_model(path, dtype):
    """The Decoder of a directory or an llm.c file (errors name the path)."""
    from ..interop import from_hf, load_llmc

    if os.path.isdir(path):
        return from_hf(path, dtype=dtype)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model {path} does not exist")
    return load_llmc(path, dtype=dtype)


def _tokenizer(args, model):
    """The tokenizer for the text in and out, or None for ids in and out."""
    from ..interop import load_tokenizer

    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    if os.path.isdir(args.model):
        file = os.path.join(args.model, "tokenizer.json")
        if os.path.isfile(file) or model.vocab_size == 256:
            return load_tokenizer(args.model, model.vocab_size)
        if args.ids is None:
            raise FileNotFoundError(f"--model {args.model} has no tokenizer.json and is no byte "
                                    "model (vocabulary 256): give --tokenizer DIR, or the "
                                    "prompt as token ids with --ids")
    return None


def _prompt_ids(args, tokenizer, vocab_size):
    """The prompt's ids (T,), checked against the vocabulary."""
    if args.ids is not None:
        if args.prompt is not None or args.chat:
            raise ValueError("--ids is the prompt: give it without --prompt and --chat")
        try:
            ids = [int(i) for i in args.ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--ids must be integers separated by spaces, got "
                             f"{args.ids[:80]!r}") from None
    elif args.chat:
        if tokenizer is None:
            raise ValueError("--chat needs a tokenizer with a chat template: give --tokenizer DIR")
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt or ""}])
        ids = tokenizer.encode(text)
    else:
        text = "\n" if args.prompt is None else args.prompt
        ids = tokenizer.encode(text, add_special_tokens=True) if tokenizer is not None \
            else list(text.encode("utf-8"))
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"the prompt's token ids must be in [0, {vocab_size}) (the model's "
                         f"vocabulary), got {bad[:5]}")
    return ids


def _stream(tokenizer, prompt_ids):
    """``(on_token, finish)``: print each new token's text (or id) as it comes."""
    from ..interop import StreamDecoder

    if tokenizer is None:
        def on_token(tokens):
            sys.stdout.write(f" {int(tokens[0])}")
            sys.stdout.flush()
        return on_token, lambda: sys.stdout.write("\n")
    decoder = StreamDecoder(tokenizer, prompt_ids)

    def on_text(tokens):
        sys.stdout.write(decoder.push(tokens[:1]))
        sys.stdout.flush()
    return on_text, lambda: sys.stdout.write(decoder.flush() + "\n")


def _run_model(args):
    from ..interop import MissingExtraError
    from ..models.generation import generate

    try:
        model = _load_model(args.model, np.dtype(args.dtype))
        tokenizer = _tokenizer(args, model)
    except (FileNotFoundError, MissingExtraError, ValueError, OSError) as exc:
        return _error(f"{exc}; nothing was generated")
    try:
        ids = _prompt_ids(args, tokenizer, model.vocab_size)
    except MissingExtraError as exc:
        return _error(exc)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from None
    idx = np.array(ids, dtype=np.int64)[None, -model.context_length:]  # (1, T)
    on_token, finish = _stream(tokenizer, idx[0].tolist())
    shown = (tokenizer.decode(idx[0]) if tokenizer is not None
             else " ".join(map(str, idx[0].tolist())))
    eos = tokenizer.eos_id if tokenizer is not None else None
    temperature = 0.0 if args.temperature is None else args.temperature
    try:
        options = dict(temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                       rng=args.seed, eos_id=eos if eos is not None and eos < model.vocab_size
                       else None)
        generate(model.eval(), idx, 0, **options)  # checks the options, generates nothing
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from None
    sys.stdout.write(shown)
    sys.stdout.flush()
    generate(model, idx, args.max_new_tokens, on_token=on_token, **options)
    finish()
    return 0


def run(args):
    """Print the prompt and its continuation, streamed; return the exit code.

    A model or tokenizer that cannot be read is one ``error:`` line naming
    it (exit 2); a bad option argparse's ``error:`` line under the usage (exit 2).
    """
    if args.resume is not None or _is_text_checkpoint(args.model):
        from ..training import text_generate

        if args.resume is None:
            args.resume = args.model
        if args.ids is not None or args.chat or args.tokenizer is not None:
            raise argparse.ArgumentError(None, "a text checkpoint's tokens are bytes: --ids, "
                                         "--chat and --tokenizer are options of --model DIR or "
                                         ".bin")
        return text_generate.run(args)
    return _run_model(args)
