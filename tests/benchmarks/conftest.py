"""Put the checkout's ``benchmarks/`` directory on ``sys.path``.

The benchmark harness (``benchmarks/bench.py``) lives beside the package, not
in it, so the installed qkvnp does not ship it; its tests import it as the
top-level module ``bench``, as ``benchmarks/run.py`` does.
"""
import os
import sys

BENCHMARKS_DIR = os.path.abspath(
    os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")
)
if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)
