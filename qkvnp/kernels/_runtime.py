"""The kernels' runtime: worker threads, BLAS thread control, and the settings
that tune them (the score-buffer pool's among them: :mod:`qkvnp.kernels.buffers`).

Shape key: ``lead`` the leading (batch, head) dims of an attention problem,
G one block of them.

Settings, not globals to patch (the model is ``torch.set_num_threads``):

- :func:`set_num_threads` / :func:`get_num_threads` / :func:`num_threads`
  (a context manager, thread-local): the worker threads the fast and tiled
  kernels split their (batch, head) blocks over, at most
  :data:`MAX_NUM_THREADS` (from :mod:`qkvnp.kernels.workers`, which says
  how they are set and run). BLAS inside the workers runs on one thread.
- :func:`set_block_sizes` / :func:`get_block_sizes` / :func:`block_sizes`:
  the sizes that cut the work into blocks and the thresholds of ``impl="auto"``
  (see :data:`BLOCK_SIZE_DEFAULTS` for each one and why it has its value).

- glibc's malloc thresholds, given once at the first kernel section
  (:mod:`qkvnp.kernels.heap`, the ``heap_mmap_threshold`` setting): without
  them the kernels' temporaries were page-faulted anew on every call.

Settings are global to the process, as PyTorch's are (but for
:func:`num_threads`' thread-local override). They, the worker threads and
the locks survive ``fork``: the child keeps the settings and starts with
fresh locks, no workers and OpenBLAS's thread count from before the kernels
pinned it (``os.register_at_fork``), whatever the parent's threads were
doing. A fork waits for the calls into OpenBLAS's thread control that
other threads' kernels are making (a count change: microseconds; a product
on OpenBLAS's own threads: until it ends). ``import`` of this
module costs numpy only: ctypes, the thread pool and the BLAS probe
(:mod:`qkvnp.kernels.openblas`) are loaded at first use. Measurements behind
the defaults: ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import math
import os
import threading

import numpy as np

from .._checks import check_int
from .heap import tune_heap
from .openblas import openblas_info, openblas_thread_functions
from .workers import (MAX_NUM_THREADS, crew, get_num_threads, in_worker, num_threads,
                      process_num_threads, set_num_threads)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any

__all__ = [
    "MAX_NUM_THREADS",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "set_block_sizes",
    "get_block_sizes",
    "block_sizes",
    "BLOCK_SIZE_DEFAULTS",
    "check_block_pair",
    "blas_threads",
    "single_threaded_blas",
    "openblas_thread_functions",
    "openblas_info",
    "current_owner",
    "OwnerScope",
    "blocks",
    "blas_section",
    "in_blas_section",
    "split_threads",
    "threads_for",
    "run",
    "run_elementwise",
    "row_slices",
    "matmul",
]

#: Default of every block-size setting (bytes, rows or positions).
BLOCK_SIZE_DEFAULTS = {
    # Largest score block (bytes) one worker handles in one step of the fast
    # core: many heads at short lengths, one head at long lengths. Smaller
    # blocks stay in cache, larger ones mean fewer numpy calls (fewer GIL
    # hand-overs between the threads); 1-4 MiB measured best.
    "fast_block_bytes": 4 << 20,
    # The fast core processes a block's rows in chunks of about this many score
    # bytes (at least ``min_row_block`` rows), so that the softmax's passes run
    # in cache (NOTE: 8 MiB measured best, benchmarks/NOTES.md).
    "row_block_bytes": 8 << 20,
    "min_row_block": 64,
    # ... and of at most this many rows under a causal mask, each chunk
    # skipping the keys none of its rows sees (the masked triangle, in steps).
    # NOTE: 256 measured faster than one chunk and than 128 (benchmarks/NOTES.md).
    "causal_row_block": 256,
    # The fused cross-entropy (qkvnp.kernels.loss) goes through the rows of
    # its (N, C) logits in chunks of about this many bytes (at least one row),
    # so that its passes run in cache. NOTE: at (1024, 4096) float32, 512 KiB
    # to 2 MiB measured fastest, 256 KiB slower (benchmarks/NOTES.md).
    "loss_block_bytes": 1 << 20,
    # Fewest rows (or columns) per thread for which a projection matmul splits.
    "min_split": 64,
    # Fewest floating-point operations of a projection that runs on OpenBLAS's
    # own threads, in a layer whose core is serial (see matmul). NOTE: below
    # about 2 MFLOP two threads measured slower than one (benchmarks/NOTES.md).
    "blas_thread_flops": 1 << 21,
    # Fewest floating-point operations of one job (a matmul, a core's pass)
    # for which the worker threads are used; smaller jobs run serially in the
    # calling thread, where the hand-off would cost more than it saves. A
    # layer whose core's backward stays below it also runs its projections on
    # OpenBLAS's threads (see matmul). NOTE: 2**27 measured faster than 2**24
    # on layers that do not split their batch (benchmarks/NOTES.md).
    "min_parallel_flops": 1 << 27,
    # Fewest entries of an elementwise job (AdamW's update, the loss's rows, sums
    # and copies of arrays: run_elementwise) for which the worker threads are used. NOTE: AdamW at two threads measured 1.3-1.45x faster from
    # 2**19 float32 entries, slower at 2**18 (benchmarks/NOTES.md).
    "min_parallel_entries": 1 << 19,
    # Fewest floating-point operations of a layer's fast forward (projections,
    # core, output projection) for which the layer splits its batch over the
    # worker threads, each running the whole layer on its share: one hand-off
    # a forward and one a backward instead of one per matmul and core pass; at
    # numpy-call sizes the threads mostly wait on the GIL. A float64 operation
    # counts 1.5 times. NOTE: the split measured slower below about 2**25
    # operations and faster above, on both hosts (benchmarks/NOTES.md).
    "batch_split_flops": 1 << 25,
    # The tiled core's default (block_q, block_k), shrunk as tiled.py says.
    "tiled_block": (512, 512),
    # Freed score buffers of at least recycle_min_bytes are kept, up to
    # recycle_bytes in all, for the next forward of the same size: fresh ones
    # page-faulted (NOTE: measured up to a quarter of a fwd+bwd,
    # benchmarks/NOTES.md). recycle_bytes = 0 disables. They are
    # kept for the layer that used them last, and let go when it is collected
    # (buffer_owner) ...
    "recycle_bytes": 512 << 20,
    # ... and up to recycle_unowned_bytes of those taken outside a layer (a
    # kernel called directly): nothing lets those go but a later call or
    # release_buffers, so they are few.
    "recycle_unowned_bytes": 8 << 20,
    "recycle_min_bytes": 1 << 20,
    # impl="auto" takes the tiled path from this many keys on (from 4096 the
    # two cost about the same and tiled needs memory linear in L) ...
    "tiled_min_length": 4096,
    # ... from this many keys on under a causal mask. Both cores skip the
    # masked triangle: the tiled one by block pairs, the dense one by chunks of
    # causal_row_block rows. NOTE: at 2048 causal keys the dense core measured
    # faster than the tiled one (benchmarks/NOTES.md) ...
    "causal_tiled_min_length": 4096,
    # ... or when the dense (..., H, T, S) weights would take more bytes than this.
    "dense_weights_budget": 256 << 20,
    # glibc's malloc serves blocks below this from its heap and keeps twice
    # this much freed memory, set at the first kernel section (what its own
    # heuristic reaches after one freed 32 MiB block; NOTE: without it small
    # layers page-fault on every step, benchmarks/NOTES.md). 0: as is.
    "heap_mmap_threshold": 32 << 20,
}
_MINIMUM = {"fast_block_bytes": 1, "row_block_bytes": 1, "min_row_block": 1, "causal_row_block": 1,
            "loss_block_bytes": 1, "min_split": 1,
            "min_parallel_flops": 0, "min_parallel_entries": 0, "batch_split_flops": 0,
            "blas_thread_flops": 0,
            "recycle_bytes": 0, "recycle_unowned_bytes": 0, "recycle_min_bytes": 0,
            "tiled_min_length": 1,
            "causal_tiled_min_length": 1,
            "dense_weights_budget": 0, "heap_mmap_threshold": 0}

_SIZES = dict(BLOCK_SIZE_DEFAULTS)
_SETTINGS_LOCK = threading.Lock()


def get_block_sizes() -> dict[str, Any]:
    """A copy of the block-size settings, by name (see :data:`BLOCK_SIZE_DEFAULTS`).

    >>> get_block_sizes()["tiled_block"]
    (512, 512)
    """
    return dict(_SIZES)


def check_block_pair(value, name):
    """``(block_q, block_k)`` from an int (both) or a pair of positive ints.

    >>> check_block_pair(64, "block_size")
    (64, 64)
    """
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair (block_q, block_k), got {value!r}")
    expected = f"a positive int or a pair of positive ints (got {value!r})"
    return tuple(check_int(b, name, 1, expected=expected) for b in pair)


def _checked_sizes(sizes):
    checked = {}
    for name, value in sizes.items():
        if name not in BLOCK_SIZE_DEFAULTS:
            raise ValueError(
                f"unknown block-size setting {name!r}; the settings are "
                f"{', '.join(BLOCK_SIZE_DEFAULTS)}"
            )
        if name == "tiled_block":
            checked[name] = check_block_pair(value, name)
        else:
            checked[name] = check_int(value, name, _MINIMUM[name])
    return checked


def set_block_sizes(**sizes: Any) -> None:
    """Set block-size settings by name; the others keep their values.

    Parameters
    ----------
    **sizes : int, or (int, int) for ``tiled_block``
        Any of :data:`BLOCK_SIZE_DEFAULTS`' names. ``None`` is not a value:
        pass the default from :data:`BLOCK_SIZE_DEFAULTS` to restore one.

    Raises
    ------
    ValueError
        On an unknown name (all names are checked before any is set) or a
        value below its minimum.
    TypeError
        On a value that is not an int.

    Examples
    --------
    >>> set_block_sizes(min_split=32)
    >>> get_block_sizes()["min_split"]
    32
    >>> set_block_sizes(min_split=BLOCK_SIZE_DEFAULTS["min_split"])
    """
    checked = _checked_sizes(sizes)
    with _SETTINGS_LOCK:
        _SIZES.update(checked)


class block_sizes:
    """Context manager: :func:`set_block_sizes` inside, the previous values after.

    (Classes rather than ``contextlib`` generators: ``import contextlib`` was
    a measurable share of ``import qkvnp``.)

    >>> with block_sizes(tiled_block=64):
    ...     get_block_sizes()["tiled_block"]
    (64, 64)
    """

    def __init__(self, **sizes: Any) -> None:
        self.sizes = _checked_sizes(sizes)
        self.previous = None

    def __enter__(self):
        self.previous = {name: _SIZES[name] for name in self.sizes}
        set_block_sizes(**self.sizes)
        return self

    def __exit__(self, *exc):
        set_block_sizes(**self.previous)
        return False


# ---------------------------------------------------------------- buffer owners

_LOCAL = threading.local()  # .owner: a weak reference to the buffers' owner, or None


def current_owner():
    """The weak reference of the :class:`OwnerScope` the calling thread runs in, or None."""
    return getattr(_LOCAL, "owner", None)


class OwnerScope:
    """Context manager: the calling thread's score buffers are kept for ``ref`` (a weak
    reference, or None). :mod:`qkvnp.kernels.buffers` reads it; :func:`run` hands it
    to the worker threads."""

    def __init__(self, ref):
        self.ref = ref
        self.previous = None

    def __enter__(self):
        self.previous = getattr(_LOCAL, "owner", None)
        _LOCAL.owner = self.ref
        return self

    def __exit__(self, *exc):
        _LOCAL.owner = self.previous
        return False


# ---------------------------------------------------------------- BLAS threads

def _settle_process():
    """What the first kernel section settles, cheaply checked on every later one.

    The thread count (``QKVNP_NUM_THREADS`` read and checked: a bad value is
    an error even for a problem too small to use the workers) and glibc's
    heap thresholds (:mod:`qkvnp.kernels.heap`).
    """
    process_num_threads()
    tune_heap(_SIZES["heap_mmap_threshold"])


class blas_threads:
    """Context manager: run BLAS with ``n`` threads inside, restore after.

    Does nothing when numpy's OpenBLAS cannot be found (``available`` is then
    False). Setting the count is global to the process. Entering it also
    gives glibc the heap thresholds, once (``qkvnp/kernels/heap.py``): the
    training loop runs in it.

    >>> with blas_threads(1) as pinned:
    ...     _ = np.ones((4, 4)) @ np.ones((4, 4))
    """

    def __init__(self, n: int) -> None:
        self.n = int(n)
        self.previous = None
        self.available = bool(openblas_thread_functions())

    def __enter__(self):
        _settle_process()
        if self.available:
            get, set_ = openblas_thread_functions()
            with _PIN_LOCK:  # not during a fork (see _PIN_LOCK)
                self.previous = get()
                set_(self.n)
        return self

    def __exit__(self, *exc):
        if self.available:
            with _PIN_LOCK:
                openblas_thread_functions()[1](self.previous)
        return False


# ---------------------------------------------------------------- threads

_SECTION_LOCK = threading.Lock()  # one threaded section at a time (the pool is shared)
# NOTE: every call of qkvnp's into OpenBLAS's thread control (its count set,
# and a product on its own threads) runs under _PIN_LOCK or _BLAS_POOL_LOCK, and
# a fork takes both first (_hold_blas_before_fork). Else a fork could land (1)
# between a section's count change and the _PIN entry that records it: the
# child saw depth 0 with BLAS left at one thread; or (2) inside OpenBLAS
# rebuilding its thread pool, which its own fork handler tears down in the
# parent at every fork and any later count change or threaded product builds
# again under its server lock: the child inherited that lock held, and hung
# at its first BLAS call. The locks cost nothing without a fork (each is
# taken where a lock or a ctypes call was already made).
_PIN_LOCK = threading.Lock()
_BLAS_POOL_LOCK = threading.RLock()  # work on OpenBLAS's threads (_on_blas_threads, may nest)
_PIN = {"depth": 0, "saved": None}  # sections inside single_threaded_blas, BLAS count before them


def _hold_blas_before_fork():
    """Before ``fork``, in the forking thread: wait for qkvnp's OpenBLAS calls in flight."""
    _BLAS_POOL_LOCK.acquire()
    _PIN_LOCK.acquire()


