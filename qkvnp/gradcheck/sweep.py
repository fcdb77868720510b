"""Error against step: the curves of ``--sweep-eps``, per tensor, method and dtype.

Shape key: ``K`` steps in the sweep.

For each step ``h`` of :data:`SWEEP_EPS` and each method, the numerical
gradient of every tensor is compared with the float64 analytic gradient; the
error of a tensor is its largest relative error
``|a - n| / max(|a|, |n|, atol)`` (``atol`` of ``TOLERANCES[dtype]["central"]``).
Each curve is a V on log-log axes: truncation on the right (slope 2 for
central, 4 for central4), round-off on the left (slope -1: ``eps_mach / h``).
:func:`fit_branches` fits both slopes; :data:`OPTIMAL_STEPS` gives the
textbook optimum of each method (``(3 eps)^(1/3)``, ``eps^(1/5)``).
"""
from __future__ import annotations


import numpy as np

from .checker import layer_problem
from .report import TOLERANCES, relative_error
from .stencils import numeric_elementwise

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable, Sequence
    from .._typing import DTypeLike, FloatArray

__all__ = ["SWEEP_EPS", "SWEEP_METHODS", "OPTIMAL_STEPS", "sweep_steps", "sweep_eps",
           "fit_branches"]

#: Half a decade apart, 1e-1 .. 1e-10: enough points on each branch to fit its slope.
SWEEP_EPS = tuple(10.0 ** (-k / 2) for k in range(2, 21))

#: Methods swept by default; complex step in float64 only (complex128 forwards).
SWEEP_METHODS = ("central", "central4", "complex_step")


def _optimal_steps():
    steps = {}
    for dtype in (np.dtype(np.float64), np.dtype(np.float32)):
        eps = float(np.finfo(dtype).eps)
        steps[("central", dtype.name)] = (3 * eps) ** (1 / 3)
        steps[("central4", dtype.name)] = eps ** (1 / 5)
    return steps


#: Textbook optimum step of each (method, dtype name): truncation = round-off
#: for a function and derivatives of order one.
OPTIMAL_STEPS = _optimal_steps()


def fit_branches(eps_values, errors, saturation=0.5, above=3.0):
    """Fit ``log err = slope log h + c`` on each side of the best step.

    Parameters
    ----------
    eps_values, errors : sequence of float, shape (K,)
    saturation : float
        Errors above it are left out (the relative error saturates near 1).
    above : float
        Only points at least ``above`` times the best error are fitted: near
        the bottom of the V both errors mix (and complex step's is flat).

    Returns
    -------
    dict
        ``best_eps``, ``best_error``, ``truncation_slope`` (points with
        larger steps) and ``roundoff_slope`` (smaller steps); a slope is None
        when its branch has fewer than two usable points.

    Examples
    --------
    >>> h = np.logspace(-1, -8, 8)
    >>> fit = fit_branches(h, h ** 2 + 1e-14 / h)
    >>> round(fit["truncation_slope"], 2), round(fit["roundoff_slope"], 2), fit["best_eps"]
    (2.0, -1.0, 1e-05)
    """
    h = np.asarray(eps_values, dtype=np.float64)
    err = np.asarray(errors, dtype=np.float64)
    usable = np.isfinite(err) & (err > 0) & (err <= saturation)
    if not usable.any():
        return {"best_eps": None, "best_error": None, "truncation_slope": None,
                "roundoff_slope": None}
    best = int(np.argmin(np.where(usable, err, np.inf)))

    def slope(mask):
        if mask.sum() < 2:
            return None
        return float(np.polyfit(np.log10(h[mask]), np.log10(err[mask]), 1)[0])

    clear = usable & (err >= above * err[best])
    larger = clear & (h > h[best])
    smaller = clear & (h < h[best])
    return {"best_eps": float(h[best]), "best_error": float(err[best]),
            "truncation_slope": slope(larger), "roundoff_slope": slope(smaller)}


