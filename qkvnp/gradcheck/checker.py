"""The checks: a hand-derived backward against a numerical derivative of its forward.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim. A checked tensor may have any shape; the checker never looks
inside it.

A backward pass is checked through the scalar ``L = <dout, f(x)>`` with a
*random* upstream gradient ``dout`` (an all-ones ``dout`` hides errors that
cancel along a softmax row). Its exact gradient is ``vjp(dout)``, the
analytic vector-Jacobian product; the numerical one comes from one of the
methods of :mod:`qkvnp.gradcheck.stencils`: central differences (the
default), the five-point stencil, Ridders' extrapolation, or complex step.

Two modes:

``"elementwise"``
    Perturb every entry of every tensor and report, per tensor, the max
    absolute error, the max relative error and the worst index with the
    analytic value beside the numeric one.
``"direction"``
    For a few random unit directions ``u`` per tensor, compare
    ``<u, vjp(dout)>`` with the derivative of ``L`` along ``u``: a few
    forwards per direction whatever the tensor's size.
``"joint"``
    The same along unit directions over every checked tensor at once: one
    row, a few forwards per direction whatever the model's size (a whole
    GPT; :mod:`qkvnp.gradcheck.budget`).

An elementwise check of a whole model samples entries (``sample=``) and a
long check shows its progress (``progress=``): :mod:`qkvnp.gradcheck.budget`.
A layer with dropout in training mode is refused unless its masks are fixed
or replayed (``replay_dropout=True``): :mod:`qkvnp.gradcheck.replay`.

Relative errors are ``|a - n| / max(|a|, |n|, atol, floor * max|n|)``: the
absolute floor ``atol`` lets a gradient that is zero pass, where the
round-off of the numeric side would otherwise give a relative error of 1.
Attention has such a gradient: ``b_key`` adds ``q . b_key`` to *every* score
of a query's row, and softmax ignores a constant added to a row, so its
gradient is zero in exact arithmetic (round-off as computed). A failing row
gets a diagnosis (:mod:`qkvnp.gradcheck.diagnosis`).

Complex step runs the forward on complex arrays: only forwards (and layers)
that declare ``supports_complex_step`` can, and only inside the checker
(:func:`qkvnp._checks.complex_step_mode`); a layer is then checked on its
reference path whatever its ``impl``. With ``oracle_dtype``, :func:`check_op`
and :func:`check_layer` compare a float32 backward with the float64 one
instead (:mod:`qkvnp.gradcheck.oracle`).

``import qkvnp.gradcheck`` imports numpy only.
"""
from __future__ import annotations

import copy
import time
from collections import namedtuple

import numpy as np

from .._checks import check_int, is_real_number, make_rng
from .budget import check_sample, choose_entries, count_forwards, make_meter
from .oracle import oracle_report
from .replay import check_repeat, guarded_evaluate
from .report import TOLERANCES, GradcheckReport, Tolerance
from .sides import check_rows, check_sides, counted
from .stencils import METHODS, ORDERS

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable, Iterable, Mapping
    from .._typing import DTypeLike

__all__ = [
    "MODES",
    "MAX_DIRECTIONS",
    "Problem",
    "check_function",
    "check_op",
    "check_layer",
    "layer_problem",
    "function_problem",
    "op_pair",
    "draw_dout",
    "resolve",
    "round_off_noise",
    "ROUND_OFF_GAIN",
]

MODES = ("elementwise", "direction", "joint")

#: The most directions per tensor a ``"direction"`` check takes. Each costs
#: two or more forwards; beyond this many, an elementwise check of any tensor
#: small enough to check is cheaper, and a typo (``10**9``) would run for days.
MAX_DIRECTIONS = 10_000

Problem = namedtuple("Problem", "slots evaluate analytic layer")
Problem.__doc__ = """A function to check, in the checker's terms.

slots : dict name -> (container, key); ``container[key]`` is the array of
    that name that ``evaluate`` reads (perturbed in place, or replaced).
evaluate : callable, ``evaluate() -> output``.
analytic : callable, ``analytic(dout) -> dict name -> float64 gradient``.
layer : the layer checked (a copy), or None for a function.
"""


