"""The numerical gradient checker: hand-derived backwards against numerical derivatives.

Modules, one concept each:

=================  ==========================================================
``checker``        :func:`check_function`, :func:`check_op`, :func:`check_layer`
``stencils``       the numerical derivatives: central, central4, Ridders'
                   extrapolation, complex step (:data:`METHODS`)
``report``         :data:`TOLERANCES`, the rows and the table
``diagnosis``      what a failing row looks like (:data:`DIAGNOSES`)
``oracle``         mixed precision: float32 backward vs float64 reference
``second_order``   Hessian-vector products and their symmetry
``sweep``          error against step, per tensor and method, fitted slopes
``plot``           the sweep as a picture (optional matplotlib)
``gallery``        deliberately wrong backwards and what the checker says
``command``        ``python -m qkvnp gradcheck``
=================  ==========================================================

``import qkvnp.gradcheck`` imports numpy only; see ``docs/gradcheck.md``.
"""
from .checker import MODES, check_function, check_layer, check_op
from .diagnosis import DIAGNOSES
from .oracle import ORACLE_EPS
from .report import TOLERANCES, GradcheckError, GradcheckReport, GradcheckRow, Tolerance
from .second_order import SymmetryReport, check_symmetry_function, check_symmetry_layer, check_symmetry_op
from .stencils import METHODS, ORDERS
from .sweep import SWEEP_EPS, sweep_eps, sweep_steps

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "GradcheckRow",
    "GradcheckReport",
    "GradcheckError",
    "check_function",
    "check_op",
    "check_layer",
    "METHODS",
    "ORDERS",
    "MODES",
    "DIAGNOSES",
    "ORACLE_EPS",
    "SymmetryReport",
    "check_symmetry_function",
    "check_symmetry_op",
    "check_symmetry_layer",
    "sweep_eps",
    "sweep_steps",
    "SWEEP_EPS",
]
