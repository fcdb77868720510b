"""The worker threads' count and their survival across threads and ``fork``.

Oracles: the documented bound :data:`qkvnp.kernels.MAX_NUM_THREADS` and its
error messages; a thread start made to fail (``threading.Thread.start``
patched) and the count read back after; the count each thread reads inside
its own :func:`qkvnp.num_threads` block; and, for ``fork``, a child process
that must finish a threaded layer forward and backward within a timeout and
match the reference path's results computed in the parent.
"""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import qkvnp
from qkvnp import kernels
from qkvnp.kernels import workers


@pytest.fixture
def process_count():
    """The process's thread count, restored after the test."""
    before = qkvnp.get_num_threads()
    yield before
    qkvnp.set_num_threads(before)


def _python(code, timeout=120, **env):
    environment = {k: v for k, v in os.environ.items() if k != "QKVNP_NUM_THREADS"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, timeout=timeout)


# ---------------------------------------------------------------- the bound


@pytest.mark.parametrize("n", [kernels.MAX_NUM_THREADS + 1, 100000])
def test_thread_counts_above_the_bound_are_refused_and_change_nothing(n, process_count):
    with pytest.raises(ValueError, match=rf"n must be <= {kernels.MAX_NUM_THREADS} "
                                         rf"\(qkvnp.kernels.MAX_NUM_THREADS\), got {n}"):
        qkvnp.set_num_threads(n)
    with pytest.raises(ValueError, match=f"got {n}"):
        qkvnp.num_threads(n)
    assert qkvnp.get_num_threads() == process_count


def test_the_bound_itself_is_accepted(process_count):
    qkvnp.set_num_threads(kernels.MAX_NUM_THREADS)  # no worker starts before a kernel call
    assert qkvnp.get_num_threads() == kernels.MAX_NUM_THREADS


def test_an_environment_count_above_the_bound_is_refused_at_first_use():
    code = ("import numpy as np, qkvnp; print('imported'); "
            "qkvnp.MultiHeadAttention(4, 2, rng=0).forward(np.ones((1, 3, 4)))")
    result = _python(code, QKVNP_NUM_THREADS="100000")
    assert result.stdout.strip() == "imported"
    assert (f"environment variable QKVNP_NUM_THREADS must be at most {kernels.MAX_NUM_THREADS} "
            "(qkvnp.kernels.MAX_NUM_THREADS), got '100000'") in result.stderr


# ---------------------------------------------------------------- failure to start

# Run in a fresh process with a timeout: a crew left broken by a failed start
# hung the next call (before the fix), which must fail the test, not block
# the suite. The patched Thread.start refuses the chosen qkvnp workers.
_START_FAILS = textwrap.dedent("""
    import contextlib, threading
    import numpy as np
    import qkvnp
    from qkvnp import kernels
    from qkvnp.kernels import workers

    layer = qkvnp.MultiHeadAttention(16, 2, rng=0, dtype=np.float64, impl="tiled")
    x = np.random.default_rng(1).standard_normal((2, 64, 16))
    with qkvnp.num_threads(1):
        serial = layer.forward(x)  # the oracle: no worker at all
    kernels.set_block_sizes(min_parallel_flops=0)  # every job goes to the workers
    qkvnp.set_num_threads(2)
    assert np.allclose(layer.forward(x), serial, rtol=1e-12, atol=1e-12)
    print(workers.crew_size())
    start = threading.Thread.start

    def start_or_fail(thread):
        if thread.name in REFUSED:
            raise RuntimeError("can't start new thread")
        return start(thread)

    threading.Thread.start = start_or_fail
    SETUP
    with CONTEXT:
        try:
            layer.forward(x)
        except RuntimeError as error:
            print(error)
        print(qkvnp.get_num_threads(), workers.crew_size())
    print(qkvnp.get_num_threads())
    print(sorted(t.name for t in threading.enumerate() if t.name.startswith("qkvnp")))
    threading.Thread.start = start
    print(bool(np.allclose(layer.forward(x), serial, rtol=1e-12, atol=1e-12)))
""")