def resolve(method, mode, dtype, eps, rtol, atol, num_directions=1):
    """Check the options of a check and fill in the defaults of :data:`TOLERANCES`.

    Returns ``(dtype, Tolerance, num_directions)``; ``num_directions`` must
    be in ``1 ..`` :data:`MAX_DIRECTIONS`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
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
    if method not in TOLERANCES[dtype]:
        raise ValueError(f"method={method!r} runs in float64 only (complex128 forwards), "
                         f"got dtype {dtype}")
    default = TOLERANCES[dtype][method]
    values = {}
    for name, value, fallback in (("eps", eps, default.eps), ("rtol", rtol, default.rtol),
                                  ("atol", atol, default.atol)):
        if value is None:
            value = fallback
        if not is_real_number(value):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
        value = float(value)
        if not np.isfinite(value) or value < 0 or (name == "eps" and value == 0):
            raise ValueError(f"{name} must be a finite {'positive' if name == 'eps' else 'non-negative'} "
                             f"number, got {value}")
        values[name] = value
    num_directions = check_int(num_directions, "num_directions", 1, MAX_DIRECTIONS,
                               expected=f"an int in 1..{MAX_DIRECTIONS} (MAX_DIRECTIONS)")
    return dtype, Tolerance(floor=default.floor, **values), num_directions


def draw_dout(out, dtype, rng):
    """A random standard normal ``dout`` of ``out``'s shape, in ``dtype`` (``out`` checked)."""
    out = np.asarray(out)
    if out.dtype.kind != "f":
        raise TypeError(f"the checked function must return a float array, got dtype {out.dtype}")
    if not np.isfinite(out).all():
        raise ValueError("the checked function returned NaN or inf at the unperturbed input")
    # NOTE: random, never all ones: ones hide errors that cancel along a softmax row.
    return rng.standard_normal(out.shape).astype(dtype)


def _check_grad_shape(grad, name, shape):
    grad = np.asarray(grad)
    if grad.dtype.kind not in "fiu":
        # NOTE: refused, as a non-float output is (draw_dout): a complex
        # gradient cast to float64 would drop its imaginary part with a warning
        raise TypeError(f"the analytic gradient of {name!r} must hold real numbers, "
                        f"got dtype {grad.dtype}")
    if grad.shape != tuple(shape):
        raise ValueError(
            f"the analytic gradient of {name!r} must have the shape of {name!r}, "
            f"{tuple(shape)}, got shape {grad.shape}"
        )
    return grad.astype(np.float64)


#: Round-off of a difference quotient in units of ``noise(L) / h``: central
#: ``(d+ + d-) / 2h``, the five-point stencil ``(8 + 8 + 1 + 1) / 12h``.
ROUND_OFF_GAIN = {"central": 1.0, "central4": 1.5}


def round_off_noise(out, dout64, method, dtype, h):
    """Model of the round-off of a numerical derivative of ``L = <dout, f(x)>``.

    ``L`` is computed to about ``u sum|dout * f(x)|`` (``u`` the unit
    round-off of ``dtype``); a difference quotient divides that noise by the
    step. Returns the absolute error ``gain * u * sum|dout * f| / h`` (0 for
    methods without a model: complex step subtracts nothing, Ridders'
    tableau estimates its own error).
    """
    if method not in ROUND_OFF_GAIN:
        return 0.0
    unit = float(np.finfo(dtype).eps) / 2
    return ROUND_OFF_GAIN[method] * unit * float(np.sum(np.abs(dout64 * out))) / h


