"""The numerical gradient checker: central differences against hand-derived backwards.

:mod:`qkvnp.gradcheck.checker` holds the checks (:func:`check_function`,
:func:`check_op`, :func:`check_layer`, the :data:`TOLERANCES` table and the
step sweep); :mod:`qkvnp.gradcheck.command` is ``python -m qkvnp gradcheck``.
See the checker's docstring for the method.
"""
from .checker import (MODES, SWEEP_EPS, TOLERANCES, GradcheckError, GradcheckReport, GradcheckRow,
                      Tolerance, check_function, check_layer, check_op, sweep_eps)

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "GradcheckRow",
    "GradcheckReport",
    "GradcheckError",
    "check_function",
    "check_op",
    "check_layer",
    "sweep_eps",
    "SWEEP_EPS",
    "MODES",
]
