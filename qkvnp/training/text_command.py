"""The command line of the text task (``python -m qkvnp train --task text``).

The task itself (data, model, loop, checkpoints) is :mod:`qkvnp.training.text`.
Its checks are the other tasks' (:mod:`qkvnp.training.command`), before the
first step: the options, the checkpoint of ``--resume`` (read header-first)
and the options given that differ from its settings, the ``--save`` path and
``--save-every``. A bad option is argparse's ``error:`` line under the usage
(exit 2); a bad checkpoint one ``error:`` line (exit 2); a divergence or a
failed write one ``error:`` line (exit 1); Ctrl-C and SIGTERM save and exit
with 130 and 143.
"""
import argparse
import dataclasses
import sys

from . import text
from .checkpoint import CheckpointError
from .loop import SaveError, check_save_options
from .text_family import FAMILIES

__all__ = ["DESCRIPTION", "add_arguments", "run"]

#: What ``train --task text --help`` opens with (plain text: ``__doc__`` is None under -OO).
DESCRIPTION = ("Train a byte-level GPT (the book's GPTModel, or with --family a Decoder of "
               "GPT-2's, Llama 3's, Mistral's, Qwen3's, Qwen3-MoE's or Gemma 3's config) on "
               "text by gradient descent, with hand-derived gradients, beside a bigram "
               "baseline.")



def _option(name):
    return "--" + name.replace("_", "-")


def add_arguments(parser):
    """The options of ``train --task text`` (its own parser: see :func:`run`).

    Every default is None, so that :func:`run` tells a value given from one
    left out: a resume takes the checkpoint's settings for what is left out.
    """
    defaults = text.TextConfig()
    parser.add_argument("--task", choices=("text",), required=True)
    parser.add_argument("--text", metavar="FILE", default=None,
                        help="a UTF-8 file to train on (default: this Python's stdlib sources)")
    for name, kind, help_text in (
            ("corpus_bytes", int, "cap of the default corpus"),
            ("context", int, "tokens (bytes) a window holds"),
            ("emb_dim", int, "width"), ("num_heads", int, "heads"),
            ("num_layers", int, "blocks"), ("dropout", float, "drop rate"),
            ("batch_size", int, "windows per step"),
            ("steps", int, "optimizer steps in total, a resumed checkpoint's included"),
            ("lr", float, "peak learning rate"), ("warmup", int, "warm-up steps"),
            ("weight_decay", float, "AdamW weight decay"), ("seed", int, "seed"),
            ("eval_every", int, "held-out evaluation period"),
            ("eval_windows", int, "held-out windows"),
            ("sample_every", int, "sample period"), ("sample_length", int, "sample bytes")):
        parser.add_argument(_option(name), type=kind, default=None,
                            help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help=f"default {defaults.dtype}")
    parser.add_argument("--kv-heads", type=int, metavar="K", default=None,
                        help="grouped-query attention: K key/value heads, a divisor of "
                             "--num-heads (default: one per head)")
    parser.add_argument("--rope", action="store_true", default=None,
                        help="rotary positions in every head (besides the learned table)")
    parser.add_argument("--window", type=int, metavar="W", default=None,
                        help="sliding-window attention: each token sees itself and the W - 1 "
                             "before it (default: the whole context)")
    parser.add_argument("--softcap", type=float, metavar="S", default=None,
                        help="soft-cap the scores: S tanh(scores / S) (default: none)")
    parser.add_argument("--family", choices=FAMILIES, default=None,
                        help="train a Decoder of this family's config (sizes from the options "
                             "above; head dim, MLP width and experts derived) instead of the "
                             "book's GPTModel")
    parser.add_argument("--init", metavar="PATH", default=None,
                        help="fine-tune this model instead of building one: a Hugging Face "
                             "directory (config.json, safetensors, tokenizer.json) or an llm.c "
                             ".bin; its tokenizer makes the tokens (bytes for a byte model)")
    parser.add_argument("--lora-rank", type=int, metavar="R", default=None,
                        help="with --init: train rank-R LoRA adapters only (default: every "
                             "parameter)")
    parser.add_argument("--lora-targets", metavar="NAMES", default=None,
                        help="with --lora-rank: the linears to adapt, comma-separated (default "
                             "q_proj,v_proj)")
    parser.add_argument("--save-hf", metavar="DIR", default=None,
                        help="at the end, write the model (adapters merged) as a directory "
                             "transformers loads (with --init or --family)")
    parser.add_argument("--save", metavar="PATH", default=None,
                        help="write a checkpoint at the end (and on Ctrl-C or SIGTERM); "
                             "checked before training")
    parser.add_argument("--save-every", type=int, metavar="N", default=None,
                        help="also write --save every N steps")
    parser.add_argument("--resume", metavar="PATH", default=None,
                        help="continue a saved run with its settings (bitwise identical to "
                             "an uninterrupted run if --steps is unchanged)")


