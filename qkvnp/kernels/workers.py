"""The kernels' worker threads: how many, and the crew that runs them.

- :func:`set_num_threads` / :func:`get_num_threads` / :class:`qkvnp.num_threads`
  (re-exported by :mod:`qkvnp.kernels` and :mod:`qkvnp`): the worker threads
  the fast and tiled kernels split their (batch, head) blocks over, from 1
  to :data:`qkvnp.kernels.MAX_NUM_THREADS`. The default is the environment variable
  ``QKVNP_NUM_THREADS``, read at the first kernel call (not at import), else
  the CPUs this process may use (at most 8). :func:`set_num_threads` sets
  the count of the process; the :class:`qkvnp.num_threads` context manager
  overrides it **for the calling thread only**, so that two threads each in
  their own ``with num_threads(...)`` block neither see nor undo the
  other's count.
- :class:`Crew`, from :func:`crew`: the threads themselves, CPU-pinned, one
  job queue each, the caller running a share.
  :func:`qkvnp.kernels._runtime.run` hands them the shares of a job; the
  settings that decide when (``min_parallel_flops``) live in
  :mod:`qkvnp.kernels._runtime`.

``import`` costs the standard library's ``threading`` only (``queue`` at the
first crew). A crew survives ``fork``: the child starts with none (its
parent's threads do not exist there) and makes its own at its first
threaded job.
"""
from __future__ import annotations

import os
import threading

from .._checks import check_int

__all__ = ["MAX_NUM_THREADS", "ENV_NUM_THREADS", "set_num_threads", "get_num_threads",
           "num_threads", "process_num_threads", "Crew", "WorkersNotStarted", "crew",
           "crew_size", "in_worker"]

ENV_NUM_THREADS = "QKVNP_NUM_THREADS"

#: Most worker threads :func:`set_num_threads`, :class:`qkvnp.num_threads` and
#: ``QKVNP_NUM_THREADS`` accept. More never pays (each worker is pinned to a
#: CPU of the process, and a job has at most one share per block), and far
#: more fails: 100000 started about 22000 threads before the system refused.
MAX_NUM_THREADS = 1024

_NUM_THREADS = None  # None until set or first read (then from the environment)
_TRIM = [False]  # set_num_threads was called: the crew may let extra workers go
_OVERRIDES = threading.local()  # .counts: this thread's num_threads() counts, innermost last
_COUNT_LOCK = threading.Lock()
_CREW = None  # (pid, Crew)
_STATE = threading.local()  # .active: this thread runs a share (a worker, or the caller's)


def _available_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _default_num_threads():
    text = os.environ.get(ENV_NUM_THREADS, "").strip()
    if not text:
        return max(1, min(_available_cpus(), 8))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"environment variable {ENV_NUM_THREADS} must be a positive integer, got {text!r}"
        )
    if value > MAX_NUM_THREADS:
        raise ValueError(
            f"environment variable {ENV_NUM_THREADS} must be at most {MAX_NUM_THREADS} "
            f"(qkvnp.kernels.MAX_NUM_THREADS), got {text!r}"
        )
    return value


def _check_count(n):
    n = check_int(n, "n", 1)
    if n > MAX_NUM_THREADS:
        raise ValueError(f"n must be <= {MAX_NUM_THREADS} (qkvnp.kernels.MAX_NUM_THREADS), "
                         f"got {n}")
    return n


def process_num_threads():
    """The count of the process (:func:`set_num_threads`, else ``QKVNP_NUM_THREADS``'s,
    read and checked at the first call), whatever this thread's :class:`qkvnp.num_threads`."""
    global _NUM_THREADS
    if _NUM_THREADS is None:
        with _COUNT_LOCK:
            if _NUM_THREADS is None:
                _NUM_THREADS = _default_num_threads()
    return _NUM_THREADS


def get_num_threads() -> int:
    """The number of worker threads the kernels use in the calling thread.

    The innermost :class:`qkvnp.num_threads` block of this thread if any, else the
    count of the process (see :func:`set_num_threads`).

    >>> get_num_threads() >= 1
    True
    """
    counts = getattr(_OVERRIDES, "counts", None)
    if counts:
        return counts[-1]
    return process_num_threads()


