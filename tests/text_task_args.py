"""Shared pieces of the text task's tests (``tests/training/test_text_*.py``).

The corpus they train on (bytes), and the command-line arguments of a
settings dict (``--name value`` for each ``name=value``, underscores as dashes).
"""
#: A short, repetitive English text: a bigram model already learns much of it.
CORPUS = ("the cat sat on the mat. the dog sat on the log. " * 40).encode()


def cli_args(settings):
    """``["--steps", "6", "--num-heads", "2", ...]`` of ``{"steps": 6, "num_heads": 2, ...}``."""
    argv = []
    for name, value in settings.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv
