"""How a test run without PyTorch reports its skipped comparisons (tests/conftest.py).

Oracle: the short test summary of a pytest run, in a fresh process, of two
tiny test files under this suite's conftest.py, with ``import torch`` made to
fail (a ``torch.py`` that raises ImportError, first on ``PYTHONPATH``). The
counts are known by hand: four tests take the ``torch`` fixture, one skips
for another reason, one passes.
"""
import os
import shutil
import subprocess
import sys

from conftest import TORCH_INSTALL_HINT

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")

FIRST = '''
import pytest


def test_one(torch):
    pass


@pytest.mark.parametrize("n", [1, 2])
def test_two(torch, n):
    pass


def test_other_reason():
    pytest.skip("needs two CPUs")


def test_plain():
    assert True
'''

SECOND = '''
def test_three(torch):
    pass
'''


def run_without_torch(tmp_path, require):
    """pytest -ra on the two files with PyTorch hidden; ``require`` sets QKVNP_REQUIRE_TORCH=1."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "test_first.py").write_text(FIRST)
    (suite / "test_second.py").write_text(SECOND)
    (suite / "pytest.ini").write_text("[pytest]\n")
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "torch.py").write_text("raise ImportError('PyTorch hidden by the test')\n")
    env = {name: value for name, value in os.environ.items()
           if name not in ("QKVNP_REQUIRE_TORCH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden)] + [p for p in sys.path if p])
    if require:
        env["QKVNP_REQUIRE_TORCH"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider",
                           "-c", str(suite / "pytest.ini"), str(suite)],
                          cwd=suite, capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stdout + done.stderr


def summary_lines(output):
    """The lines of pytest's short test summary."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    return lines[start + 1:-1]


def test_missing_pytorch_is_one_summary_line_and_other_skips_keep_theirs(tmp_path):
    status, output = run_without_torch(tmp_path, require=False)
    assert status == 0, output
    lines = summary_lines(output)
    about_torch = [line for line in lines if "PyTorch" in line]
    assert len(about_torch) == 1, output
    assert about_torch[0].startswith("SKIPPED [4] ") and TORCH_INSTALL_HINT in about_torch[0]
    assert any(line.startswith("SKIPPED [1] ") and line.endswith("needs two CPUs")
               for line in lines), output
    assert len(lines) == 2, output
    assert "1 passed, 5 skipped" in output.splitlines()[-1]


def test_required_pytorch_still_fails_when_missing(tmp_path):
    # QKVNP_REQUIRE_TORCH=1 (CI): the four tests that need PyTorch error out
    status, output = run_without_torch(tmp_path, require=True)
    assert status == 1, output
    assert "1 passed, 1 skipped, 4 errors" in output.splitlines()[-1], output
    assert not any(line.startswith("SKIPPED") and "PyTorch" in line
                   for line in summary_lines(output)), output
