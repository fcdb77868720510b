"""Input checks shared by every public function: dtypes, shapes, finiteness.

Every check raises ``TypeError`` or ``ValueError`` naming the argument, what was
expected and what was received, so that a user never meets an ``IndexError``
from deep inside a matmul or a silent broadcast.
"""
from __future__ import annotations

import contextlib
import math
import threading

import numpy as np

__all__ = ["declare_complex_step", "compute_dtype", "as_float_array", "as_upstream_grad",
           "not_finite", "check_real_dtype", "check_ndim", "check_last_dim", "check_same_shape",
           "make_rng", "check_int", "check_bool", "check_attention_inputs", "is_real_number",
           "check_scale", "layer_dtype", "check_indices", "owned", "as_numpy", "check_state_value",
           "abs_max", "projected_score_bound", "core_scores_may_overflow", "values_may_overflow",
           "row_norm_max", "scores_may_overflow", "complex_step_mode", "complex_step_active"]

_COMPLEX_STEP = threading.local()


@contextlib.contextmanager
def complex_step_mode():
    """Let complex128 arrays through the input checks, in this thread, for a while.

    The gradient checker's complex step (:mod:`qkvnp.gradcheck`,
    ``method="complex_step"``) runs the reference forwards on ``x + i h u``.
    Outside this context every public function refuses complex input as
    before; inside it, :func:`check_real_dtype` and :func:`compute_dtype`
    accept complex128 and :func:`as_float_array` keeps an imaginary part
    instead of dropping it. Not for users: only forwards that declare
    ``supports_complex_step`` are meant to run under it.
    """
    previous = getattr(_COMPLEX_STEP, "on", False)
    _COMPLEX_STEP.on = True
    try:
        yield
    finally:
        _COMPLEX_STEP.on = previous


def declare_complex_step(*functions):
    """Mark ``functions`` as safe under :func:`complex_step_mode`.

    The gradient checker's complex step runs a forward only when it carries
    ``supports_complex_step = True`` (it must be analytic in its inputs).
    """
    for function in functions:
        function.supports_complex_step = True  # type: ignore[attr-defined]


def complex_step_active():
    """True inside :func:`complex_step_mode` (in the calling thread)."""
    return getattr(_COMPLEX_STEP, "on", False)


def _complex_allowed(dtype):
    return dtype == np.complex128 and complex_step_active()


def check_real_dtype(dtype, name=None):
    """Raise ``TypeError`` unless ``dtype`` holds real numbers (bool, int or float).

    The message names the argument ``name`` (or says "expected" without one).

    >>> check_real_dtype(np.dtype(complex), "dout")
    Traceback (most recent call last):
    ...
    TypeError: dout must hold real numbers (bool, int or float), got dtype complex128
    """
    if np.dtype(dtype).kind not in "biuf" and not _complex_allowed(np.dtype(dtype)):
        what = "expected" if name is None else f"{name} must hold"
        raise TypeError(f"{what} real numbers (bool, int or float), got dtype {np.dtype(dtype)}")


#: The dtypes :func:`compute_dtype` returns as they are.
_NATIVE_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def compute_dtype(*dtypes, names=None):
    """Return the floating dtype in which arrays of ``dtypes`` are computed.

    float32 and float64 keep their precision; integers and booleans are
    promoted to float64; float16 is computed in float32 (its 10-bit mantissa
    is too short for a softmax over long rows).

    Parameters
    ----------
    *dtypes : dtype
    names : sequence of str, optional
        Argument names of ``dtypes``, one each, used in error messages.

    Returns
    -------
    dtype
        float32 or float64.

    Raises
    ------
    TypeError
        If a dtype is not real (complex, object, string...) or wider than
        float64 (``np.longdouble`` where it is float128): the message names
        that dtype's argument when ``names`` is given.

    Examples
    --------
    >>> compute_dtype(np.int64)
    dtype('float64')
    >>> compute_dtype(np.float16, np.float32)
    dtype('float32')
    """
    if len(dtypes) == 1 and dtypes[0] in _NATIVE_FLOATS:
        return np.dtype(dtypes[0])  # NOTE: the common case first: 0.2 us instead of 1.6
    dtypes = [np.dtype(d) for d in dtypes]
    names = [None] * len(dtypes) if names is None else list(names)
    if len(names) != len(dtypes):
        raise ValueError(f"names must give one name per dtype ({len(dtypes)}), got {len(names)}")
    for d, name in zip(dtypes, names):
        check_real_dtype(d, name)
    for d, name in zip(dtypes, names):
        if d.kind == "f" and d.itemsize > 8:
            what = "expected" if name is None else f"{name} must be"
            raise TypeError(f"{what} float16, float32 or float64, got dtype {d}")
    floats = [d for d in dtypes if d.kind == "f" or _complex_allowed(d)]
    if not floats:
        return np.dtype(np.float64)
    result = np.result_type(*floats)
    if result.itemsize < 4:
        return np.dtype(np.float32)
    return np.dtype(result)


