"""A composite's call succeeds whole or changes nothing: :func:`transactional`.

A model's ``forward``, ``backward`` or ``decode`` touches many objects: the
per-thread cache of each sub-layer, the gradients of each sub-layer, the
:class:`~qkvnp.KVCache` of each block, the dropout Generators. A check that
refuses the call (a bad mask, a NaN weight, an overflow in the last block)
may come after some of them were touched. Inside a transaction:

- an object about to change its per-thread state first hands that state to
  :func:`journal` (once per call); if the call raises, every journaled
  object gets its state back;
- a gradient is handed to :func:`add_grad`, which keeps it aside; only when
  the outermost call has returned are the kept gradients added into the
  layers' ``grads``, all of them under one lock, after checking that every
  addition can be made;
- a Generator about to draw a dropout mask is handed to
  :func:`journal_generator` first, and gets its state back if the call
  raises.

Transactions nest: a composite called inside another joins the outer call,
which alone commits or rolls back. A transaction is the calling thread's
own: another thread neither sees nor joins it.

Outside a transaction (a lone layer), :func:`journal` does nothing and
:func:`add_grad` adds at once, under the same lock.
"""
from __future__ import annotations

import functools
import os
import threading

import numpy as np

__all__ = ["transactional", "journal", "journal_generator", "add_grad", "add_grads"]

# NOTE: one lock for every layer's gradient accumulation: an addition into
# ``grads`` is short next to the backward that computed it, and one
# module-level lock can be renewed in a forked child (a lock held by another
# thread at the fork would never be released there).
_GRADS_LOCK = threading.Lock()


def _renew_grads_lock():
    global _GRADS_LOCK
    _GRADS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_grads_lock)


class _Local(threading.local):
    current = None  # the calling thread's open transaction, if any


_LOCAL = _Local()


class _Transaction:
    """One outermost call's journal, kept gradients and saved Generator states."""

    __slots__ = ("journal", "grads", "generators")

    def __init__(self):
        self.journal = {}  # id(obj) -> (obj, the state it had before the call)
        self.grads = []  # (owner, attribute, name, gradient), in the order they came
        self.generators = {}  # id(generator) -> (generator, its state before the call)

    def commit(self):
        """Add every kept gradient into its layer's array, or none if one cannot be added."""
        if not self.grads:
            return
        targets = []
        for owner, attribute, name, grad in self.grads:
            target = getattr(owner, attribute)[name]
            grad = np.asarray(grad)
            if grad.shape != target.shape or grad.dtype != target.dtype:
                _check_addable(name, target, grad)
            targets.append((target, grad))
        with _GRADS_LOCK:  # backwards from several threads add as if serial
            _add_all(targets)

    def rollback(self):
        """Give every journaled object, and every Generator, the state it had before the call."""
        for obj, state in self.journal.values():
            obj._restore_state(state)
        for generator, state in self.generators.values():
            generator.bit_generator.state = state


def _add_all(targets):
    """``target += grad`` for each pair, in order within each target's memory.

    Pairs whose targets share a base array form one group, added in the
    pairs' order (a tied table gets its two gradients in the order they
    came); from the ``min_parallel_entries`` setting on, the groups are
    dealt among the kernels' worker threads, each group whole to one thread:
    the same sums, the same bits.
    """
    from ..kernels._runtime import run_elementwise

    groups: dict[int, list] = {}
    for target, grad in targets:
        root = target
        while isinstance(root.base, np.ndarray):
            root = root.base
        groups.setdefault(id(root), []).append((target, grad))
    work = sorted(groups.values(), key=lambda group: -sum(t.size for t, _ in group))

    def add(part):
        for group in part:
            for target, grad in group:
                target += grad

    run_elementwise(add, work, sum(t.size for t, _ in targets))


def _check_addable(name, target, grad):
    """Refuse a gradient that ``target += grad`` would broadcast it up or cast it down."""
    if (np.broadcast_shapes(target.shape, grad.shape) != target.shape
            or not np.can_cast(grad.dtype, target.dtype, "same_kind")):
        raise ValueError(f"the gradient of {name!r} ({grad.dtype}, shape {grad.shape}) cannot "
                         f"be added into its array ({target.dtype}, shape {target.shape}); "
                         "nothing was added")


def journal(obj) -> None:
    """Inside a transaction: keep ``obj._save_state()`` once, to restore if the call raises.

    Called by an object (a layer, a KV cache) right before it changes its
    state; a no-op outside a transaction.
    """
    current = _LOCAL.current
    if current is not None and id(obj) not in current.journal:
        current.journal[id(obj)] = (obj, obj._save_state())


def journal_generator(generator) -> None:
    """Inside a transaction: keep ``generator``'s state once, to restore if the call raises.

    Called right before a layer draws a dropout mask from it.
    """
    current = _LOCAL.current
    if (current is not None and id(generator) not in current.generators
            and isinstance(generator, np.random.Generator)):
        current.generators[id(generator)] = (generator, generator.bit_generator.state)


def add_grad(owner, attribute: str, name: str, grad) -> None:
    """``getattr(owner, attribute)[name] += grad``, now (locked) or at the transaction's commit."""
    if grad is None:
        return
    current = _LOCAL.current
    if current is not None:
        current.grads.append((owner, attribute, name, grad))
        return
    with _GRADS_LOCK:  # backwards from several threads add as if serial
        getattr(owner, attribute)[name] += grad


def add_grads(owner, attribute: str, grads) -> None:
    """:func:`add_grad` for each ``name -> gradient`` of ``grads`` (one lock for all)."""
    current = _LOCAL.current
    if current is not None:
        current.grads.extend((owner, attribute, name, grad) for name, grad in grads.items()
                             if grad is not None)
        return
    target = getattr(owner, attribute)
    with _GRADS_LOCK:  # backwards from several threads add as if serial
        for name, grad in grads.items():
            if grad is not None:
                target[name] += grad


def transactional(method):
    """Make a composite's ``method(self, ...)`` a transaction (see the module's docstring).

    The outermost call runs ``method``, then commits the kept gradients; if
    anything raises (``KeyboardInterrupt`` included) it restores what the
    call changed and re-raises. A call made inside an open transaction
    joins it.
    """
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if _LOCAL.current is not None:
            return method(self, *args, **kwargs)
        current = _LOCAL.current = _Transaction()
        try:
            result = method(self, *args, **kwargs)
            current.commit()
        except BaseException:
            current.rollback()
            raise
        finally:
            _LOCAL.current = None
        return result

    call.transactional = True  # type: ignore[attr-defined]
    return call
