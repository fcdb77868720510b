"""Numerical derivatives of ``L = <dout, f(x)>``: the four methods of the checker.

Shape key: a checked tensor may have any shape; ``u`` is a direction of that
shape, ``e_i`` the unit vector of entry ``i``.

Each method estimates the directional derivative ``phi'(0)`` of
``phi(t) = <dout, f(x + t u)>``, always forming the differences of the
outputs *before* the inner product with ``dout`` (a difference of two sums
would cancel):

==================  ========================================  ==============  ============
method              estimate                                  truncation      round-off
==================  ========================================  ==============  ============
``central``         ``(phi(h) - phi(-h)) / 2h``               ``h^2 f'''/6``  ``eps / h``
``central4``        ``(8 (phi(h) - phi(-h)) - (phi(2h) -      ``h^4 f^(5)/30``  ``eps / h``
                    phi(-2h))) / 12h``
``richardson``      Ridders: central differences at ``h,      ``h^(2k)``,     ``eps / h``
                    h/1.4, ...`` extrapolated to ``h -> 0``   ``k`` adaptive
``complex_step``    ``Im phi(i h) / h``                       ``h^2 f'''/6``  none
==================  ========================================  ==============  ============

The optimum steps balance the two columns: ``h ~ (3 eps)^(1/3)`` for
``central`` and ``h ~ eps^(1/5)`` for ``central4``; complex step has no
subtraction, so ``h = 1e-30`` makes its truncation vanish and leaves the
forward's own round-off (see ``docs/gradcheck.md``).
"""
import numpy as np

from .._checks import complex_step_mode

__all__ = ["METHODS", "ORDERS", "snapshot", "numeric_elementwise", "numeric_directions",
           "numeric_joint", "RIDDERS_STEPS", "RIDDERS_SHRINK"]

METHODS = ("central", "central4", "richardson", "complex_step")

#: Truncation order of each method, as the reports print it.
ORDERS = {
    "central": "O(h^2)",
    "central4": "O(h^4)",
    "richardson": "O(h^2k), Ridders",
    "complex_step": "O(h^2), no cancellation",
}

RIDDERS_STEPS = 7  # central differences per entry: h, h/1.4, ..., h/1.4^6
RIDDERS_SHRINK = 1.4  # Numerical Recipes' CON: steps shrink by 1.4, h^2 by 1.96


def snapshot(out):
    """``out`` as a float64 (or complex128) copy: an output may be a view of the input."""
    out = np.asarray(out)
    if out.dtype.kind == "c":
        return np.array(out, dtype=np.complex128)
    return np.array(out, dtype=np.float64) if out.dtype.kind == "f" else out


def _checked_output(out, dout):
    if out.shape != dout.shape:
        raise ValueError(
            f"the checked function must keep its output shape {dout.shape} under "
            f"perturbation, got shape {out.shape}"
        )
    return out


def _central(at, dout, h):
    """``<dout, f(h) - f(-h)> / 2h``: the difference first, then the sum."""
    return float(np.sum(dout * (at(h) - at(-h)))) / (2 * h), 0.0


def _central4(at, dout, h):
    """The five-point stencil ``(8 D(h) - D(2h)) / 12h`` with ``D(s) = f(s) - f(-s)``."""
    near = at(h) - at(-h)
    far = at(2 * h) - at(-2 * h)
    return float(np.sum(dout * (8 * near - far))) / (12 * h), 0.0


def _ridders(at, dout, h):
    """Ridders' method (Numerical Recipes' ``dfridr``): value and error estimate.

    Column 0 of the tableau holds central differences at ``h / 1.4^i``; each
    next column eliminates the next even power of ``h``. The answer is the
    entry whose change from its neighbours is smallest, and that change is
    the error estimate; the iteration stops when a new diagonal entry is
    worse than twice the best estimate.
    """
    factor = RIDDERS_SHRINK ** 2
    tableau = np.zeros((RIDDERS_STEPS, RIDDERS_STEPS))
    tableau[0, 0] = _central(at, dout, h)[0]
    best, error = tableau[0, 0], np.inf
    for i in range(1, RIDDERS_STEPS):
        h = h / RIDDERS_SHRINK
        tableau[0, i] = _central(at, dout, h)[0]
        scale = factor
        for j in range(1, i + 1):
            tableau[j, i] = (tableau[j - 1, i] * scale - tableau[j - 1, i - 1]) / (scale - 1)
            scale *= factor
            change = max(abs(tableau[j, i] - tableau[j - 1, i]),
                         abs(tableau[j, i] - tableau[j - 1, i - 1]))
            if change <= error:
                best, error = tableau[j, i], change
        if abs(tableau[i, i] - tableau[i - 1, i - 1]) >= 2 * error:
            break
    return float(best), float(error)