def as_float_array(x, name, dtype=None, finite=True):
    """Convert ``x`` to a floating ndarray, checking its dtype and values.

    Parameters
    ----------
    x : array_like
    name : str
        Argument name used in error messages.
    dtype : dtype, optional
        Target dtype; by default :func:`compute_dtype` of ``x``'s dtype.
    finite : bool
        If True, NaN or inf entries raise ``ValueError``.

    Returns
    -------
    ndarray
        ``x`` in the target dtype (not a copy when it already has it).

    Raises
    ------
    TypeError
        If ``x`` is None, not real (complex, object, string...), or, with no
        ``dtype`` given, wider than float64 (float128).
    ValueError
        If ``finite`` and an entry is NaN or inf.
    """
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    arr = np.asarray(x)
    check_real_dtype(arr.dtype, name)
    target = compute_dtype(arr.dtype, names=(name,)) if dtype is None else np.dtype(dtype)
    if _complex_allowed(arr.dtype):
        target = np.result_type(target, arr.dtype)  # NOTE: complex step: keep the imaginary part
    arr = arr.astype(target, copy=False)
    if finite and not np.isfinite(arr).all():
        raise not_finite(name)
    return arr


def not_finite(name):
    """The ``ValueError`` of a NaN or inf entry in argument ``name``: one text for every check,
    whole-array (:func:`as_float_array`, :func:`as_upstream_grad`) or by a kernel's chunks.

    >>> not_finite("logits")
    ValueError('logits contains NaN or inf; expected finite values')
    """
    return ValueError(f"{name} contains NaN or inf; expected finite values")


def as_upstream_grad(d, name, shape, dtype, finite=True):
    """Check an upstream gradient (``dout`` of a backward) and return it in ``dtype``.

    The backward counterpart of :func:`as_float_array`: every public
    ``backward(dout, ...)`` passes its upstream gradient through it once.

    Parameters
    ----------
    d : array_like
        The upstream gradient.
    name : str
        Argument name used in error messages (``"dout"``, ``"dweights"``).
    shape : tuple of int
        Exact shape required: the shape of the forward output (``d`` is not
        broadcast to it).
    dtype : dtype
        The forward's compute dtype; ``d`` is cast to it (float32 for a
        float64 forward, float128 or int for any, are accepted and cast).
    finite : bool
        False: skip the NaN / inf test, for a caller that makes it itself
        (raising :func:`not_finite`), as a kernel does by chunks in its worker
        threads. Honoured only when ``d`` needs no cast; a cast ``d`` is tested
        here, where the error can say that the cast made the inf.

    Returns
    -------
    ndarray, shape ``shape``
        ``d`` in ``dtype``; ``d`` itself (no copy) when it is already an
        ndarray of that dtype.

    Raises
    ------
    TypeError
        If ``d`` is None or does not hold real numbers (complex, object,
        string...).
    ValueError
        If ``d``'s shape is not ``shape``, or an entry is NaN or inf (after
        the cast: a float64 value beyond float32's range counts as inf; with
        ``finite=False`` and no cast, left to the caller).

    Notes
    -----
    Costs one ``np.isfinite`` pass over ``d`` (and the cast, if any): a NaN
    upstream gradient would otherwise turn every gradient into NaN without a
    word, and a complex one would lose its imaginary part with a mere warning.

    Examples
    --------
    >>> as_upstream_grad([[1, 2]], "dout", (1, 2), np.float64)
    array([[1., 2.]])
    """
    if d is None:
        raise TypeError(f"{name} must be an array, got None")
    arr = np.asarray(d)
    check_same_shape(arr, name, shape)
    check_real_dtype(arr.dtype, name)
    if arr.dtype == dtype:
        grad = arr
    else:
        with np.errstate(over="ignore"):  # reported below, naming the argument
            grad = arr.astype(dtype)
    if (finite or grad is not arr) and not np.isfinite(grad).all():
        if grad is not arr and np.isfinite(arr).all():  # only the cast made it inf
            raise ValueError(
                f"{name} has values too large for {np.dtype(dtype)} (cast from {arr.dtype}, "
                f"they become inf); expected finite values in {np.dtype(dtype)}'s range"
            )
        raise not_finite(name)
    return grad