def _release_blas_after_fork_in_parent():
    _PIN_LOCK.release()
    _BLAS_POOL_LOCK.release()


def _reset_after_fork_in_child():
    """After ``fork``, in the child: fresh locks, no section open, BLAS as before the sections.

    NOTE: only the forking thread lives on in the child. A lock another
    thread held at the fork (a kernel running in a background thread) would
    stay held for good, and the child's first threaded kernel would wait on
    it forever. No kernel forks, so no section of the forking thread is
    open either: the child restores OpenBLAS's count from before the
    parent's sections (consistent with ``_PIN``: the fork held ``_PIN_LOCK``).
    """
    global _SECTION_LOCK, _PIN_LOCK, _BLAS_POOL_LOCK, _SETTINGS_LOCK
    _SECTION_LOCK, _PIN_LOCK = threading.Lock(), threading.Lock()
    _BLAS_POOL_LOCK = threading.RLock()
    _SETTINGS_LOCK = threading.Lock()
    if _PIN["depth"]:
        _PIN["depth"] = 0
        functions = openblas_thread_functions()
        if functions and _PIN["saved"] is not None:
            functions[1](_PIN["saved"])


class single_threaded_blas:
    """Context manager: BLAS at one thread inside; nested and concurrent sections share it.

    The kernels run their BLAS calls at one thread: in the threads that run a
    shared job's shares (the workers, one per core, and the calling thread,
    which runs the first share), and in the calling thread for jobs too small
    to share;
    the exceptions are a layer's projections beside a serial core, which
    :func:`matmul` raises to OpenBLAS's threads for the product alone, and a
    large job of one block, which :func:`run` cannot share.
    NOTE: left to itself OpenBLAS spreads even small matmuls over its own
    threads, which then spin after the call and more than double a small
    layer's CPU time (benchmarks/NOTES.md). The count is process-wide, so the
    first section to enter sets it to 1 and the last one to leave restores
    it (other threads' numpy calls run single-threaded meanwhile). A class,
    not a generator: it is entered on every kernel call.
    """

    __slots__ = ("functions",)

    def __enter__(self):
        _settle_process()
        self.functions = openblas_thread_functions()
        if self.functions:
            with _PIN_LOCK:
                if _PIN["depth"] == 0:
                    _PIN["saved"] = self.functions[0]()
                    self.functions[1](1)
                _PIN["depth"] += 1
        return self

    def __exit__(self, *exc):
        if self.functions:
            with _PIN_LOCK:
                _PIN["depth"] -= 1
                if _PIN["depth"] == 0:
                    self.functions[1](_PIN["saved"])
        return False


