"""The kernels' worker threads: CPU-pinned, one job queue each, the caller running a share.

:func:`qkvnp.kernels._runtime.run` hands the shares of a job to the
:class:`Crew` of :func:`crew`; the settings that decide when (the thread
count, ``min_parallel_flops``) live in :mod:`qkvnp.kernels._runtime`.
``import`` costs the standard library's ``threading`` only (``queue`` at the
first crew).
"""
import os
import threading

__all__ = ["Crew", "crew", "in_worker"]

_CREW = None  # (pid, Crew)
_STATE = threading.local()  # .active: this thread runs a share (a worker, or the caller's)


def in_worker():
    """True in a thread that runs a share: its inner jobs run serially (no nested hand-off)."""
    return getattr(_STATE, "active", False)


class Crew:
    """The worker threads: one per thread of :func:`qkvnp.get_num_threads`, each on its own CPU.

    Worker ``i`` is pinned to ``cpus[i % len(cpus)]`` and takes its jobs from
    its own queue, so that a job goes to a known core. :meth:`run` gives
    share 0 to the calling thread, pinned to worker 0's CPU for the duration
    (worker 0 stays idle), and share ``i`` to worker ``i``: one thread fewer
    to wake, and nobody left waiting when the caller's share ends last.

    NOTE: unpinned, a worker woken after an idle spell was often placed on the
    CPU of the thread that woke it (Linux's wake-affine) and the two halves of
    the work ran on one core: measured 27 ms instead of 15 ms for a layer
    called after a 50 ms pause. The caller is pinned for the same reason: an
    unpinned caller running a share shared a core with a worker
    ((8, 128, 256, 8) float32 13.9 -> 21.4 ms). Pinned, against the caller
    only waiting on two workers, layer fwd+bwd, three alternated pairs of
    processes (2026-11-24): (64, 33, 64, 1) float32 causal 2.42-2.47 ->
    2.25-2.41 ms, (32, 64, 128, 8) float32 7.00-7.26 -> 6.78-7.18,
    (8, 128, 256, 8) float64 20.7-22.3 -> 19.8-21.7; (4, 512, 512, 8) and
    (1, 2048, 512, 8) causal unchanged within their spread.
    """

    def __init__(self, workers):
        import queue  # here: `import qkvnp` does not need it

        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux: nobody is pinned
            cpus = None
        self.cpus = cpus
        self.queues = []
        for i in range(workers):
            jobs = queue.SimpleQueue()
            threading.Thread(target=_work, args=(jobs, cpus[i % len(cpus)] if cpus else None),
                             name=f"qkvnp-kernels-{i}", daemon=True).start()
            self.queues.append(jobs)

    def close(self):
        for jobs in self.queues:
            jobs.put(None)  # the worker exits

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
        for error in errors:
            if error is not None:
                raise error


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


def crew(workers):
    """The process's :class:`Crew` of ``workers`` threads (made anew after a fork or a
    change of :func:`qkvnp.set_num_threads`; the old one's workers exit)."""
    global _CREW
    if _CREW is None or _CREW[0] != os.getpid() or len(_CREW[1].queues) != workers:
        if _CREW is not None and _CREW[0] == os.getpid():
            _CREW[1].close()  # its idle workers exit
        _CREW = (os.getpid(), Crew(workers))
    return _CREW[1]
