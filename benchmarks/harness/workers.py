"""One library per process: the worker processes of the benchmark's small-shape protocol.

Shape key: B batch, L sequence length, E embedding, H heads (as in :mod:`workloads.grid`).

At small sizes, a call takes tens of microseconds to a few milliseconds, and
threads that one library leaves behind slow the other: PyTorch's OpenMP pool
and numpy's OpenBLAS threads, idle but resident in one process, made the
other library's calls several times slower on a 2-core machine
(benchmarks/NOTES.md). So each implementation runs in a process of its own
(the qkvnp ones never import PyTorch), and the parent asks them in turn for one timed round each:
qkvnp, PyTorch, qkvnp, ... (:func:`time_alternating`).

This module is the parent's side: :class:`Worker` starts a fresh Python
process running :func:`harness.worker_child.serve` and sends it one JSON command a
line (``setup`` a runner, write its ``result``, ``calibrate`` the calls of a
round, ``time`` them); it knows nothing of what the runners compute. The
child's side, which builds the runners of :mod:`workloads.attention` and
:mod:`workloads.training`, is :mod:`harness.worker_child`.
"""
import json
import subprocess
import sys
import tempfile
import time

from benchmarks.harness.timing import ROUND_SECONDS

__all__ = ["WorkerError", "Worker", "WorkerPool", "time_alternating"]

METHODS = {"fwd": "forward", "fwd_bwd": "forward_backward"}


class WorkerError(RuntimeError):
    """A worker process failed: it exited, or answered with an error."""


class Worker:
    """A fresh Python process that sets up one runner at a time and times it on request.

    Parameters
    ----------
    name : str
        For messages.
    path : list of str
        Put first on the child's ``sys.path``: the directory holding the
        ``benchmarks`` package and that of the qkvnp the parent imported.
    module : str
        The module whose ``serve()`` the child runs:
        ``benchmarks.harness.worker_child`` (the attention workloads) or
        ``benchmarks.workloads.gpt`` (the GPT's).
    """

    def __init__(self, name, path, module="benchmarks.harness.worker_child"):
        self.name = name
        self._stderr = tempfile.TemporaryFile(mode="w+")
        code = f"import sys; sys.path[:0] = sys.argv[1:]; from {module} import serve; serve()"
        self.process = subprocess.Popen([sys.executable, "-c", code, *path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                        bufsize=1)

    def request(self, op, **fields):
        """Send one command; return the reply (a dict), or raise :class:`WorkerError`."""
        try:
            self.process.stdin.write(json.dumps(dict(fields, op=op)) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise WorkerError(f"worker {self.name!r} exited ({self._stderr_tail()})")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"worker {self.name!r}: {reply['error']}")
        return reply

    def _stderr_tail(self):
        self._stderr.seek(0)
        lines = self._stderr.read().strip().splitlines()
        return lines[-1] if lines else "no output"

    def close(self):
        """Ask the worker to quit; kill it if it does not within 10 s."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self._stderr.close()


class WorkerPool:
    """Workers by name, started on first use and closed together (a context manager)."""

    def __init__(self, path):
        self.path = list(path)
        self.workers = {}

    def get(self, name):
        """The worker called ``name``, started if it is not running."""
        worker = self.workers.get(name)
        if worker is None or worker.process.poll() is not None:
            worker = self.workers[name] = Worker(name, self.path)
        return worker

    def close(self):
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def time_alternating(workers, mode, repeats, warmup=1, pause=0.3, round_seconds=ROUND_SECONDS,
                     progress=None):
    """Time each worker's runner in rounds, one worker after the other.

    Parameters
    ----------
    workers : dict of str to Worker
        Each set up (``setup``) with the runner to time.
    mode : {"fwd", "fwd_bwd"}
        The runner method timed (``forward`` or ``forward_backward``).
    repeats, warmup : int
        Timed and untimed rounds.
    pause : float
        Seconds slept before each round that follows another worker's:
        threads that a worker leaves spinning after its round take the
        cores from the next one (in another process just as in the same).
    round_seconds : float
        Each worker first picks how many calls make a round last at least
        this long, far above the timer's resolution (``calibrate``).
    progress : callable, optional
        Told which round is running, at most every 10 seconds.

    Returns
    -------
    seconds : dict of str to list of float
        Seconds per call in each timed round (the round's time / its calls).
    calls : dict of str to int
        Calls per round.

    Notes
    -----
    The first worker of a round rotates, as in :func:`harness.timing.time_interleaved`.
    """
    method = METHODS[mode]
    names = list(workers)
    calls = {}
    for name in names:
        if calls and pause > 0:
            time.sleep(pause)
        calls[name] = workers[name].request("calibrate", method=method,
                                            seconds=round_seconds)["calls"]
    seconds = {name: [] for name in names}
    last_name, last_report = names[-1], time.perf_counter()
    for round_index in range(warmup + repeats):
        if progress and time.perf_counter() - last_report > 10:
            progress(f"      round {round_index + 1} of {warmup + repeats}")
            last_report = time.perf_counter()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if name != last_name and pause > 0:
                time.sleep(pause)
            last_name = name
            elapsed = workers[name].request("time", method=method, calls=calls[name])["seconds"]
            if round_index >= warmup:
                seconds[name].append(elapsed / calls[name])
    return seconds, calls
