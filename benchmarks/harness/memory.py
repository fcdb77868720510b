"""Peak memory of one forward+backward, each implementation in a fresh Python process.

Shape key: B batch, L sequence length, E embedding, H heads, D = E // H.

The inputs and weights are built, every library is warmed up on a tiny
problem, then the kernel's peak-RSS counter is reset
(``/proc/self/clear_refs``), and the peak resident set during the call minus
the resident set before it is reported (it includes the outputs, gradients
and caches that the call creates). PyTorch's allocations do not show in
``tracemalloc``, so the RSS number is the one that compares libraries; for
qkvnp the ``tracemalloc`` peak of a second call is also recorded in the
JSON output. Where ``clear_refs`` cannot be written, the ``ru_maxrss`` delta
is used instead (an underestimate when importing cost more than the call)
and the method is named in the output.
"""
import gc
import json

import numpy as np

from benchmarks.harness.machine import run_json_child
from benchmarks.harness.rss import proc_status_kib, reset_peak_rss
from benchmarks.workloads.attention import make_problem, make_runner
from benchmarks.workloads.grid import Config

__all__ = ["MIB", "TILED_MEMORY_SHAPE", "TILED_MEMORY_LIMIT_MIB", "measure_memory",
           "measure_tiled_memory", "memory_child"]

MIB = 2.0 ** 20
# the memory target of the tiled core: (B, H, L, D), float32, MiB
TILED_MEMORY_SHAPE = (1, 1, 16384, 64)
TILED_MEMORY_LIMIT_MIB = 64


def memory_child(spec_json):
    """Body of the fresh process that :func:`measure_memory` starts; prints JSON."""
    import resource
    import tracemalloc

    spec = json.loads(spec_json)
    kind, impl, dtype = spec["kind"], spec["impl"], np.dtype(spec["dtype"])
    config = Config(*spec["config"])
    # warm every library up on a tiny problem: thread pools, lazy imports
    tiny = make_runner(impl, make_problem(kind, (1, 8, 4 * config.heads, config.heads), dtype))
    tiny.forward_backward()
    del tiny
    problem = make_problem(kind, config, dtype)
    runner = make_runner(impl, problem)
    gc.collect()
    if reset_peak_rss():
        method = "rss"
        before = proc_status_kib("VmRSS")
        result = runner.forward_backward()
        peak = proc_status_kib("VmHWM")
    else:
        method = "ru_maxrss"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = runner.forward_backward()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = {"method": method, "rss_mib": (peak - before) / 1024.0, "tracemalloc_mib": None}
    del result, runner
    gc.collect()
    if impl != "torch":  # PyTorch's allocations are invisible to tracemalloc
        runner = make_runner(impl, problem)
        tracemalloc.start()
        result = runner.forward_backward()
        report["tracemalloc_mib"] = tracemalloc.get_traced_memory()[1] / MIB
        tracemalloc.stop()
        del result
    print(json.dumps(report))


def measure_memory(kind, impl, config, dtype, timeout=900):
    """Peak extra memory (MiB) of one forward+backward, in a fresh process.

    Returns
    -------
    dict
        ``rss_mib`` (peak RSS during the call minus RSS before it),
        ``tracemalloc_mib`` (qkvnp only, else None), ``method``; or
        ``error`` with the child's last error line if it failed.
    """
    spec = json.dumps({"kind": kind, "impl": impl, "config": list(config),
                       "dtype": np.dtype(dtype).name})
    return run_json_child("benchmarks.harness.memory", "memory_child", spec, timeout)



def measure_tiled_memory():
    """The tiled core's memory at :data:`TILED_MEMORY_SHAPE`, float32, beyond its outputs.

    Returns
    -------
    dict
        :func:`measure_memory`'s, plus ``outputs_mib`` (``out`` and the three
        gradients), ``beyond_outputs_mib`` and ``limit_mib``
        (:data:`TILED_MEMORY_LIMIT_MIB`); or ``error``.
    """
    B, H, L, D = TILED_MEMORY_SHAPE
    measured = measure_memory("core", "tiled", Config(B, L, H * D, H), "float32")
    if "error" not in measured:
        outputs_mib = 4 * B * H * L * D * 4 / MIB  # out, dquery, dkey, dvalue in float32
        measured["outputs_mib"] = outputs_mib
        measured["beyond_outputs_mib"] = measured["rss_mib"] - outputs_mib
        measured["limit_mib"] = TILED_MEMORY_LIMIT_MIB
    return measured
