"""What a gradient check reports: the tolerance table, the rows and the table.

Shape key: none; a row summarises one checked tensor of any shape.

:data:`TOLERANCES` is the one table of defaults, keyed by the dtype the
check computes in and then by method (:data:`qkvnp.gradcheck.stencils.METHODS`).
A :class:`GradcheckReport` holds one :class:`GradcheckRow` per tensor and
prints them as a fixed-width table, with the method, its truncation order
and, on a failing row, the diagnosis in words
(:mod:`qkvnp.gradcheck.diagnosis`).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Sequence
    from .._typing import DTypeLike


__all__ = [
    "TOLERANCES",
    "Tolerance",
    "GradcheckRow",
    "GradcheckReport",
    "GradcheckError",
    "relative_error",
    "nan_to_inf",
]

Tolerance = namedtuple("Tolerance", "eps rtol atol floor", defaults=(0.0,))
Tolerance.__doc__ = """Default step and tolerances of one dtype and method.

Attributes
----------
eps : float
    The step ``h`` (the first, largest step for ``"richardson"``).
rtol : float
    Largest accepted relative error.
atol : float
    Absolute floor of the relative error's denominator.
floor : float
    Floor relative to the check's largest numeric gradient entry (over every
    tensor): the denominator is ``max(|a|, |n|, atol, floor * max|n|)``.
"""

# NOTE: the one table of defaults, keyed by the dtype the check computes in.
# central, float64: h = 1e-5 sits near the optimum (eps_mach)^(1/3) ~ 6e-6;
# measured errors of attention gradients are ~1e-8 relative (truncation,
# ~h^2) and ~1e-10 absolute (round-off, ~eps_mach |L| / h), so rtol = 1e-6
# certifies with margin and the floor atol = 1e-3 turns the round-off of an
# exactly zero gradient into a relative error ~1e-7. float32 (eps_mach 1.2e-7)
# cannot certify more than a few digits: at h = 1e-2 truncation and round-off
# are both ~5e-3 relative (see --sweep-eps), so rtol = 5e-2.
# central4: optimum h ~ eps_mach^(1/5) (7e-4 in float64), error ~eps^(4/5) relative
# to |L|: measured 1.4e-9 against the floor atol on the multi-head layer.
# richardson: Ridders' tableau from h0 = 0.1 (its error estimate picks the step).
# complex_step: no subtraction, so no round-off / h term: h = 1e-30 leaves
# only the forward's own round-off (measured <= 1e-15 relative on the layers);
# the floor is relative to the largest gradient entry of the check, so that an
# exactly zero gradient (b_key) is held to 1e-15 of the layer's scale.
TOLERANCES = {
    np.dtype(np.float64): {
        "central": Tolerance(eps=1e-5, rtol=1e-6, atol=1e-3),
        "central4": Tolerance(eps=1e-3, rtol=1e-8, atol=1e-3),
        "richardson": Tolerance(eps=1e-1, rtol=1e-9, atol=1e-3),
        "complex_step": Tolerance(eps=1e-30, rtol=1e-12, atol=0.0, floor=1e-3),
    },
    np.dtype(np.float32): {
        "central": Tolerance(eps=1e-2, rtol=5e-2, atol=1e-2),
        "central4": Tolerance(eps=5e-2, rtol=2e-2, atol=1e-2),
        "richardson": Tolerance(eps=2e-1, rtol=2e-2, atol=1e-2),
    },
}

GradcheckRow = namedtuple(
    "GradcheckRow",
    "name shape max_abs_err max_rel_err worst_index analytic numeric ok diagnosis detail",
    defaults=(None, ""),
)
GradcheckRow.__doc__ = """Result of one checked tensor.

Attributes
----------
name : str
    E.g. ``"x"``, ``"param W_query"``, ``"input 0"``.
shape : tuple
    The tensor's shape.
max_abs_err, max_rel_err : float
    Over entries (or directions). With ``oracle_dtype``, the normwise error
    ``max|g - g_oracle| / max|g_oracle|``.
worst_index : tuple or int
    The entry (tuple) or direction number (int) of the largest relative error.
analytic, numeric : float
    The two values at ``worst_index`` (the oracle's value in place of the
    numeric one with ``oracle_dtype``).
ok : bool
    ``max_rel_err <= rtol``.
diagnosis : str or None
    A code of :data:`qkvnp.gradcheck.DIAGNOSES` on a failing row.
detail : str
    The diagnosis in words.
