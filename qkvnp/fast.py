"""Fast dense attention: the math of :mod:`qkvnp.functional`, tuned for the CPU.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim (of queries and keys), Dv head dim of values, N = B*T rows,
``...`` any leading (batch, head) dims, G one block of them.

Same semantics as :func:`qkvnp.functional.attention_forward` (masks, causal,
fully masked rows, validation errors), same results (float32 within 1e-5
and float64 within 1e-12 relative of the reference, see ``tests/test_fast.py``),
but written for speed. What it does differently (each step measured on a
2-core AVX-512 machine with numpy's OpenBLAS, issue 4):

- no scipy: the softmax is written in place into the score buffer, and it is
  **not normalised**: the cache keeps ``exp_scores = exp(S - m)`` and
  ``inv_sum = 1 / rowsum``; the division is applied to ``(T, Dv)`` and
  ``(T, D)`` operands instead of the ``(T, S)`` matrix;
- ``m`` is not the row max but the bound ``|q| max|k| + max(mask row)``,
  known before the scores, so ``[q | -m] @ [k | 1]^T`` yields ``S - m`` in
  the matmul itself (no max pass, no subtraction pass), ``E @ [v | 1]`` yields
  the output and the row sums together (no sum pass), and ``exp2`` (faster
  than ``exp``) runs on scores pre-multiplied by ``log2(e)``. A few probe keys
  check that the bound is within :data:`MAX_BOUND_GAP` bits of the max;
  otherwise (and on overflow, fully masked rows) a block takes the exact
  max, as the reference does: subnormal exponentials are 100x slower;
- the scale ``1/sqrt(D)`` is folded into Q (a ``(T, D)`` product);
- the backward uses ``rowsum(P * dP) = rowsum(dO * O)`` (a ``(T, Dv)`` product),
  gets ``dP - delta`` from one matmul ``[dO | -delta] @ [V | 1]^T`` and forms
  ``dS`` in place; it computes ``dK^T = Q^T dS`` and ``dV^T = dO^T P``
  (measured up to 1.5x faster than ``dS^T Q`` in float64);
- rows are processed in chunks of about :data:`ROW_BLOCK_BYTES` so that the
  elementwise passes run in cache; results are written with ``out=`` into
  their final arrays (possibly strided views: numpy hands them to BLAS);
- the (batch, head) groups are split into blocks that :data:`NUM_THREADS`
  Python threads process concurrently with BLAS pinned to one thread (ufuncs
  and BLAS release the GIL). Never around a multi-threaded BLAS call: when
  the BLAS thread count cannot be set (no OpenBLAS found) or there is a single
  block, the work runs in the calling thread with BLAS's own threads.

:func:`mha_forward` / :func:`mha_backward` are the matching multi-head layer
path: one fused ``(N, E) @ (E, 3E)`` projection for self-attention, heads as
strided views, the output written into the merged ``(..., T, E)`` layout,
buffers reused from the previous call, and the projections split over the
same pinned threads (after a multi-threaded OpenBLAS call its idle threads
spin and slowed what followed).

Measured on a quiet machine (2 cores, nothing else running, 2026-11-22;
torch 2.13 and numpy's OpenBLAS, 2 threads each; one process interleaving
the settings with PyTorch, 0.3 s pause when switching library, median of 7),
forward+backward, qkvnp fast / PyTorch: the layer vs
``nn.MultiheadAttention(need_weights=False)`` 0.93 (float32) / 1.08
(float64) at (B, L, E, H) = (8, 128, 256, 8), 1.03 / 1.03 at (4, 512, 512, 8),
1.25 / 1.12 at (1, 2048, 512, 8), 1.27 / 1.11 at (1, 4096, 256, 4) (where
``impl="auto"`` runs the tiled path: 1.43-1.63); the core alone vs
``scaled_dot_product_attention`` 0.89 / 0.93 at L = 128, 1.07-1.32 at
L >= 512. The tuning constants (:data:`BLOCK_BYTES`, :data:`MIN_SPLIT`
1-8 MiB and 32-128 within noise of each other, :data:`ROW_BLOCK_BYTES`
8 MiB best) were re-chosen from that sweep. At small sizes the first qkvnp
call after a pause is up to 50% slower (threads waking up), so ratios there
move by that much with the order of the calls. Most
of the core's time is in its six matmuls, which OpenBLAS runs at 100-170
GFLOP/s per core, slower on operands that have left the cache (the dense
``(T, S)`` matrices are written once and read three times); PyTorch's fused
kernel works on cache-sized tiles, which is what bounds these ratios from
below on this BLAS. These are a tuning sweep's numbers; the benchmark
command's full runs (``benchmarks/RESULTS.md``, commits 22fbdf2 and 871cd30)
gave the same picture: layer 0.84-1.44 and 0.87-1.55, core 1.20-1.34 and
1.19-1.39 at L >= 512. A variant that
recomputes the scores in the backward instead of storing them measured at
best equal (forward 17-24% faster, backward 14-44% slower), see RESULTS.md.

``import qkvnp.fast`` imports numpy only (ctypes and threads are loaded on
first use).
"""
import os
import threading
from collections import namedtuple

import numpy as np

from ._checks import as_upstream_grad
from .functional import _check_attention_inputs, _check_scale, sum_to_shape
from .masks import prepare_mask

__all__ = [
    "NUM_THREADS",
    "BLOCK_BYTES",
    "attention_forward",
    "attention_backward",
    "attention_weights",
    "mha_forward",
    "mha_backward",
    "blas_threads",
    "release_buffers",
    "RECYCLE_BYTES",
    "FastAttentionCache",
    "FastLayerCache",
]


def _available_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


#: Python threads used over (batch, head) blocks; 1 disables threading.
#: Module-level setting: ``qkvnp.fast.NUM_THREADS = 1`` switches it off.
NUM_THREADS = max(1, min(_available_cpus(), 8))