def sweep_steps(problems: Sequence[tuple[Any, ...]], eps_values: Sequence[float] = SWEEP_EPS,
                methods: Sequence[str] = SWEEP_METHODS,
                dtypes: Sequence[DTypeLike] = (np.float64, np.float32), seed: int = 0,
                progress: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Error of every tensor's numerical gradient over the steps, per method and dtype.

    Parameters
    ----------
    problems : list of (title, layer, inputs, forward_kwargs)
    eps_values : sequence of float
    methods : sequence of str
        Of :data:`qkvnp.gradcheck.METHODS` except ``"richardson"``
        (which picks its own steps); ``"complex_step"`` runs in float64 only,
        on the reference path.
    dtypes : sequence of dtype
    seed : int
        Seed of the random ``dout``.
    progress : callable, optional
        Called with a short string before each curve.

    Returns
    -------
    dict
        ``{"eps": [...], "curves": [...], "summary": [...]}``: a curve is
        ``{"problem", "tensor", "method", "dtype", "errors"}``; a summary
        entry is the worst error over every tensor of one ``(problem,
        method, dtype)`` with its ``fit_branches`` and ``optimal_eps``.
    """
    eps_values = [float(e) for e in eps_values]
    curves = []
    for title, layer, inputs, forward_kwargs in problems:
        rng = np.random.default_rng(seed)
        exact = layer_problem(layer, inputs, forward_kwargs, np.dtype(np.float64), True)
        dout = rng.standard_normal(np.shape(exact.evaluate()))
        grads = exact.analytic(dout)
        for dtype in (np.dtype(d) for d in dtypes):
            dout_cast = dout.astype(dtype).astype(np.float64)
            atol = TOLERANCES[dtype]["central"].atol
            for method in methods:
                if method not in TOLERANCES[dtype]:
                    continue  # complex step: float64 only
                problem = layer_problem(layer, inputs, forward_kwargs, dtype, True,
                                        reference=method == "complex_step")
                for name in grads:
                    if progress is not None:
                        progress(f"{title}: {name}, {method}, {dtype}")
                    errors = []
                    for eps in eps_values:
                        numeric, _ = numeric_elementwise(problem.slots[name], problem.evaluate,
                                                         dout_cast, method, eps)
                        rel, _ = relative_error(grads[name], numeric, atol)
                        errors.append(float(rel.max(initial=0.0)))
                    curves.append({"problem": title, "tensor": name, "method": method,
                                   "dtype": dtype.name, "errors": errors})
    summary = []
    for title in dict.fromkeys(c["problem"] for c in curves):
        for method in methods:
            for dtype_name in (np.dtype(d).name for d in dtypes):
                mine = [c["errors"] for c in curves if c["problem"] == title
                        and c["method"] == method and c["dtype"] == dtype_name]
                if not mine:
                    continue
                worst = np.max(np.array(mine), axis=0)
                summary.append({"problem": title, "method": method, "dtype": dtype_name,
                                "errors": worst.tolist(),
                                "optimal_eps": OPTIMAL_STEPS.get((method, dtype_name)),
                                **fit_branches(eps_values, worst)})
    return {"eps": eps_values, "curves": curves, "summary": summary}


def sweep_eps(problems: Sequence[tuple[Any, ...]], eps_values: Sequence[float] = SWEEP_EPS,
              dtypes: Sequence[DTypeLike] = (np.float64, np.float32),
              seed: int = 0) -> dict[np.dtype, FloatArray]:
    """Max relative error of central differences over ``eps``, per dtype.

    The analytic gradients are computed once in float64; the numerical ones
    in each dtype with each ``eps``. :func:`sweep_steps` with
    ``methods=("central",)``, reduced to the worst tensor.

    Returns
    -------
    dict dtype -> ndarray of shape (len(eps_values),)
    """
    result = sweep_steps(problems, eps_values, ("central",), dtypes, seed)
    errors: dict[np.dtype, FloatArray] = {np.dtype(d): np.zeros(len(eps_values)) for d in dtypes}
    for entry in result["summary"]:
        errors[np.dtype(entry["dtype"])] = np.maximum(errors[np.dtype(entry["dtype"])],
                                                      entry["errors"])
    return errors