def set_num_threads(n: int) -> None:
    """Set the number of worker threads of the fast and tiled kernels, for the process.

    Parameters
    ----------
    n : int
        From 1 to :data:`qkvnp.kernels.MAX_NUM_THREADS`; 1 runs every kernel in the calling
        thread, BLAS at one thread there too. BLAS inside the workers stays
        at one thread. The calling thread runs one of the shares itself,
        pinned to one CPU while it does (Linux; its CPU set is given back
        after).

    Raises
    ------
    TypeError
        If ``n`` is not an int (bools refused).
    ValueError
        If ``n < 1`` or ``n > MAX_NUM_THREADS``.

    Notes
    -----
    The workers start at the first kernel call that uses them. If the
    system refuses to start one, that call raises ``RuntimeError`` (which
    worker, and why), the workers it started exit, and the count goes back
    to the workers already running (1 if none), so that the next call works.

    A thread inside a :class:`qkvnp.num_threads` block keeps that block's count
    until the block ends; the other threads, and that one after its blocks,
    use ``n``.

    Examples
    --------
    >>> previous = get_num_threads()
    >>> set_num_threads(1); get_num_threads()
    1
    >>> set_num_threads(previous)
    """
    global _NUM_THREADS
    n = _check_count(n)
    with _COUNT_LOCK:
        _NUM_THREADS = n
        _TRIM[0] = True


class num_threads:
    """Context manager: ``n`` worker threads for the calling thread's kernels inside.

    Thread-local: other threads keep their own count, and the count of the
    process (:func:`set_num_threads`) is not changed, so that blocks entered
    and left in any order by several threads leave it as it was. Nested
    blocks in one thread: the innermost wins. (A class rather than a
    ``contextlib`` generator: ``import contextlib`` was a measurable share of
    ``import qkvnp``.)

    Parameters
    ----------
    n : int
        The worker threads, 1 to ``MAX_NUM_THREADS``; 1 runs every kernel in
        the calling thread.

    >>> with num_threads(1):
    ...     get_num_threads()
    1
    """

    def __init__(self, n: int) -> None:
        self.n = _check_count(n)

    def __enter__(self):
        counts = getattr(_OVERRIDES, "counts", None)
        if counts is None:
            counts = _OVERRIDES.counts = []
        counts.append(self.n)
        return self

    def __exit__(self, *exc):
        _OVERRIDES.counts.pop()
        return False


def in_worker():
    """True in a thread that runs a share: its inner jobs run serially (no nested hand-off)."""
    return getattr(_STATE, "active", False)


class Crew:
    """The worker threads: at least one per thread of :func:`get_num_threads`, each on its own CPU.

    Worker ``i`` is pinned to ``cpus[i % len(cpus)]`` and takes its jobs from
    its own queue, so that a job goes to a known core. :meth:`run` gives
    share 0 to the calling thread, pinned to worker 0's CPU for the duration
    (worker 0 stays idle), and share ``i`` to worker ``i``: one thread fewer
    to wake, and nobody left waiting when the caller's share ends last.

    NOTE: unpinned, a worker woken after an idle spell was often placed on the
    CPU of the thread that woke it (Linux's wake-affine) and the two halves of
    the work ran on one core. The caller is pinned for the same reason: an
    unpinned caller running a share shared a core with a worker. Pinned, the
    caller running a share measured as fast or faster than a caller only
    waiting on two workers (benchmarks/NOTES.md).
    """

    def __init__(self, workers):
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux: nobody is pinned
            cpus = None
        self.cpus = cpus
        self.queues = []
        self.grow(workers)

    def grow(self, workers):
        """Start workers until there are ``workers``, all or none.

        Raises
        ------
        WorkersNotStarted
            If a thread cannot be started: the workers this call started have
            exited before it raises, and the crew is as it was.
        """
        import queue  # here: `import qkvnp` does not need it

        started = []  # (queue, thread)
        for i in range(len(self.queues), workers):
            jobs = queue.SimpleQueue()
            thread = threading.Thread(target=_work,
                                      args=(jobs, self.cpus[i % len(self.cpus)] if self.cpus else None),
                                      name=f"qkvnp-kernels-{i}", daemon=True)
            try:
                thread.start()
            except Exception as error:  # "can't start new thread", out of memory
                for jobs_started, _ in started:
                    jobs_started.put(None)
                for _, thread_started in started:
                    thread_started.join()  # gone before the caller tries again
                raise WorkersNotStarted(i, workers, error) from error
            started.append((jobs, thread))
        self.queues.extend(jobs for jobs, _ in started)

    def trim(self, workers):
        """Let the workers beyond the first ``workers`` exit (once idle)."""
        for jobs in self.queues[workers:]:
            jobs.put(None)  # the worker exits
        del self.queues[workers:]

    def close(self):
        self.trim(0)

    def run(self, task, parts):
        """``task(part)`` for each of ``parts`` (at most one per worker); errors re-raised
        after every share has ended, the first share's first."""
        saved = _pin_caller(self.cpus[0]) if self.cpus else None
        errors = [None] * len(parts)
        mine = 0 if saved is not None else None  # the share the caller runs, if any
        done = []
        try:
            for i, part in enumerate(parts):
                if i != mine:
                    lock = threading.Lock()
                    lock.acquire()  # released by the worker when the share has ended
                    self.queues[i].put((task, part, errors, i, lock))
                    done.append(lock)
            if mine is not None:
                _STATE.active = True  # its inner jobs run serially, as a worker's
                try:
                    task(parts[mine])
                except BaseException as error:  # re-raised once the workers are done
                    errors[mine] = error
                finally:
                    _STATE.active = False
        finally:
            for lock in done:
                lock.acquire()  # the workers may still write into shared arrays
            if saved is not None:
                os.sched_setaffinity(0, saved)
        for failure in errors:
            if failure is not None:
                raise failure


