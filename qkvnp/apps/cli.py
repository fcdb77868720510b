"""The command line: ``python -m qkvnp COMMAND`` (or the ``qkvnp`` script).

Each command lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them.
A command refuses a bad option by raising ``argparse.ArgumentError`` before
it starts any work; :func:`main` prints it as argparse does (the command's
usage, then ``<prog> <command>: error: ...``) and returns 2.

Ctrl-C raises ``KeyboardInterrupt`` and, while a command runs, SIGTERM
raises :class:`Interrupted` (a ``KeyboardInterrupt``): a command that can
say what it kept catches it and prints one line; otherwise :func:`main`
prints one line. The exit status is 128 + the signal's number (130 for
Ctrl-C, 143 for SIGTERM), as a shell reports a process the signal killed.
"""
import argparse
import importlib
import os
import signal
import sys
import threading

__all__ = ["main", "COMMANDS", "Interrupted", "interrupt_status", "interrupt_name",
           "report_interrupt", "program_name"]

# command name -> (module, one-line help, the description its --help opens with)
# NOTE: plain text here, not the modules' docstrings: those are reST (double
# backticks), and None under ``python -OO``.
COMMANDS = {
    "demo": ("qkvnp.apps.demo", "walk through a small attention example step by step",
             "Walk through attention step by step, printing every number, on the six-token "
             "sentence 'Your journey starts with one step' of Sebastian Raschka's Build a "
             "Large Language Model (From Scratch), chapter 3."),
    "gradcheck": ("qkvnp.gradcheck.command", "check the layers' analytic gradients numerically",
                  "Check the analytic gradients of SelfAttention and MultiHeadAttention "
                  "against numerical derivatives."),
    "train": ("qkvnp.training.command",
              "train a model: attention on kv-recall, partner, teacher; a GPT on text",
              "Train by gradient descent, with hand-derived gradients: attention layers on "
              "the kv-recall, partner and teacher tasks, or a byte-level GPT on text "
              "(--task text)."),
    "ablation": ("qkvnp.training.ablation",
                 "why Q, K and V: tied and missing projections on two tasks",
                 "Why Q, K and V? Train kv-recall and partner with separate, tied and missing "
                 "projections."),
    "generate": ("qkvnp.apps.generate",
                 "continue a prompt: a Hugging Face directory, an llm.c file, a checkpoint",
                 "Continue a prompt, streaming the text: a Hugging Face model directory "
                 "(config.json, safetensors, tokenizer.json), an llm.c .bin file, or a "
                 "checkpoint of 'train --task text'."),
}

# (command, option, value) -> the module that takes that command over (its own options)
TASK_MODULES = {("train", "--task", "text"): "qkvnp.training.text_command"}


def _task_module(command, argv):
    """The module of :data:`TASK_MODULES` that ``argv`` selects, or None."""
    for (name, option, value), module in TASK_MODULES.items():
        if name == command and any(a == f"{option}={value}" or (a == option and b == value)
                                   for a, b in zip(argv, argv[1:] + [None])):
            return module
    return None


class Interrupted(KeyboardInterrupt):
    """SIGTERM while a command runs (Ctrl-C raises a plain ``KeyboardInterrupt``).

    Parameters
    ----------
    signum : int
        The signal; kept as ``signal.Signals`` in the ``signal`` attribute.
    """

    def __init__(self, signum):
        super().__init__(signum)
        self.signal = signal.Signals(signum)


def interrupt_status(exc):
    """The exit status for the interrupt ``exc``: 128 + its signal (Ctrl-C: 130, SIGTERM: 143)."""
    return 128 + int(getattr(exc, "signal", None) or signal.SIGINT)


def interrupt_name(exc):
    """``"Ctrl-C"`` for SIGINT (or a plain ``KeyboardInterrupt``), else the signal's name."""
    signum = getattr(exc, "signal", None) or signal.SIGINT
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def report_interrupt(exc, message):
    """Print ``<Ctrl-C or SIGTERM>: <message>`` as one line on stderr; return :func:`interrupt_status`.

    On a terminal the line starts on a fresh line (after ``^C`` or a live
    progress line).
    """
    start = "\n" if sys.stderr.isatty() else ""
    print(f"{start}{interrupt_name(exc)}: {message}", file=sys.stderr, flush=True)
    return interrupt_status(exc)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def program_name():
    """``qkvnp`` when run as the console script, else ``python -m qkvnp``.

    argparse's default, the basename of ``sys.argv[0]``, would print
    ``__main__.py`` under ``python -m qkvnp`` (Pythons before 3.14).
    """
    script = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    # "qkvnp.exe" / "qkvnp-script.py" are the Windows launchers' names
    return "qkvnp" if script in ("qkvnp", "qkvnp-script") else "python -m qkvnp"


def build_parser(command=None, module_name_override=None):
    """Return the top-level parser; only ``command``'s module is imported.

    Every command gets a sub-parser (so ``--help`` lists them all), but only
    the selected one imports its module and adds its options: a command's
    heavy or broken imports never slow down or break another command.
    """
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="Q/K/V attention in pure NumPy with hand-derived gradients.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text, description) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module = importlib.import_module(module_name_override or module_name)
        # a task's module (train --task text) may say what it trains
        description = getattr(module, "DESCRIPTION", description)
        parser_for_command = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(parser_for_command)
        parser_for_command.set_defaults(_run=module.run, _parser=parser_for_command)
    return parser


def main(argv=None):
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None, _task_module(command, argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # under the command's usage, not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt as exc:  # a command that did not say what it kept
        return report_interrupt(exc, f"{args._parser.prog} stopped before it finished")
    except argparse.ArgumentError as exc:
        args._parser.print_usage(sys.stderr)
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # output piped into e.g. `head`, which closed early: exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
