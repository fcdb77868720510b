"""The command line: ``python -m qkvnp COMMAND`` (or the ``qkvnp`` script).

Each command lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them.
A command refuses a bad option by raising ``argparse.ArgumentError`` before
it starts any work; :func:`main` prints it as argparse does (the command's
usage, then ``<prog> <command>: error: ...``) and returns 2.
"""
import argparse
import importlib
import os
import sys

__all__ = ["main", "COMMANDS"]

# command name -> (module, one-line help)
COMMANDS = {
    "demo": ("qkvnp.demo", "walk through the seeds' attention example step by step"),
    "gradcheck": ("qkvnp.gradcheck.command", "check the layers' analytic gradients numerically"),
    "train": ("qkvnp.training.command", "train attention projections by gradient descent"),
    "ablation": ("qkvnp.training.ablation", "why Q, K and V: tied and missing projections on two tasks"),
    "generate": ("qkvnp.training.text_generate",
                 "continue a prompt with a model of train --task text"),
}

# (command, option, value) -> the module that takes that command over (its own options)
TASK_MODULES = {("train", "--task", "text"): "qkvnp.training.text"}


def _task_module(command, argv):
    """The module of :data:`TASK_MODULES` that ``argv`` selects, or None."""
    for (name, option, value), module in TASK_MODULES.items():
        if name == command and any(a == f"{option}={value}" or (a == option and b == value)
                                   for a, b in zip(argv, argv[1:] + [None])):
            return module
    return None


def _program_name():
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
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=_program_name(),
        description="Q/K/V attention in pure NumPy with hand-derived gradients.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        module = importlib.import_module(module_name_override or module_name)
        parser_for_command = sub.add_parser(
            name, help=help_text, description=module.__doc__.strip().splitlines()[0]
        )
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
    try:
        return int(args._run(args) or 0)
    except argparse.ArgumentError as exc:
        args._parser.print_usage(sys.stderr)
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # output piped into e.g. `head`, which closed early: exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
