"""The scripts of ``examples/`` run as plain Python and check their own claims.

Oracle: each script asserts what it shows (a bounded cache and outputs equal
to the full forward; RoPE scores equal at equal offsets; ALiBi's constant
diagonals); a failing assertion exits non-zero.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["alibi_picture.py", "rope_relative.py", "sliding_window_decoder.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_examples_are_short():
    for script in SCRIPTS:
        with open(os.path.join(ROOT, "examples", script), encoding="utf-8") as f:
            assert len(f.read().splitlines()) <= 80, script
