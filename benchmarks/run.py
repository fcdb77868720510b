"""Run the qkvnp benchmark: ``python benchmarks/run.py [options]``.

The same command as ``python -m qkvnp bench``; everything lives in
:mod:`qkvnp.bench` (``--help`` lists the options, ``README.md`` beside this
file says what is measured and how).
"""
import sys

from qkvnp.bench import main

if __name__ == "__main__":
    sys.exit(main())