#: Largest score block (bytes) one thread handles in one step: many heads at
#: short lengths, one head at long lengths (a per-thread scratch of up to this
#: size is what the backward allocates). Smaller blocks stay in cache, larger
#: ones mean fewer numpy calls, i.e. fewer GIL hand-overs between the threads;
#: 1-4 MiB measured best (one core, and two threads, respectively).
BLOCK_BYTES = 4 << 20

#: Rows of a block are processed in chunks of about this many score bytes
#: (at least :data:`MIN_ROW_BLOCK` rows), so that the elementwise passes of
#: the softmax and its backward run in cache at long sequence lengths.
#: Quiet machine, 2 threads: 8 MiB 1-5% faster than 4 MiB at L >= 2048,
#: 2 MiB 1-13% and 1 MiB 10% slower (issue 4 sweep, 2026-11-22).
ROW_BLOCK_BYTES = 8 << 20
MIN_ROW_BLOCK = 64

#: The softmax subtracts a cheap upper bound of each row max instead of the
#: max itself; a block whose bound may exceed the max by more than this many
#: bits (judged from :data:`PROBE_KEYS` sampled keys) takes the exact max.
MAX_BOUND_GAP = 24
PROBE_KEYS = 8

FastAttentionCache = namedtuple(
    "FastAttentionCache", "query key value exp_scores inv_sum out scale shapes"
)
FastAttentionCache.__doc__ = """What :func:`attention_backward` reads.

query : (..., T, D) query already multiplied by ``scale``.
key, value : (..., S, D), (..., S, Dv) broadcast to the common leading dims.
exp_scores : (..., T, S) ``exp(S - m)``, unnormalised softmax numerators
    (0 at masked positions), ``m`` an upper bound of the row max (or the row
    max itself); the weights are ``exp_scores * inv_sum``.
inv_sum : (..., T, 1) ``1 / rowsum(exp_scores)``, 0 for a fully masked row.
out : (..., T, Dv) the forward output.
scale : float.
shapes : the original shapes of query, key and value (for broadcast inputs).
"""

#: Freed score buffers of at least :data:`RECYCLE_MIN_BYTES` are kept, up to
#: this many bytes in all, for the next :func:`attention_forward` of the same
#: size: a fresh 128 MiB buffer cost 24% of a forward+backward at
#: (B, H, L, D) = (1, 8, 2048, 64) in page faults (smaller ones are recycled by
#: malloc anyway). 0 disables; :func:`release_buffers` frees them now.
RECYCLE_BYTES = 512 << 20
RECYCLE_MIN_BYTES = 16 << 20

_SPARE = []  # base arrays, each free while only this list refers to it
_SPARE_LOCK = threading.Lock()


def _recycled_empty(shape, dtype):
    """``np.empty(shape, dtype)``, reusing a large buffer no array refers to any more.

    A buffer is free when its only references are this pool's: every numpy
    view of it (the cache's array, any slice a caller took) refers to it.
    """
    import sys

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < RECYCLE_MIN_BYTES or nbytes > RECYCLE_BYTES:
        return np.empty(shape, dtype)
    with _SPARE_LOCK:
        for base in _SPARE:
            # references: the list, this loop's name, getrefcount's argument
            if base.nbytes == nbytes and sys.getrefcount(base) == 3:
                return base.view(dtype).reshape(shape)
        base = np.empty(nbytes, np.uint8)
        _SPARE.append(base)
        total = sum(b.nbytes for b in _SPARE)
        for old in list(_SPARE):
            if total <= RECYCLE_BYTES:
                break
            if old is not base and sys.getrefcount(old) == 3:  # list, name, argument
                _SPARE.remove(old)
                total -= old.nbytes
        return base.view(dtype).reshape(shape)


def release_buffers():
    """Drop the recycled buffers that no array uses (see :data:`RECYCLE_BYTES`)."""
    import sys

    with _SPARE_LOCK:
        _SPARE[:] = [b for b in _SPARE if sys.getrefcount(b) > 3]  # list, name, argument


# ---------------------------------------------------------------- BLAS threads

_BLAS = None  # (get, set) ctypes functions, () if not found
_BLAS_LOCK = threading.Lock()


def _find_openblas():
    """The OpenBLAS thread-count functions of the library numpy links, or ()."""
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
    names = [(f"{prefix}get_num_threads{suffix}", f"{prefix}set_num_threads{suffix}")
             for prefix in ("scipy_openblas_", "openblas_") for suffix in ("64_", "_64", "")]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                lib = ctypes.CDLL(path)  # already loaded by numpy: same handle
            except OSError:
                continue
            for get_name, set_name in names:
                get = getattr(lib, get_name, None)
                set_ = getattr(lib, set_name, None)
                if get is not None and set_ is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    set_.restype, set_.argtypes = None, [ctypes.c_int]
                    return get, set_
    return ()


def _openblas():
    global _BLAS
    if _BLAS is None:
        with _BLAS_LOCK:
            if _BLAS is None:
                _BLAS = _find_openblas()
    return _BLAS


class blas_threads:
    """Context manager: run BLAS with ``n`` threads inside, restore after.

    Does nothing when numpy's OpenBLAS cannot be found (``available`` is then
    False). Setting the count is global to the process.

    >>> with blas_threads(1) as pinned:
    ...     _ = np.ones((4, 4)) @ np.ones((4, 4))
    """

    def __init__(self, n):
        self.n = int(n)
        self.previous = None
        self.available = bool(_openblas())

    def __enter__(self):
        if self.available:
            get, set_ = _openblas()
            self.previous = get()
            set_(self.n)
        return self

    def __exit__(self, *exc):
        if self.available:
            _openblas()[1](self.previous)
        return False