def blocks(lead, group_bytes, threads):
    """Index tuples over the leading dims, one per block of (batch, head) groups.

    A block is an integer index over the first ``k - 1`` leading dims and a
    slice of dim ``k - 1``: as many groups as fit in the ``fast_block_bytes`` setting (at
    least one), and at least ``threads`` blocks when there are that many groups.
    """
    if not lead:
        return [()]
    block_bytes = _SIZES["fast_block_bytes"]
    k = 1
    while k < len(lead) and math.prod(lead[k:]) * group_bytes > block_bytes:
        k += 1
    outer, n = math.prod(lead[:k - 1]), lead[k - 1]
    inner_bytes = math.prod(lead[k:]) * group_bytes  # one index of dim k - 1
    per = max(1, block_bytes // max(1, inner_bytes))
    if outer < threads:  # split dim k - 1 finely enough to feed every thread
        per = min(per, max(1, -(-n * outer // threads)))
    return [index + (slice(start, min(start + per, n)),)
            for index in np.ndindex(*lead[:k - 1]) for start in range(0, n, per)]


class blas_section:
    """Context manager: the calling thread's products run on OpenBLAS's own threads inside.

    A model whose products are large enough for OpenBLAS's threads (the
    book's GPT at the 124M size) enters it around its blocks; a layer kernel
    inside then keeps its batch whole (:func:`split_threads`) unless its
    attention core alone would use the pool. Thread-local; nests.

    >>> with blas_section():
    ...     in_blas_section()
    True
    """

    def __enter__(self):
        _LOCAL.blas_sections = getattr(_LOCAL, "blas_sections", 0) + 1
        return self

    def __exit__(self, *exc):
        _LOCAL.blas_sections -= 1
        return False


def in_blas_section():
    """True inside a :class:`blas_section` of the calling thread."""
    return getattr(_LOCAL, "blas_sections", 0) > 0


def split_threads(flops, core_flops):
    """The worker threads a layer's batch split gets: ``threads_for(flops, "batch_split_flops")``.

    ``flops`` counts the layer's forward (projections, core, output
    projection), ``core_flops`` its attention core alone. Inside a
    :class:`blas_section`, 1 when the core is below ``min_parallel_flops``:
    the projections then run on OpenBLAS's threads like the model's other
    products. NOTE: shares on the pool between OpenBLAS-threaded products
    measured a third slower a step than no split, on the 124M GPT at
    (4, 64) and two threads (OpenBLAS's idle threads spin while the pool
    works; benchmarks/NOTES.md).
    """
    if in_blas_section() and core_flops < _SIZES["min_parallel_flops"]:
        return 1
    return threads_for(flops, "batch_split_flops")


def threads_for(flops, setting="min_parallel_flops"):
    """The worker threads a job of ``flops`` operations gets: 1 below the ``setting``.

    Also 1 in a worker thread: a job that is a worker's share already (the
    layer's batch split) runs its inner jobs serially.
    """
    if flops < _SIZES[setting] or in_worker():
        return 1
    return get_num_threads()


def run_elementwise(task, work, entries):
    """``task(part)`` on shares of the list ``work`` in the worker threads from the
    ``min_parallel_entries`` setting on (``entries``: the job's array entries), else
    ``task(work)`` in the calling thread.

    For elementwise jobs (AdamW's chunks, the loss's rows, sums of arrays), whose
    cost goes with the entries they touch rather than with operations.
    """
    if len(work) > 1 and threads_for(entries, "min_parallel_entries") > 1:
        run(task, work)
    else:
        task(work)


def row_slices(N, rows):
    """``N`` rows cut in slices of ``rows`` (at least one), the last one shorter if need be.

    >>> row_slices(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    rows = max(1, rows)
    return [slice(lo, min(lo + rows, N)) for lo in range(0, N, rows)]


def _snake_shares(work, threads):
    """``work`` dealt in snake order (0, 1, 1, 0, 0, 1, ...), each share in the list's order.

    Balanced for equal costs and for costs growing along the list, as the causal tiled
    core's: 68 and 68 block pairs at (1, 4096, 256, 4) where 0, 1, 0, 1, ... gave 64, 72."""
    shares = [[] for _ in range(threads)]
    for i, item in enumerate(work):
        turn, place = divmod(i, threads)
        shares[place if turn % 2 == 0 else threads - 1 - place].append(item)
    return shares


def run(task, work, flops=None):
    """Call ``task(part)`` on shares of the list ``work``, in threads when it pays.

    Threads only when there are two blocks or more, the job's ``flops`` (an
    estimate of its floating-point operations) reach the ``min_parallel_flops``
    setting, and BLAS can be pinned to one thread for the duration (restored
    after, even on error). Below that the job runs serially in the calling
    thread: handing work to a worker and waking it costs more than small
    matmuls (measured: at (B, L, E, H) = (8, 16, 32, 4) more than half of a
    layer's time was spent waiting on the workers' locks). In threads, the
    calling thread runs the first share itself, pinned to a CPU for the
    duration (its CPU set is given back after), and waits for the workers'
    shares before it returns or re-raises an error (:class:`qkvnp.kernels.workers.Crew`).

    A job of one block that reaches the setting (one (batch, head) group, as
    a one-head layer on one sequence) cannot be shared: it runs in the
    calling thread with its products on OpenBLAS's own threads, as many as
    the kernels', capped by OpenBLAS's count before the section pinned it
    (:func:`matmul`). NOTE: measured a third faster on a one-head layer
    (benchmarks/NOTES.md).
    """
    workers = get_num_threads()
    threads = min(workers, len(work))
    if (flops is not None and flops < _SIZES["min_parallel_flops"]) or in_worker():
        threads = 1  # small, or a worker's own share (no nested hand-off)
    elif threads == 1 and flops is not None and workers > 1 and _PIN["depth"]:
        _on_blas_threads(lambda: task(work), min(workers, _PIN["saved"]))
        return
    if threads < 2 or not openblas_thread_functions():
        if _PIN["depth"]:  # already inside a single-threaded section
            task(work)
        else:
            with single_threaded_blas():
                task(work)
        return
    parts = _snake_shares(work, threads)
    owner = current_owner()
    if owner is not None:  # the workers' buffers are kept for the caller's owner too
        shared = task

        def task(part):
            with OwnerScope(owner):
                shared(part)

    with _SECTION_LOCK, single_threaded_blas():
        crew(workers).run(task, parts)  # share 0 in the calling thread (see workers.Crew)


def _on_blas_threads(call, count):
    """``call()``'s result, called with OpenBLAS at ``count`` threads, back to one
    after, even on error (inside a :class:`single_threaded_blas` section)."""
    set_blas_threads = openblas_thread_functions()[1]
    with _BLAS_POOL_LOCK:  # no fork while OpenBLAS's pool is set up or working (see _PIN_LOCK)
        with _PIN_LOCK:
            set_blas_threads(count)
        try:
            return call()
        finally:
            with _PIN_LOCK:
                set_blas_threads(1)  # back to the section's pin


def matmul(a, b, out=None, split="rows", blas_threads=False):
    """``a @ b`` for 2-D operands (the layers' projections), threaded where it pays.

    In the pool's workers, one product on one thread: it is a share already.
    Elsewhere, with ``blas_threads`` (the caller's next steps do not use the
    pool) and from ``blas_thread_flops`` on, on OpenBLAS's own threads: as
    many as :func:`get_num_threads`, at most OpenBLAS's count before the
    kernels pinned it to one (one under ``blas_threads(1)``, as in the
    training loop). Otherwise, from ``min_parallel_flops`` on, split over the
    pool: ``split="rows"`` splits the rows of ``a``, ``"cols"`` the columns of
    ``b`` (for ``x^T @ dy``, whose rows are few).

    NOTE: OpenBLAS hands a product to its threads faster than the pool does,
    but its threads spin after the call and slow a pooled core that follows
    (benchmarks/NOTES.md): hence only where no pool work follows.
    """
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if _PIN["depth"] and flops < _SIZES["blas_thread_flops"]:  # the small ones: one thread
        return np.matmul(a, b, out=out)
    threads = 1 if in_worker() else get_num_threads()
    if blas_threads and _PIN["depth"]:  # from blas_thread_flops on (see above)
        blas = min(threads, _PIN["saved"])
        if blas > 1:
            return _on_blas_threads(lambda: np.matmul(a, b, out=out), blas)
    if threads < 2 or flops < _SIZES["min_parallel_flops"]:
        if _PIN["depth"]:  # the layer kernels' section: BLAS at one thread
            return np.matmul(a, b, out=out)
        with single_threaded_blas():
            return np.matmul(a, b, out=out)
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), np.result_type(a, b))
    length = a.shape[0] if split == "rows" else b.shape[1]
    bounds = np.linspace(0, length, min(get_num_threads(), max(1, length // _SIZES["min_split"]))
                         + 1).astype(int)
    pieces = [(slice(lo, hi),) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def task(part):
        for (piece,) in part:
            if split == "rows":
                np.matmul(a[piece], b, out=out[piece])  # (n, K) @ (K, M) -> (n, M)
            else:
                np.matmul(a, b[:, piece], out=out[:, piece])  # (N, K) @ (K, m) -> (N, m)

    run(task, pieces)
    return out


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_hold_blas_before_fork,
                        after_in_parent=_release_blas_after_fork_in_parent,
                        after_in_child=_reset_after_fork_in_child)
