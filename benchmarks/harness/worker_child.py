"""The worker process's side of the one-library-per-process protocol: build a runner, answer.

Shape key: B batch, L sequence length, E embedding, H heads (as in :mod:`workloads.grid`).

:class:`harness.workers.Worker` starts ``python -c "from
benchmarks.harness.worker_child import serve; serve()"`` and talks to it
over stdin and stdout, one JSON object a line each way. :func:`serve` holds one runner at a time (``setup``): an
attention runner of :mod:`workloads.attention` or a training step of
:mod:`workloads.training`. It writes the runner's results to an ``.npz`` file for
the parent's cross-check (``result``), picks how many calls make a round
last at least a given time (``calibrate``) and times that many calls
(``time``).
"""
import gc
import json
import sys
import time

import numpy as np

from benchmarks.harness.timing import calls_per_round
from benchmarks.workloads.attention import ImplementationMissing, make_problem, make_runner
from benchmarks.workloads.training import make_training_runner

__all__ = ["serve"]


def _make_runner(workload, spec):
    if workload == "attention":
        problem = make_problem(spec["kind"], spec["config"], spec["dtype"], causal=spec["causal"])
        return make_runner(spec["impl"], problem)
    if workload == "training":
        return make_training_runner(spec["library"], spec["task"], spec["dtype"], spec["data"])
    raise ValueError(f"workload must be 'attention' or 'training', got {workload!r}")


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
                reply = {"calls": calls_per_round(call, command["seconds"])}
            elif op == "time":
                reply = {"seconds": _repeat(runner, command["method"], command["calls"])}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
