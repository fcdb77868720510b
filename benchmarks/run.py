"""Run the qkvnp benchmark from a checkout: ``python benchmarks/run.py [options]``.

The harness is ``bench.py`` beside this file (``--help`` lists the options,
``README.md`` says what is measured and how, ``RESULTS.md`` holds dated
runs). It is not part of the installed package. The qkvnp measured is the
one of this checkout, installed or not: its root goes first on ``sys.path``.
"""
import os
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(CHECKOUT, "qkvnp", "__init__.py")):
    sys.path.insert(0, CHECKOUT)

from bench import main  # noqa: E402  (after the checkout is on sys.path)

if __name__ == "__main__":
    sys.exit(main())
