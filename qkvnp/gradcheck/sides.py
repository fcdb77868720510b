"""The two sides of a check, by mode, and its rows: analytic values beside numerical ones.

Shape key: a checked tensor may have any shape; ``k`` sampled entries or
directions give sides of shape ``(k,)``.

``"elementwise"`` compares every entry (or the sampled ones), ``"direction"``
a few unit directions per tensor, ``"joint"`` a few unit directions over
every tensor at once (:mod:`qkvnp.gradcheck.checker`'s module docstring).
"""
import numpy as np

from .diagnosis import diagnose
from .report import GradcheckReport, GradcheckRow, relative_error
from .stencils import ORDERS, numeric_directions, numeric_elementwise, numeric_joint

__all__ = ["numeric_side", "check_sides", "joint_name", "counted", "check_rows"]


def numeric_side(problem, name, analytic, dout64, method, mode, tol, chosen):
    """``(analytic side, numeric side, estimate)`` of tensor ``name``, by mode.

    ``chosen``: the sampled entries (elementwise; None for all), the
    directions (direction), or the direction makers (joint, where ``name``
    stands for every tensor of ``analytic``, a dict).
    """
    if mode == "joint":
        slots = {tensor: problem.slots[tensor] for tensor in analytic}
        a, n = numeric_joint(slots, analytic, problem.evaluate, dout64, method, tol.eps, chosen)
        return a, n, None
    slot = problem.slots[name]
    if mode == "elementwise":
        numeric, estimate = numeric_elementwise(slot, problem.evaluate, dout64, method, tol.eps,
                                                chosen)
        if chosen is not None:
            analytic = analytic[tuple(np.array(chosen).T)]  # the sampled entries, (k,)
        return analytic, numeric, estimate
    a, n = numeric_directions(slot, analytic, problem.evaluate, dout64, method, tol.eps, chosen)
    return a, n, None


def _directions(shape, rng, num_directions):
    units = []
    for _ in range(num_directions):
        u = rng.standard_normal(shape)
        norm = np.linalg.norm(u)
        units.append(u / norm if norm > 0 else u)
    return units


def _joint_directions(grads, rng, num_directions):
    """Makers of unit directions over every tensor of ``grads`` together, one seed each.

    NOTE: made when used, not kept: a model's direction is the model's size.
    """
    seeds = rng.integers(0, 2 ** 63, size=num_directions)

    def maker(seed):
        def direction():
            draw = np.random.default_rng(int(seed))
            u = {name: draw.standard_normal(np.shape(g)) for name, g in grads.items()}
            norm = np.sqrt(sum(float(np.vdot(part, part)) for part in u.values()))
            for part in u.values():
                part /= norm if norm > 0 else 1.0
            return u
        return direction

    return [maker(seed) for seed in seeds]


def check_sides(problem, grads, dout64, method, mode, tol, rng, num_directions, entries):
    """``{row name: (analytic side, numeric side, chosen)}`` and Ridders' estimates."""
    if mode == "joint":
        chosen = _joint_directions(grads, rng, num_directions)
        a, n, _ = numeric_side(problem, None, grads, dout64, method, mode, tol, chosen)
        return {joint_name(grads): (a, n, chosen)}, {}
    sides, estimates = {}, {}
    for name, analytic in grads.items():
        shape = problem.slots[name][0][problem.slots[name][1]].shape
        if mode == "direction":
            chosen = _directions(shape, rng, num_directions)
        else:
            chosen = None if entries is None else entries.get(name)
        a, n, estimate = numeric_side(problem, name, analytic, dout64, method, mode, tol, chosen)
        sides[name] = (a, n, chosen)
        if estimate is not None:
            estimates[name] = float(estimate.max(initial=0.0))
    return sides, estimates


def joint_name(grads):
    """The row name of a ``"joint"`` check: ``"all (N tensors)"``."""
    return f"all ({len(grads)} tensors)"


def counted(evaluate, meter):
    """``evaluate`` that ticks ``meter`` after each forward."""

    def counted():
        out = evaluate()
        meter.tick()
        return out
    return counted


def _row(name, shape, a, n, atol, rtol):
    rel, abs_err = relative_error(a, n, atol)
    if rel.size == 0:
        return GradcheckRow(name, tuple(shape), 0.0, 0.0, (), 0.0, 0.0, True)
    worst = np.unravel_index(int(np.argmax(rel)), rel.shape)
    max_rel = float(rel.max())
    return GradcheckRow(name=name, shape=tuple(shape), max_abs_err=float(abs_err.max()),
                        max_rel_err=max_rel, worst_index=tuple(int(i) for i in worst),
                        analytic=float(np.asarray(a)[worst]),
                        numeric=float(np.asarray(n)[worst]), ok=bool(max_rel <= rtol))


def check_rows(problem, noise, grads, sides, dout64, method, mode, dtype, tol, model_floor):
    """The report's rows from the two sides of each tensor, with diagnoses.

    ``noise``: the round-off model's error of the numerical side.
    """
    scale = max((float(np.abs(n).max(initial=0.0)) for _, n, _ in sides.values()), default=0.0)
    atol = max(tol.atol, tol.floor * scale)
    if model_floor and tol.rtol > 0:
        # NOTE: derived, not loosened: an entry is held to the accuracy the
        # differences can have, noise / h, relative to rtol (E = 128: 5e-3).
        atol = max(atol, noise / tol.rtol)
    tol = tol._replace(atol=atol)
    rows = []
    for name, (a, n, chosen) in sides.items():
        shape = (sum(int(np.size(g)) for g in grads.values()),) if mode == "joint" \
            else grads[name].shape
        row = _row(name, shape, a, n, atol, tol.rtol)
        vector = mode != "elementwise" or chosen is not None  # compared as a list of values
        if mode != "elementwise":
            row = row._replace(worst_index=row.worst_index[0] if row.worst_index else 0)
        elif chosen is not None and row.worst_index:
            row = row._replace(worst_index=chosen[row.worst_index[0]])  # the tensor's entry
        if not row.ok:
            code, words = diagnose(a, n, tol.rtol, "direction" if vector else mode, noise)
            if code == "unknown" and _matches_for_ones(problem, name, grads, dout64, method, mode,
                                                       tol, chosen, atol):
                code, words = "ones_dout", (
                    "matches only for an all-ones dout: the backward ignores dout's values "
                    "(errors that cancel along a row)")
            row = row._replace(diagnosis=code, detail=words)
        rows.append(row)
    report = GradcheckReport(rows, mode, dtype, tol.eps, tol.rtol, atol, method=method,
                             order=ORDERS[method], floor=tol.floor)
    report.round_off = noise
    return report


def _matches_for_ones(problem, name, grads, dout64, method, mode, tol, chosen, atol):
    """Re-run tensor ``name``'s check with ``dout`` all ones: does it pass then?"""
    ones = np.ones_like(dout64)
    analytic = problem.analytic(ones)
    analytic = {tensor: analytic[tensor] for tensor in grads} if mode == "joint" \
        else analytic[name]
    a, n, _ = numeric_side(problem, name, analytic, ones, method, mode, tol, chosen)
    rel, _ = relative_error(a, n, atol)
    return bool(rel.max(initial=0.0) <= tol.rtol)
