"""The score-buffer pool: large ``(..., T, S)`` buffers reused instead of page-faulted anew.

Shape key: T query length, S key length, ``...`` the leading (batch, head) dims.

The fast cores take their score buffers from ``recycled_empty``. A
buffer is free when no array refers to it any more; the next forward of the
same size takes it again. What the pool holds is bounded by two settings of
:func:`qkvnp.kernels.set_block_sizes` (:data:`qkvnp.kernels.BLOCK_SIZE_DEFAULTS`):

- ``recycle_bytes``: buffers kept for live layers. A layer runs its kernels
  under :func:`buffer_owner`; when the layer is garbage-collected, the pool
  forgets its buffers.
- ``recycle_unowned_bytes``: buffers taken outside any layer (a kernel
  called directly), which nothing but a later call or :func:`release_buffers`
  lets go.

:func:`held_buffer_bytes` says how much the pool holds. The pool is never
needed for a correct answer: ``recycle_bytes=0`` and
``recycle_unowned_bytes=0`` turn it off.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import weakref

import numpy as np

from ._runtime import _SIZES, OwnerScope, current_owner

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any

__all__ = ["recycled_empty", "release_buffers", "held_buffer_bytes", "buffer_owner"]

_SPARE: list[np.ndarray] = []  # base arrays, each free while only this list refers to it
_SPARE_OWNERS: list[Any] = []  # beside each: a weak reference to the layer it is kept for, or None
_SPARE_LOCK = threading.Lock()
_WATCHED: dict[int, Any] = {}  # id(owner) -> its weak reference, while it lives


def _references(pool, index):
    """``sys.getrefcount`` of ``pool[index]``, always taken the same way (see ``_FREE``)."""
    return sys.getrefcount(pool[index])


def _free_references():
    """What :func:`_references` counts for a buffer that only its pool holds.

    NOTE: measured, not assumed. How many references ``getrefcount`` sees
    depends on how the caller holds the object: a loop name over the pool
    adds one, a copy of the list another, and Python 3.14 borrows some
    references it used to count. A buffer that an array still uses has at
    least one more (the array's base), so comparing with this count, taken
    through the same function, is exact on any of them. The trim below once
    compared a loop over a copy of the pool (4 references when free) with
    3, so that it never let a buffer go: 100 buffers of distinct sizes kept
    200 MiB under a 16 MiB ``recycle_bytes``.
    """
    pool = [np.empty(1, np.uint8)]
    return _references(pool, 0)


_FREE = _free_references()


def buffer_owner(owner: Any) -> OwnerScope:
    """Context manager: the score buffers taken inside are kept for ``owner`` while it lives.

    A layer runs its kernels inside it (``qkvnp.layers.AttentionLayer``):
    the pool keeps the free buffers of live layers, up to ``recycle_bytes``
    in all, for their next forward of the same size, and forgets a layer's
    buffers when the layer is garbage-collected. Buffers taken outside any
    owner (a kernel called directly) are kept up to ``recycle_unowned_bytes``.
    Thread-local; ``run`` (``qkvnp/kernels/_runtime.py``) hands the caller's owner to its worker threads.

    >>> class Owner: pass
    >>> with buffer_owner(Owner()):
    ...     buffer = recycled_empty((1024, 1024), np.float32)
    >>> buffer.shape
    (1024, 1024)
    """
    key = id(owner)
    ref = _WATCHED.get(key)
    if ref is None or ref() is not owner:
        ref = weakref.ref(owner)
        _WATCHED[key] = ref
        weakref.finalize(owner, _forget_owner, key, ref).atexit = False  # nothing to free at exit
    return OwnerScope(ref)


def _forget_owner(key, ref):
    """An owner was garbage-collected: the pool lets its buffers go (now, or at its next call)."""
    if _WATCHED.get(key) is ref:
        del _WATCHED[key]
    # NOTE: never wait here: the collector may run in a thread that holds the
    # lock (inside recycled_empty), which drops dead owners' buffers itself
    if _SPARE_LOCK.acquire(blocking=False):
        try:
            _drop_dead_owners()
        finally:
            _SPARE_LOCK.release()


def _drop_dead_owners():
    """Forget the buffers whose owner is gone (with ``_SPARE_LOCK`` held); arrays still using one keep it alive."""
    live = [i for i, ref in enumerate(_SPARE_OWNERS) if ref is None or ref() is not None]
    if len(live) < len(_SPARE):
        _SPARE[:] = [_SPARE[i] for i in live]
        _SPARE_OWNERS[:] = [_SPARE_OWNERS[i] for i in live]


def _trim():
    """Drop free buffers, oldest first, until the owned and the unowned ones fit their settings."""
    limits = (_SIZES["recycle_unowned_bytes"], _SIZES["recycle_bytes"])  # by "has an owner"
    totals = [0, 0]
    for base, ref in zip(_SPARE, _SPARE_OWNERS):
        totals[ref is not None] += base.nbytes
    i = 0
    while i < len(_SPARE) and (totals[0] > limits[0] or totals[1] > limits[1]):
        owned = _SPARE_OWNERS[i] is not None
        if totals[owned] > limits[owned] and _references(_SPARE, i) == _FREE:
            totals[owned] -= _SPARE[i].nbytes
            del _SPARE[i], _SPARE_OWNERS[i]
        else:
            i += 1


def recycled_empty(shape, dtype):
    """``np.empty(shape, dtype)``, reusing a large buffer no array refers to any more.

    A buffer is free when its only reference is this pool's: every numpy
    view of it (the cache's array, any slice a caller took) refers to it.
    The pool keeps, of its buffers (the one returned aside, older free ones
    going first): at most ``recycle_bytes`` taken under a live
    :func:`buffer_owner` (a layer's forward or backward), and at most
    ``recycle_unowned_bytes`` taken outside one. A buffer is kept for the
    owner that took it last, and forgotten when that owner is collected.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    owner = current_owner()
    limit = _SIZES["recycle_bytes" if owner is not None else "recycle_unowned_bytes"]
    if nbytes < _SIZES["recycle_min_bytes"] or nbytes > limit:
        return np.empty(shape, dtype)
    with _SPARE_LOCK:
        _drop_dead_owners()
        for i in range(len(_SPARE)):
            if _SPARE[i].nbytes == nbytes and _references(_SPARE, i) == _FREE:
                _SPARE_OWNERS[i] = owner  # kept for its last user
                buffer = _SPARE[i].view(dtype).reshape(shape)
                break
        else:
            base = np.empty(nbytes, np.uint8)
            _SPARE.append(base)
            _SPARE_OWNERS.append(owner)
            buffer = base.view(dtype).reshape(shape)
        _trim()  # `buffer` refers to its base: never dropped here
        return buffer


def release_buffers() -> None:
    """Drop the recycled score buffers that no array uses (settings ``recycle_bytes``, ``recycle_unowned_bytes``)."""
    with _SPARE_LOCK:
        busy = [i for i in range(len(_SPARE)) if _references(_SPARE, i) > _FREE]
        _SPARE[:] = [_SPARE[i] for i in busy]
        _SPARE_OWNERS[:] = [_SPARE_OWNERS[i] for i in busy]
        _drop_dead_owners()


def held_buffer_bytes() -> int:
    """Bytes of the score buffers the pool holds, in use or free (``recycled_empty``).

    >>> held_buffer_bytes() >= 0
    True
    """
    with _SPARE_LOCK:
        _drop_dead_owners()
        return sum(base.nbytes for base in _SPARE)


def _fresh_lock_after_fork_in_child():
    """A lock another thread held at the fork would stay held in the child for good."""
    global _SPARE_LOCK
    _SPARE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_fresh_lock_after_fork_in_child)
