"""Train attention projections by gradient descent (``python -m qkvnp train``).

Everything the command is given is checked before the first step: each
value and combination (:meth:`qkvnp.training.config.TrainConfig.resolved`),
options that do not apply to the chosen task, optimizer or schedule, the
``--save`` and ``--plot`` paths (:func:`qkvnp._io.check_writable`), the
checkpoint of ``--resume`` (read header-first, see
:func:`qkvnp.training.checkpoint.load_checkpoint`). A bad option is
argparse's ``error:`` line under the command's usage, exit status 2; a bad
checkpoint one ``error:`` line, exit status 2; a checkpoint that cannot be
written one ``error:`` line, exit status 1. Ctrl-C and SIGTERM save and exit
with 130 and 143.

The loop itself is :func:`qkvnp.training.loop.train`; what is printed,
:mod:`qkvnp.training.report`.
"""
import argparse
import dataclasses
import re
import sys

from .._io import check_writable
from ..apps.cli import interrupt_status, program_name
from .checkpoint import CheckpointError, load_checkpoint
from .config import LOOKUP_TASKS, TASK_DEFAULTS, TrainConfig
from .loop import (SaveError, build_model, check_resume, check_save_options, checkpoint_layout,
                   scheduled_lr, train)

__all__ = ["add_arguments", "config_from_args", "run"]

# options that only mean something for one task / optimizer / schedule
_TASK_OPTIONS = {  # tasks -> their options
    LOOKUP_TASKS: ("num_keys", "num_values", "num_pairs", "dim", "variant"),
    ("teacher",): ("embed_dim", "num_heads", "seq_len"),
}
_CONFIG_OPTIONS = [field.name for field in dataclasses.fields(TrainConfig)]


def add_arguments(parser):
    """Add the ``train`` options to an ``argparse`` parser."""
    _add_run_options(parser)
    _add_lookup_options(parser.add_argument_group("kv-recall and partner"))
    _add_teacher_options(parser.add_argument_group("teacher"))
    _add_file_options(parser.add_argument_group("files"))
    parser.add_argument("--quiet", action="store_true", help="no progress lines, summary only")


def _add_run_options(parser):
    """The task, the optimizer and its schedule, the batches, the evaluation."""
    # NOTE: "text" is listed for --help; `train --task text` never reaches this
    # parser (qkvnp.apps.cli sends it to qkvnp.training.text_command, which has its own options)
    parser.add_argument("--task", choices=tuple(TASK_DEFAULTS) + ("text",), default=None,
                        help="kv-recall (default): recall the value stored under a key; "
                             "partner: recall the value stored under the key's partner "
                             "(a fixed random pairing; tied Q=K cannot learn it); "
                             "teacher: a student attention layer fits a random teacher; "
                             "text: a byte-level GPT on text, with options of its own "
                             "(see 'train --task text --help')")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="total optimizer steps, counting those of a resumed checkpoint, "
                             "and the cosine schedule's horizon "
                             "(default: kv-recall and partner 1000, teacher 2000)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: kv-recall and partner 5e-3, teacher "
                             "2e-2; sgd: kv-recall and partner 0.05, teacher 0.5)")
    parser.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default=None,
                        help="default adam; sgd uses --momentum")
    parser.add_argument("--momentum", type=float, default=None,
                        help="SGD momentum, >= 0 (default 0.9; sgd only)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help=">= 0 (default 0.01 with adamw, else 0)")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default=None,
                        help="learning-rate schedule (default cosine, with --warmup steps of "
                             "linear warm-up)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help="default 50 (cosine only; at most --steps)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B", help="default 64")
    parser.add_argument("--seed", type=int, default=None, help="default 0")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None,
                        help="default float64")
    parser.add_argument("--eval-every", type=int, default=None, metavar="N",
                        help="held-out evaluation period (default steps/10)")
    parser.add_argument("--eval-size", type=int, default=None, metavar="N",
                        help="held-out sequences (default 2000)")
    parser.add_argument("--dropout", type=float, default=None, metavar="P",
                        help="dropout on the attention weights while training, in [0, 1) "
                             "(default 0)")


def _add_lookup_options(kv):
    """The options of kv-recall and partner: vocabularies, pairs, width, Q/K/V variant."""
    from .models import VARIANTS

    kv.add_argument("--num-keys", type=int, default=None,
                    help="key vocabulary (default 64; even for partner)")
    kv.add_argument("--num-values", type=int, default=None, help="value vocabulary (default 64)")
    kv.add_argument("--num-pairs", type=int, default=None,
                    help="pairs per sequence, at most --num-keys (default 16; partner: >= 2)")
    kv.add_argument("--dim", type=int, default=None, help="model width (default 64)")
    kv.add_argument("--variant", choices=tuple(VARIANTS), default=None,
                    help="Q/K/V projections: separate (default), tied_qk, no_value, shared")


def _add_teacher_options(teacher):
    """The options of teacher: the attention layer's shape and the sequence length."""
    teacher.add_argument("--embed-dim", type=int, default=None, help="default 16")
    teacher.add_argument("--num-heads", type=int, default=None,
                         help="must divide --embed-dim (default 2)")
    teacher.add_argument("--seq-len", type=int, default=None, help="default 8")


def _add_file_options(files):
    """Checkpoints (save, save periodically, resume) and the plot."""
    files.add_argument("--save", metavar="CKPT.npz", default=None,
                       help="write a checkpoint at the end (and on Ctrl-C or SIGTERM); "
                            "checked before training")
    files.add_argument("--save-every", type=int, default=None, metavar="N",
                       help="also write --save every N steps (a killed run loses at most N)")
    files.add_argument("--resume", metavar="CKPT.npz", default=None,
                       help="continue a saved run up to --steps (its settings are reused; "
                            "bitwise identical to an uninterrupted run if --steps is unchanged)")
    files.add_argument("--plot", metavar="OUT.png", default=None,
                       help="save the loss curve and a held-out attention heat map "
                            "(needs pip install 'qkvnp[plot]')")


