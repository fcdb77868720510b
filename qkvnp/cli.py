"""The command line: ``python -m qkvnp COMMAND`` (or the ``qkvnp`` script).

Each command lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them.
"""
import argparse
import importlib

__all__ = ["main", "COMMANDS"]

# command name -> (module, one-line help)
COMMANDS = {
    "demo": ("qkvnp.demo", "walk through the seeds' attention example step by step"),
    "gradcheck": ("qkvnp.gradcheck", "check the layers' analytic gradients numerically"),
    "train": ("qkvnp.train", "train attention projections by gradient descent"),
    "ablation": ("qkvnp.ablation", "why Q, K and V: train kv-recall with tied projections"),
    "bench": ("qkvnp.bench", "time attention against PyTorch on this CPU"),
}


def build_parser():
    """Return the top-level ``argparse`` parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(
        prog="python -m qkvnp",
        description="Q/K/V attention in pure NumPy with hand-derived gradients.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__.splitlines()[0])
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv=None):
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)
