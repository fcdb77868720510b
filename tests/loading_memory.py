"""What reading a file costs in memory, for the tests of hostile and large files.

- :func:`traced_peak`: the peak of Python's traced allocations (``tracemalloc``,
  numpy's arrays included) inside a block: a refusal must come before
  anything large is allocated.
- :func:`load_growth`: how much a load grows a fresh process's peak resident
  memory (Linux's ``VmHWM``), against the parameters it loaded.
"""
import contextlib
import os
import subprocess
import sys
import tracemalloc

_LOAD_SCRIPT = """
import sys
import numpy as np
from qkvnp.interop import {name}

def high_water():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

base = high_water()
model = {call}
print(high_water() - base, sum(p.size for p in model.params.values()))
"""

#: Whether :func:`load_growth` can measure here (it reads ``/proc/self/status``).
HAS_VMHWM = os.path.exists("/proc/self/status")


@contextlib.contextmanager
def traced_peak():
    """Trace allocations inside the block; the yielded list holds their peak (bytes) after it.

    >>> with traced_peak() as peak:
    ...     _ = bytearray(10)
    >>> peak[0] >= 10
    True
    """
    peak = []
    tracemalloc.start()
    try:
        yield peak
        peak.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def load_growth(name, call, path):
    """``(bytes the peak resident memory grew by, parameters loaded)`` of ``call`` in a fresh
    process: ``call`` is the source of the load, e.g. ``"load_llmc(sys.argv[1])"``, where
    ``name`` is imported from ``qkvnp.interop`` and ``sys.argv[1]`` is ``path``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _LOAD_SCRIPT.format(name=name, call=call)
    out = subprocess.run([sys.executable, "-c", script, str(path)], check=True,
                         capture_output=True, text=True, cwd=root).stdout.split()
    return int(out[0]), int(out[1])
