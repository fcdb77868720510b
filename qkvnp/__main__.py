"""``python -m qkvnp``: see :mod:`qkvnp.apps.cli`."""
import sys

from .apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
