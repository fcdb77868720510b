"""Numerical gradient checks: central differences against hand-derived backwards.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim. A checked tensor may have any shape; the checker never looks
inside it.

A backward pass is checked through the scalar ``L = <dout, f(x)>`` with a
*random* upstream gradient ``dout`` (an all-ones ``dout`` hides errors that
cancel along a softmax row). Its exact gradient is ``vjp(dout)``, the
analytic vector-Jacobian product; its numerical gradient is the central
difference

.. math:: \\frac{\\partial L}{\\partial x_i} \\approx
          \\frac{\\langle dout, f(x + h e_i) - f(x - h e_i)\\rangle}{2h}

whose truncation error is :math:`O(h^2)` and whose round-off error is
:math:`O(\\epsilon_{mach} / h)`; ``python -m qkvnp gradcheck --sweep-eps``
shows both.

Two modes:

``"elementwise"``
    Perturb every entry of every tensor (two forwards per entry) and report,
    per tensor, the max absolute error, the max relative error and the worst
    index with the analytic value beside the numeric one.
``"direction"``
    For a few random unit directions ``u`` per tensor, compare
    ``<u, vjp(dout)>`` with ``<dout, (f(x + h u) - f(x - h u)) / 2h>``: two
    forwards per direction whatever the tensor's size.

Relative errors are ``|a - n| / max(|a|, |n|, atol)``: the absolute floor
``atol`` lets a gradient that is zero pass, where the round-off of the
numeric side would otherwise give a relative error of 1. Attention has
such a gradient: ``b_key`` adds ``q . b_key`` to *every* score of a query's
row, and softmax ignores a constant added to a row, so the output never
depends on ``b_key``: its gradient is zero in exact arithmetic (round-off as computed).

``import qkvnp.gradcheck`` imports numpy only; the layers are imported by the
command line (:mod:`qkvnp.gradcheck.command`) when it runs.
"""
import copy
import time
from collections import namedtuple

import numpy as np

from .._checks import check_int, make_rng

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "GradcheckRow",
    "GradcheckReport",
    "GradcheckError",
    "check_function",
    "check_op",
    "check_layer",
    "MODES",
    "SWEEP_EPS",
    "sweep_eps",
]

MODES = ("elementwise", "direction")

Tolerance = namedtuple("Tolerance", "eps rtol atol")
Tolerance.__doc__ = """Default step and tolerances of one dtype and mode.

eps : central-difference step ``h``.
rtol : largest accepted relative error.
atol : absolute floor of the relative error's denominator.
"""

# NOTE: the one table of defaults, keyed by the dtype the check computes in.
# float64: h = 1e-5 sits near the optimum (eps_mach)^(1/3) ~ 6e-6; measured
# errors of attention gradients are ~1e-8 relative (truncation, ~h^2) and
# ~1e-10 absolute (round-off, ~eps_mach |L| / h), so rtol = 1e-6 certifies
# with margin and the floor atol = 1e-3 turns the round-off of an exactly
# zero gradient into a relative error ~1e-7: entries below 1e-3 are checked
# to 1e-9 absolute. float32 (eps_mach 1.2e-7) cannot certify more than a few
# digits: at h = 1e-2 truncation and round-off are both ~5e-3 relative (see
# --sweep-eps), so rtol = 5e-2 still catches a missing term, a transpose or a
# wrong factor, not a subtle 1e-3 error: certify in float64.
TOLERANCES = {
    np.dtype(np.float64): {
        "elementwise": Tolerance(eps=1e-5, rtol=1e-6, atol=1e-3),
        "direction": Tolerance(eps=1e-5, rtol=1e-6, atol=1e-3),
    },
    np.dtype(np.float32): {
        "elementwise": Tolerance(eps=1e-2, rtol=5e-2, atol=1e-2),
        "direction": Tolerance(eps=1e-2, rtol=5e-2, atol=1e-2),
    },
}