def _run(problem, out, grads, dout64, method, mode, dtype, tol, rng, num_directions,
         model_floor=False, entries=None, sampled="", meter=None):
    """Numerical side, rows, diagnoses (and the all-ones ``dout`` re-run) of a check.

    ``out`` is the forward at the unperturbed point. ``model_floor``: raise
    ``atol`` to the round-off model's floor ``round_off_noise / rtol`` (when
    the caller left ``atol`` to its default). ``entries``: the sampled
    entries per tensor (:func:`qkvnp.gradcheck.budget.choose_entries`),
    described by ``sampled``; ``meter`` counts the forwards.
    """
    for name in grads:
        container, key = problem.slots[name]
        if not np.isfinite(container[key]).all():
            raise ValueError(
                f"{name!r} contains NaN or inf: numerical derivatives need finite inputs "
                "(express a -inf mask as a mask argument, not as a checked input)"
            )
    if meter is not None:
        problem = problem._replace(evaluate=counted(problem.evaluate, meter))
    try:
        sides, estimates = check_sides(problem, grads, dout64, method, mode, tol, rng,
                                  num_directions, entries)
        noise = round_off_noise(np.asarray(out, dtype=np.float64), dout64, method, dtype, tol.eps)
        report = check_rows(problem, noise, grads, sides, dout64, method, mode, dtype, tol,
                            model_floor)
    finally:
        if meter is not None:
            meter.close()
    report.error_estimates = estimates
    report.sampled = sampled
    return report


def _check_complex_support(owner, what):
    if not getattr(owner, "supports_complex_step", False):
        raise ValueError(f"method='complex_step' needs a {what} that runs on complex arrays "
                         f"and declares supports_complex_step = True; "
                         f"{getattr(owner, '__name__', type(owner).__name__)} does not")


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


def function_problem(fun, inputs, vjp, dtype):
    """The :class:`Problem` of ``fun`` and ``vjp`` at ``inputs`` (copies cast to ``dtype``)."""
    if not callable(fun) or not callable(vjp):
        raise TypeError("fun and vjp must be callables")
    work = _working_inputs(inputs, dtype)

    def analytic(dout):
        grads = vjp(dout.astype(dtype), **work)
        if not isinstance(grads, dict):
            raise TypeError(f"vjp must return a dict name -> gradient, got {type(grads).__name__}")
        unknown = [name for name in grads if name not in work]
        if unknown:
            raise ValueError(f"vjp returned gradients for unknown inputs {unknown}; "
                             f"inputs are {list(work)}")
        checked = {}
        for name, value in work.items():
            grad = grads.get(name)
            if grad is None:
                continue
            if not isinstance(value, np.ndarray):
                raise TypeError(f"vjp returned a gradient for {name!r}, which is not a float "
                                f"array (got {type(value).__name__}); map it to None")
            checked[name] = _check_grad_shape(grad, name, value.shape)
        return checked

    slots = {name: (work, name) for name, value in work.items() if isinstance(value, np.ndarray)}
    return Problem(slots, lambda: fun(**work), analytic, None)


