"""The programs on top of the library: the command line and the demo.

``python -m qkvnp COMMAND`` runs :mod:`qkvnp.apps.cli`; the training tasks
and the gradient-check study it calls live in :mod:`qkvnp.training` and
:mod:`qkvnp.gradcheck`, whose import paths are part of the public surface.
"""

__all__: list = []