def check_ndim(x, name, min_ndim, shape_hint):
    """Raise ``ValueError`` unless ``x.ndim >= min_ndim``."""
    if x.ndim < min_ndim:
        raise ValueError(
            f"{name} must have shape {shape_hint} (at least {min_ndim} dims), "
            f"got shape {x.shape}"
        )


def check_last_dim(x, name, size, shape_hint):
    """Raise ``ValueError`` unless the last axis of ``x`` has length ``size``.

    ``shape_hint`` names that size, e.g. ``"(..., T, 8)"``.
    """
    if x.shape[-1] != size:
        raise ValueError(f"{name} must have shape {shape_hint}, got shape {x.shape}")


def broadcast_shapes(*shapes):
    """``np.broadcast_shapes``, with equal shapes (the common case) returned at once.

    >>> broadcast_shapes((2, 3), (2, 3)), broadcast_shapes((2, 1), (3,))
    ((2, 3), (2, 3))

    NOTE: numpy's builds broadcast views in Python: 1.0-1.3 us a call alone
    against 0.3 (more inside a training step), and every attention forward
    and backward calls it.
    """
    first = shapes[0]
    if all(shape == first for shape in shapes):
        return tuple(first)
    return np.broadcast_shapes(*shapes)


def check_same_shape(x, name, shape):
    """Raise ``ValueError`` unless ``x.shape == shape`` (no broadcasting)."""
    if tuple(np.shape(x)) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} (the shape of the forward "
            f"output; it is not broadcast), got shape {tuple(np.shape(x))}"
        )


