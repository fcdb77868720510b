"""``python -m qkvnp demo``: runs, exits 0, prints the seeds' numbers.

Oracle: the seeds' printed numbers (issue 2, copied into ``tests/test_seeds.py``,
which checks them through the API); here we check that the walkthrough prints
them, formatted to the requested precision, and that it uses the issue's data.
"""
import argparse
import subprocess
import sys

import numpy as np
import pytest

import qkvnp.apps.demo as demo
from qkvnp.apps import cli

import book_layers as seeds_book
import test_seeds as seeds

# Numbers a learner must see in the default (4-digit) output.
KEY_NUMBERS_4 = [
    "[0.4306, 1.4551]",  # query of "journey"
    "[1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440]",  # its scores
    "[0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820]",  # its scaled softmax weights
    "[0.1551, 0.2104, 0.2059, 0.1413, 0.1074, 0.1799]",  # weights row 1
    "[0.3061, 0.8210]",  # context vector of "journey"
    "[0.2996, 0.8053]",  # context vector of "Your"
    "[0.2990, 0.8040]",  # context vector of "step"
    "[0.9852, 1.7417, 0.7565]",  # numpy example, word 1
    "[0.4421, 0.5931, 0.5790]",  # without weights, token 1
    "[0.4177, 0.6503, 0.5645]",  # without weights, token 6
]


def _run_demo(argv):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.run(parser.parse_args(argv))


def test_cli_demo_exits_0_and_prints_the_key_numbers(capsys):
    """Oracle: the seeds' 4-digit numbers appear verbatim in the output."""
    status = cli.main(["demo"])
    out = capsys.readouterr().out
    assert status == 0
    for number in KEY_NUMBERS_4:
        assert number in out, f"{number} missing from the demo's output"
    assert "All cross-checks agree." in out


def test_demo_explains_the_single_score_softmax_pitfall(capsys):
    """Oracle: a one-element softmax is 1, and the demo must show and say so."""
    assert _run_demo([]) == 0
    out = capsys.readouterr().out
    assert "softmax([score_22 / sqrt(2)]) = [1.0000]" in out
    assert "ALL the scores" in out
    assert "sqrt(embed_size)" in out  # the tutorial's scaling bug is named


def test_demo_precision_8_prints_the_seeds_8_digit_numbers(capsys):
    """Oracle: the numpy example's output as the seeds print it, 8 decimals."""
    assert _run_demo(["--precision", "8"]) == 0
    out = capsys.readouterr().out
    for row in seeds.ATTENTION:
        assert "[" + ", ".join(f"{v:.8f}" for v in row) + "]" in out


def test_demo_precision_2(capsys):
    """Oracle: the query of "journey" rounded to 2 decimals is [0.43, 1.46]."""
    assert _run_demo(["--precision", "2"]) == 0
    assert "[0.43, 1.46]" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["-1", "17", "four"])
def test_demo_rejects_a_bad_precision(bad, capsys):
    """Oracle: argparse exits with status 2 and names the option."""
    with pytest.raises(SystemExit) as excinfo:
        _run_demo(["--precision", bad])
    assert excinfo.value.code == 2
    assert "--precision" in capsys.readouterr().err


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (17, ValueError), (2.0, TypeError),
                                        (True, TypeError)])
def test_walkthrough_rejects_a_bad_precision(bad, error):
    """Oracle: the documented contract, an int in 0..16, named in the message."""
    with pytest.raises(error, match="precision"):
        demo.walkthrough(precision=bad)


def test_demo_uses_the_issue_data():
    """Oracle: the issue's data, as copied into tests/test_seeds.py."""
    for ours, theirs in [
        (demo.INPUTS, seeds.INPUTS), (demo.W_QUERY, seeds.W_QUERY),
        (demo.W_KEY, seeds.W_KEY), (demo.W_VALUE, seeds.W_VALUE),
        (demo.NUMPY_WORDS, seeds.WORDS), (demo.NUMPY_W_Q, seeds.W_Q),
        (demo.NUMPY_W_K, seeds.W_K), (demo.NUMPY_W_V, seeds.W_V),
    ]:
        assert ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)
    assert demo.NUMPY_WORDS.dtype.kind == "i"  # the seeds' example is integer
    assert len(demo.WORDS) == len(demo.INPUTS) == 6


def test_demo_reports_a_failed_cross_check(monkeypatch, capsys):
    """Oracle: a cross-check that cannot fail is worthless; break one code path.

    Shifting the layer's output by 1e-6 (far above round-off, far below the
    printed digits) must make the SelfAttention-vs-functional cross-check
    fail and the command return 1.
    """
    original = demo.SelfAttention.forward

    def broken_forward(self, x, **kwargs):
        out, weights = original(self, x, **kwargs)
        return out + 1e-6, weights

    monkeypatch.setattr(demo.SelfAttention, "forward", broken_forward)
    assert _run_demo([]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out


def test_python_m_qkvnp_demo_subprocess():
    """Oracle: the documented command itself exits 0 and prints the query of "journey"."""
    result = subprocess.run(
        [sys.executable, "-m", "qkvnp", "demo"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "[0.4306, 1.4551]" in result.stdout


def test_demo_prints_the_books_multi_head_numbers(capsys):
    """Oracle: the book's printed chapter 3 multi-head context vectors (4 decimals).

    Each row appears twice: once computed by the layer, once as the book's
    printed value shown beside it.
    """
    assert demo.walkthrough(precision=4) == 0
    out = capsys.readouterr().out
    for row in seeds_book.PRINTED["MultiHeadAttention"][3]:
        text = "[" + ", ".join(f"{value:.4f}" for value in row) + "]"
        assert out.count(text) == 2, f"{text} printed {out.count(text)} times, expected 2"
    np.testing.assert_array_equal(demo.BOOK_MHA_PRINTED, seeds_book.PRINTED["MultiHeadAttention"][3])


def test_book_constants_are_the_weights_torch_draws_under_the_books_seed(torch):
    """Oracle: the book's layer built in torch after ``torch.manual_seed(123)``, bit for bit."""
    seed, args, _, _ = seeds_book.PRINTED["MultiHeadAttention"]
    torch.manual_seed(seed)
    module = seeds_book.book_layers(torch)["MultiHeadAttention"](*args)
    state = {name: value.numpy().astype(np.float64)
             for name, value in module.state_dict().items() if name != "mask"}
    assert sorted(state) == sorted(demo.BOOK_MHA_STATE)
    for name, value in state.items():
        np.testing.assert_array_equal(demo.BOOK_MHA_STATE[name], value, err_msg=name)
