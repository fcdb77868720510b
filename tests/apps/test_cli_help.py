"""What ``--help`` and the demo say: plain text, every option explained, the example named.

Oracles: argparse's own records of each sub-command's options (every one has a
help string); the text it prints (no reST markup such as double backticks,
which argparse shows verbatim); the demo's output naming its example (the
book, Sebastian Raschka's Build a Large Language Model (From Scratch),
chapter 3) instead of an unexplained "the seeds".
"""
import argparse
import re

import pytest

from qkvnp.apps.cli import COMMANDS, build_parser, main


def _sub_parser(command):
    parser = build_parser(command)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, action.choices[command]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_help_text(command):
    # was: gradcheck --seed had none
    _, sub = _sub_parser(command)
    missing = [action.option_strings for action in sub._actions
               if action.option_strings and not action.help]
    assert missing == []


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text(command, capsys):
    # was: "Train attention projections by gradient descent (``python -m qkvnp train``)."
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":class:" not in out
    assert not re.search(r"\bthe seeds\b|\bseeds'", out), out


def test_the_demo_names_its_example(capsys):
    # was: "the seeds' attention example", never explained
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\bthe seeds\b|\bseeds?'", out)
    assert "Your journey starts with one step" in out
    assert "Sebastian Raschka's Build a Large Language Model" in out and "chapter 3" in out