def check_function(fun: Callable[..., Any], inputs: dict[str, Any], vjp: Callable[..., Any], *,
                   method: str = "central", mode: str = "elementwise",
                   dtype: DTypeLike = np.float64, eps: float | None = None,
                   rtol: float | None = None, atol: float | None = None,
                   rng: np.random.Generator | int | None = None,
                   num_directions: int = 5) -> GradcheckReport:
    """Check a vector-Jacobian product ``vjp`` against numerical derivatives of ``fun``.

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
    method : {"central", "central4", "richardson", "complex_step"}
        The numerical derivative (``qkvnp/gradcheck/stencils.py``).
        ``"complex_step"`` needs ``fun.supports_complex_step = True`` (it
        runs ``fun`` on complex arrays) and float64.
    mode : {"elementwise", "direction"}
        ``"elementwise"`` perturbs every entry; ``"direction"`` checks
        ``num_directions`` random directions per tensor, for tensors too
        large to sweep.
    dtype : {float64, float32}
        Precision of the check; it selects the defaults in :data:`TOLERANCES`.
    eps, rtol, atol : float, optional
        Step ``h``, accepted relative error, absolute floor of the relative
        error's denominator. Default: ``TOLERANCES[dtype][method]``.
    rng : numpy.random.Generator or int, optional
        Source of ``dout`` and of the directions; default seed 0, so that a
        check reproduces.
    num_directions : int
        Directions per tensor in ``"direction"`` mode, at most
        ``qkvnp.gradcheck.checker.MAX_DIRECTIONS`` (10,000).

    Returns
    -------
    GradcheckReport
        One row per differentiable input; ``report.ok`` and ``report.table()``;
        a failing row carries a ``diagnosis``.

    Raises
    ------
    TypeError, ValueError
        On a bad method, mode, dtype, eps/rtol/atol, on non-dict inputs or
        gradients, a gradient of the wrong shape, a gradient for an unknown
        or non-differentiable input, no differentiable input at all, or
        complex step on a ``fun`` that does not declare it.

    Notes
    -----
    With a random ``dout`` (standard normal), ``L = <dout, fun(x)>``. The
    analytic side is ``g = vjp(dout)``; elementwise, the numeric side is
    the method's estimate of ``dL/dx_i`` (central:
    ``(L(x + h e_i) - L(x - h e_i)) / 2h``) and the error per entry is
    ``|g_i - n_i| / max(|g_i|, |n_i|, atol, floor max|n|)``. In direction
    mode it compares ``<u, g>`` with the derivative along unit vectors ``u``.

    Examples
    --------
    >>> x = np.array([1.0, -2.0, 3.0])
    >>> report = check_function(lambda x: x ** 2, {"x": x},
    ...                         lambda dout, x: {"x": 2 * x * dout})
    >>> report.ok, report.row("x").shape
    (True, (3,))
    """
    dtype, tol, num_directions = resolve(method, mode, dtype, eps, rtol, atol, num_directions)
    if method == "complex_step":
        _check_complex_support(fun, "fun")
    rng = make_rng(0 if rng is None else rng)
    problem = function_problem(fun, inputs, vjp, dtype)
    out = problem.evaluate()
    dout = draw_dout(out, dtype, rng)
    out = np.array(out, dtype=np.float64)  # a copy: it may be a view of a perturbed input
    grads = problem.analytic(dout)
    if not grads:
        raise ValueError("vjp returned no gradient: nothing to check")
    return _run(problem, out, grads, dout.astype(np.float64), method, mode, dtype, tol, rng,
                num_directions, model_floor=atol is None)


def op_pair(forward, backward, names, forward_kwargs, wrt):
    """``fun`` and ``vjp`` of :func:`check_function` for a functional op pair.

    ``fun`` inherits ``forward``'s ``supports_complex_step``.
    """

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

    fun.supports_complex_step = getattr(forward, "supports_complex_step", False)
    fun.__name__ = getattr(forward, "__name__", "forward")
    return fun, vjp


def check_op(forward: Callable[..., Any], backward: Callable[..., Any], inputs: dict[str, Any], *,
             forward_kwargs: Mapping[str, Any] | None = None, wrt: Iterable[str] | None = None,
             oracle_dtype: DTypeLike | None = None, **options: Any) -> GradcheckReport:
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
    oracle_dtype : dtype, optional
        Instead of a numerical derivative, compare the backward in ``dtype``
        (float32) with the same op's backward in ``oracle_dtype`` (float64)
        at the same point, normwise per tensor in units of ``dtype``'s
        epsilon (``qkvnp.gradcheck.oracle.oracle_report``).
    **options
        ``method, mode, dtype, eps, rtol, atol, rng, num_directions`` of
        :func:`check_function`. ``method="complex_step"`` needs
        ``forward.supports_complex_step`` (every forward of
        :mod:`qkvnp.functional` has it).

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
    ...          forward_kwargs={"is_causal": True}, method="complex_step").ok
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
    fun, vjp = op_pair(forward, backward, names, forward_kwargs, wrt)
    if oracle_dtype is not None:
        return _oracle_check(fun, vjp, inputs, oracle_dtype, options)
    return check_function(fun, inputs, vjp, **options)


