"""Input checks shared by every public function: dtypes, shapes, finiteness.

Every check raises ``TypeError`` or ``ValueError`` naming the argument, what was
expected and what was received, so that a user never meets an ``IndexError``
from deep inside a matmul or a silent broadcast.
"""
import numpy as np

__all__ = [
    "compute_dtype",
    "as_float_array",
    "check_ndim",
    "check_last_dim",
    "check_same_shape",
    "make_rng",
    "check_int",
]


def compute_dtype(*dtypes):
    """Return the floating dtype in which arrays of ``dtypes`` are computed.

    float32 and float64 keep their precision; integers and booleans are
    promoted to float64; float16 is computed in float32 (its 10-bit mantissa
    is too short for a softmax over long rows).

    >>> compute_dtype(np.int64)
    dtype('float64')
    >>> compute_dtype(np.float16, np.float32)
    dtype('float32')
    """
    dtypes = [np.dtype(d) for d in dtypes]
    for d in dtypes:
        if d.kind not in "biuf":
            raise TypeError(
                f"expected real numbers (bool, int or float), got dtype {d}"
            )
    floats = [d for d in dtypes if d.kind == "f"]
    if not floats:
        return np.dtype(np.float64)
    result = np.result_type(*floats)
    if result.itemsize < 4:
        return np.dtype(np.float32)
    if result.itemsize > 8:
        raise TypeError(f"expected float16, float32 or float64, got dtype {result}")
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
    """
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must hold real numbers (bool, int or float), got dtype {arr.dtype}"
        )
    target = compute_dtype(arr.dtype) if dtype is None else np.dtype(dtype)
    arr = arr.astype(target, copy=False)
    if finite and not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf; expected finite values")
    return arr


def check_ndim(x, name, min_ndim, shape_hint):
    """Raise ``ValueError`` unless ``x.ndim >= min_ndim``."""
    if x.ndim < min_ndim:
        raise ValueError(
            f"{name} must have shape {shape_hint} (at least {min_ndim} dims), "
            f"got shape {x.shape}"
        )


def check_last_dim(x, name, size, shape_hint):
    """Raise ``ValueError`` unless the last axis of ``x`` has length ``size``."""
    if x.shape[-1] != size:
        raise ValueError(
            f"{name} must have shape {shape_hint} with last dim {size}, "
            f"got shape {x.shape}"
        )


def check_same_shape(x, name, shape):
    """Raise ``ValueError`` unless ``x.shape == shape`` (no broadcasting)."""
    if tuple(np.shape(x)) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} (the shape of the forward "
            f"output; it is not broadcast), got shape {tuple(np.shape(x))}"
        )


def check_int(value, name, minimum):
    """Return ``value`` as an ``int``, refusing bools, floats and values below ``minimum``.

    >>> check_int(np.int64(3), "num_heads", 1)
    3
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def make_rng(rng):
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
