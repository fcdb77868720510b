"""One library per process: the worker processes of the benchmark's small-shape protocol.

Shape key: B batch, L sequence length, E embedding, H heads (as in ``bench.py``).

At small sizes, a call takes tens of microseconds to a few milliseconds, and
threads that one library leaves behind slow the other: PyTorch's OpenMP pool
and numpy's OpenBLAS threads, idle but resident in one process, made the
other library's calls up to 4x slower on the 2-core machine. So each
implementation runs in a process of its own (the qkvnp ones never import
PyTorch), and the parent asks them in turn for one timed round each:
qkvnp, PyTorch, qkvnp, ... (:func:`time_alternating`).

The parent talks to a worker over its stdin and stdout, one JSON object a
line each way. A worker holds one runner at a time (``setup``), writes its
results to an ``.npz`` file for the parent's cross-check (``result``),
picks how many calls make a round last at least a given time
(``calibrate``) and times that many calls (``time``). The runners are the
harness's own: :func:`bench.make_runner` for attention,
:func:`train_bench.make_training_runner` for a training step.
"""
import gc
import json
import math
import subprocess
import sys
import tempfile
import time

__all__ = ["WorkerError", "Worker", "WorkerPool", "serve", "time_alternating"]

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
        Put first on the child's ``sys.path``: the directory of this module
        and that of the qkvnp the parent imported.
    """

    def __init__(self, name, path):
        self.name = name
        self._stderr = tempfile.TemporaryFile(mode="w+")
        code = "import sys; sys.path[:0] = sys.argv[1:]; from workers import serve; serve()"
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


def time_alternating(workers, mode, repeats, warmup=1, pause=0.3, round_seconds=0.25,
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
    The first worker of a round rotates, as in ``bench.time_interleaved``.
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


# ---------------------------------------------------------------- the child


def _make_runner(workload, spec):
    if workload == "attention":
        from bench import make_problem, make_runner

        problem = make_problem(spec["kind"], spec["config"], spec["dtype"], causal=spec["causal"])
        return make_runner(spec["impl"], problem)
    if workload == "training":
        from train_bench import make_training_runner

        return make_training_runner(spec["library"], spec["task"], spec["dtype"], spec["data"])
    raise ValueError(f"workload must be 'attention' or 'training', got {workload!r}")


def _calibrate(call, seconds):
    """Calls that make a round last at least ``seconds``, from a short trial after a warm call."""
    call()
    done, start = 0, time.perf_counter()
    while True:
        call()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min(seconds, 0.02) and done >= 2:
            break
    return max(1, math.ceil(seconds / (elapsed / done)))


def _repeat(runner, method, calls):
    """Seconds taken by ``calls`` calls of ``runner.<method>`` (its ``repeat`` if it has one)."""
    gc.collect()
    repeat = getattr(runner, "repeat", None)
    if repeat is not None:
        start = time.perf_counter()
        repeat(method, calls)
        return time.perf_counter() - start
    call = getattr(runner, method)
    start = time.perf_counter()
    for _ in range(calls):
        result = call()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def serve():
    """The worker's main loop: read commands from stdin, answer on stdout, until ``quit``."""
    import numpy as np

    from bench import ImplementationMissing

    protocol = sys.stdout
    sys.stdout = sys.stderr  # whatever the libraries print stays off the protocol
    runner = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        try:
            if op == "setup":
                runner = None
                gc.collect()
                threads = command["spec"].get("torch_threads")
                if threads:  # only when asked: PyTorch's default otherwise
                    import torch

                    torch.set_num_threads(threads)
                try:
                    runner = _make_runner(command["workload"], command["spec"])
                except ImplementationMissing as missing:
                    reply = {"missing": str(missing)}
                else:
                    reply = {"library": runner.library}
                    if runner.library == "torch":
                        import torch

                        reply["torch_threads"] = torch.get_num_threads()
            elif op == "result":
                arrays = runner.result()
                np.savez(command["path"], **arrays)
                reply = {"saved": command["path"]}
                dispatch = getattr(runner, "dispatch", None)
                if dispatch is not None:
                    reply["dispatch"] = dispatch
            elif op == "calibrate":
                repeat = getattr(runner, "repeat", None)
                call = ((lambda: repeat(command["method"], 1)) if repeat is not None
                        else getattr(runner, command["method"]))
                reply = {"calls": _calibrate(call, command["seconds"])}
            elif op == "time":
                reply = {"seconds": _repeat(runner, command["method"], command["calls"])}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