def _oracle_check(fun, vjp, inputs, oracle_dtype, options):
    """:func:`check_op` with ``oracle_dtype``: the op's backward in two precisions."""
    allowed = {"dtype", "rtol", "rng"}
    extra = sorted(set(options) - allowed)
    if extra:
        raise TypeError(f"with oracle_dtype, check_op takes only {sorted(allowed)}, got {extra}")
    dtype = np.dtype(options.get("dtype", np.float32))
    rng = make_rng(0 if options.get("rng") is None else options["rng"])
    test = _working_inputs(inputs, dtype)
    dout = draw_dout(fun(**test), dtype, rng)
    grads = {name: np.asarray(g) for name, g in vjp(dout, **test).items() if g is not None}
    oracle = {name: (value.astype(oracle_dtype) if isinstance(value, np.ndarray) else value)
              for name, value in test.items()}
    reference = vjp(dout.astype(oracle_dtype), **oracle)
    return oracle_report(grads, reference, dtype, oracle_dtype, options.get("rtol"))


def _layer_copy(layer, dtype, reference):
    """A deep copy of ``layer`` cast to ``dtype`` (on the reference path if asked).

    NOTE: always a copy: the checker leaves the layer as it found it (its
    cache, every thread's, its grads, params, training mode and generators),
    so that a check between a user's forward and backward changes nothing.
    """
    try:
        layer = copy.deepcopy(layer)
    except Exception as error:  # noqa: BLE001 -- any failure to copy, named
        raise TypeError(f"check_layer checks a deep copy of the layer, to leave it as it "
                        f"was; copy.deepcopy({type(layer).__name__}) failed: {error}") from error
    if any(p.dtype != dtype for p in layer.params.values()):
        layer.params = {name: p.astype(dtype) for name, p in layer.params.items()}
    if hasattr(layer, "dtype"):
        layer.dtype = dtype
    if reference:  # NOTE: the math, whatever path the original (or a model's layer) runs
        named = getattr(layer, "named_layers", None)
        for sub in [layer] + ([sub for _, sub in named()] if named else []):
            if hasattr(sub, "impl"):
                sub.impl = "reference"
    layer.zero_grad()
    return layer


def layer_problem(layer, inputs, forward_kwargs, dtype, wrt_inputs, reference=False,
                  replay_dropout=False):
    """The :class:`Problem` of a layer: its params and inputs, a forward, the gradients.

    ``reference=True`` checks a copy on the reference path (complex step,
    oracles). A forward that draws random numbers is refused unless
    ``replay_dropout`` (:func:`qkvnp.gradcheck.replay.guarded_evaluate`).
    """
    for attribute in ("params", "grads", "forward", "backward", "zero_grad"):
        if not hasattr(layer, attribute):
            raise TypeError(f"layer must have params, grads, forward, backward and "
                            f"zero_grad, got {type(layer).__name__} without {attribute!r}")
    forward_kwargs = {} if forward_kwargs is None else dict(forward_kwargs)
    if forward_kwargs.get("return_weights"):
        raise ValueError("forward_kwargs must not set return_weights: the check needs "
                         "the output alone")
    layer = _layer_copy(layer, dtype, reference)
    # copies, perturbed in place; integer inputs (token ids) stay integers, not differentiated
    arrays = [np.array(x) if np.asarray(x).dtype.kind in "iub" else np.array(x, dtype=dtype)
              for x in inputs]

    evaluate = guarded_evaluate(layer, lambda: layer.forward(*arrays, **forward_kwargs),
                                forward_kwargs, replay_dropout)

    def analytic(dout):
        layer.zero_grad()
        evaluate()
        dinputs = layer.backward(dout.astype(dtype))
        if not isinstance(dinputs, tuple):
            dinputs = (dinputs,)
        if len(dinputs) < len(arrays):
            raise ValueError(f"layer.backward returned {len(dinputs)} gradients for "
                             f"{len(arrays)} inputs")
        grads = {f"param {name}": _check_grad_shape(layer.grads[name], f"param {name}", p.shape)
                 for name, p in layer.params.items()}
        if wrt_inputs:
            for i, (x, dx) in enumerate(zip(arrays, dinputs)):
                if dx is not None and x.dtype.kind == "f":
                    grads[f"input {i}"] = _check_grad_shape(dx, f"input {i}", x.shape)
        return grads

    slots = {f"param {name}": (layer.params, name) for name in layer.params}
    slots.update({f"input {i}": (arrays, i) for i, x in enumerate(arrays) if x.dtype.kind == "f"})
    return Problem(slots, evaluate, analytic, layer)


