"""Second-order checks without autograd: symmetry of Hessian-vector products.

Shape key: ``z`` is every checked tensor (parameters and inputs) together;
``u`` and ``v`` are directions over all of them, of unit norm overall.

The hand-written backward gives the gradient ``g(z)`` of ``L = <dout, f(z)>``
for a fixed random ``dout``; central differences *of the backward* give
Hessian-vector products

.. math:: H u \\approx (g(z + h u) - g(z - h u)) / 2h .

A true gradient has a symmetric Jacobian (the Hessian of ``L``), so
``<v, H u> = <u, H v>`` for every ``u, v``. A backward that is not the
gradient of any scalar function (a term of the wrong operand, a transpose
inside a product) breaks the symmetry even where a loose first-order check
passes. The asymmetry is reported relative to
``max(|<v, Hu>|, |<u, Hv>|, 1e-3 |u| |v| max|Hu, Hv entries|)``, so that an
op whose Hessian is zero (split and merge heads, a linear map in one
argument) passes: both products are then round-off.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import make_rng
from .checker import draw_dout, function_problem, layer_problem, op_pair

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable, Mapping
    from .._typing import ArrayLike, DTypeLike, FloatArray

__all__ = ["SYMMETRY_TOLERANCES", "SymmetryReport", "check_symmetry_function",
           "check_symmetry_op", "check_symmetry_layer", "check_symmetry"]

#: (step h, rtol) of the symmetry check by dtype: truncation ~h^2, round-off ~eps / h.
SYMMETRY_TOLERANCES = {np.dtype(np.float64): (1e-4, 1e-6), np.dtype(np.float32): (3e-2, 5e-2)}

SymmetryReport = namedtuple("SymmetryReport", "v_hu u_hv asymmetry relative hvp_max ok rtol eps")
SymmetryReport.__doc__ = """Outcome of a symmetry check.

v_hu, u_hv : float, ``<v, H u>`` and ``<u, H v>``.
asymmetry : float, ``|<v, Hu> - <u, Hv>|``.
relative : float, the asymmetry over the denominator of the module docstring.
hvp_max : float, the largest entry of ``Hu`` and ``Hv``.
ok : bool, ``relative <= rtol``.
rtol, eps : float, the pass mark and the step ``h``.
"""


def _unit_directions(grads, rng):
    direction = {name: rng.standard_normal(g.shape) for name, g in grads.items()}
    norm = np.sqrt(sum(float(np.sum(d * d)) for d in direction.values()))
    return {name: d / norm for name, d in direction.items()}


def _hvp(problem, dout, direction, h):
    """``(g(z + h u) - g(z - h u)) / 2h`` over the tensors of ``direction``."""
    saved = {name: problem.slots[name][0][problem.slots[name][1]].copy() for name in direction}

    def gradient_at(t):
        for name, u in direction.items():
            container, key = problem.slots[name]
            np.copyto(container[key], saved[name] + t * u, casting="unsafe")
        try:
            return problem.analytic(dout)
        finally:
            for name in direction:
                container, key = problem.slots[name]
                np.copyto(container[key], saved[name])

    plus, minus = gradient_at(h), gradient_at(-h)
    return {name: (plus[name] - minus[name]) / (2 * h) for name in direction}


def check_symmetry(problem, dtype, eps=None, rtol=None, rng=None):
    """Symmetry of the Hessian-vector products of a :class:`~qkvnp.gradcheck.checker.Problem`.

    Returns
    -------
    SymmetryReport
    """
    dtype = np.dtype(dtype)
    if dtype not in SYMMETRY_TOLERANCES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SYMMETRY_TOLERANCES]}, "
                         f"got {dtype}")
    default_eps, default_rtol = SYMMETRY_TOLERANCES[dtype]
    eps = default_eps if eps is None else float(eps)
    rtol = default_rtol if rtol is None else float(rtol)
    rng = make_rng(0 if rng is None else rng)
    dout = draw_dout(problem.evaluate(), dtype, rng)
    grads = problem.analytic(dout)
    u, v = _unit_directions(grads, rng), _unit_directions(grads, rng)
    hu, hv = _hvp(problem, dout, u, eps), _hvp(problem, dout, v, eps)
    v_hu = sum(float(np.sum(v[name] * hu[name])) for name in grads)
    u_hv = sum(float(np.sum(u[name] * hv[name])) for name in grads)
    hvp_max = max(float(np.abs(h[name]).max(initial=0.0)) for h in (hu, hv) for name in grads)
    asymmetry = abs(v_hu - u_hv)
    denom = max(abs(v_hu), abs(u_hv), 1e-3 * hvp_max)  # |u| = |v| = 1
    relative = asymmetry / denom if denom > 0 else (0.0 if asymmetry == 0 else np.inf)
    relative = np.inf if np.isnan(relative) else float(relative)
    return SymmetryReport(v_hu, u_hv, asymmetry, relative, hvp_max, bool(relative <= rtol),
                          rtol, eps)


def check_symmetry_function(fun: Callable[..., Any], inputs: Mapping[str, ArrayLike],
                            vjp: Callable[..., Any], *, dtype: DTypeLike = np.float64,
                            eps: float | None = None, rtol: float | None = None,
                            rng: np.random.Generator | int | None = None) -> SymmetryReport:
    """Check ``<v, H u> = <u, H v>`` for the gradient ``vjp`` of ``<dout, fun>``.

    Parameters
    ----------
    fun, inputs, vjp
        As in :func:`qkvnp.gradcheck.check_function`.
    dtype : {float64, float32}
    eps, rtol : float, optional
        Step of the differences of the backward, and pass mark; default
        ``SYMMETRY_TOLERANCES`` (1e-4 and 1e-6 in float64).
    rng : Generator or int, optional
        Source of ``dout``, ``u`` and ``v`` (default seed 0).

    Returns
    -------
    SymmetryReport

    Examples
    --------
    >>> check_symmetry_function(lambda x: np.sin(x), {"x": np.arange(3.0)},
    ...                         lambda dout, x: {"x": np.cos(x) * dout}).ok
    True
    """
    return check_symmetry(function_problem(fun, inputs, vjp, dtype), dtype, eps, rtol, rng)


def check_symmetry_op(forward: Callable[..., Any], backward: Callable[..., Any],
                      inputs: Mapping[str, ArrayLike], *,
                      forward_kwargs: Mapping[str, Any] | None = None,
                      **options: Any) -> SymmetryReport:
    """:func:`check_symmetry_function` of a functional pair, as :func:`~qkvnp.gradcheck.check_op`."""
    forward_kwargs = {} if forward_kwargs is None else dict(forward_kwargs)
    fun, vjp = op_pair(forward, backward, list(inputs), forward_kwargs, None)
    return check_symmetry_function(fun, inputs, vjp, **options)


def check_symmetry_layer(layer: Any, *inputs: FloatArray,
                         forward_kwargs: Mapping[str, Any] | None = None,
                         dtype: DTypeLike = np.float64, eps: float | None = None,
                         rtol: float | None = None,
                         rng: np.random.Generator | int | None = None) -> SymmetryReport:
    """:func:`check_symmetry_function` over every parameter and input of a layer."""
    problem = layer_problem(layer, inputs, forward_kwargs, np.dtype(dtype), True)
    return check_symmetry(problem, dtype, eps, rtol, rng)