GradcheckRow = namedtuple(
    "GradcheckRow",
    "name shape max_abs_err max_rel_err worst_index analytic numeric ok",
)
GradcheckRow.__doc__ = """Result of one checked tensor.

name : str, e.g. ``"x"``, ``"param W_query"``, ``"input 0"``.
shape : tuple, the tensor's shape.
max_abs_err, max_rel_err : float, over entries (or directions).
worst_index : tuple (entry) or int (direction number) of the largest
    relative error.
analytic, numeric : float, the two values at ``worst_index``.
ok : bool, ``max_rel_err <= rtol``.
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

    Examples
    --------
    >>> report = check_function(lambda x: 3 * x, {"x": np.ones(2)},
    ...                         lambda dout, x: {"x": 2 * dout})
    >>> report.ok, report.row("x").worst_index
    (False, (0,))
    """

    def __init__(self, rows, mode, dtype, eps, rtol, atol):
        self.rows = list(rows)
        self.mode = mode
        self.dtype = np.dtype(dtype)
        self.eps = eps
        self.rtol = rtol
        self.atol = atol
        self.ok = bool(self.rows) and all(row.ok for row in self.rows)

    def row(self, name):
        """Return the row named ``name`` (``KeyError`` listing the names if absent)."""
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row named {name!r}; rows are {[row.name for row in self.rows]}")

    @property
    def max_rel_err(self):
        """Largest relative error over all rows (NaN counts as infinite)."""
        return max((_nan_to_inf(row.max_rel_err) for row in self.rows), default=0.0)

    def table(self):
        """Return the report as a readable fixed-width table."""
        where = "direction" if self.mode == "direction" else "worst index"
        header = (
            f"gradcheck ({self.mode}, {self.dtype}, eps={self.eps:g}, "
            f"rtol={self.rtol:g}, atol={self.atol:g}): {'OK' if self.ok else 'FAILED'}"
        )
        columns = ("tensor", "shape", "max abs err", "max rel err", where,
                   "analytic", "numeric", "")
        lines = []
        for row in self.rows:
            index = f"u{row.worst_index}" if self.mode == "direction" else str(row.worst_index)
            lines.append((
                row.name, str(row.shape), f"{row.max_abs_err:.3e}", f"{row.max_rel_err:.3e}",
                index, f"{row.analytic:+.9e}", f"{row.numeric:+.9e}",
                "ok" if row.ok else "FAIL",
            ))
        widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c)
                  for i, c in enumerate(columns)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        body = [fmt.format(*columns).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
        body += [fmt.format(*line).rstrip() for line in lines]
        return "\n".join([header] + body)

    __str__ = table

    def __repr__(self):
        return (f"<GradcheckReport ok={self.ok} mode={self.mode!r} dtype={self.dtype} "
                f"rows={len(self.rows)} max_rel_err={self.max_rel_err:.3e}>")

    def raise_if_failed(self):
        """Raise :class:`GradcheckError` (a ``ValueError``) with the table unless ``ok``."""
        if not self.ok:
            raise GradcheckError("gradient check failed\n" + self.table())
        return self


# ------------------------------------------------------------------ engine


def _nan_to_inf(value):
    return np.inf if np.isnan(value) else float(value)


def _relative_error(analytic, numeric, atol):
    """``|a - n| / max(|a|, |n|, atol)`` elementwise, NaN mapped to inf."""
    analytic = np.asarray(analytic, dtype=np.float64)
    numeric = np.asarray(numeric, dtype=np.float64)
    abs_err = np.abs(analytic - numeric)
    denom = np.maximum(np.maximum(np.abs(analytic), np.abs(numeric)), atol)
    with np.errstate(invalid="ignore"):
        rel = abs_err / denom
    return np.where(np.isnan(rel), np.inf, rel), np.where(np.isnan(abs_err), np.inf, abs_err)


def _snapshot(evaluate):
    """``evaluate()`` as a float64 copy: an output may be a view of the perturbed input."""
    out = evaluate()
    return np.array(out, dtype=np.float64) if np.asarray(out).dtype.kind == "f" else np.asarray(out)


def _inner_difference(dout, plus, minus):
    """``<dout, plus - minus>`` in float64 (the difference first: no cancellation in a sum)."""
    plus = np.asarray(plus)
    minus = np.asarray(minus)
    if plus.shape != dout.shape or minus.shape != dout.shape:
        raise ValueError(
            f"the checked function must keep its output shape {dout.shape} under "
            f"perturbation, got shapes {plus.shape} and {minus.shape}"
        )
    return float(np.sum(dout * (plus.astype(np.float64) - minus.astype(np.float64))))


def _numeric_elementwise(array, evaluate, dout, eps):
    """Central-difference gradient of ``<dout, evaluate()>`` w.r.t. ``array``, in place.

    ``array`` is perturbed entry by entry and restored exactly. The divisor
    is the step actually taken, ``(x + h) - (x - h)`` as rounded in
    ``array``'s dtype, not ``2h``: in float32 the two differ by up to 1e-4
    relative, which would otherwise show up as gradient error.
    """
    numeric = np.empty(array.shape, dtype=np.float64)
    for index in np.ndindex(array.shape):
        original = array[index].copy()
        array[index] = original + eps
        high = float(array[index])
        plus = _snapshot(evaluate)
        array[index] = original - eps
        low = float(array[index])
        minus = _snapshot(evaluate)
        array[index] = original
        step = high - low
        # NOTE: a step below the spacing of floats at x rounds to 0: no derivative.
        numeric[index] = _inner_difference(dout, plus, minus) / step if step else np.nan
    return numeric


def _row_from_errors(name, shape, analytic, numeric, tol):
    rel, abs_err = _relative_error(analytic, numeric, tol.atol)
    if rel.size == 0:
        return GradcheckRow(name, tuple(shape), 0.0, 0.0, (), 0.0, 0.0, True)
    worst = np.unravel_index(int(np.argmax(rel)), rel.shape)
    max_rel = float(rel.max())
    return GradcheckRow(
        name=name,
        shape=tuple(shape),
        max_abs_err=float(abs_err.max()),
        max_rel_err=max_rel,
        worst_index=tuple(int(i) for i in worst),
        analytic=float(np.asarray(analytic)[worst]),
        numeric=float(np.asarray(numeric)[worst]),
        ok=bool(max_rel <= tol.rtol),
    )


def _check_elementwise(name, array, analytic, evaluate, dout, tol):
    numeric = _numeric_elementwise(array, evaluate, dout, tol.eps)
    return _row_from_errors(name, array.shape, analytic, numeric, tol)


def _check_directions(name, array, analytic, evaluate, dout, tol, rng, num_directions):
    """Compare ``<u, analytic>`` with ``<dout, f(x + h u) - f(x - h u)> / 2h``.

    Both sides use the displacement actually stored in ``array``'s dtype, so
    that rounding the perturbed input does not count as gradient error.
    """
    saved = array.copy()
    analytic_values = np.empty(num_directions)
    numeric_values = np.empty(num_directions)
    for k in range(num_directions):
        u = rng.standard_normal(array.shape)
        norm = np.linalg.norm(u)
        u = u / norm if norm > 0 else u
        np.copyto(array, saved + tol.eps * u, casting="unsafe")
        high = array.astype(np.float64)
        plus = _snapshot(evaluate)
        np.copyto(array, saved - tol.eps * u, casting="unsafe")
        low = array.astype(np.float64)
        minus = _snapshot(evaluate)
        np.copyto(array, saved)
        step = high - low  # ~ 2h u, as rounded in array's dtype
        analytic_values[k] = float(np.sum(analytic * step)) / (2 * tol.eps)
        numeric_values[k] = _inner_difference(dout, plus, minus) / (2 * tol.eps)
    row = _row_from_errors(name, array.shape, analytic_values, numeric_values, tol)
    return row._replace(worst_index=row.worst_index[0] if row.worst_index else 0)


def _resolve(mode, dtype, eps, rtol, atol, num_directions):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dtype not in TOLERANCES:
        raise ValueError(
            f"dtype must be one of {[str(d) for d in TOLERANCES]} (the keys of "
            f"TOLERANCES), got {dtype}"
        )
    default = TOLERANCES[dtype][mode]
    values = {}
    for name, value, fallback in (("eps", eps, default.eps), ("rtol", rtol, default.rtol),
                                  ("atol", atol, default.atol)):
        if value is None:
            value = fallback
        if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
        value = float(value)
        if not np.isfinite(value) or value < 0 or (name == "eps" and value == 0):
            raise ValueError(f"{name} must be a finite {'positive' if name == 'eps' else 'non-negative'} "
                             f"number, got {value}")
        values[name] = value
    num_directions = check_int(num_directions, "num_directions", 1, expected="a positive int")
    return dtype, Tolerance(**values), num_directions


def _draw_dout(out, dtype, rng):
    out = np.asarray(out)
    if out.dtype.kind != "f":
        raise TypeError(f"the checked function must return a float array, got dtype {out.dtype}")
    if not np.isfinite(out).all():
        raise ValueError("the checked function returned NaN or inf at the unperturbed input")
    # NOTE: random, never all ones: ones hide errors that cancel along a softmax row.
    dout = rng.standard_normal(out.shape).astype(dtype)
    return dout, dout.astype(np.float64)


def _check_grad_shape(grad, name, shape):
    grad = np.asarray(grad)
    if grad.shape != tuple(shape):
        raise ValueError(
            f"the analytic gradient of {name!r} must have the shape of {name!r}, "
            f"{tuple(shape)}, got shape {grad.shape}"
        )
    return grad.astype(np.float64)


def _run(tensors, analytic, evaluate, dout64, mode, dtype, tol, rng, num_directions):
    for name, array in tensors.items():
        if not np.isfinite(array).all():
            raise ValueError(
                f"{name!r} contains NaN or inf: central differences need finite inputs "
                "(express a -inf mask as a mask argument, not as a checked input)"
            )
    rows = []
    for name, array in tensors.items():
        if mode == "elementwise":
            rows.append(_check_elementwise(name, array, analytic[name], evaluate, dout64, tol))
        else:
            rows.append(_check_directions(name, array, analytic[name], evaluate, dout64, tol,
                                          rng, num_directions))
    return GradcheckReport(rows, mode, dtype, tol.eps, tol.rtol, tol.atol)


# ------------------------------------------------------------------ public API


def _working_inputs(inputs, dtype):
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict name -> array, got {type(inputs).__name__}")
    work = {}
    for name, value in inputs.items():
        if isinstance(value, (np.ndarray, list, tuple)) and np.asarray(value).dtype.kind in "fiu":
            work[name] = np.array(value, dtype=dtype)  # a copy: perturbed in place
        else:
            work[name] = value  # masks, scalars, None: passed through, never differentiated
    return work


def check_function(fun, inputs, vjp, *, mode="elementwise", dtype=np.float64, eps=None,
                   rtol=None, atol=None, rng=None, num_directions=5):
    """Check a vector-Jacobian product ``vjp`` against central differences of ``fun``.

    Parameters
    ----------
    fun : callable
        ``fun(**inputs) -> ndarray``, the forward.
    inputs : dict of str -> array_like
        The point at which to check. Float and integer arrays are copied and
        cast to ``dtype``; any other value (a bool mask, a scalar, None) is
        passed through unchanged and never differentiated.
    vjp : callable
        ``vjp(dout, **inputs) -> dict name -> gradient``: the gradient of
        ``<dout, fun(**inputs)>`` w.r.t. each input, of that input's shape. A
        name mapped to None (or absent) is skipped.
    mode : {"elementwise", "direction"}
        ``"elementwise"`` perturbs every entry (2 forwards each);
        ``"direction"`` checks ``num_directions`` random directions per
        tensor (2 forwards each), for tensors too large to sweep.
    dtype : {float64, float32}
        Precision of the check; it selects the defaults in :data:`TOLERANCES`.
    eps, rtol, atol : float, optional
        Step ``h``, accepted relative error, absolute floor of the relative
        error's denominator. Default: ``TOLERANCES[dtype][mode]``.
    rng : numpy.random.Generator or int, optional
        Source of ``dout`` and of the directions; default seed 0, so that a
        check reproduces.
    num_directions : int
        Directions per tensor in ``"direction"`` mode.

    Returns
    -------
    GradcheckReport
        One row per differentiable input; ``report.ok`` and ``report.table()``.

    Raises
    ------
    TypeError, ValueError
        On a bad mode, dtype, eps/rtol/atol, on non-dict inputs or gradients,
        a gradient of the wrong shape, a gradient for an unknown or
        non-differentiable input, or no differentiable input at all.

    Notes
    -----
    With a random ``dout`` (standard normal), ``L = <dout, fun(x)>``. The
    analytic side is ``g = vjp(dout)``; elementwise, the numeric side is
    ``(L(x + h e_i) - L(x - h e_i)) / 2h`` and the error per entry is
    ``|g_i - n_i| / max(|g_i|, |n_i|, atol)``. In direction mode it compares
    ``<u, g>`` with ``(L(x + h u) - L(x - h u)) / 2h`` for unit vectors ``u``.
    A gradient that is zero in exact arithmetic (``b_key`` of attention:
    softmax ignores the constant ``q . b_key`` added to a row), computed as
    round-off on both sides, passes thanks to ``atol``.

    Examples
    --------
    >>> x = np.array([1.0, -2.0, 3.0])
    >>> report = check_function(lambda x: x ** 2, {"x": x},
    ...                         lambda dout, x: {"x": 2 * x * dout})
    >>> report.ok, report.row("x").shape
    (True, (3,))
    """
    dtype, tol, num_directions = _resolve(mode, dtype, eps, rtol, atol, num_directions)
    if not callable(fun) or not callable(vjp):
        raise TypeError("fun and vjp must be callables")
    rng = make_rng(0 if rng is None else rng)
    work = _working_inputs(inputs, dtype)
    dout, dout64 = _draw_dout(fun(**work), dtype, rng)
    grads = vjp(dout, **work)
    if not isinstance(grads, dict):
        raise TypeError(f"vjp must return a dict name -> gradient, got {type(grads).__name__}")
    unknown = [name for name in grads if name not in work]
    if unknown:
        raise ValueError(f"vjp returned gradients for unknown inputs {unknown}; "
                         f"inputs are {list(work)}")
    tensors, analytic = {}, {}
    for name, value in work.items():
        grad = grads.get(name)
        if grad is None:
            continue
        if not isinstance(value, np.ndarray):
            raise TypeError(f"vjp returned a gradient for {name!r}, which is not a float "
                            f"array (got {type(value).__name__}); map it to None")
        tensors[name] = value
        analytic[name] = _check_grad_shape(grad, name, value.shape)
    if not tensors:
        raise ValueError("vjp returned no gradient: nothing to check")
    return _run(tensors, analytic, lambda: fun(**work), dout64, mode, dtype, tol, rng,
                num_directions)


def check_op(forward, backward, inputs, *, forward_kwargs=None, wrt=None, **options):
    """Check a functional pair ``forward -> (out, cache)``, ``backward(dout, cache)``.

    Parameters
    ----------
    forward : callable
        ``forward(**inputs, **forward_kwargs) -> (out, cache)``.
    backward : callable
        ``backward(dout, cache) -> tuple`` of gradients in the order of
        ``inputs`` (a single array for a one-input op). Trailing extra
        entries must be None (``linear_backward`` returns ``db=None`` when
        called without a bias).
    inputs : dict of str -> ndarray
        Differentiable inputs, in the order ``backward`` returns them.
    forward_kwargs : dict, optional
        Non-differentiable arguments (masks, ``axis``, ``num_heads``...).
    wrt : iterable of str, optional
        Names to check (default: every input whose gradient is not None).
    **options
        ``mode, dtype, eps, rtol, atol, rng, num_directions`` of
        :func:`check_function`.

    Returns
    -------
    GradcheckReport

    Examples
    --------
    >>> from qkvnp.functional import attention_forward, attention_backward
    >>> rng = np.random.default_rng(0)
    >>> inputs = {"query": rng.normal(size=(3, 4)), "key": rng.normal(size=(5, 4)),
    ...           "value": rng.normal(size=(5, 2))}
    >>> check_op(attention_forward, attention_backward, inputs,
    ...          forward_kwargs={"is_causal": True}).ok
    True
    """
    forward_kwargs = {} if forward_kwargs is None else dict(forward_kwargs)
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict name -> array, got {type(inputs).__name__}")
    names = list(inputs)
    if wrt is not None:
        wrt = [wrt] if isinstance(wrt, str) else list(wrt)
        missing = [name for name in wrt if name not in inputs]
        if missing:
            raise ValueError(f"wrt names {missing} are not inputs; inputs are {names}")

    def fun(**values):
        return forward(**values, **forward_kwargs)[0]

    def vjp(dout, **values):
        _, cache = forward(**values, **forward_kwargs)
        grads = backward(dout, cache)
        if not isinstance(grads, tuple):
            grads = (grads,)
        if len(grads) < len(names) or any(g is not None for g in grads[len(names):]):
            raise ValueError(
                f"backward must return one gradient per input {names} (extra entries "
                f"must be None), got {len(grads)} values"
            )
        return {name: grad for name, grad in zip(names, grads)
                if wrt is None or name in wrt}

    return check_function(fun, inputs, vjp, **options)


def _layer_copy_in_dtype(layer, dtype):
    """Return ``layer`` itself if its params are in ``dtype``, else a cast deep copy."""
    if all(p.dtype == dtype for p in layer.params.values()):
        return layer
    layer = copy.deepcopy(layer)
    layer.params = {name: p.astype(dtype) for name, p in layer.params.items()}
    if hasattr(layer, "dtype"):
        layer.dtype = dtype
    layer.zero_grad()
    return layer


def _layer_problem(layer, inputs, forward_kwargs, dtype, wrt_inputs):
    """Tensors to perturb, a forward closure and the analytic gradients of a layer."""
    for attribute in ("params", "grads", "forward", "backward", "zero_grad"):
        if not hasattr(layer, attribute):
            raise TypeError(f"layer must have params, grads, forward, backward and "
                            f"zero_grad, got {type(layer).__name__} without {attribute!r}")
    forward_kwargs = {} if forward_kwargs is None else dict(forward_kwargs)
    if forward_kwargs.get("return_weights"):
        raise ValueError("forward_kwargs must not set return_weights: the check needs "
                         "the output alone")
    layer = _layer_copy_in_dtype(layer, dtype)
    arrays = [np.array(x, dtype=dtype) for x in inputs]  # copies, perturbed in place

    def evaluate():
        return layer.forward(*arrays, **forward_kwargs)

    def analytic(dout):
        layer.zero_grad()
        evaluate()
        dinputs = layer.backward(dout)
        if not isinstance(dinputs, tuple):
            dinputs = (dinputs,)
        if len(dinputs) < len(arrays):
            raise ValueError(f"layer.backward returned {len(dinputs)} gradients for "
                             f"{len(arrays)} inputs")
        grads = {f"param {name}": _check_grad_shape(layer.grads[name], f"param {name}", p.shape)
                 for name, p in layer.params.items()}
        if wrt_inputs:
            for i, (x, dx) in enumerate(zip(arrays, dinputs)):
                if dx is not None:
                    grads[f"input {i}"] = _check_grad_shape(dx, f"input {i}", x.shape)
        return grads

    tensors = {f"param {name}": p for name, p in layer.params.items()}
    tensors.update({f"input {i}": x for i, x in enumerate(arrays)})
    return tensors, evaluate, analytic


def check_layer(layer, *inputs, forward_kwargs=None, wrt_inputs=True, mode="elementwise",
                dtype=np.float64, eps=None, rtol=None, atol=None, rng=None, num_directions=5):
    """Check every parameter gradient and input gradient of a layer.

    Parameters
    ----------
    layer : Layer
        Anything with ``params``, ``grads``, ``forward``, ``backward`` and
        ``zero_grad`` (:class:`qkvnp.SelfAttention`,
        :class:`qkvnp.MultiHeadAttention`). Its ``params`` are perturbed in
        place and restored exactly; ``zero_grad()`` is called, and afterwards
        ``grads`` hold the gradients of the check's random ``dout``. If
        ``dtype`` differs from the params' dtype, a cast deep copy is checked
        and ``layer`` is left untouched.
    *inputs : ndarray
        Positional inputs of ``layer.forward`` (copied and cast to ``dtype``).
    forward_kwargs : dict, optional
        Keyword arguments of ``layer.forward`` (masks, ``is_causal``).
    wrt_inputs : bool
        Also check the input gradients returned by ``backward`` (one array,
        or a tuple whose None entries are skipped).
    mode, dtype, eps, rtol, atol, rng, num_directions
        As in :func:`check_function`. ``dtype`` is float64 whatever the
        layer's dtype (a float32 layer is checked through a float64 copy, to
        certify its math); pass ``dtype=np.float32`` to check float32
        arithmetic with the float32 tolerances.

    Returns
    -------
    GradcheckReport
        Rows ``"param W_query"``, ..., ``"input 0"``, ...

    Examples
    --------
    ``b_key`` has a zero gradient (0 in exact arithmetic, round-off as computed) (softmax ignores the constant
    ``q . b_key`` added to each row), and passes thanks to the floor ``atol``:

    >>> from qkvnp import MultiHeadAttention
    >>> layer = MultiHeadAttention(4, 2, rng=0)
    >>> x = np.random.default_rng(0).normal(size=(2, 3, 4))
    >>> report = check_layer(layer, x, forward_kwargs={"is_causal": True})
    >>> report.ok, report.row("param b_key").analytic
    (True, 0.0)
    """
    if not inputs:
        raise ValueError("check_layer needs at least one input array for layer.forward")
    dtype, tol, num_directions = _resolve(mode, dtype, eps, rtol, atol, num_directions)
    rng = make_rng(0 if rng is None else rng)
    tensors, evaluate, analytic = _layer_problem(layer, inputs, forward_kwargs, dtype, wrt_inputs)
    dout, dout64 = _draw_dout(evaluate(), dtype, rng)
    grads = analytic(dout)
    tensors = {name: array for name, array in tensors.items() if name in grads}
    return _run(tensors, grads, evaluate, dout64, mode, dtype, tol, rng, num_directions)


SWEEP_EPS = tuple(10.0 ** -k for k in range(1, 11))


def sweep_eps(problems, eps_values=SWEEP_EPS, dtypes=(np.float64, np.float32), seed=0):
    """Max relative error of numerical gradients over ``eps``, per dtype.

    The analytic gradients are computed once in float64; the numerical ones
    in each dtype with each ``eps``. The relative error of an entry is
    ``|a - n| / max(|a|, |n|, atol)`` with the elementwise ``atol`` of that
    dtype in :data:`TOLERANCES`.

    Parameters
    ----------
    problems : list of (title, layer, inputs, forward_kwargs)
    eps_values : sequence of float
    dtypes : sequence of dtype
    seed : int
        Seed of the random ``dout``.

    Returns
    -------
    dict dtype -> ndarray of shape (len(eps_values),)
    """
    errors = {np.dtype(d): np.zeros(len(eps_values)) for d in dtypes}
    for _, layer, inputs, forward_kwargs in problems:
        rng = np.random.default_rng(seed)
        tensors64, evaluate64, analytic64 = _layer_problem(
            layer, inputs, forward_kwargs, np.dtype(np.float64), True)
        dout = rng.standard_normal(np.shape(evaluate64()))
        grads = analytic64(dout)
        for dtype in errors:
            tensors, evaluate, _ = _layer_problem(layer, inputs, forward_kwargs, dtype, True)
            dout_cast = dout.astype(dtype).astype(np.float64)
            atol = TOLERANCES[dtype]["elementwise"].atol
            for j, eps in enumerate(eps_values):
                for name, array in tensors.items():
                    if name not in grads:
                        continue
                    numeric = _numeric_elementwise(array, evaluate, dout_cast, eps)
                    rel, _ = _relative_error(grads[name], numeric, atol)
                    errors[dtype][j] = max(errors[dtype][j], float(rel.max(initial=0.0)))
    return errors
