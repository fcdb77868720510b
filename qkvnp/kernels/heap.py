"""glibc's malloc thresholds, set where its own heuristic ends up, before the first kernel.

Every forward and backward allocates and frees temporaries of the same sizes
again and again. glibc serves blocks from 128 KiB on with ``mmap`` until a
freed block teaches it a higher threshold, and gives the top of its heap back
to the system whenever more than ``2 x`` that threshold is free. Each block
that comes back from the system is page-faulted anew on its first write.
NOTE: a small layer's forward+backward measured hundreds of faults a step,
a third slower than without them (benchmarks/NOTES.md).
How many faults a process takes depends on the sizes it happened to free
first, so the same call is fast in one process and slow in the next.

:func:`tune_heap` sets, once, the values glibc's own dynamic rule reaches
after the first freed block of its maximum (``DEFAULT_MMAP_THRESHOLD_MAX``,
32 MiB on 64-bit): ``M_MMAP_THRESHOLD`` = the ``heap_mmap_threshold``
setting (:func:`qkvnp.kernels.set_block_sizes`, default 32 MiB) and
``M_TRIM_THRESHOLD`` = twice that. A process then keeps up to that much freed
memory for reuse, as it would after one large temporary; blocks of 32 MiB
and more are still mapped and unmapped each time (the kernels recycle their
large score buffers themselves, :func:`qkvnp.kernels.buffers.recycled_empty`).

It is process-wide, like the BLAS thread count, and is done at the first
kernel call, never at ``import qkvnp``. It does nothing off glibc, with
``heap_mmap_threshold=0``, or when the user set glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``
with ``glibc.malloc``), which then win.
"""
import os

__all__ = ["tune_heap", "heap_thresholds"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers

#: The user's own malloc settings, which qkvnp never overrides.
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

# seen: the setting last decided on (None before the first kernel section);
# tuned: that decision (glibc has its thresholds); given: the threshold last
# handed to glibc (0: never); mallopt: glibc's function, False off glibc.
_STATE = {"seen": None, "tuned": False, "given": 0, "mallopt": None}


def _mallopt():
    """glibc's ``mallopt`` through ctypes, or False off glibc (musl, macOS, Windows)."""
    if _STATE["mallopt"] is None:
        import ctypes

        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # glibc only: musl has mallopt but ignores it
            function = libc.mallopt
        except (OSError, AttributeError, TypeError):
            function = False
        else:
            function.restype, function.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
        _STATE["mallopt"] = function
    return _STATE["mallopt"]


def _user_configured():
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(os.environ.get(name) for name in USER_VARIABLES) or "glibc.malloc." in tunables


def heap_thresholds(threshold):
    """``(mmap threshold, trim threshold)`` in bytes for a ``heap_mmap_threshold`` setting.

    >>> heap_thresholds(32 << 20) == (32 << 20, 64 << 20)
    True
    """
    return threshold, 2 * threshold


def tune_heap(threshold):
    """Give glibc the thresholds of ``threshold`` (bytes), deciding once per setting; see the module.

    Every kernel section calls it: after the first, while the setting stays
    the same, it returns the decision taken then (the environment is read
    once, as ``QKVNP_NUM_THREADS`` is).

    Parameters
    ----------
    threshold : int
        The ``heap_mmap_threshold`` setting; 0 leaves malloc alone, or, when a
        threshold was already given, sets glibc's initial 128 KiB back (glibc
        has no way to turn its dynamic adjustment on again).

    Returns
    -------
    bool
        True when glibc now has this setting's thresholds.
    """
    if threshold != _STATE["seen"]:  # the first section, or the setting changed
        _STATE["seen"] = threshold
        _STATE["tuned"] = _give(threshold)
    return _STATE["tuned"]


def _give(threshold):
    """Hand glibc the thresholds of ``threshold`` unless it is to be left alone."""
    if (threshold == 0 and _STATE["given"] == 0) or _user_configured():
        return False
    mallopt = _mallopt()
    if not mallopt:
        return False
    mmap_bytes, trim_bytes = heap_thresholds(threshold or 128 << 10)
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))
    _STATE["given"] = threshold
    return ok and threshold != 0