# ---------------------------------------------------------------- threads

_POOL = None  # (pid, ThreadPoolExecutor of NUM_THREADS CPU-pinned workers)
_SECTION_LOCK = threading.Lock()  # one pinned section at a time (the count is global)


def _pin_worker(cpus, counter, lock):
    """Pool initializer: pin this worker thread to the next CPU of ``cpus``.

    NOTE: unpinned, a worker woken after an idle spell was often placed on the
    CPU of the thread that woke it (Linux's wake-affine) and the two halves of
    the work ran on one core: measured 27 ms instead of 15 ms for a layer
    called after a 50 ms pause. Pinned workers run on their own cores.
    """
    with lock:
        cpu = cpus[next(counter) % len(cpus)]
    try:
        os.sched_setaffinity(0, {cpu})  # 0: the calling thread
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


def _pool(workers):
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers != workers:
        import itertools
        from concurrent.futures import ThreadPoolExecutor

        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = list(range(os.cpu_count() or 1))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="qkvnp-fast",
                                  initializer=_pin_worker,
                                  initargs=(cpus, itertools.count(), threading.Lock()))
        start = threading.Barrier(workers)
        for future in [pool.submit(start.wait) for _ in range(workers)]:
            future.result()  # all workers exist (and are pinned) from now on
        if _POOL is not None and _POOL[0] == os.getpid():
            _POOL[1].shutdown(wait=False)  # its idle workers exit
        _POOL = (os.getpid(), pool)
    return _POOL[1]


