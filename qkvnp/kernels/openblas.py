"""numpy's OpenBLAS, found once: its thread-count functions and what it says of itself.

The kernels pin BLAS to one thread in their sections and raise it for the
projections that pay (:mod:`qkvnp.kernels._runtime`); the benchmark reports
:func:`openblas_info` beside its numbers. ``ctypes`` and the search run at the
first call, not at import.
"""
import os
import threading

import numpy as np

__all__ = ["openblas_thread_functions", "openblas_info"]

_BLAS = None  # (get, set) ctypes functions, () if not found
_BLAS_LOCK = threading.Lock()


def _fresh_lock_in_child():
    """After ``fork``, in the child: a lock held by another thread at the fork stays held."""
    global _BLAS_LOCK
    _BLAS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _find_openblas():
    """The OpenBLAS thread-count functions of the library numpy links, or ()."""
    import ctypes

    found = _openblas_library()
    if not found:
        return ()
    _, lib, prefix, suffix = found
    get = getattr(lib, f"{prefix}get_num_threads{suffix}")
    set_ = getattr(lib, f"{prefix}set_num_threads{suffix}")
    get.restype, get.argtypes = ctypes.c_int, []
    set_.restype, set_.argtypes = None, [ctypes.c_int]
    return get, set_


def _openblas_library():
    """``(path, library, prefix, suffix)`` of the OpenBLAS numpy links, or ().

    The one search of the package: the library beside numpy's wheel or
    through ``scipy_openblas64``, with every symbol naming scheme OpenBLAS
    builds use (``{prefix}get_num_threads{suffix}``).
    """
    import ctypes
    import glob

    root = os.path.dirname(np.__file__)
    patterns = [os.path.join(root, os.pardir, "numpy.libs", "*openblas*"),  # Linux wheels
                os.path.join(root, ".dylibs", "*openblas*"),  # macOS wheels
                os.path.join(root, "_core", "*openblas*")]
    try:  # numpy built against the scipy-openblas package
        import scipy_openblas64

        patterns.append(os.path.join(scipy_openblas64.get_lib_dir(), "*openblas*"))
    except (ImportError, AttributeError):
        pass
    schemes = [(prefix, suffix) for prefix in ("scipy_openblas_", "openblas_")
               for suffix in ("64_", "_64", "")]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                lib = ctypes.CDLL(path)  # already loaded by numpy: same handle
            except OSError:
                continue
            for prefix, suffix in schemes:
                if (hasattr(lib, f"{prefix}get_num_threads{suffix}")
                        and hasattr(lib, f"{prefix}set_num_threads{suffix}")):
                    return path, lib, prefix, suffix
    return ()


def openblas_thread_functions():
    """OpenBLAS's ``(get_num_threads, set_num_threads)`` for numpy's BLAS, or ``()``.

    The one probe of the package (the benchmark reports it too): the library
    numpy links, found beside numpy's wheel or through ``scipy_openblas64``,
    with every symbol naming scheme OpenBLAS builds use.
    """
    global _BLAS
    if _BLAS is None:
        with _BLAS_LOCK:
            if _BLAS is None:
                _BLAS = _find_openblas()
    return _BLAS


def openblas_info():
    """What numpy's OpenBLAS says of itself, or None if it is not found.

    The library is the one :func:`openblas_thread_functions` drives (the
    same search). Reported by the benchmark beside its numbers.

    Returns
    -------
    dict or None
        ``library`` (file name), ``corename`` (the kernels OpenBLAS chose for
        this CPU), ``config`` (its build options) and ``threads`` (its
        current thread count); ``corename`` or ``config`` is None when the
        build does not export it.

    Examples
    --------
    >>> info = openblas_info()
    >>> info is None or info["threads"] >= 1
    True
    """
    import ctypes

    found = _openblas_library()
    if not found:
        return None
    path, lib, prefix, suffix = found
    info = {"library": os.path.basename(path)}
    for key in ("corename", "config"):
        function = getattr(lib, f"{prefix}get_{key}{suffix}", None)
        info[key] = None
        if function is not None:
            function.restype, function.argtypes = ctypes.c_char_p, []
            info[key] = function().decode().strip()
    get_num_threads = getattr(lib, f"{prefix}get_num_threads{suffix}")
    get_num_threads.restype, get_num_threads.argtypes = ctypes.c_int, []
    info["threads"] = get_num_threads()
    return info