_STENCILS = {"central": _central, "central4": _central4, "richardson": _ridders}


def _central_elementwise(array, evaluate, dout, eps, indices=None):
    """Central differences entry by entry, divided by the step actually taken.

    The divisor is ``(x + h) - (x - h)`` as rounded in ``array``'s dtype,
    not ``2h``: in float32 the two differ by up to 1e-4 relative, which
    would otherwise show up as gradient error.
    """
    numeric = np.empty(array.shape if indices is None else len(indices), dtype=np.float64)
    for at, index in _positions(array.shape, indices):
        original = array[index].copy()
        array[index] = original + eps
        high = float(array[index])
        plus = _checked_output(snapshot(evaluate()), dout)
        array[index] = original - eps
        low = float(array[index])
        minus = _checked_output(snapshot(evaluate()), dout)
        array[index] = original
        step = high - low
        # NOTE: a step below the spacing of floats at x rounds to 0: no derivative.
        numeric[at] = float(np.sum(dout * (plus - minus))) / step if step else np.nan
    return numeric


def _positions(shape, indices):
    """``(where to store, entry of the array)`` for every entry, or for the given ones."""
    if indices is None:
        return ((index, index) for index in np.ndindex(shape))
    return enumerate(indices)


def numeric_elementwise(slot, evaluate, dout, method, h, indices=None):
    """Numerical gradient of ``<dout, evaluate()>`` w.r.t. the array in ``slot``.

    Parameters
    ----------
    slot : (container, key)
        ``container[key]`` is the array ``evaluate`` reads; it is perturbed
        in place (or, for complex step, replaced by a complex copy) and
        restored exactly.
    evaluate : callable
        The forward, reading the containers.
    dout : ndarray, float64
    method : str
        One of :data:`METHODS`.
    h : float
        The step (the first step of Ridders' tableau).
    indices : list of index tuples, optional
        Only these entries (a sampled check); default every entry.

    Returns
    -------
    numeric : ndarray, float64, the array's shape (``(len(indices),)`` if given)
    estimate : ndarray or None
        Ridders' error estimate per entry (``"richardson"`` only).
    """
    container, key = slot
    array = container[key]
    if method == "central":
        return _central_elementwise(array, evaluate, dout, h, indices), None
    numeric = np.empty(array.shape if indices is None else len(indices), dtype=np.float64)
    if method == "complex_step":
        work = array.astype(np.complex128)
        container[key] = work
        try:
            with complex_step_mode():
                for at, index in _positions(array.shape, indices):
                    original = work[index]
                    work[index] = original + 1j * h
                    # a copy before the restore: the output may be a view of ``work``
                    out = _checked_output(np.array(evaluate(), dtype=np.complex128), dout)
                    work[index] = original
                    numeric[at] = float(np.sum(dout * out.imag)) / h
        finally:
            container[key] = array
        return numeric, None
    estimate = np.empty(numeric.shape, dtype=np.float64)
    for where, index in _positions(array.shape, indices):
        original = array[index].copy()

        def at(t):
            array[index] = original + t
            try:
                return _checked_output(snapshot(evaluate()), dout)
            finally:
                array[index] = original

        numeric[where], estimate[where] = _STENCILS[method](at, dout, h)
    return numeric, (estimate if method == "richardson" else None)