def _start_fails(refused, setup, context):
    script = (_START_FAILS.replace("REFUSED", repr(sorted(refused)))
              .replace("SETUP", setup).replace("CONTEXT", context))
    try:
        result = _python(script, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a layer call hung after the workers failed to start")
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_workers_that_cannot_start_roll_the_count_back_with_one_error():
    # the process's count raised from 2 to 5; worker 2 starts, worker 3 cannot
    lines = _start_fails({"qkvnp-kernels-3"}, "qkvnp.set_num_threads(5)",
                         "contextlib.nullcontext()")
    assert lines == [
        "2",  # the crew the first threaded call started
        "could not start worker thread 4 of 5 (RuntimeError: can't start new thread); the "
        "worker thread count (qkvnp.set_num_threads) is back to 2, the workers already running",
        "2 2",  # the count and the running workers, as before the call
        "2",
        "['qkvnp-kernels-0', 'qkvnp-kernels-1']",  # worker 2, started, has exited
        "True",  # the next call works, on the two workers
    ]


def test_a_thread_block_that_cannot_start_its_workers_falls_back_in_that_thread_only():
    lines = _start_fails({"qkvnp-kernels-2", "qkvnp-kernels-3"}, "pass", "qkvnp.num_threads(4)")
    assert lines == [
        "2",
        "could not start worker thread 3 of 4 (RuntimeError: can't start new thread); the "
        "worker thread count (this thread's num_threads block) is back to 2, the workers "
        "already running",
        "2 2",  # inside the block: back to the running workers
        "2",  # after it: the process's count, never touched
        "['qkvnp-kernels-0', 'qkvnp-kernels-1']",
        "True",
    ]


# ---------------------------------------------------------------- thread-local blocks


def test_num_threads_blocks_in_two_threads_leave_the_process_count_as_it_was(process_count):
    qkvnp.set_num_threads(2)
    steps = [threading.Event() for _ in range(4)]
    seen = {}

    def first():  # enters first, leaves while the other is still inside
        with qkvnp.num_threads(1):
            steps[0].set()
            steps[1].wait()
            seen["first"] = qkvnp.get_num_threads()
        steps[2].set()

    def second():
        steps[0].wait()
        with qkvnp.num_threads(3):
            seen["main while both inside"] = None
            steps[1].set()
            steps[2].wait()
            seen["second"] = qkvnp.get_num_threads()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    steps[1].wait()
    seen["main"] = qkvnp.get_num_threads()  # no block in this thread: the process's count
    for thread in threads:
        thread.join()
    assert seen["first"] == 1 and seen["second"] == 3 and seen["main"] == 2
    assert qkvnp.get_num_threads() == 2


def test_a_thread_block_is_used_by_that_threads_kernels(process_count):
    qkvnp.set_num_threads(1)
    seen = set()

    def task(part):
        seen.add(threading.current_thread().name)

    from qkvnp.kernels import _runtime

    def in_thread():
        with qkvnp.num_threads(2):
            _runtime.run(task, [0, 1], flops=1 << 40)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert "qkvnp-kernels-1" in seen  # the block's two threads served that call
    seen.clear()
    _runtime.run(task, [0, 1], flops=1 << 40)
    assert seen == {threading.current_thread().name}  # the process's count, 1: serial


# ---------------------------------------------------------------- fork

_FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys, threading, warnings
    import numpy as np
    import qkvnp
    from qkvnp import kernels
    from qkvnp.kernels import _runtime, openblas, workers

    warnings.simplefilter("ignore")  # 3.12+: DeprecationWarning for fork with threads
    TRIALS, TIMEOUT = 20, 20.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64, 16))
    dy = rng.standard_normal((2, 64, 16))
    layers = {impl: qkvnp.MultiHeadAttention(16, 2, rng=0, dtype=np.float64, impl=impl)
              for impl in ("reference", "fast", "tiled")}

    def fwd_bwd(layer):
        layer.zero_grad()
        out = layer.forward(x)
        dx = layer.backward(dy)
        return [out, dx] + [layer.grads[name] for name in sorted(layer.grads)]

    expected = fwd_bwd(layers["reference"])  # the oracle, computed before any fork
    blas = openblas.openblas_thread_functions()
    blas_count = blas[0]() if blas else None
    qkvnp.set_num_threads(2)
    kernels.set_block_sizes(min_parallel_flops=0, batch_split_flops=0)  # all on the workers

    def child():
        for impl in ("fast", "tiled"):
            for got, want in zip(fwd_bwd(layers[impl]), expected):
                if not np.allclose(got, want, rtol=1e-10, atol=1e-10):
                    os._exit(3)
        if workers.crew_size() < 2:
            os._exit(4)  # the child's calls did not use its own workers
        if blas and blas[0]() != blas_count:
            os._exit(5)  # BLAS left pinned to one thread
        os._exit(0)

    context = multiprocessing.get_context("fork")
    for impl in ("fast", "tiled"):
        fwd_bwd(layers[impl])  # the parent's workers exist and are idle

    stop = threading.Event()
    def loop():  # the issue's repro: a layer's fwd+bwd in a loop, beside the forks
        layer = qkvnp.MultiHeadAttention(64, 4, rng=1, impl="fast")
        x_big = rng.standard_normal((8, 256, 64)).astype(np.float32)
        while not stop.is_set():
            layer.forward(x_big)
            layer.backward(x_big[::-1])

    def hold(inside, release):  # a kernel running: section locked, BLAS pinned, workers busy
        def task(part):
            inside.set()
            release.wait()
        _runtime.run(task, [0, 1], flops=1 << 40)

    looping = threading.Thread(target=loop, daemon=True)
    failures = []
    for trial in range(TRIALS):
        mode = "idle pool" if trial < 7 else "held kernel" if trial < 14 else "layer loop"
        held = None
        if mode == "held kernel":
            inside, release = threading.Event(), threading.Event()
            held = threading.Thread(target=hold, args=(inside, release), daemon=True)
            held.start()
            inside.wait()
        elif mode == "layer loop" and not looping.is_alive():
            looping.start()
        process = context.Process(target=child)
        process.start()
        process.join(TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join()
            failures.append(f"trial {trial} ({mode}): the child hung")
        elif process.exitcode != 0:
            failures.append(f"trial {trial} ({mode}): the child exited {process.exitcode}")
        if held is not None:
            release.set()
            held.join()
        if failures:
            break
    stop.set()
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_computes_whatever_the_parents_threads_were_doing():
    try:
        result = _python(_FORK_SCRIPT, timeout=300)
    except subprocess.TimeoutExpired:  # a hung child outlived its trial's timeout
        pytest.fail("the fork script did not finish")
    assert result.returncode == 0 and result.stdout.strip() == "ok", \
        result.stdout + result.stderr