def config_from_args(args, base=None):
    """A :class:`TrainConfig` from parsed options laid over ``base`` (a dict)."""
    values = dict(base or {})
    for name in _CONFIG_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    return TrainConfig.from_dict(values)


def _option(name):
    return "--" + name.replace("_", "-")


def _usage_error(message):
    """What ``qkvnp.apps.cli.main`` prints as ``<prog> train: error: <message>`` under the usage."""
    return argparse.ArgumentError(None, message)


def _as_options(message):
    """A :meth:`TrainConfig.resolved` message with its field names spelled as options."""
    pattern = r"\b(" + "|".join(sorted(_CONFIG_OPTIONS, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda match: _option(match.group(1)), message)


def _check_applicable(args, config):
    """Refuse options given for another task, optimizer or schedule than ``config``'s."""
    for tasks, names in _TASK_OPTIONS.items():
        given = [_option(name) for name in names if getattr(args, name) is not None]
        if given and config.task not in tasks:
            raise _usage_error(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                               f"to --task {' and '.join(tasks)} only (this run's task is "
                               f"{config.task})")
    if args.momentum is not None and config.optimizer != "sgd":
        raise _usage_error(f"--momentum applies to --optimizer sgd only (this run uses "
                           f"{config.optimizer})")
    if args.warmup is not None and config.schedule != "cosine":
        raise _usage_error("--warmup applies to --schedule cosine only")


def _check_combinations(args, config):
    """Refuse what the resolved ``config`` and the file options cannot do together."""
    if args.warmup is not None and config.warmup > config.steps:
        raise _usage_error(f"--warmup {config.warmup} is longer than the run "
                           f"(--steps {config.steps})")
    try:
        check_save_options(args.save, args.save_every, ("--save", "--save-every"))
        if args.plot is not None:
            check_writable(args.plot, "--plot")
    except (OSError, ValueError, TypeError) as exc:
        raise _usage_error(str(exc)) from None
    if args.plot is not None and not _have_matplotlib():
        raise _usage_error(f"--plot {args.plot}: matplotlib is not installed; install it with "
                           "pip install 'qkvnp[plot]' (or pip install matplotlib)")


def _have_matplotlib():
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def _schedule_note(checkpoint, config):
    """The line saying the cosine schedule changes on resume, or None if it does not."""
    saved = TrainConfig.from_dict(checkpoint.config).resolved()
    if config.schedule != "cosine" or saved.steps == config.steps or checkpoint.step >= config.steps:
        return None
    step = checkpoint.step + 1
    return (f"note: the checkpoint's cosine schedule was built for --steps {saved.steps}; with "
            f"--steps {config.steps} the learning rate changes from step {step} on "
            f"({scheduled_lr(saved, step):.3g} -> {scheduled_lr(config, step):.3g}), so the run "
            f"will match no uninterrupted run (resume with --steps {saved.steps} for that)")


def _error(message, code):
    print(f"error: {message}", file=sys.stderr)
    return code


def run(args):
    """Run ``python -m qkvnp train`` with the parsed ``args``; return the exit code.

    Raises
    ------
    argparse.ArgumentError
        For a bad option, before anything is trained; ``qkvnp.apps.cli.main``
        prints it under the command's usage and returns 2.
    """
    from .report import Progress, describe, plot_run, summary
    from .tasks import make_streams

    checkpoint = None
    if args.resume is not None:
        try:
            checkpoint = load_checkpoint(args.resume, checkpoint_layout)
        except (FileNotFoundError, CheckpointError) as exc:
            return _error(f"--resume: {exc}; nothing was trained or written", 2)
    try:
        config = config_from_args(args, checkpoint and checkpoint.config)
        _check_applicable(args, config)
        config = config.resolved()
    except (TypeError, ValueError) as exc:
        raise _usage_error(_as_options(str(exc))) from None
    _check_combinations(args, config)
    if checkpoint is not None:
        try:
            check_resume(checkpoint, config)
        except CheckpointError as exc:
            return _error(f"--resume: {exc}; nothing was trained or written", 2)
    plot = args.plot
    note = checkpoint and _schedule_note(checkpoint, config)
    if note:
        print(note, file=sys.stderr)
    progress = None if args.quiet else Progress()
    print(describe(config, build_model(config, make_streams(config.seed).init)), flush=True)
    try:
        result = train(config, resume=checkpoint, save=args.save, save_every=args.save_every,
                       callback=progress)
    except KeyboardInterrupt as exc:
        return _error("aborted by a second Ctrl-C or SIGTERM (or before training started): "
                      "nothing was saved", interrupt_status(exc))
    except (FileNotFoundError, CheckpointError) as exc:
        return _error(f"{exc}; nothing was trained or written", 2)
    except (FloatingPointError, SaveError) as exc:
        return _error(exc, 1)
    finally:
        if progress is not None:
            progress.close()
    for line in summary(result):
        print(line)
    if result.interrupted:
        print(f"interrupted: resume with {program_name()} train --resume {result.checkpoint}"
              + (f" --save {args.save}" if args.save else ""))
        return 128 + result.signal
    if plot is not None:
        try:
            plot_run(result, plot)
        except OSError as exc:
            return _error(f"--plot: could not write {plot!r} ({exc.strerror or exc}); the "
                          "checkpoint and results above are unaffected", 1)
    return 0