def check_layer(layer: Any, *inputs: Any, forward_kwargs: Mapping[str, Any] | None = None,
                wrt_inputs: bool = True, method: str = "central", mode: str = "elementwise",
                dtype: DTypeLike = np.float64, eps: float | None = None, rtol: float | None = None,
                atol: float | None = None, rng: np.random.Generator | int | None = None,
                num_directions: int = 5, oracle_dtype: DTypeLike | None = None,
                replay_dropout: bool = False, sample: int | str | None = "auto",
                progress: Any = None) -> GradcheckReport:
    """Check every parameter gradient and input gradient of a layer.

    Parameters
    ----------
    layer : Layer
        Anything with ``params``, ``grads``, ``forward``, ``backward`` and
        ``zero_grad`` (:class:`qkvnp.SelfAttention`,
        :class:`qkvnp.MultiHeadAttention`). A deep copy (cast to ``dtype``)
        is checked: ``layer`` is left as it was found, its parameters,
        gradients, cache (a forward awaiting its backward keeps it), training
        mode and generators.
    *inputs : ndarray
        Positional inputs of ``layer.forward`` (copied and cast to ``dtype``;
        integer and bool arrays, such as token ids, stay as they are and
        are not differentiated).
    forward_kwargs : dict, optional
        Keyword arguments of ``layer.forward`` (masks, ``is_causal``).
    wrt_inputs : bool
        Also check the input gradients returned by ``backward`` (one array,
        or a tuple whose None entries are skipped).
    method, mode, dtype, eps, rtol, atol, rng, num_directions
        As in :func:`check_function`. ``dtype`` is float64 whatever the
        layer's dtype (a float32 layer is checked through a float64 copy, to
        certify its math); pass ``dtype=np.float32`` to check float32
        arithmetic with the float32 tolerances. ``method="complex_step"``
        checks a float64 copy on the reference path (the layer must declare
        ``supports_complex_step``), whatever the layer's ``impl``.
        ``mode="joint"`` checks ``num_directions`` random unit directions
        over every parameter and input at once, in one row: the check of a
        whole large model (a few forwards per direction).
    replay_dropout : bool
        Check a layer with dropout in training mode with the same masks at
        every forward: each of the layer's Generators (``generators()``, its
        sub-layers' included) is put back to its state before the check's
        first forward before each forward. Works on every layer and model
        of qkvnp with dropout. Default False: such a layer is **refused**.
    sample : "auto", int or None
        Elementwise mode: check this many random entries of each tensor (all
        of a smaller one); None checks every entry; ``"auto"`` (default)
        checks every entry of a check of up to
        ``qkvnp.gradcheck.budget.SAMPLE_ABOVE`` (20,000) entries and 32
        (``AUTO_SAMPLE``) of each tensor beyond. ``report.sampled`` (and
        the table) say what was sampled.
    progress : None, bool or file
        None (default): progress lines and an estimate on ``sys.stderr``
        when the check is estimated to take more than
        ``qkvnp.gradcheck.budget.PROGRESS_AFTER`` (5) seconds (forwards
        times the first forward's time); False: quiet; True: always on
        ``sys.stderr``; a stream (``write``): always there.
    oracle_dtype : dtype, optional
        Instead of a numerical derivative, compare the layer's backward in
        ``dtype`` (its own path: fast, tiled...) with the float64 backward
        of a reference-path copy at the same point, normwise per tensor in
        units of ``dtype``'s epsilon; default pass at 64 epsilons.

    Returns
    -------
    GradcheckReport
        Rows ``"param W_query"``, ..., ``"input 0"``, ... (``"joint"``: one
        row ``"all (N tensors)"``).

    Raises
    ------
    ValueError
        ``qkvnp.gradcheck.replay.DropoutActiveError`` when the forward
        draws new dropout masks (training mode, dropout > 0, no fixed mask)
        and ``replay_dropout`` is False: it names the sub-layers,
        ``model.eval()`` and ``replay_dropout=True``. Refused rather than
        warned: every row of such a check would fail with numerical
        gradients that measure the change of mask, and the diagnoses would
        blame the backward. Also on the options' errors of
        :func:`check_function`.

    Examples
    --------
    ``b_key`` has a zero gradient (0 in exact arithmetic, round-off as
    computed: softmax ignores the constant ``q . b_key`` added to each row),
    and passes thanks to the floor ``atol``:

    >>> from qkvnp import MultiHeadAttention
    >>> layer = MultiHeadAttention(4, 2, rng=0)
    >>> x = np.random.default_rng(0).normal(size=(2, 3, 4))
    >>> report = check_layer(layer, x, forward_kwargs={"is_causal": True})
    >>> report.ok, report.row("param b_key").analytic
    (True, 0.0)
    """
    if not inputs:
        raise ValueError("check_layer needs at least one input array for layer.forward")
    if not isinstance(replay_dropout, (bool, np.bool_)):
        raise TypeError(f"replay_dropout must be a bool, got {type(replay_dropout).__name__}")
    sample = check_sample(sample)
    if oracle_dtype is not None:
        return _oracle_layer(layer, inputs, forward_kwargs, wrt_inputs, dtype, oracle_dtype,
                             rtol, rng, replay_dropout)
    dtype, tol, num_directions = resolve(method, mode, dtype, eps, rtol, atol, num_directions)
    complex_step = method == "complex_step"
    if complex_step:
        _check_complex_support(layer, "layer")
    rng = make_rng(0 if rng is None else rng)
    problem = layer_problem(layer, inputs, forward_kwargs, dtype, wrt_inputs, complex_step,
                            replay_dropout)
    start = time.perf_counter()
    out = problem.evaluate()
    seconds = time.perf_counter() - start
    dout = draw_dout(out, dtype, rng)
    out = np.array(out, dtype=np.float64)  # a copy: it may be a view of a perturbed input
    grads = problem.analytic(dout)
    check_repeat(problem.layer, out, problem.evaluate.last)
    seconds = min(seconds, problem.evaluate.seconds)  # NOTE: the first call may warm up caches
    shapes = {name: np.shape(grad) for name, grad in grads.items()}
    entries, sampled = choose_entries(shapes, sample if mode == "elementwise" else None, rng)
    if mode == "joint":
        total = sum(int(np.size(grad)) for grad in grads.values())
        sampled = (f"{num_directions} random unit directions over all {total:,} "
                   f"entries of the {len(grads)} tensors at once")
    meter = make_meter(progress, count_forwards(shapes, entries, method, mode, num_directions),
                       seconds)
    return _run(problem, out, grads, dout.astype(np.float64), method, mode, dtype, tol, rng,
                num_directions, model_floor=atol is None, entries=entries, sampled=sampled,
                meter=meter)


def _oracle_layer(layer, inputs, forward_kwargs, wrt_inputs, dtype, oracle_dtype, rtol, rng,
                  replay_dropout):
    """:func:`check_layer` with ``oracle_dtype``: the layer's path against the reference."""
    dtype = np.dtype(dtype)
    rng = make_rng(0 if rng is None else rng)
    test = layer_problem(layer, inputs, forward_kwargs, dtype, wrt_inputs,
                         replay_dropout=replay_dropout)
    dout = draw_dout(test.evaluate(), dtype, rng)
    grads = test.analytic(dout)
    point = [test.slots[f"input {i}"][0][i] for i in range(len(inputs))]
    oracle = layer_problem(test.layer, point, forward_kwargs, np.dtype(oracle_dtype), wrt_inputs,
                           reference=True, replay_dropout=replay_dropout)
    reference = oracle.analytic(dout.astype(oracle_dtype))
    report = oracle_report(grads, reference, dtype, oracle_dtype, rtol)
    report.dispatch = getattr(test.layer, "last_dispatch", None)  # the path that was checked
    return report