def _blocks(lead, group_bytes, threads):
    """Index tuples over the leading dims, one per block of (batch, head) groups.

    A block is an integer index over the first ``k - 1`` leading dims and a
    slice of dim ``k - 1``: as many groups as fit in :data:`BLOCK_BYTES` (at
    least one), and at least ``threads`` blocks when there are that many groups.
    """
    if not lead:
        return [()]
    k = 1
    while k < len(lead) and int(np.prod(lead[k:])) * group_bytes > BLOCK_BYTES:
        k += 1
    outer, n = int(np.prod(lead[:k - 1])), lead[k - 1]
    inner_bytes = int(np.prod(lead[k:])) * group_bytes  # one index of dim k - 1
    per = max(1, BLOCK_BYTES // max(1, inner_bytes))
    if outer < threads:  # split dim k - 1 finely enough to feed every thread
        per = min(per, max(1, -(-n * outer // threads)))
    return [index + (slice(start, min(start + per, n)),)
            for index in np.ndindex(*lead[:k - 1]) for start in range(0, n, per)]


def _run(task, blocks):
    """Call ``task(part)`` on shares of ``blocks``, in threads when it pays.

    Threads only when there are two blocks or more and BLAS can be pinned to
    one thread for the duration (restored after, even on error).
    """
    threads = min(NUM_THREADS, len(blocks))
    if threads < 2 or not _openblas():
        task(blocks)
        return
    parts = [blocks[i::threads] for i in range(threads)]  # equal-cost blocks
    from concurrent.futures import wait

    with _SECTION_LOCK, blas_threads(1):
        # every share goes to a (CPU-pinned) worker; the caller only waits
        futures = [_pool(NUM_THREADS).submit(task, part) for part in parts]
        wait(futures)
        for future in futures:
            future.result()  # re-raise a worker's error


def _matmul(a, b, out=None, split="rows"):
    """``a @ b`` for 2-D operands, split over the threads of :func:`_run`.

    The layer's projections run this way, with BLAS pinned to one thread like
    the attention core, rather than on OpenBLAS's own threads: after a
    multi-threaded call OpenBLAS's idle threads keep spinning and slowed the
    core that follows by up to 1.4x (measured). ``split="rows"`` splits the
    rows of ``a``; ``"cols"`` the columns of ``b`` (for ``x^T @ dy``, whose
    rows are few).
    """
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), np.result_type(a, b))
    length = a.shape[0] if split == "rows" else b.shape[1]
    parts = min(NUM_THREADS, max(1, length // MIN_SPLIT))
    if parts < 2:
        np.matmul(a, b, out=out)
        return out
    bounds = np.linspace(0, length, parts + 1).astype(int)
    pieces = [(slice(lo, hi),) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def task(part):
        for (piece,) in part:
            if split == "rows":
                np.matmul(a[piece], b, out=out[piece])  # (n, K) @ (K, M) -> (n, M)
            else:
                np.matmul(a, b[:, piece], out=out[:, piece])  # (N, K) @ (K, m) -> (N, m)

    _run(task, pieces)
    return out


#: Fewest rows (or columns) per thread for which :func:`_matmul` splits.
MIN_SPLIT = 64

# ---------------------------------------------------------------- core


def _additive_mask(bias, keep, dtype):
    """One additive mask: ``bias`` where allowed, ``-inf`` where ``keep`` forbids."""
    if keep is None:
        return bias
    return np.where(keep, 0 if bias is None else bias, -np.inf).astype(dtype, copy=False)


def _exp_scores_careful(scores, query, key_t, mask):
    """Recompute a block's scores the reference way; return the row max.

    Used only for blocks with an overflowed score (inf, NaN) or a fully
    masked row: overflow is clipped to the dtype's largest finite value as in
    :func:`qkvnp.functional.attention_forward`, and a fully masked row gets
    max 0 so that ``exp(-inf - 0) = 0``.
    """
    big = np.finfo(scores.dtype).max
    np.matmul(query, key_t, out=scores)
    np.nan_to_num(scores, copy=False, nan=0.0, posinf=big, neginf=-big)
    if mask is not None:
        scores += mask
        np.minimum(scores, big, out=scores)  # -inf stays -inf
    row_max = scores.max(axis=-1, keepdims=True)
    row_max[np.isneginf(row_max)] = 0  # NOTE: fully masked row -> weights 0, output 0
    return row_max


def _row_chunks(G, T, S, itemsize):
    """Row slices of a ``(G, T, S)`` block, about :data:`ROW_BLOCK_BYTES` per group.

    A chunk's scores stay in the CPU cache between the matmul that writes
    them and the elementwise passes that follow.
    """
    rows = ROW_BLOCK_BYTES // max(1, S * itemsize)
    if rows >= T:
        return [slice(None)]
    rows = max(rows, MIN_ROW_BLOCK)
    return [slice(start, min(start + rows, T)) for start in range(0, T, rows)]


def _augment(x, last, factor=None):
    """``[x * factor | last]``: a copy of ``x`` with one more column holding ``last``."""
    out = np.empty(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)  # (..., L, n) -> (..., L, n + 1)
    if factor is None:
        out[..., :-1] = x
    else:
        np.multiply(x, factor, out=out[..., :-1])
    out[..., -1:] = last
    return out


def _augment_t(x, last):
    """``[x | last]^T`` laid out contiguously: ``(..., L, n) -> (..., n + 1, L)``."""
    out = np.empty(x.shape[:-2] + (x.shape[-1] + 1, x.shape[-2]), x.dtype)  # (..., n + 1, L)
    out[..., :-1, :] = np.swapaxes(x, -1, -2)
    out[..., -1, :] = last
    return out


def _mask_row_max(mask, dtype):
    """Largest finite entry of each row of the additive mask, 0 if none (broadcastable)."""
    if mask is None:
        return None
    finite = np.where(np.isneginf(mask), -np.inf, mask)
    row_max = finite.max(axis=-1, keepdims=True)  # (..., T, S) -> (..., T, 1)
    row_max[np.isneginf(row_max)] = 0
    return row_max.astype(dtype, copy=False)


def _core_forward(query, key, value, mask, exp_scores, inv_sum, out):
    """Fill ``exp_scores``, ``inv_sum`` and ``out`` (all preallocated, full leading dims).

    ``query`` is already scaled; ``mask`` is None or an additive mask whose
    shape broadcasts to ``exp_scores``' (it is broadcast here).
    """
    lead = exp_scores.shape[:-2]
    T, S = exp_scores.shape[-2:]
    if S == 0:  # NOTE: no key at all: every row is fully masked, output 0
        out[...] = 0
        inv_sum[...] = 0
        return
    dtype = exp_scores.dtype
    log2e = dtype.type(np.log2(np.e))
    mask_max = _mask_row_max(mask, dtype)
    if mask is not None:
        # base-2 scores: exp(x) = exp2(x log2(e)) and exp2 is the faster ufunc
        mask = np.broadcast_to(mask * log2e, lead + (T, S))
        mask_max = np.broadcast_to(mask_max, lead + (T, 1))
    # a few keys whose scores give a lower bound on each row max (key 0 is
    # visible under a causal mask and usually under key padding)
    probes = np.unique(np.linspace(0, S - 1, min(S, PROBE_KEYS)).astype(np.intp))

    def task(part):
        # NOTE: overflow is handled below (clipped as in the reference), so
        # numpy's overflow warnings of the matmul and the subtraction are noise.
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            for idx in part:
                k, v = key[idx], value[idx]  # (G, S, D), (G, S, Dv)
                key_aug_t = _augment_t(k, 1)  # (G, S, D) -> (G, D + 1, S)
                value_aug = _augment(v, 1)  # (G, S, Dv) -> (G, S, Dv + 1)
                key_norm = np.sqrt(np.max(np.sum(k * k, axis=-1), axis=-1))[..., None, None]  # (G, 1, 1)
                G = int(np.prod(exp_scores[idx].shape[:-2]))
                for rows in _row_chunks(G, T, S, exp_scores.itemsize):
                    block = idx + (Ellipsis, rows, slice(None))
                    _forward_rows(exp_scores[block], query[block], k, key_aug_t, key_norm, value_aug,
                                  None if mask is None else mask[block],
                                  None if mask is None else mask_max[block],
                                  inv_sum[block], out[block], probes, log2e)

    _run(task, _blocks(lead, T * S * exp_scores.itemsize, NUM_THREADS))


def _forward_rows(scores, q, k, key_aug_t, key_norm, value_aug, mask, mask_max, inv, o,
                  probes, log2e):
    """Forward of one block of rows: scores, softmax numerators, output.

    The row max is replaced by the bound ``m = |q| max|k| + max(mask row)``
    (Cauchy-Schwarz), known before the scores, so that ``(S - m) log2(e)``
    comes out of one matmul, ``[q log2(e) | -m log2(e)] @ [k | 1]^T``, and
    ``exp(S - m)`` is one ``exp2`` in place (``mask`` comes pre-multiplied by
    ``log2(e)``); likewise ``E @ [v | 1]`` gives the output and the row sums
    together.

    NOTE: the bound must not exceed the true row max by much: the
    exponentials would drift into the subnormal range, where ``exp2`` and the
    matmul were measured 100x slower. The scores of a few ``probes`` keys give
    a lower bound on the row max; a block where bound - probe max exceeds
    :data:`MAX_BOUND_GAP` bits, with overflowed scores or with a fully masked
    row is redone by the reference recipe (:func:`_exp_scores_careful`,
    with ``mask / log2(e)``), i.e. with the exact row max.
    """
    bound = np.sqrt(np.sum(q * q, axis=-1, keepdims=True)) * key_norm  # (G, R, 1)
    if mask_max is not None:
        bound += mask_max
    out_aug = np.empty(o.shape[:-1] + (o.shape[-1] + 1,), o.dtype)  # (G, R, Dv + 1)
    bound *= log2e  # base 2 from here on
    query_aug = _augment(q, -bound, log2e)  # (G, R, D) -> (G, R, D + 1)
    probe_scores = query_aug[..., :-1] @ key_aug_t[..., :-1, probes]  # (G, R, D) @ (G, D, P) -> (G, R, P)
    if mask is not None:
        probe_scores += mask[..., probes]
    gap = bound - probe_scores.max(axis=-1, keepdims=True)  # >= bound - row max, (G, R, 1)
    careful = not (gap <= MAX_BOUND_GAP).all()  # also catches inf and NaN
    if not careful:
        np.matmul(query_aug, key_aug_t, out=scores)  # (S - m) log2 e: (G, R, D+1) @ (G, D+1, S) -> (G, R, S)
        if mask is not None:
            scores += mask
        np.exp2(scores, out=scores)
        np.matmul(scores, value_aug, out=out_aug)  # [E v | rowsum E]: (G, R, S) @ (G, S, Dv+1) -> (G, R, Dv+1)
        row_sum = out_aug[..., -1:]
        careful = not np.isfinite(row_sum).all()
    if careful:
        row_max = _exp_scores_careful(scores, q, np.swapaxes(k, -1, -2),
                                      None if mask is None else mask / log2e)
        scores -= row_max
        np.exp(scores, out=scores)
        np.matmul(scores, value_aug, out=out_aug)  # (G, R, S) @ (G, S, Dv+1) -> (G, R, Dv+1)
        row_sum = out_aug[..., -1:]
        dead = row_sum == 0
        row_sum[dead] = 1
        np.reciprocal(row_sum, out=inv)
        inv[dead] = 0
    else:
        np.reciprocal(row_sum, out=inv)
    np.multiply(out_aug[..., :-1], inv, out=o)  # (G, R, Dv)


def _core_backward(dout, cache_arrays, dquery, dkey, dvalue, dquery_scale):
    """Write the gradients into ``dquery``, ``dkey``, ``dvalue`` (preallocated).

    ``dquery`` receives ``dquery_scale * dS @ K``: pass the forward scale for
    the gradient of the unscaled query, 1 for the gradient of the scaled one.
    """
    query, key, value, exp_scores, inv_sum, out = cache_arrays
    lead = exp_scores.shape[:-2]
    T, S = exp_scores.shape[-2:]

    def task(part):
        scratch = partial = None
        for idx in part:
            k = key[idx]  # (G, S, D)
            value_aug_t = _augment_t(value[idx], 1)  # (G, S, Dv) -> (G, Dv + 1, S)
            # NOTE: dK^T = Q^T dS and dV^T = dO^T P measured faster than dS^T Q
            # and P^T dO (up to 1.5x in float64): accumulate the transposes.
            dk_t = np.empty(np.swapaxes(dkey[idx], -1, -2).shape, k.dtype)  # (G, D, S)
            dv_t = np.empty(np.swapaxes(dvalue[idx], -1, -2).shape, k.dtype)  # (G, Dv, S)
            G = int(np.prod(exp_scores[idx].shape[:-2]))
            chunks = _row_chunks(G, T, S, exp_scores.itemsize)
            for n, rows in enumerate(chunks):
                block = idx + (Ellipsis, rows, slice(None))
                weights_num = exp_scores[block]  # (G, R, S)
                R = weights_num.shape[-2]
                if scratch is None or scratch.shape[:-2] != weights_num.shape[:-2] or scratch.shape[-2] < R:
                    scratch = np.empty_like(weights_num)
                if n and (partial is None or partial[0].shape != dk_t.shape or partial[1].shape != dv_t.shape):
                    partial = np.empty_like(dk_t), np.empty_like(dv_t)
                _backward_rows(dout[block], out[block], query[block], k, value_aug_t, weights_num,
                               inv_sum[block], scratch[..., :R, :], dquery[block], dk_t, dv_t,
                               dquery_scale, None if n == 0 else partial)
            dkey[idx] = np.swapaxes(dk_t, -1, -2)  # (G, D, S) -> (G, S, D)
            dvalue[idx] = np.swapaxes(dv_t, -1, -2)  # (G, Dv, S) -> (G, S, Dv)

    _run(task, _blocks(lead, T * S * exp_scores.itemsize, NUM_THREADS))


def _backward_rows(do, o, q, k, value_aug_t, weights_num, inv, dscores, dq, dk_t, dv_t, dq_scale,
                   partial):
    """Backward of one block of rows; ``dk_t``, ``dv_t`` (transposed) are
    written (``partial`` is None) or accumulated through ``partial`` buffers.

    ``dP - delta`` comes out of one matmul: ``[dO | -delta] @ [V | 1]^T``.
    """
    delta = np.sum(do * o, axis=-1, keepdims=True)  # rowsum(P * dP) = rowsum(dO * O), (G, R, 1)
    # dV^T = dO^T P = (dO / rowsum)^T E
    dv_rows = dv_t if partial is None else partial[1]
    np.matmul(np.swapaxes(do * inv, -1, -2), weights_num, out=dv_rows)  # (G, Dv, R) @ (G, R, S) -> (G, Dv, S)
    dout_aug = _augment(do, -delta)  # (G, R, Dv) -> (G, R, Dv + 1)
    np.matmul(dout_aug, value_aug_t, out=dscores)  # dP - delta: (G, R, Dv+1) @ (G, Dv+1, S) -> (G, R, S)
    dscores *= weights_num  # = rowsum * dS, with dS = P * (dP - delta)
    np.matmul(dscores, k, out=dq)  # (G, R, S) @ (G, S, D) -> (G, R, D)
    dq *= inv * dq_scale
    dk_rows = dk_t if partial is None else partial[0]
    np.matmul(np.swapaxes(q * inv, -1, -2), dscores, out=dk_rows)  # (G, D, R) @ (G, R, S) -> (G, D, S)
    if partial is not None:
        dv_t += dv_rows
        dk_t += dk_rows


def attention_forward(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Scaled dot-product attention ``softmax(q k^T * scale + mask) v``, fast path.

    Same arguments, semantics and errors as
    :func:`qkvnp.functional.attention_forward`.

    Parameters
    ----------
    query : ndarray, shape (..., T, D)
    key : ndarray, shape (..., S, D)
    value : ndarray, shape (..., S, Dv)
        Leading dims of the three broadcast against each other.
    attn_mask : ndarray of bool or float, optional
        Broadcastable to ``(..., T, S)``. Bool: True = may attend. Float: added.
    is_causal : bool
        Query ``i`` attends to keys ``0..i`` (top-left aligned), combined with
        ``attn_mask`` as in the reference.
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.

    Returns
    -------
    out : ndarray, shape (..., T, Dv)
    cache : FastAttentionCache
        The softmax numerators and row sums rather than the weights; see
        :func:`attention_weights`.

    Raises
    ------
    ValueError
        On mismatched dims, a mask that does not broadcast, non-finite inputs.
    TypeError
        On a mask that is neither bool nor float.

    Notes
    -----
    Forward, with :math:`c` the scale and :math:`M` the additive mask
    (``-inf`` where a boolean mask forbids):

    .. math:: \\tilde Q = cQ,\\quad S = \\tilde Q K^T + M,\\quad
              E = e^{S - m},\\quad r = 1/\\mathrm{rowsum}(E),\\quad
              O = r \\odot (E V)

    where :math:`m \\ge \\max_{row} S` is the bound
    :math:`|\\tilde q|\\,\\max_j |k_j| + \\max_{row} M` (or the row max itself
    when that bound is loose; the weights do not depend on :math:`m`).

    Backward, with :math:`P = r \\odot E` and
    :math:`\\delta = \\mathrm{rowsum}(P \\odot \\bar P) = \\mathrm{rowsum}(\\bar O \\odot O)`:

    .. math:: \\bar V = E^T (r \\odot \\bar O),\\quad
              G = E \\odot (\\bar O V^T - \\delta),\\quad
              \\bar Q = c\\, r \\odot (G K),\\quad \\bar K = G^T (r \\odot \\tilde Q)

    (:math:`G = \\bar S / r`, the softmax backward of the reference times the
    row sum). A fully masked row has :math:`E = 0` and :math:`r = 0`: output
    0 and no gradient; so does every row when there is no key at all
    (``S = 0``, where the reference raises). Scores that overflow are clipped
    as in the reference; since the scale is applied to Q first, where exactly
    a product of huge inputs overflows can differ from the reference (both
    stay finite).

    Large score buffers are recycled between calls once nothing refers to
    them (see :data:`RECYCLE_BYTES`).

    Examples
    --------
    >>> out, cache = attention_forward(np.ones((2, 4)), np.ones((1, 4)), np.array([[3., 5.]]))
    >>> out
    array([[3., 5.],
           [3., 5.]])
    >>> [g.shape for g in attention_backward(np.ones((2, 2)), cache)]
    [(2, 4), (1, 4), (1, 2)]
    """
    query, key, value, lead = _check_attention_inputs(query, key, value)
    scale = _check_scale(scale, query.shape[-1])
    (T, D), (S, Dv) = query.shape[-2:], value.shape[-2:]
    dtype = query.dtype
    bias, keep = prepare_mask(attn_mask, is_causal, lead + (T, S), dtype)
    mask = _additive_mask(bias, keep, dtype)
    scaled_query = np.empty(lead + (T, D), dtype)
    np.multiply(query, dtype.type(scale), out=scaled_query)  # (..., T, D), broadcast
    key_b = np.broadcast_to(key, lead + (S, D))
    value_b = np.broadcast_to(value, lead + (S, Dv))
    exp_scores = _recycled_empty(lead + (T, S), dtype)
    inv_sum = np.empty(lead + (T, 1), dtype)
    out = np.empty(lead + (T, Dv), dtype)
    _core_forward(scaled_query, key_b, value_b, mask, exp_scores, inv_sum, out)
    # NOTE: the cache keeps its own copy of out (a (T, Dv) copy): a caller
    # editing the returned array in place must not change the gradients.
    cache = FastAttentionCache(scaled_query, key_b, value_b, exp_scores, inv_sum, out.copy(),
                               scale, (query.shape, key.shape, value.shape))
    return out, cache


def attention_backward(dout, cache):
    """Backward of :func:`attention_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, Dv)
        Same shape as the forward output (it is not broadcast).
    cache : FastAttentionCache

    Returns
    -------
    dquery, dkey, dvalue : ndarray
        Shapes of the forward's ``query``, ``key`` and ``value``.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
    """
    query, key, value, exp_scores, inv_sum, out, scale, shapes = cache
    dout = as_upstream_grad(dout, "dout", out.shape, out.dtype)  # no copy if already out.dtype
    dquery = np.empty(query.shape, out.dtype)
    dkey = np.empty(key.shape, out.dtype)
    dvalue = np.empty(value.shape, out.dtype)
    _core_backward(dout, (query, key, value, exp_scores, inv_sum, out),
                   dquery, dkey, dvalue, out.dtype.type(scale))
    return (sum_to_shape(dquery, shapes[0]), sum_to_shape(dkey, shapes[1]),
            sum_to_shape(dvalue, shapes[2]))


def attention_weights(cache):
    """The attention weights ``(..., T, S)`` of a forward (a new array).

    >>> _, cache = attention_forward(np.zeros((1, 2)), np.zeros((2, 2)), np.ones((2, 1)))
    >>> attention_weights(cache)
    array([[0.5, 0.5]])
    """
    return cache.exp_scores * cache.inv_sum


# ---------------------------------------------------------------- layers

FastLayerCache = namedtuple(
    "FastLayerCache",
    "kind core rows in_shapes W_in in_names scale heads_cache merged W_out has_out_proj "
    "out_shape buffers",
)
FastLayerCache.__doc__ = """What :func:`mha_backward` reads.

kind : "self", "key_only" or "cross".
core : "fast" or "tiled".
rows : tuple of the 2-D inputs ``(N, features)`` fed to each projection.
in_shapes : tuple of the shapes of those inputs before flattening.
W_in : tuple of the fused projection matrices actually used (the query part
    already multiplied by ``scale``), one per entry of ``rows``.
in_names : tuple, per projection, of the parameter stems it fuses
    (``("query", "key", "value")`` for self-attention).
scale : float folded into the query projection.
heads_cache : the attention core's cache (fast or tiled) and the head shapes.
merged : (N, E) attention output with heads merged (input of ``W_out``).
W_out : (E, E) or None.
buffers : dict of the large arrays above by name, offered for reuse to the
    next forward (``workspace=``).
"""


def _buffer(workspace, name, shape, dtype, buffers):
    """``workspace``'s buffer ``name`` if it has this shape and dtype, else a new one."""
    old = None if workspace is None else workspace.buffers.get(name)
    if old is None or old.shape != shape or old.dtype != dtype:
        old = np.empty(shape, dtype)
    buffers[name] = old
    return old


def _heads(x2d, batch, T, H):
    """View ``(N, H*D)`` rows as heads: ``(N, E) -> (..., H, T, D)``, no copy."""
    E = x2d.shape[-1]
    heads = x2d.reshape(batch + (T, H, E // H))  # (N, E) -> (..., T, H, D)
    return np.swapaxes(heads, -2, -3)  # (..., T, H, D) -> (..., H, T, D)


def _unheads(x):
    """Drop the head axis of a single-head layer: ``(..., 1, T, D) -> (..., T, D)``."""
    return x[..., 0, :, :]


def mha_forward(params, inputs, kind, num_heads, mask, is_causal, core="fast",
                need_weights=False, out_proj=True, block_size=None, workspace=None):
    """Multi-head attention layer forward on the fast path.

    Parameters
    ----------
    params : dict
        ``W_query, W_key, W_value`` (``(in, E)``), optional ``b_*``, and with
        ``out_proj`` also ``W_out (E, E)`` (optional ``b_out``).
    inputs : tuple of ndarray
        ``(x,)`` for self-attention (``x`` is ``(..., T, in)``), ``(query, key)``
        for ``kind="key_only"`` (value = key), ``(query, key, value)`` for cross.
    kind : {"self", "key_only", "cross"}
    num_heads : int
    mask : ndarray or None
        bool or float, broadcastable to ``(..., H, T, S)`` (or ``(..., T, S)``
        when ``out_proj`` is False and ``num_heads == 1``).
    is_causal : bool
    core : {"fast", "tiled"}
    need_weights : bool
        Also return the weights ``(..., H, T, S)``; forces the dense core.
    out_proj : bool
        False for :class:`qkvnp.layers.SelfAttention` (no output projection,
        a single head, no head axis).
    block_size : int, optional
        Passed to the tiled core.
    workspace : FastLayerCache, optional
        The cache of a previous forward **that will not be used again**: its
        large buffers (projections, softmax numerators, merged heads) are
        overwritten when their shapes match, which saves allocating and
        page-faulting them on every call (the layers pass their previous
        cache, which they drop first). Input errors (``ValueError``,
        ``TypeError``) are raised before anything is written into it.

    Returns
    -------
    out : ndarray, shape (..., T, E)
    weights : ndarray or None
    cache : FastLayerCache

    Notes
    -----
    Same math as the reference layers. For self-attention the three input
    projections run as one ``(N, in) @ (in, 3E)`` product with the matrix
    ``[c W_q, W_k, W_v]`` (``c = 1/sqrt(D)``, so the core gets Q already
    scaled); the matrix is concatenated on every call (``in * 3E`` copies,
    negligible next to the product), so in-place parameter updates are
    always seen. Heads are strided views of the projection output, and the
    core writes its output into the merged ``(N, E)`` layout.
    """
    p = params
    query = inputs[0]
    batch, T = query.shape[:-2], query.shape[-2]
    S = inputs[1].shape[-2] if kind != "self" else T
    E = p["W_query"].shape[1]
    H = num_heads
    D = E // H
    scale = 1.0 / np.sqrt(D)
    dtype = p["W_query"].dtype
    c = dtype.type(scale)
    has_bias = "b_query" in p
    lead = batch + (H,) if out_proj else batch  # SelfAttention: no head axis
    # NOTE: every check that can refuse the input runs here, before anything
    # is written into ``workspace``, so that a refused call leaves it intact.
    bias, keep = prepare_mask(mask, is_causal, lead + (T, S), dtype)

    def fused(names):
        W = np.concatenate([p["W_" + n] for n in names], axis=1)  # (in, len(names)*E)
        b = np.concatenate([p["b_" + n] for n in names]) if has_bias else None
        if names[0] == "query":
            W[:, :E] *= c
            if b is not None:
                b[:E] *= c
        return W, b

    groups = {"self": (("query", "key", "value"),),
              "key_only": (("query",), ("key", "value")),
              "cross": (("query",), ("key",), ("value",))}[kind]
    rows, W_in, projected, buffers = [], [], [], {}
    for i, (x, names) in enumerate(zip(inputs, groups)):
        x2d = x.reshape(-1, x.shape[-1])  # (..., L, in) -> (N, in)
        W, b = fused(names)
        y = _buffer(workspace, f"projected{i}", (x2d.shape[0], W.shape[1]), dtype, buffers)
        _matmul(x2d, W, y)  # (N, in) @ (in, k*E) -> (N, k*E)
        if b is not None:
            y += b
        rows.append(x2d)
        W_in.append(W)
        projected.extend(y[:, i * E:(i + 1) * E] for i in range(len(names)))  # (N, E) views
    q = _heads(projected[0], batch, T, H)  # (N, E) -> (..., H, T, D)
    k = _heads(projected[1], batch, S, H)  # (N, E) -> (..., H, S, D)
    v = _heads(projected[2], batch, S, H)  # (N, E) -> (..., H, S, D)
    merged = _buffer(workspace, "merged", (projected[0].shape[0], E), dtype, buffers)  # (N, E)
    out_heads = _heads(merged, batch, T, H)  # (..., H, T, D) view of merged
    if not out_proj:  # SelfAttention: no head axis in the mask
        q, k, v, out_heads = _unheads(q), _unheads(k), _unheads(v), _unheads(out_heads)
    if core == "tiled" and not need_weights:
        from . import tiled

        _, core_cache = tiled.attention_forward(q, k, v, mask, is_causal, scale=1.0,
                                                block_size=block_size, out=out_heads)
        weights = None
    else:
        core = "fast"
        add = _additive_mask(bias, keep, dtype)
        exp_scores = _buffer(workspace, "exp_scores", lead + (T, S), dtype, buffers)
        inv_sum = _buffer(workspace, "inv_sum", lead + (T, 1), dtype, buffers)
        _core_forward(q, k, v, add, exp_scores, inv_sum, out_heads)
        core_cache = (q, k, v, exp_scores, inv_sum, out_heads)
        weights = exp_scores * inv_sum if need_weights else None
    if out_proj:
        y = _matmul(merged, p["W_out"])  # (N, E) @ (E, E) -> (N, E)
        if "b_out" in p:
            y += p["b_out"]
    else:
        y = merged.copy()  # the caller may edit its output; the cache keeps merged
    out = y.reshape(batch + (T, E))  # (N, E) -> (..., T, E)
    cache = FastLayerCache(kind, core, tuple(rows), tuple(x.shape for x in inputs),
                           tuple(W_in), groups, scale,
                           (core_cache, lead, T, S, H), merged,
                           p["W_out"] if out_proj else None, out_proj, out.shape, buffers)
    return out, weights, cache


def mha_backward(dout, cache):
    """Backward of :func:`mha_forward`.

    Parameters
    ----------
    dout : ndarray, shape (..., T, E)
        Same shape as the forward output (it is not broadcast); cast to the
        parameters' dtype.
    cache : FastLayerCache

    Returns
    -------
    grads : dict
        Gradient of every parameter the forward used (``W_*``, ``b_*``).
    dinputs : tuple of ndarray
        Gradient of each entry of the forward's ``inputs``.

    Raises
    ------
    TypeError
        If ``dout`` does not hold real numbers (complex, object...).
    ValueError
        If ``dout`` is not of the output's shape exactly or holds NaN or inf.
        This is the only check of ``dout`` on the layers' fast path: the
        layers pass theirs straight here.
    """
    (kind, core, rows, in_shapes, W_in, groups, scale, heads_cache, merged, W_out, out_proj,
     out_shape, _) = cache
    core_cache, lead, T, S, H = heads_cache
    dtype = merged.dtype
    E = merged.shape[1]
    batch = out_shape[:-2]
    dy = as_upstream_grad(dout, "dout", out_shape, dtype).reshape(-1, E)  # (..., T, E) -> (N, E)
    grads = {}
    if out_proj:
        grads["W_out"] = _matmul(merged.T, dy, split="cols")  # (E, N) @ (N, E) -> (E, E)
        grads["b_out"] = dy.sum(axis=0)  # (N, E) -> (E,)
        dmerged = _matmul(dy, W_out.T)  # (N, E) @ (E, E) -> (N, E)
    else:
        dmerged = dy
    dprojected = [np.empty((x2d.shape[0], len(names) * E), dtype)
                  for x2d, names in zip(rows, groups)]  # (N, k*E) per projection
    dcols = [d[:, i * E:(i + 1) * E] for d in dprojected for i in range(d.shape[1] // E)]
    dq = _heads(dcols[0], batch, T, H)  # (N, E) -> (..., H, T, D)
    dk = _heads(dcols[1], batch, S, H)  # (N, E) -> (..., H, S, D)
    dv = _heads(dcols[2], batch, S, H)  # (N, E) -> (..., H, S, D)
    dheads = _heads(dmerged, batch, T, H)  # (N, E) -> (..., H, T, D)
    if not out_proj:
        dq, dk, dv, dheads = _unheads(dq), _unheads(dk), _unheads(dv), _unheads(dheads)
    if core == "tiled":
        from . import tiled

        tiled._attention_backward(dheads, core_cache, grads_out=(dq, dk, dv))  # dy checked above
    else:
        # gradient w.r.t. the *scaled* query: the scale lives in the fused W
        _core_backward(dheads, core_cache, dq, dk, dv, dtype.type(1))
    c = dtype.type(scale)
    dinputs = []
    for x2d, shape, W, names, d in zip(rows, in_shapes, W_in, groups, dprojected):
        dW = _matmul(x2d.T, d, split="cols")  # (in, N) @ (N, k*E) -> (in, k*E)
        db = d.sum(axis=0)  # (N, k*E) -> (k*E,)
        for i, name in enumerate(names):
            factor = c if name == "query" else 1  # W' = c W_query
            grads["W_" + name] = dW[:, i * E:(i + 1) * E] * factor
            grads["b_" + name] = db[i * E:(i + 1) * E] * factor
        dx = _matmul(d, W.T)  # (N, k*E) @ (k*E, in) -> (N, in)
        dinputs.append(dx.reshape(shape))  # (N, in) -> (..., L, in)
    return grads, tuple(dinputs)
