"""The worker threads' count and their survival across threads and ``fork``.

Oracles: the documented bound :data:`qkvnp.kernels.MAX_NUM_THREADS` and its
error messages; a thread start made to fail (``threading.Thread.start``
patched) and the count read back after; the count each thread reads inside
its own :func:`qkvnp.num_threads` block; and, for ``fork``, a child process
that must find every lock of qkvnp's free and OpenBLAS's thread count as it
was before any kernel pinned it, then finish a threaded layer forward and
backward within a timeout and match the reference path's results computed in
the parent.
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

# One script, one process: the modes run in turn, each forking children
# while the parent's threads are in a known state, and each child must finish
# within TIMEOUT. The deterministic modes stop a thread where a fork used to
# break the child: holding each lock of qkvnp's (found by scanning its
# modules, so that a lock added later is covered too), or inside OpenBLAS's
# count change at a kernel section's entry or exit (a patched setter waits
# there; the fork must wait for it, which the timer lets happen). The loops
# are the repro: the child exited 5 (BLAS left at one thread) or hung
# once in a dozen runs before; the pin loop, a thread doing nothing but enter
# and leave sections, failed one fork in five; the product loop (products on
# OpenBLAS's own threads) hung the parent's fork or the child within a few.
_FORK_SCRIPT = textwrap.dedent("""
    import faulthandler, multiprocessing, os, sys, threading, types, warnings
    import numpy as np
    import qkvnp
    from qkvnp import kernels
    from qkvnp.kernels import _runtime, openblas, workers

    warnings.simplefilter("ignore")  # 3.12+: DeprecationWarning for fork with threads
    TIMEOUT = 20.0
    MODES = ["idle pool"] * 2 + ["held kernel"] * 2 + ["locks held", "pinning BLAS",
             "unpinning BLAS"] + ["pin loop"] * 4 + ["product loop"] * 3 + ["layer loop"] * 4
    # taken by the fork itself (it waits for the thread that holds them)
    GATES = {"qkvnp.kernels._runtime._PIN_LOCK", "qkvnp.kernels._runtime._BLAS_POOL_LOCK"}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64, 16))
    dy = rng.standard_normal((2, 64, 16))
    layers = {impl: qkvnp.MultiHeadAttention(16, 2, rng=0, dtype=np.float64, impl=impl)
              for impl in ("reference", "fast", "tiled")}

    def fwd_bwd(layer):
        layer.zero_grad()
        out = layer.forward(x, is_causal=True)
        dx = layer.backward(dy)
        return [out, dx] + [layer.grads[name] for name in sorted(layer.grads)]

    def qkvnp_locks():
        locks = {}  # "module.name" or "module.name.lock" -> how to read it now
        kind = (type(threading.Lock()), type(threading.RLock()))
        for module_name, module in list(sys.modules.items()):
            if module_name.split(".")[0] != "qkvnp":
                continue
            for name, value in list(vars(module).items()):
                if isinstance(value, kind):
                    locks[f"{module_name}.{name}"] = (module, name, None)
                elif (not isinstance(value, (type, types.ModuleType))
                      and isinstance(getattr(value, "lock", None), kind)):
                    locks[f"{module_name}.{name}.lock"] = (module, name, "lock")
        return locks

    def current(where):
        module, name, attribute = where
        value = getattr(module, name)
        return getattr(value, attribute) if attribute else value

    expected = fwd_bwd(layers["reference"])  # the oracle, computed before any fork
    blas = openblas.openblas_thread_functions()
    if blas and blas[0]() < 2:
        blas[1](2)  # so that a count left pinned shows
    blas_count = blas[0]() if blas else None
    qkvnp.set_num_threads(2)
    kernels.set_block_sizes(min_parallel_flops=0, batch_split_flops=0)  # all on the workers
    for impl in ("fast", "tiled"):
        fwd_bwd(layers[impl])  # the parent's workers exist and are idle
    locks = qkvnp_locks()
    assert {"qkvnp.kernels._runtime._SECTION_LOCK", "qkvnp.layers.transaction._GRADS_LOCK",
            "qkvnp.ops.masks._SHARED.lock"} <= set(locks), sorted(locks)

    def child():
        faulthandler.dump_traceback_later(TIMEOUT - 5)  # where it hangs, if it does
        for name, where in sorted(locks.items()):
            lock = current(where)
            if not lock.acquire(blocking=False):
                sys.stderr.write(f"{name} held in the child\\n")
                os._exit(6)
            lock.release()
        if blas and blas[0]() != blas_count:
            sys.stderr.write(f"BLAS at {blas[0]()} threads in the child, {blas_count} before\\n")
            os._exit(5)  # left pinned to one thread
        for impl in ("fast", "tiled"):
            for got, want in zip(fwd_bwd(layers[impl]), expected):
                if not np.allclose(got, want, rtol=1e-10, atol=1e-10):
                    os._exit(3)
        if workers.crew_size() < 2:
            os._exit(4)  # the child's calls did not use its own workers
        if blas and blas[0]() != blas_count:
            os._exit(5)
        os._exit(0)

    # A thread stops inside OpenBLAS's count change (after the set for the pin
    # to 1, before the set back): set_pause[n] = (inside, release, after).
    set_pause = {}
    if blas:
        get_count, set_count = blas

        def paused_set(n):
            pause = None  # only a section's own count change (no section open), in that thread
            if threading.current_thread().name == "paused" and not _runtime._PIN["depth"]:
                pause = set_pause.pop(n, None)
            if pause and not pause[2]:
                pause[0].set()
                pause[1].wait(TIMEOUT)
            set_count(n)
            if pause and pause[2]:
                pause[0].set()
                pause[1].wait(TIMEOUT)

        openblas._BLAS = (get_count, paused_set)

    stop = {name: threading.Event() for name in ("pin loop", "product loop", "layer loop")}
    def pin_loop():
        while not stop["pin loop"].is_set():
            with _runtime.single_threaded_blas():
                pass

    def product_loop():  # products on OpenBLAS's own threads, as a one-block kernel's
        a = rng.standard_normal((200, 200))
        while not stop["product loop"].is_set():
            with _runtime.single_threaded_blas():
                _runtime._on_blas_threads(lambda: a @ a, 2)

    def layer_loop():  # the issue's repro: a layer's fwd+bwd in a loop, beside the forks
        layer = qkvnp.MultiHeadAttention(64, 4, rng=1, impl="fast")
        x_big = rng.standard_normal((8, 256, 64)).astype(np.float32)
        while not stop["layer loop"].is_set():
            layer.forward(x_big)
            layer.backward(x_big[::-1])

    def hold(inside, release):  # a kernel running: section locked, BLAS pinned, workers busy
        def task(part):
            inside.set()
            release.wait()
        _runtime.run(task, [0, 1], flops=1 << 40)

    def hold_locks(inside, release):
        held = [current(where) for name, where in sorted(locks.items()) if name not in GATES]
        for lock in held:
            lock.acquire()
        inside.set()
        release.wait()
        for lock in held:
            lock.release()

    def pause_in_set(n, after, inside, release):
        set_pause[n] = (inside, release, after)
        layers["fast"].forward(x)  # a kernel section: the pin to 1, then the set back

    loops = {"pin loop": threading.Thread(target=pin_loop, daemon=True),
             "product loop": threading.Thread(target=product_loop, daemon=True),
             "layer loop": threading.Thread(target=layer_loop, daemon=True)}
    context = multiprocessing.get_context("fork")
    failures = []
    for trial, mode in enumerate(MODES):
        held = None
        inside, release = threading.Event(), threading.Event()
        if mode == "held kernel":
            held = threading.Thread(target=hold, args=(inside, release), daemon=True)
        elif mode == "locks held":
            held = threading.Thread(target=hold_locks, args=(inside, release), daemon=True)
        elif mode in ("pinning BLAS", "unpinning BLAS") and blas:
            pinning = mode == "pinning BLAS"
            held = threading.Thread(target=pause_in_set, name="paused", daemon=True,
                                    args=(1 if pinning else blas_count, pinning, inside, release))
            threading.Timer(0.2, release.set).start()  # the fork waits for it
        elif mode in loops:
            for name, thread in loops.items():
                if name != mode and thread.is_alive():
                    stop[name].set()
                    thread.join()
            if not loops[mode].is_alive():
                loops[mode].start()
        if held is not None:
            held.start()
            if not inside.wait(TIMEOUT):
                failures.append(f"trial {trial} ({mode}): the thread never got there")
                break
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
    for name, thread in loops.items():
        stop[name].set()
        if thread.is_alive():
            thread.join()  # not left running into the interpreter's exit
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_computes_whatever_the_parents_threads_were_doing():
    try:
        result = _python(_FORK_SCRIPT, timeout=120)  # about 10 s when all goes well
    except subprocess.TimeoutExpired:  # a hung child outlived its trial's timeout
        pytest.fail("the fork script did not finish")
    assert result.returncode == 0 and result.stdout.strip() == "ok", \
        result.stdout + result.stderr