"""


class GradcheckError(ValueError):
    """Raised by :meth:`GradcheckReport.raise_if_failed`; its message is the table."""


class GradcheckReport:
    """Outcome of a gradient check: one :class:`GradcheckRow` per tensor.

    Attributes
    ----------
    ok : bool
        True when every row is within ``rtol``.
    rows : list of GradcheckRow
    mode, dtype, eps, rtol, atol
        The settings the check ran with.
    method : str
        ``"central"``, ``"central4"``, ``"richardson"``, ``"complex_step"``,
        or ``"oracle float64"`` for a mixed-precision check.
    order : str
        The method's truncation order, e.g. ``"O(h^2)"``.
    floor : float
        Floor of the denominator relative to the largest numeric entry.
    round_off : float
        The round-off model's absolute error of the numerical side
        (``u sum|dout f| / h``, central methods; 0 otherwise).
    error_estimates : dict
        ``"richardson"``: Ridders' error estimate per tensor (largest entry).
    sampled : str
        What a check of part of the entries checked (sampled entries, or
        ``"joint"`` directions), in words; empty when every entry was.

    Examples
    --------
    >>> from qkvnp.gradcheck import check_function
    >>> report = check_function(lambda x: 3 * x, {"x": np.ones(2)},
    ...                         lambda dout, x: {"x": 2 * dout})
    >>> report.ok, report.row("x").worst_index, report.row("x").diagnosis
    (False, (0,), 'ratio')
    """

    def __init__(self, rows: Sequence[GradcheckRow], mode: str, dtype: DTypeLike, eps: float,
                 rtol: float, atol: float, method: str = "central", order: str = "O(h^2)",
                 floor: float = 0.0) -> None:
        self.rows = list(rows)
        self.mode = mode
        self.dtype = np.dtype(dtype)
        self.eps = eps
        self.rtol = rtol
        self.atol = atol
        self.method = method
        self.order = order
        self.floor = floor
        self.round_off = 0.0
        self.error_estimates: dict[str, float] = {}
        self.sampled = ""
        self.ok = bool(self.rows) and all(row.ok for row in self.rows)

    def row(self, name: str) -> GradcheckRow:
        """Return the row named ``name`` (``KeyError`` listing the names if absent)."""
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row named {name!r}; rows are {[row.name for row in self.rows]}")

    @property
    def max_rel_err(self) -> float:
        """Largest relative error over all rows (NaN counts as infinite)."""
        return max((nan_to_inf(row.max_rel_err) for row in self.rows), default=0.0)

    def _header(self):
        verdict = "OK" if self.ok else "FAILED"
        if self.method.startswith("oracle"):
            eps = float(np.finfo(self.dtype).eps)
            return (f"gradcheck ({self.method}, {self.dtype} backward vs the oracle's, normwise "
                    f"max|g - g_oracle| / max|g_oracle|, pass <= {self.rtol / eps:.0f} eps "
                    f"= {self.rtol:.3g}): {verdict}")
        floor = f", floor={self.floor:g}*max|n|" if self.floor else ""
        return (f"gradcheck ({self.method} {self.order}, {self.mode}, {self.dtype}, "
                f"eps={self.eps:g}, rtol={self.rtol:g}, atol={self.atol:g}{floor}): {verdict}")

    def table(self) -> str:
        """Return the report as a readable fixed-width table; failing rows say why."""
        oracle = self.method.startswith("oracle")
        where = "direction" if self.mode == "direction" else "worst index"
        columns = ("tensor", "shape", "max abs err",
                   "err / eps" if oracle else "max rel err", where,
                   "analytic", "oracle" if oracle else "numeric", "")
        eps = float(np.finfo(self.dtype).eps)
        lines = []
        for row in self.rows:
            index = f"u{row.worst_index}" if self.mode == "direction" else str(row.worst_index)
            error = f"{row.max_rel_err / eps:.2f}" if oracle else f"{row.max_rel_err:.3e}"
            lines.append((
                row.name, str(row.shape), f"{row.max_abs_err:.3e}", error,
                index, f"{row.analytic:+.9e}", f"{row.numeric:+.9e}",
                "ok" if row.ok else "FAIL",
            ))
        widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c)
                  for i, c in enumerate(columns)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        body = [fmt.format(*columns).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
        body += [fmt.format(*line).rstrip() for line in lines]
        if self.sampled:
            body.append(f"sampled: {self.sampled}")
        if self.error_estimates:
            body.append("Ridders' error estimates: " + ", ".join(
                f"{name} {value:.1e}" for name, value in self.error_estimates.items()))
        why = [f"  {row.name}: {row.detail}" for row in self.rows if not row.ok and row.detail]
        if why:
            body += ["diagnosis:"] + why
        return "\n".join([self._header()] + body)

    __str__ = table

    def __repr__(self):
        return (f"<GradcheckReport ok={self.ok} method={self.method!r} mode={self.mode!r} "
                f"dtype={self.dtype} rows={len(self.rows)} max_rel_err={self.max_rel_err:.3e}>")

    def raise_if_failed(self) -> GradcheckReport:
        """Raise :class:`GradcheckError` (a ``ValueError``) with the table unless ``ok``."""
        if not self.ok:
            raise GradcheckError("gradient check failed\n" + self.table())
        return self


def nan_to_inf(value):
    """``value`` as a float, NaN mapped to inf (a NaN error is the worst error)."""
    return np.inf if np.isnan(value) else float(value)


def relative_error(analytic, numeric, atol):
    """``|a - n| / max(|a|, |n|, atol)`` elementwise, NaN mapped to inf, 0 where ``a == n``.

    Returns ``(relative, absolute)`` float64 arrays.
    """
    analytic = np.asarray(analytic, dtype=np.float64)
    numeric = np.asarray(numeric, dtype=np.float64)
    abs_err = np.abs(analytic - numeric)
    denom = np.maximum(np.maximum(np.abs(analytic), np.abs(numeric)), atol)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(abs_err == 0, 0.0, abs_err / denom)  # 0 / 0: both exactly zero
    return np.where(np.isnan(rel), np.inf, rel), np.where(np.isnan(abs_err), np.inf, abs_err)