def numeric_directions(slot, analytic, evaluate, dout, method, h, directions):
    """``<u, analytic>`` and the numeric ``phi'(0)`` for each direction ``u``.

    For ``"central"`` both sides use the displacement actually stored in the
    array's dtype (``fl(x + h u) - fl(x - h u)``), so that rounding the
    perturbed input does not count as gradient error; the other methods use
    the nominal ``u`` (they are float64 methods).

    Returns
    -------
    analytic_values, numeric_values : ndarray, shape (len(directions),)
    """
    container, key = slot
    array = container[key]
    saved = array.copy()
    analytic_values = np.empty(len(directions))
    numeric_values = np.empty(len(directions))
    for k, u in enumerate(directions):
        if method == "complex_step":
            container[key] = saved + 1j * h * u
            try:
                with complex_step_mode():
                    out = _checked_output(np.array(evaluate(), dtype=np.complex128), dout)
            finally:
                container[key] = array
            analytic_values[k] = float(np.sum(analytic * u))
            numeric_values[k] = float(np.sum(dout * out.imag)) / h
            continue
        if method == "central":
            np.copyto(array, saved + h * u, casting="unsafe")
            high = array.astype(np.float64)
            plus = _checked_output(snapshot(evaluate()), dout)
            np.copyto(array, saved - h * u, casting="unsafe")
            low = array.astype(np.float64)
            minus = _checked_output(snapshot(evaluate()), dout)
            np.copyto(array, saved)
            analytic_values[k] = float(np.sum(analytic * (high - low))) / (2 * h)
            numeric_values[k] = float(np.sum(dout * (plus - minus))) / (2 * h)
            continue

        def at(t):
            np.copyto(array, saved + t * u, casting="unsafe")
            try:
                return _checked_output(snapshot(evaluate()), dout)
            finally:
                np.copyto(array, saved)

        analytic_values[k] = float(np.sum(analytic * u))
        numeric_values[k] = _STENCILS[method](at, dout, h)[0]
    return analytic_values, numeric_values


def _move_all(slots, saved, direction, t):
    """Every checked array to ``saved + t u`` (in its own dtype), in place."""
    for name, (container, key) in slots.items():
        array = container[key]
        if array.dtype == np.float64:  # NOTE: no temporary: a model's arrays are large
            np.multiply(direction[name], t, out=array)
            array += saved[name]
        else:
            np.copyto(array, saved[name] + t * direction[name], casting="unsafe")


def numeric_joint(slots, analytic, evaluate, dout, method, h, directions):
    """``<u, analytic>`` and the numeric ``phi'(0)`` along directions over all tensors at once.

    Parameters
    ----------
    slots : dict of str -> (container, key)
        Every checked array; each is moved by its part of ``u`` together.
    analytic : dict of str -> ndarray
        The analytic gradient of each array.
    evaluate, dout, method, h
        As in :func:`numeric_elementwise`.
    directions : sequence of callables
        ``direction() -> dict name -> ndarray``: one unit direction over all
        arrays, made when it is used (a model's direction is the model's size).

    Returns
    -------
    analytic_values, numeric_values : ndarray, shape (len(directions),)

    Notes
    -----
    For ``"central"`` the analytic side uses the displacement stored in each
    array's dtype, ``fl(x + h u) - fl(x - h u)``, as
    :func:`numeric_directions` does.
    """
    saved = {name: container[key].copy() for name, (container, key) in slots.items()}
    analytic_values = np.empty(len(directions))
    numeric_values = np.empty(len(directions))
    for k, make in enumerate(directions):
        u = make()
        if method == "complex_step":
            originals = {name: container[key] for name, (container, key) in slots.items()}
            try:
                for name, (container, key) in slots.items():
                    container[key] = saved[name] + 1j * h * u[name]
                with complex_step_mode():
                    out = _checked_output(np.array(evaluate(), dtype=np.complex128), dout)
            finally:
                for name, (container, key) in slots.items():
                    container[key] = originals[name]
            numeric_values[k] = float(np.sum(dout * out.imag)) / h
        else:
            def at(t):
                _move_all(slots, saved, u, t)
                try:
                    return _checked_output(snapshot(evaluate()), dout)
                finally:
                    for name, (container, key) in slots.items():
                        np.copyto(container[key], saved[name])

            numeric_values[k] = _STENCILS[method](at, dout, h)[0]
        if method == "central":
            analytic_values[k] = sum(
                float(np.vdot(analytic[name], _stored_step(saved[name], u[name], h)))
                for name in slots) / (2 * h)
        else:
            analytic_values[k] = sum(float(np.vdot(analytic[name], u[name])) for name in slots)
    return analytic_values, numeric_values


def _stored_step(saved, u, h):
    """``fl(x + h u) - fl(x - h u)`` in ``x``'s dtype, as float64."""
    if saved.dtype == np.float64:
        high = h * u
        high += saved
        low = np.multiply(u, -h)
        low += saved
        high -= low
        return high
    high = (saved + h * u).astype(saved.dtype).astype(np.float64)
    return high - (saved - h * u).astype(saved.dtype).astype(np.float64)
