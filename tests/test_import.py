"""``import qkvnp`` stays light, and the command line starts.

Oracle: ``sys.modules`` of a fresh interpreter. ``import qkvnp`` must load
numpy and none of scipy (imported the first time a softmax runs), PyTorch,
matplotlib or hypothesis. Run in a subprocess because this test session has
already imported all of them.
"""
import json
import subprocess
import sys

HEAVY = ["scipy", "torch", "matplotlib", "hypothesis", "pytest"]


def run_python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_import_loads_numpy_only():
    code = (
        "import json, sys; import qkvnp; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "numpy" in loaded and "qkvnp" in loaded
    heavy = sorted(loaded.intersection(HEAVY))
    assert not heavy, f"import qkvnp also imported {heavy}"


def test_softmax_imports_scipy_lazily():
    """The other half of the contract: scipy does arrive once a softmax runs."""
    code = (
        "import sys, qkvnp; before = 'scipy' in sys.modules; "
        "qkvnp.softmax([1.0, 2.0]); print(before, 'scipy' in sys.modules)"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_cli_help():
    result = run_python("-m", "qkvnp", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "demo" in result.stdout and "gradcheck" in result.stdout