def _work(jobs, cpu):
    """A worker's loop: pin itself to ``cpu``, then run the jobs of its queue until None."""
    _STATE.active = True  # a job it runs runs serially (the pool is busy with it)
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread
        except OSError:  # not allowed
            pass
    while True:
        job = jobs.get()
        if job is None:
            return
        task, part, errors, index, lock = job
        try:
            task(part)
        except BaseException as error:
            errors[index] = error
        finally:
            lock.release()
        # NOTE: let go of the job before waiting for the next one: its task
        # refers to the caller's arrays (a layer's score buffer, its masks),
        # which an idle worker would otherwise keep alive after their layer
        job = task = part = errors = None


def _pin_caller(cpu):
    """Pin the calling thread to ``cpu``; return its affinity before, or None if it
    cannot be (not Linux, not allowed, or ``cpu`` outside the thread's own set)."""
    try:
        saved = os.sched_getaffinity(0)
        if cpu not in saved:
            return None  # the user keeps this thread off that CPU: the workers run it all
        if saved != {cpu}:
            os.sched_setaffinity(0, {cpu})
        return saved
    except (AttributeError, OSError):
        return None


class WorkersNotStarted(RuntimeError):
    """Worker thread ``index`` (counted from 0) of ``wanted`` could not be started
    (``cause``); :func:`crew` turns it into the user's error."""

    def __init__(self, index, wanted, cause):
        super().__init__(f"could not start worker thread {index + 1} of {wanted} "
                         f"({type(cause).__name__}: {cause})")
        self.index, self.wanted, self.cause = index, wanted, cause


def crew(workers):
    """The process's :class:`Crew`, with at least ``workers`` threads (under the kernels'
    section lock).

    It grows when asked for more, and keeps its extra workers when asked
    for fewer (:meth:`Crew.run` uses the first ones) until the next
    :func:`set_num_threads`, which lets the workers beyond the count go.
    Made anew in a child process after ``fork``.

    Raises
    ------
    RuntimeError
        If a worker cannot be started. NOTE: the count that asked for it
        (this thread's :class:`qkvnp.num_threads` block if any, else the
        process's) then goes back to the workers already running, 1 if
        none: else every later call would try, and fail, again.
    """
    global _CREW, _NUM_THREADS
    try:
        if _CREW is None or _CREW[0] != os.getpid():
            _CREW = (os.getpid(), Crew(workers))
        pool = _CREW[1]
        if len(pool.queues) < workers:
            pool.grow(workers)
        elif _TRIM[0]:  # set_num_threads was called: extra workers may go
            _TRIM[0] = False
            pool.trim(max(workers, process_num_threads()))
        return pool
    except WorkersNotStarted as error:
        back = max(1, crew_size())
        counts = getattr(_OVERRIDES, "counts", None)
        if counts:
            counts[-1] = back
            where = "this thread's num_threads block"
        else:
            with _COUNT_LOCK:
                _NUM_THREADS = back
            where = "qkvnp.set_num_threads"
        raise RuntimeError(f"{error}; the worker thread count ({where}) is back to {back}, "
                           "the workers already running") from None


def crew_size():
    """How many workers this process's crew has running (0 before the first threaded job)."""
    if _CREW is None or _CREW[0] != os.getpid():
        return 0
    return len(_CREW[1].queues)


def _forget_crew_in_child():
    """After ``fork``, in the child: the parent's workers do not exist here, and a lock
    another thread held at the fork would stay held."""
    global _CREW, _COUNT_LOCK
    _CREW, _COUNT_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_crew_in_child)