def check_int(value, name, minimum=None, maximum=None, expected=None):
    """Return ``value`` as an ``int``, refusing bools, floats and values out of range.

    The one "an int, but not a bool" check of the package (``True`` is an
    ``int`` in Python, and ``num_heads=True`` must not mean one head).

    Parameters
    ----------
    value : object
    name : str
        The argument's name, for the message.
    minimum, maximum : int, optional
        Inclusive bounds.
    expected : str, optional
        How the range is said in the ``ValueError`` (e.g. ``"a positive int"``);
        by default ``">= minimum"`` / ``"<= maximum"``.

    Raises
    ------
    TypeError
        ``"<name> must be an int, got <type> <value>"``.
    ValueError
        ``"<name> must be >= <minimum>, got <value>"`` (or ``expected``).

    >>> check_int(np.int64(3), "num_heads", 1)
    3
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {expected or f'>= {minimum}'}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be {expected or f'<= {maximum}'}, got {value}")
    return int(value)


def make_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    """Return a ``numpy.random.Generator`` from a Generator, an int seed or None."""
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        if rng < 0:
            raise ValueError(f"rng as an int seed must be >= 0, got {rng}")
        return np.random.default_rng(int(rng))
    raise TypeError(
        f"rng must be a numpy.random.Generator, an int seed or None, got {type(rng).__name__}"
    )


def check_attention_inputs(query, key, value):
    """Cast to a common float dtype and check the attention shapes."""
    try:
        dtype = compute_dtype(*(np.asarray(a).dtype for a in (query, key, value)),
                              names=("query", "key", "value"))
    except TypeError:
        dtype = None  # as_float_array below names the argument that is not real or is float128
    query = as_float_array(query, "query", dtype)
    one_array = value is key  # stays one array, cast once (attention_backward's key_is_value)
    key = as_float_array(key, "key", dtype)
    value = key if one_array else as_float_array(value, "value", dtype)
    check_ndim(query, "query", 2, "(..., T, D)")
    check_ndim(key, "key", 2, "(..., S, D)")
    check_ndim(value, "value", 2, "(..., S, Dv)")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key must have shape (..., S, {query.shape[-1]}) to match query's head "
            f"dim D={query.shape[-1]}, got shape {key.shape}"
        )
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"value must have shape (..., {key.shape[-2]}, Dv) to match key's length "
            f"S={key.shape[-2]}, got shape {value.shape}"
        )
    try:
        lead = broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    except ValueError:
        raise ValueError(
            "the leading (batch, head) dims of query, key and value must broadcast, "
            f"got query {query.shape}, key {key.shape}, value {value.shape}"
        ) from None
    return query, key, value, lead


def is_real_number(value):
    """True for a Python or numpy int or float scalar, False for a bool and anything else.

    The one "a real number, but not a bool" test of the package (``True`` is
    an ``int`` in Python); each caller words its own error.

    >>> is_real_number(np.float32(0.5)), is_real_number(True), is_real_number("1")
    (True, False, False)
    """
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)))


def check_scale(scale, head_dim):
    """The attention scale as a Python float: ``1/sqrt(head_dim)`` by default.

    Any finite float is accepted, zero and negative ones included, as PyTorch
    does (its ``test_scaled_dot_product_attention_math_with_negative_scale``).

    >>> check_scale(None, 4), check_scale(-2, 4)
    (0.5, -2.0)
    """
    if scale is None:
        if head_dim == 0:
            # NOTE: with D = 0 every score is an empty dot product, 0, whatever
            # the scale; 1/sqrt(0) would turn it into inf * 0 = NaN.
            return 1.0
        # NOTE: 1/sqrt(D) with D the *head* dim: it keeps the variance of a score
        # near 1 for unit-variance q, k. Scaling by the embedding size (a bug of
        # popular attention tutorials) flattens the softmax as heads are added.
        return 1.0 / math.sqrt(head_dim)  # a Python float: np.float64 would upcast float32
    if not is_real_number(scale):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    return scale


def layer_dtype(dtype):
    """The compute dtype of a layer built with ``dtype=`` (float16 computes in float32).

    >>> layer_dtype("float16")
    dtype('float32')
    """
    try:
        requested = np.dtype(dtype)
    except TypeError:
        requested = None
    if requested is None or requested.kind != "f" or requested.itemsize > 8:
        raise TypeError(f"dtype must be float16, float32 or float64, got {dtype!r}")
    return compute_dtype(requested, names=("dtype",))


def check_indices(indices, num_embeddings, name="indices"):
    """Integer array with every entry in ``[0, num_embeddings)``."""
    if indices is None:
        raise TypeError(f"{name} must be an integer array, got None")
    indices = np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integer token ids (e.g. int64), got dtype {indices.dtype}"
        )
    bad = (indices < 0) | (indices >= num_embeddings)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} must be in [0, {num_embeddings}) (num_embeddings={num_embeddings}), "
            f"got {int(indices[where])} at index {where}"
        )
    return indices


def owned(arrays, originals):
    """``arrays``, each copied if it may share memory with one of ``originals``.

    A cache keeps what its backward reads. When a checked input is the
    caller's own array (no cast was needed), the caller could edit it in
    place between the forward and the backward and silently change the
    gradients; PyTorch refuses that case ("modified by an inplace
    operation"), qkvnp keeps its own copy. A copy costs the size of the
    input, against a forward that multiplies it by a matrix.

    >>> x = np.ones(3)
    >>> owned((x, np.zeros(2)), (x,))[0] is x
    False
    >>> key, value = owned((x, x), (x,))  # one array passed twice: one copy
    >>> key is value and key is not x
    True
    """
    originals = [o for o in originals if isinstance(o, np.ndarray)]
    if not originals:
        return tuple(arrays)  # nothing to share memory with (check=False callers)
    copies = {}  # id -> copy: an array passed twice (a key that is the value) is copied once

    def own(a):
        if not isinstance(a, np.ndarray) or not any(a is o or np.may_share_memory(a, o)
                                                     for o in originals):
            return a
        if id(a) not in copies:
            copies[id(a)] = a.copy()
        return copies[id(a)]

    return tuple(own(a) for a in arrays)


def as_numpy(value, name):
    """``value`` as an ndarray; a torch tensor by duck typing, never importing torch.

    Anything with ``.detach()`` whose result has ``.cpu().numpy()`` (a torch
    tensor, a parameter, one with ``requires_grad``, on any device) is
    converted that way; everything else goes through ``np.asarray``. A
    floating-point tensor numpy has no dtype for (bfloat16, the float8
    formats) goes through float32 first, which holds each of its values
    exactly: the values are then cast as PyTorch's ``load_state_dict`` casts
    them into a parameter of another dtype.

    >>> as_numpy([1.0, 2.0], "x")
    array([1., 2.])

    Raises
    ------
    TypeError
        If ``value`` is None or its tensor cannot become a numpy array
        (a sparse tensor, for one).
    """
    if value is None:
        raise TypeError(f"{name} must be an array, got None")
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        tensor = value.detach().cpu()
        try:
            return tensor.numpy()
        except (TypeError, RuntimeError) as error:  # bfloat16, a sparse tensor...
            if getattr(tensor, "is_floating_point", lambda: False)() and \
                    getattr(tensor, "element_size", lambda: 4)() < 4:
                with contextlib.suppress(TypeError, RuntimeError):
                    return tensor.float().numpy()  # exact: float32 holds every such value
            raise TypeError(f"{name}: cannot convert {type(value).__name__} to a numpy "
                            f"array ({error})") from None
    return np.asarray(value)


def check_state_value(value, name, shape, dtype, context=""):
    """A parameter value to load: an ndarray of exactly ``shape``, cast to ``dtype``.

    ``value`` may be a torch tensor (:func:`as_numpy`). ``context`` is
    appended to the shape error (which layer, which layout).

    >>> check_state_value([1, 2], "state_dict['b']", (2,), np.float32)
    array([1., 2.], dtype=float32)

    Raises
    ------
    TypeError
        If ``value`` is None or does not hold real numbers.
    ValueError
        If its shape is not ``shape``, or it holds NaN or inf (also after
        the cast: float64 1e300 in float32).
    """
    arr = as_numpy(value, name)
    if arr.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}{context}, got shape {arr.shape}")
    return as_upstream_grad(arr, name, shape, dtype)  # real, cast, finite (after the cast too)


def abs_max(a):
    """``max|a|`` as a Python float (0.0 for an empty array; inf and NaN come through).

    >>> abs_max(np.array([[1.0, -3.0], [2.0, 0.5]]))
    3.0
    """
    if a.size <= 4096:  # one reduction of a small |a|: 1.5 us against 2.5 for max and min
        return float(abs(a).max()) if a.size else 0.0
    return max(float(a.max()), -float(a.min()))  # no |a| temporary


def projected_score_bound(query_rows, key_rows, head_dim):
    """An upper bound of every score ``q . k`` of the heads of these projections.

    ``query_rows`` ``(N, H*D)`` (already scaled) and ``key_rows``
    ``(N_kv, H_kv*D)``, or any arrays holding the queries and keys of head
    dim ``D`` (the cores' ``(..., T, D)``): each head's score is at most
    ``|q_t| |k_s| <= D max|q| max|k|`` (Cauchy-Schwarz, ``|q_t| <= sqrt(D)
    max|q|``). Arrays holding more columns than the queries' and keys' (a
    whole fused projection) give a looser bound; one array passed as both is
    reduced once. Two reductions after the projection: computed from the
    parameters and inputs before it, the bound took five (9.2 us a layer
    call at (1, 6, 3, 1), 11.5 at (8, 16, 32, 4)). Python floats: inf when
    a projection overflowed, NaN for NaN, never a warning.

    >>> projected_score_bound(np.ones((3, 4)), -2 * np.ones((5, 4)), head_dim=2)
    4.0
    """
    query_max = abs_max(query_rows)
    return head_dim * query_max * (query_max if key_rows is query_rows else abs_max(key_rows))


def core_scores_may_overflow(query, key, scale):
    """Whether the scores ``scale * q . k`` may reach ``sqrt(finfo.max)`` (:func:`scores_may_overflow`).

    Parameters
    ----------
    query : ndarray, shape (..., T, D)
    key : ndarray, shape (..., S, D)
        Checked inputs of one dtype (:func:`check_attention_inputs`).
    scale : float

    Notes
    -----
    First a screen from the largest entries alone, the layers' own
    (:func:`projected_score_bound`): each score is at most ``|scale| |q_t|
    |k_s| <= |scale| D max|q| max|k|``, two reductions over each input. Only a
    screen at the limit pays for the exact bound from the row norms
    (:func:`row_norm_max`: six passes over each input), whose answer is the
    one given. The fast core's forward at (B, H, L, D) = (4, 8, 128, 32)
    spent 19% of its time (0.42 of 2.24 ms, float32) in the row norms alone.
    """
    if not scores_may_overflow(abs(scale) * projected_score_bound(query, key, query.shape[-1]),
                               query.dtype):
        return False
    return scores_may_overflow(abs(scale) * row_norm_max(query) * row_norm_max(key), query.dtype)


def values_may_overflow(value):
    """Whether ``max|v|`` reaches ``sqrt(finfo.max)`` (:func:`scores_may_overflow`'s limit).

    The fast and tiled cores sum unnormalised weighted values (up to ``S
    max|v|``) and multiply ``dO v^T`` in their backward, where the reference
    sums normalised weights and recomputes an overflowed gradient exactly
    (:mod:`qkvnp.ops.overflow`); they defer to it from there on. One reduction.

    >>> values_may_overflow(np.array([1e300, 1.0])), values_may_overflow(np.ones(2))
    (True, False)
    """
    return scores_may_overflow(abs_max(value), value.dtype)


def row_norm_max(x):
    """``max_i ||x_i||`` over the last axis, as a Python float (inf if it overflows)."""
    if x.size == 0:
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        peak = float(np.max(np.abs(x)))
        if peak == 0.0 or not math.isfinite(peak):
            return peak
        scaled = x / peak  # no overflow in the squares: |x / peak| <= 1
        return peak * math.sqrt(float(np.max(np.sum(scaled * scaled, axis=-1))))


def scores_may_overflow(bound, dtype):
    """True when attention scores bounded by ``bound`` may reach ``sqrt(finfo(dtype).max)``.

    That is 1.3e154 in float64 and 1.8e19 in float32, far beyond any score a
    softmax can tell apart from a one-hot row (a gap of 40 already does).

    NOTE: below it the fast and tiled paths compute their own way (scale
    folded into the queries, a bound subtracted inside the matmul,
    ``rowsum(dO * O)`` for ``rowsum(P * dP)``) and agree with the reference
    within the path tolerance. From there on a backward multiplies
    score-sized terms by input-sized ones and can overflow, and the fast
    identities lose the exact zeros of a saturated softmax that the
    reference keeps (``P * (dP - delta)`` is exactly 0 for a one-hot row):
    measured, ``SelfAttention`` on ``x * 1e150`` gave inf weight gradients on
    the fast and tiled paths where the reference's are finite. So the paths
    defer to the reference there.
    """
    limit = _SCORE_LIMITS.get(dtype)
    if limit is None:
        limit = _SCORE_LIMITS[dtype] = math.sqrt(float(np.finfo(dtype).max))
    return not bound < limit


_SCORE_LIMITS: dict[np.dtype, float] = {}  # dtype -> sqrt(finfo(dtype).max): np.finfo costs more than the test


def check_eps(eps, name="eps"):
    """Return ``eps`` as a float, refusing anything but a finite number > 0 (a norm's epsilon).

    >>> check_eps(1e-5)
    1e-05
    """
    if not is_real_number(eps) or not 0.0 < float(eps) < math.inf:
        raise ValueError(f"{name} must be a finite float > 0, got {eps!r}")
    return float(eps)


def check_bool(value, name, allow_none=False):
    """Return ``value`` as a ``bool``, refusing anything but ``True``/``False`` (and ``np.bool_``).

    NOTE: ``bool(0.1)`` is True: ``MultiHeadAttention(16, 4, 0.1)`` once meant
    ``bias=True`` when PyTorch's user meant ``dropout=0.1``.

    Raises
    ------
    TypeError
        ``"<name> must be a bool, got <type> <value>"``.

    >>> check_bool(np.True_, "bias")
    True
    """
    if allow_none and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        expected = "a bool or None" if allow_none else "a bool"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return bool(value)
