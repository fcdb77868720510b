"""A layer shared by threads computes exactly what serial calls compute.

Oracle: the same calls run serially, one after another, on the same layer
(bitwise equal: every path is deterministic for a given input). Eight
threads each run 1,000 calls on one shared layer per path (``reference``,
``fast``, ``tiled``, ``auto``): forward and backward pairs (a backward uses
the cache of its own thread's forward), with ``return_weights``, and with
dropout replayed from an explicit ``dropout_mask``. The thread switch
interval is shortened so that the threads interleave inside the calls.
Shapes are tiny: the point is the interleaving, not the arithmetic.
"""
import sys
import threading
import time

import numpy as np
import pytest

import qkvnp

PATHS = ["reference", "fast", "tiled", "auto"]
THREADS = 8
CALLS = 1000  # per thread
B, T, E, H = 2, 3, 4, 2


@pytest.fixture
def fast_switching():
    """Switch threads every 100 us (default 5 ms) so that calls interleave."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(interval)


def _in_threads(work, threads=THREADS):
    """Run ``work(thread_index)`` in ``threads`` threads started together; re-raise a failure."""
    barrier = threading.Barrier(threads)
    errors = []

    def run(index):
        try:
            barrier.wait()
            work(index)
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    if errors:
        raise errors[0]


def _problems(rng, n=4):
    """``n`` inputs, upstream gradients and dropout masks (random, never all ones)."""
    return [(rng.normal(size=(B, T, E)), rng.normal(size=(B, T, E)),
             rng.random((B, H, T, T)) > 0.5) for _ in range(n)]


def _call(layer, variant, x, dout, keep, backward):
    """One forward (and a backward if asked): ``(out, weights or None, dx or None)``."""
    if variant == "weights":
        out, weights = layer.forward(x, is_causal=True, return_weights=True)
    elif variant == "dropout":  # the layer is in eval mode: the given mask alone drops
        out, weights = layer.forward(x, dropout_mask=keep, return_weights=True)
    else:
        out, weights = layer.forward(x, is_causal=True), None
    return out, weights, layer.backward(dout) if backward else None


VARIANTS = ["plain", "weights", "dropout"]
BACKWARD_EVERY = 4  # every 4th call is a forward/backward pair, the others forwards


@pytest.mark.parametrize("path", PATHS)
def test_threads_sharing_a_layer_get_the_serial_results(path, fast_switching):
    """8 threads x 1000 calls on one layer match the serial calls bit for bit:
    outputs, weights (``return_weights``), outputs and weights under an
    explicit dropout mask, and, for the forward/backward pairs, ``dx`` (the
    backward reads the calling thread's own last forward)."""
    layer = qkvnp.MultiHeadAttention(E, H, rng=0, impl=path, dropout=0.5).eval()
    problems = _problems(np.random.default_rng(1))
    serial = {(i, variant): _call(layer, variant, x, dout, keep, True)
              for i, (x, dout, keep) in enumerate(problems) for variant in VARIANTS}
    wrong = []

    def work(thread):
        for call in range(CALLS):
            i, variant = (thread + call) % len(problems), VARIANTS[call % len(VARIANTS)]
            got = _call(layer, variant, *problems[i], backward=call % BACKWARD_EVERY == 0)
            for name, a, b in zip(("out", "weights", "dx"), got, serial[i, variant]):
                if a is not None and not np.array_equal(a, b):
                    wrong.append((thread, call, variant, name))

    _in_threads(work)
    assert not wrong, f"{len(wrong)} results differ from the serial ones, first {wrong[:3]}"


@pytest.mark.parametrize("path", PATHS)
def test_backwards_from_threads_add_their_gradients_as_if_serial(path, fast_switching):
    """Every thread runs the same forward/backward 1000 times, so each
    backward adds the same gradient ``g``: any order of the additions gives
    ``g + g + ... + g`` exactly, the serial sum; a lost update would show.
    The weights are 64 x 64 (4096 entries: numpy releases the GIL while
    adding arrays this large, so unlocked additions could interleave)."""
    width = 64
    layer = qkvnp.MultiHeadAttention(width, 2, rng=0, impl=path)
    rng = np.random.default_rng(2)
    x, dout = rng.normal(size=(1, 2, width)), rng.normal(size=(1, 2, width))
    serial = {}
    layer.forward(x)
    layer.backward(dout)
    once = {name: g.copy() for name, g in layer.grads.items()}
    for name, g in once.items():
        total = np.zeros_like(g)
        for _ in range(THREADS * CALLS // 8):
            total += g
        serial[name] = total
    layer.zero_grad()

    def work(thread):
        for _ in range(CALLS // 8):
            layer.forward(x)
            layer.backward(dout)

    _in_threads(work)
    for name, want in serial.items():
        np.testing.assert_array_equal(layer.grads[name], want, err_msg=name)


def test_the_cache_a_backward_uses_is_its_own_threads():
    """Oracle: serial forward/backward of each input. Thread 1's forward
    runs between thread 0's forward and backward (the order forced with
    events); thread 0's backward still differentiates its own forward, and
    a thread that never ran a forward is told so."""
    layer = qkvnp.MultiHeadAttention(E, H, rng=0)
    (x0, d0, _), (x1, d1, _) = _problems(np.random.default_rng(3), 2)
    want = []
    for x, d in ((x0, d0), (x1, d1)):
        layer.forward(x)
        want.append(layer.backward(d))
    got = {}
    forwarded, other_done = threading.Event(), threading.Event()

    def first():
        layer.forward(x0)
        forwarded.set()
        other_done.wait()
        got[0] = layer.backward(d0)

    def second():
        forwarded.wait()
        layer.forward(x1)
        other_done.set()
        got[1] = layer.backward(d1)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(
        pytest.raises(RuntimeError, layer.backward, d0)))
    thread.start()
    thread.join()
    assert "before forward" in str(errors[0].value)


@pytest.mark.parametrize("path", ["fast", "tiled", "auto"])
def test_threads_sharing_the_worker_pool_get_the_serial_results(path, fast_switching):
    """The batch split and the cores' worker threads (2 threads, thresholds 0)
    serve 8 calling threads at once: 8 x 50 forward/backward pairs match
    the serial ones bit for bit."""
    from qkvnp import kernels

    layer = qkvnp.MultiHeadAttention(8, 2, rng=0, impl=path)
    rng = np.random.default_rng(5)
    problems = [(rng.normal(size=(4, 5, 8)), rng.normal(size=(4, 5, 8))) for _ in range(4)]
    wrong = []
    with kernels.num_threads(2), kernels.block_sizes(batch_split_flops=0, min_parallel_flops=0):
        serial = []
        for x, dout in problems:
            out = layer.forward(x, is_causal=True)
            serial.append((out, layer.backward(dout)))

        def work(thread):
            for call in range(50):
                i = (thread + call) % len(problems)
                x, dout = problems[i]
                out = layer.forward(x, is_causal=True)
                dx = layer.backward(dout)
                if not (np.array_equal(out, serial[i][0]) and np.array_equal(dx, serial[i][1])):
                    wrong.append((thread, call))

        _in_threads(work)
    assert not wrong, f"{len(wrong)} of {THREADS * 50} pairs differ, first {wrong[:3]}"


class _SlowAdd(np.ndarray):
    """A gradient array whose ``+=`` reads, waits 5 ms, then writes: two unlocked
    additions from two threads would overlap, and one of them would be lost."""

    def __iadd__(self, other):
        total = np.add(np.asarray(self), other)  # read
        time.sleep(0.005)  # the other thread's addition lands here, unless locked
        np.asarray(self)[...] = total  # write
        return self


@pytest.mark.parametrize("variant", ["separate", "tied_qk"])
def test_the_kv_recall_models_backwards_from_threads_add_as_if_serial(variant):
    """Oracle: two threads each run the same forward/backward, so the gradients
    must be twice one backward's, up to the rounding of the order in which the
    two threads' additions land (the key table gets two per backward). Every
    gradient array is a :class:`_SlowAdd`, which turns any unlocked addition
    into a lost update, a whole backward's share: the model's own role
    matrices and its embedding tables' rows alike."""
    from qkvnp.training.models import KVRecallModel

    model = KVRecallModel(6, 5, 8, variant=variant, rng=0)
    rng = np.random.default_rng(3)
    keys, values = rng.integers(0, 6, size=(4, 3)), rng.integers(0, 5, size=(4, 3))
    query = keys[:, 0]
    dlogits = rng.normal(size=(4, 5))
    model.forward(keys, values, query)
    model.backward(dlogits)
    once = {name: g.copy() for name, g in model.grads.items()}
    model.zero_grad()
    model._own_grads = {name: g.view(_SlowAdd) for name, g in model._own_grads.items()}
    for table in (model.embed_key, model.embed_value):
        table.grads["weight"] = table.grads["weight"].view(_SlowAdd)

    def work(thread):
        model.forward(keys, values, query)
        model.backward(dlogits)

    _in_threads(work, threads=2)
    for name, g in once.items():
        np.testing.assert_allclose(np.asarray(model.grads[name]), g + g, rtol=1e-13,
                                   atol=1e-15, err_msg=name)