def _error(message, code):
    print(f"error: {message}", file=sys.stderr)
    return code


def _usage_error(exc):
    return argparse.ArgumentError(None, str(exc))


def _config_from_args(args, checkpoint):
    """``(config, given)``: the options given, laid over the checkpoint's settings or the defaults.

    ``given`` lists the options given whose value differs from the checkpoint's
    and may not change on a resume.
    """
    names = [field.name for field in dataclasses.fields(text.TextConfig)]
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if checkpoint is None:
        return text.TextConfig(**given), []
    try:
        saved, _ = text.text_config_of(checkpoint.config)
    except (TypeError, ValueError) as exc:  # the layout checked it: only a Checkpoint made by hand
        raise CheckpointError(f"{checkpoint.path!r} holds an invalid configuration "
                              f"(meta/config): {exc}") from None
    differs = [name for name, value in given.items()
               if name not in text.TextConfig.RESUMABLE_CHANGES and value != getattr(saved, name)]
    return dataclasses.replace(saved, **given), differs


def _differs_message(path, differs, checkpoint, args):
    saved = checkpoint.config
    return (f"--resume {path} was trained with other {', '.join(map(_option, differs))} ("
            + "; ".join(f"{_option(name)}: checkpoint {saved[name]!r}, given "
                        f"{getattr(args, name)!r}" for name in differs)
            + "); leave them out to resume with the checkpoint's settings; nothing was "
              "trained or written")


def _schedule_note(checkpoint, config):
    steps = checkpoint.config["steps"]
    if steps == config.steps or checkpoint.step >= config.steps:
        return None
    return (f"note: the checkpoint's cosine schedule was built for --steps {steps}; with "
            f"--steps {config.steps} the learning rate changes from step {checkpoint.step + 1} "
            f"on, so the run will match no uninterrupted run (resume with --steps {steps} "
            "for that)")


def run(args):
    """Run ``train --task text``; return the exit code.

    The checks of the other tasks, before the first step: the options, the
    checkpoint of ``--resume`` (read header-first) and the options given
    that differ from its settings, the ``--save`` path. A bad option is a
    usage error (exit 2), a bad checkpoint one ``error:`` line (exit 2), a
    divergence or a failed write one ``error:`` line (exit 1).
    """
    checkpoint = None
    if args.resume is not None:
        try:
            checkpoint = text.read_text_checkpoint(args.resume)
        except (FileNotFoundError, CheckpointError) as exc:
            return _error(f"--resume: {exc}; nothing was trained or written", 2)
    try:
        config, differs = _config_from_args(args, checkpoint)
        config.check()
        check_save_options(args.save, args.save_every, ("--save", "--save-every"))
    except CheckpointError as exc:
        return _error(f"--resume: {exc}; nothing was trained or written", 2)
    except (TypeError, ValueError, OSError) as exc:
        raise _usage_error(exc) from None
    if differs:
        return _error(_differs_message(args.resume, differs, checkpoint, args), 2)
    built = [name for name in ("emb_dim", "num_heads", "num_layers")
             if getattr(args, name) is not None]
    if config.init is not None and built:
        raise _usage_error(f"{_option(built[0])} is not an option of --init: the model's "
                           f"sizes are {config.init}'s")
    note = checkpoint and _schedule_note(checkpoint, config)
    if note:
        print(note, file=sys.stderr)
    try:
        *_, code = text.train_text(config, resume=checkpoint, save=args.save,
                                   save_every=args.save_every, save_hf=args.save_hf)
    except KeyboardInterrupt as exc:
        from ..apps.cli import interrupt_status

        return _error("aborted by a second Ctrl-C or SIGTERM: nothing was saved",
                      interrupt_status(exc))
    except CheckpointError as exc:
        return _error(f"{exc}; nothing was trained or written", 2)
    except (FloatingPointError, SaveError) as exc:
        return _error(exc, 1)
    except ImportError as exc:  # an optional package (the hf extra's) is missing
        return _error(f"{exc}; nothing was trained or written", 2)
    except (TypeError, ValueError, OSError) as exc:  # the text: missing, not UTF-8, too short
        raise _usage_error(exc) from None
    return code
