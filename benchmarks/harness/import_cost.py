"""Import cost: ``import numpy`` against ``import qkvnp``, each in fresh interpreters.

``time.perf_counter`` around the import statement, interpreter start-up
excluded, interleaved, median of several; from cached bytecode, as an
installed package runs. Also lists every module outside the standard
library that ``import qkvnp`` loads beyond those of ``import numpy`` (there
should be none: scipy is imported on first use, PyTorch and matplotlib
never).
"""
import os
import subprocess
import sys

import numpy as np

from benchmarks.harness.machine import CHILD_PATH

__all__ = ["measure_import_time"]

_IMPORT_SNIPPET = (
    "import sys, time\n"
    "sys.path[:0] = sys.argv[1:]\n"  # CHILD_PATH: the same qkvnp as this process's
    "start = time.perf_counter()\n"
    "import {module}\n"
    "elapsed = time.perf_counter() - start\n"
    "print(elapsed)\n"
    "print(' '.join(sorted(sys.modules)))\n"
)


def _in_stdlib(name):
    """Whether top-level module ``name`` is the standard library's.

    ``sys.stdlib_module_names`` from Python 3.10; before, where the module's
    file lies (the standard library's folder, not its site-packages), or
    built in.
    """
    names = getattr(sys, "stdlib_module_names", None)
    if names is not None:
        return name in names
    import importlib.util
    import sysconfig

    spec = importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None) or ""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    return origin in ("built-in", "frozen") or (
        os.path.realpath(origin).startswith(stdlib + os.sep) and "site-packages" not in origin)


def _import_in_fresh_process(module):
    # NOTE: without PYTHONDONTWRITEBYTECODE (set on some machines, this one
    # included): the warm-up import writes qkvnp's .pyc files, as `pip install`
    # does, where numpy's were written at its install. With it, every import
    # compiled qkvnp's source, which was most of the difference measured.
    env = {name: value for name, value in os.environ.items()
           if name != "PYTHONDONTWRITEBYTECODE"}
    child = subprocess.run([sys.executable, "-c", _IMPORT_SNIPPET.format(module=module),
                            *CHILD_PATH], capture_output=True, text=True, timeout=120, check=True,
                           env=env)
    elapsed, modules = child.stdout.splitlines()[:2]
    return float(elapsed), set(modules.split())


def measure_import_time(repeats=7):
    """Median time of ``import numpy`` and of ``import qkvnp`` in fresh interpreters.

    Both from cached bytecode, as an installed package runs (the warm-up
    imports write qkvnp's ``__pycache__``, even where
    ``PYTHONDONTWRITEBYTECODE`` is set).

    Returns
    -------
    dict
        ``numpy_ms``, ``qkvnp_ms``, ``ratio`` (qkvnp / numpy), ``repeats``,
        ``extra_modules``: top-level packages outside the standard library
        that ``import qkvnp`` loads and ``import numpy`` does not.
    """
    numpy_times, qkvnp_times = [], []
    for module in ("numpy", "qkvnp"):  # warm the file cache and .pyc files, not timed
        _import_in_fresh_process(module)
    for _ in range(repeats):
        elapsed, numpy_modules = _import_in_fresh_process("numpy")
        numpy_times.append(elapsed)
        elapsed, qkvnp_modules = _import_in_fresh_process("qkvnp")
        qkvnp_times.append(elapsed)
    extra = sorted({
        name.split(".")[0] for name in qkvnp_modules - numpy_modules
        if not _in_stdlib(name.split(".")[0]) and name.split(".")[0] not in ("qkvnp", "numpy")
        and not name.startswith("_")
    })
    numpy_ms = 1e3 * float(np.median(numpy_times))
    qkvnp_ms = 1e3 * float(np.median(qkvnp_times))
    return {"numpy_ms": numpy_ms, "qkvnp_ms": qkvnp_ms, "ratio": qkvnp_ms / numpy_ms,
            "numpy_min_ms": 1e3 * min(numpy_times), "qkvnp_min_ms": 1e3 * min(qkvnp_times),
            "repeats": repeats, "extra_modules": extra}
