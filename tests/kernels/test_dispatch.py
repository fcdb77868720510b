"""The seam between layers and kernels: settings, path choice and its reasons.

Oracles: the documented rules of :func:`qkvnp.kernels.choose_path` (thresholds
read back from the settings), the thread that runs a task (the calling
thread, or a worker named ``qkvnp-kernels-<i>``), and fresh processes for the
environment variable read at first use.
"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import qkvnp
from qkvnp import kernels
from qkvnp.kernels import _runtime, tiled, workers

from oracles import assert_matches_reference


# ---------------------------------------------------------------- threads


def test_num_threads_is_set_read_and_restored():
    before = qkvnp.get_num_threads()
    with qkvnp.num_threads(1):
        assert qkvnp.get_num_threads() == 1
        with qkvnp.num_threads(3):
            assert kernels.get_num_threads() == 3
        assert qkvnp.get_num_threads() == 1
    assert qkvnp.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"):
        with qkvnp.num_threads(2):
            raise RuntimeError("inside")
    assert qkvnp.get_num_threads() == before  # restored on error too


@pytest.mark.parametrize("value, error, fragment", [
    (0, ValueError, "n must be >= 1, got 0"),
    (-2, ValueError, "n must be >= 1, got -2"),
    (True, TypeError, "n must be an int, got bool"),  # a bool is not a count
    (2.0, TypeError, "n must be an int, got float"),
    ("2", TypeError, "n must be an int, got str"),
])
def test_bad_thread_counts_are_refused(value, error, fragment):
    before = qkvnp.get_num_threads()
    with pytest.raises(error, match=fragment):
        qkvnp.set_num_threads(value)
    assert qkvnp.get_num_threads() == before


def _can_pin():
    """True where a thread can be pinned to one CPU of its own set (Linux)."""
    try:
        cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        return True
    except (AttributeError, OSError):
        return False


def _affinity():
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def test_the_thread_setting_decides_who_runs_the_work():
    """Oracle: the name and CPU set of the thread that ran each share of the work."""
    if not _runtime.openblas_thread_functions():
        pytest.skip("numpy's OpenBLAS not found: the kernels never use worker threads")
    seen = []

    def task(part):
        seen.append((threading.current_thread().name, len(part), _affinity()))

    me = threading.current_thread().name
    with qkvnp.num_threads(1):
        _runtime.run(task, [0, 1, 2, 3])
    assert seen == [(me, 4, _affinity())]
    seen.clear()
    before = _affinity()
    with qkvnp.num_threads(2):
        _runtime.run(task, [0, 1, 2, 3])
    assert _affinity() == before  # the caller's CPUs are given back
    assert sorted(n for _, n, _ in seen) == [2, 2]
    names = sorted(name for name, _, _ in seen)
    if _can_pin():
        # share 0 in the caller, pinned to worker 0's CPU; share 1 in worker 1
        assert names == sorted([me, "qkvnp-kernels-1"]), seen
        cpus = sorted(before)
        pinned = {name: affinity for name, _, affinity in seen}
        assert pinned[me] == {cpus[0]}
        if len(cpus) > 1:
            assert pinned["qkvnp-kernels-1"] == {cpus[1]}
    else:
        assert names == ["qkvnp-kernels-0", "qkvnp-kernels-1"], seen


def test_a_caller_kept_off_the_first_cpu_only_waits():
    """Oracle: the thread names. A caller whose own CPU set excludes worker 0's CPU is
    not moved there: both shares go to the workers."""
    if not _runtime.openblas_thread_functions() or not _can_pin():
        pytest.skip("needs OpenBLAS and a thread that can be pinned (Linux)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    seen = []
    with qkvnp.num_threads(2):
        _runtime.run(lambda part: None, [0, 1])  # the workers exist, pinned from the full set
        os.sched_setaffinity(0, set(cpus[1:]))
        try:
            _runtime.run(lambda part: seen.append(threading.current_thread().name), [0, 1])
            assert os.sched_getaffinity(0) == set(cpus[1:])  # untouched
        finally:
            os.sched_setaffinity(0, set(cpus))
    assert sorted(seen) == ["qkvnp-kernels-0", "qkvnp-kernels-1"]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_share_error_is_raised_after_every_share_has_ended(failing):
    """Oracle: the other share's end time against the raise. Share 0 runs in the
    caller, share 1 in a worker: whichever fails, the other has finished writing."""
    if not _runtime.openblas_thread_functions():
        pytest.skip("numpy's OpenBLAS not found: the kernels never use worker threads")
    import time

    ended = []

    def task(part):
        (index,) = part
        if index == failing:
            raise KeyError(f"share {index}")
        time.sleep(0.05)  # the share that works ends last
        ended.append(index)

    before = _affinity()
    with qkvnp.num_threads(2):
        with pytest.raises(KeyError, match=f"share {failing}"):
            _runtime.run(task, [0, 1])
        assert ended == [1 - failing]
        assert _affinity() == before
        assert not workers.in_worker()  # the caller is not left marked as a worker
        ended.clear()
        _runtime.run(lambda part: ended.append(part), [0, 1])  # the crew still works
    assert sorted(ended) == [[0], [1]]


def test_small_jobs_run_serially_in_the_calling_thread():
    """Oracle: the thread names; below min_parallel_flops no hand-off to a worker."""
    if not _runtime.openblas_thread_functions():
        pytest.skip("numpy's OpenBLAS not found: the kernels never use worker threads")
    seen = []

    def task(part):
        seen.append(threading.current_thread().name)

    me = threading.current_thread().name
    limit = kernels.get_block_sizes()["min_parallel_flops"]
    with qkvnp.num_threads(2):
        _runtime.run(task, [0, 1, 2, 3], flops=limit - 1)
        assert seen == [me]
        assert _runtime.threads_for(limit - 1) == 1 and _runtime.threads_for(limit) == 2
        seen.clear()
        _runtime.run(task, [0, 1, 2, 3], flops=limit)
        assert len(seen) == 2 and "qkvnp-kernels-1" in seen


def test_elementwise_jobs_go_to_the_workers_from_min_parallel_entries_on():
    """Oracle: the thread names and the setting's definition: below the entries, or
    with one item of work, the calling thread runs the whole list."""
    if not _runtime.openblas_thread_functions():
        pytest.skip("numpy's OpenBLAS not found: the kernels never use worker threads")
    seen = []

    def task(part):
        seen.append((threading.current_thread().name, list(part)))

    me = threading.current_thread().name
    limit = kernels.get_block_sizes()["min_parallel_entries"]
    with qkvnp.num_threads(2):
        for work, entries in (([0, 1, 2], limit - 1), ([0], limit)):
            seen.clear()
            _runtime.run_elementwise(task, work, entries)
            assert seen == [(me, work)]
        seen.clear()
        _runtime.run_elementwise(task, [0, 1, 2], limit)
        assert len(seen) == 2 and "qkvnp-kernels-1" in [name for name, _ in seen]
        assert sorted(i for _, part in seen for i in part) == [0, 1, 2]


def _python(code, **env):
    environment = {k: v for k, v in os.environ.items() if k != "QKVNP_NUM_THREADS"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment)


def test_environment_variable_is_read_at_first_use_not_at_import():
    code = ("import qkvnp, qkvnp.kernels.workers as r; print(r._NUM_THREADS); "
            "print(qkvnp.get_num_threads())")
    result = _python(code, QKVNP_NUM_THREADS="3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "3"]


def test_a_bad_environment_variable_names_itself_at_first_use():
    code = ("import numpy as np, qkvnp; print('imported'); "
            "qkvnp.MultiHeadAttention(4, 2, rng=0).forward(np.ones((1, 3, 4)))")
    result = _python(code, QKVNP_NUM_THREADS="zero")
    assert result.stdout.strip() == "imported"  # import works; the first kernel call refuses
    assert "QKVNP_NUM_THREADS must be a positive integer, got 'zero'" in result.stderr


def test_set_num_threads_overrides_the_environment():
    code = "import qkvnp; qkvnp.set_num_threads(1); print(qkvnp.get_num_threads())"
    result = _python(code, QKVNP_NUM_THREADS="4")
    assert result.stdout.strip() == "1", result.stderr


# ---------------------------------------------------------------- block sizes


def test_block_sizes_are_set_and_restored():
    before = kernels.get_block_sizes()
    assert before == kernels.BLOCK_SIZE_DEFAULTS  # no test leaves a setting behind
    with kernels.block_sizes(tiled_block=(64, 128), min_split=8):
        now = kernels.get_block_sizes()
        assert now["tiled_block"] == (64, 128) and now["min_split"] == 8
        assert {k: v for k, v in now.items() if k not in ("tiled_block", "min_split")} == {
            k: v for k, v in before.items() if k not in ("tiled_block", "min_split")}
    assert kernels.get_block_sizes() == before
    now = kernels.get_block_sizes()
    now["min_split"] = 1  # a copy: changing it changes nothing
    assert kernels.get_block_sizes() == before


@pytest.mark.parametrize("sizes, error, fragment", [
    ({"block_bytes": 4}, ValueError, "unknown block-size setting 'block_bytes'"),
    ({"min_split": 0}, ValueError, "min_split must be >= 1, got 0"),
    ({"recycle_bytes": -1}, ValueError, "recycle_bytes must be >= 0, got -1"),
    ({"fast_block_bytes": 2.5}, TypeError, "fast_block_bytes must be an int, got float"),
    ({"tiled_block": (4, 4, 4)}, ValueError, "tiled_block must be an int or a pair"),
    ({"tiled_block": (4, True)}, TypeError, "tiled_block must be an int, got bool"),
    ({"min_split": 8, "nope": 1}, ValueError, "unknown block-size setting 'nope'"),
])
def test_bad_block_sizes_are_refused_before_any_is_set(sizes, error, fragment):
    before = kernels.get_block_sizes()
    with pytest.raises(error, match=fragment):
        kernels.set_block_sizes(**sizes)
    with pytest.raises(error, match=fragment):
        with kernels.block_sizes(**sizes):
            pass
    assert kernels.get_block_sizes() == before


def test_tiled_default_block_follows_the_setting():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(200, 4)) for _ in range(3))
    with qkvnp.num_threads(1), kernels.block_sizes(tiled_block=(48, 80)):
        _, cache = tiled.attention_forward(q, k, v)
    assert (cache.block_q, cache.block_k) == (48, 80)


# ---------------------------------------------------------------- the path and why


def test_choose_path_follows_the_settings_and_says_why():
    sizes = kernels.get_block_sizes()
    choice = kernels.choose_path("auto", 8, 16, 16, np.float64)
    assert choice == (
        "auto", "fast",
        "fast: auto: 16 keys < tiled_min_length 4096 and dense weights of 0.0156 MiB within "
        "dense_weights_budget")
    long = kernels.choose_path("auto", 1, 8, sizes["tiled_min_length"], np.float32)
    assert long.path == "tiled" and "keys >= tiled_min_length" in long.reason
    with kernels.block_sizes(dense_weights_budget=1 << 10):
        big = kernels.choose_path("auto", 4, 16, 16, np.float64)  # 8 KiB of weights
    assert big.path == "tiled" and "dense_weights_budget" in big.reason
    wanted = kernels.choose_path("auto", 1, 8, sizes["tiled_min_length"], np.float32, True)
    assert wanted.path == "fast" and "weights requested" in wanted.reason
    assert sizes["causal_tiled_min_length"] <= sizes["tiled_min_length"]
    with kernels.block_sizes(causal_tiled_min_length=512):  # below tiled_min_length
        assert kernels.choose_path("auto", 8, 512, 512, np.float32).path == "fast"
        tiled_causal = kernels.choose_path("auto", 8, 512, 512, np.float32, is_causal=True)
        assert tiled_causal.path == "tiled" and "causal_tiled_min_length" in tiled_causal.reason
        assert kernels.choose_path("auto", 8, 512, 511, np.float32, is_causal=True).path == "fast"
    fallback = kernels.choose_path("tiled", 1, 8, 8, np.float32, need_weights=True)
    assert fallback.path == "fast" and "fell back to the fast core" in fallback.reason
    assert kernels.choose_path("reference", 1, 8, 8, np.float32, True).path == "reference"
    # the reason opens with the path that ran (it once never named it)
    for choice in (long, big, wanted, tiled_causal, fallback):
        assert choice.reason.startswith(f"{choice.path}: "), choice


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype, factor", [(np.float32, 1e20), (np.float64, 1e155)])
def test_scores_beyond_sqrt_of_the_float_max_take_the_reference_path(dtype, factor, split):
    """Oracle: the reference layer, with the same dropout Generator state. The
    fused kernels bound the scores from their projections and hand a call whose
    bound reaches sqrt(finfo.max) to the reference path, which choose_path
    names; nothing is drawn from the rng before (an unsplit call), or the batch
    split's mask is the one the reference applies."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 5, 6)).astype(dtype)
    dout = rng.normal(size=(4, 5, 6)).astype(dtype)
    reference, auto = (qkvnp.MultiHeadAttention(6, 2, rng=0, dtype=dtype, impl=impl, dropout=0.25)
                       for impl in ("reference", "auto"))
    threads = 2 if split else 1
    for scale in (1.0, factor):  # moderate scores stay on the fast path
        results = []
        for layer in (reference, auto):
            generator = np.random.default_rng(8)
            with kernels.num_threads(threads), kernels.block_sizes(batch_split_flops=0):
                with np.errstate(over="ignore", invalid="ignore"):  # the reference clips
                    out = layer.forward(x * dtype(scale), is_causal=True, rng=generator)
                    dx = layer.backward(dout)
            results.append((out, dx, generator.random()))
        (out_ref, dx_ref, draw_ref), (out, dx, draw) = results
        path = "reference" if scale > 1 else "fast"
        assert auto.last_dispatch.path == path
        if path == "reference":
            assert "beyond sqrt(finfo(" in auto.last_dispatch.reason
            np.testing.assert_array_equal(out, out_ref)
            np.testing.assert_array_equal(dx, dx_ref)
        else:
            assert_matches_reference(out, out_ref, "out", "auto")
            assert_matches_reference(dx, dx_ref, "dx", "auto")
        assert draw == draw_ref  # one key drawn from the Generator on either path
        assert isinstance(auto._used_cache, kernels.mha.SplitLayerCache) == (split and path == "fast")


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_huge_values_alone_keep_the_fast_path_and_the_exact_bound_is_reported(kind):
    """Oracle: projected_score_bound of the query and key columns alone. The
    kernels screen with the whole fused projections (values included) and
    only then compute the exact bound: values beyond the screen's limit with
    moderate queries and keys stay on the fast path; scores beyond it go to
    the reference with the exact bound in the reason."""
    dtype = np.float32
    layer = qkvnp.MultiHeadAttention(6, 2, rng=0, dtype=dtype)
    x = np.random.default_rng(5).normal(size=(3, 4, 6)).astype(dtype)
    layer.params["W_value"] *= dtype(1e12)  # |v| ~ 1e12: the screen D max|y|^2 ~ 1e24 > 1.8e19
    inputs = (x,) if kind == "self" else (x, x, x)
    layer.forward(*inputs)
    assert layer.last_dispatch.path == "fast"
    layer.params["W_query"] *= dtype(1e10)  # now the scores themselves may overflow
    layer.params["W_key"] *= dtype(1e10)
    with np.errstate(over="ignore", invalid="ignore"):
        layer.forward(*inputs)
    q = x.reshape(-1, 6) @ layer.params["W_query"] / np.sqrt(dtype(3))  # (12, 6), scaled
    k = x.reshape(-1, 6) @ layer.params["W_key"]
    exact = kernels.mha.projected_score_bound(q, k, 3)
    assert layer.last_dispatch.path == "reference"
    assert f"scores may reach {exact:.3g}," in layer.last_dispatch.reason


@pytest.mark.parametrize("make", [
    lambda impl: qkvnp.SelfAttention(4, 4, rng=0, impl=impl),
    lambda impl: qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl),
])
@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_layers_record_the_path_of_their_last_forward(make, impl):
    layer = make(impl)
    assert layer.last_dispatch is None
    x = np.random.default_rng(1).normal(size=(2, 5, 4))
    layer.forward(x)
    expected = "fast" if impl == "auto" else impl
    assert layer.last_dispatch.path == expected
    assert layer.last_dispatch.impl == impl
    layer.forward(x, return_weights=True)
    assert layer.last_dispatch.path == ("reference" if impl == "reference" else "fast")
    if impl == "tiled":
        assert "fell back" in layer.last_dispatch.reason
    with kernels.block_sizes(tiled_min_length=4):  # auto now takes the tiled core
        layer.forward(x)
    assert layer.last_dispatch.path == ("tiled" if impl == "auto" else expected)
    with kernels.block_sizes(causal_tiled_min_length=4):  # ... under a causal mask only
        layer.forward(x)
        assert layer.last_dispatch.path == expected
        layer.forward(x, is_causal=True)
        assert layer.last_dispatch.path == ("tiled" if impl == "auto" else expected)
    # the cache is the one the path's backward reads: backward works after each
    assert layer.backward(np.ones((2, 5, 4))).shape == (2, 5, 4)


def test_weights_from_every_impl_match_the_reference():
    """Oracle: the reference path's weights (the fallback returns the same thing)."""
    x = np.random.default_rng(2).normal(size=(2, 5, 4))
    weights = {}
    for impl in ("reference", "fast", "tiled"):
        layer = qkvnp.MultiHeadAttention(4, 2, rng=0, impl=impl)
        weights[impl] = layer.forward(x, is_causal=True, return_weights=True)[1]
    for impl in ("fast", "tiled"):
        np.testing.assert_allclose(weights[impl], weights["reference"], rtol=0, atol=1e-12)


# ---------------------------------------------------------------- Layer's contract


def test_layer_is_an_abstract_base():
    with pytest.raises(TypeError, match="abstract"):
        qkvnp.layers.Layer()

    class ForwardOnly(qkvnp.layers.Layer):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="backward"):
        ForwardOnly()


@pytest.mark.parametrize("layer, text", [
    (qkvnp.MultiHeadAttention(16, 4, rng=0),
     "MultiHeadAttention(embed_dim=16, num_heads=4, bias=True, dtype=float64, impl='auto')"),
    (qkvnp.MultiHeadAttention(8, 2, bias=False, kdim=3, rng=0, dtype=np.float32, impl="tiled"),
     "MultiHeadAttention(embed_dim=8, num_heads=2, bias=False, kdim=3, dtype=float32, "
     "impl='tiled')"),
    (qkvnp.SelfAttention(3, 2, rng=0),
     "SelfAttention(d_in=3, d_out=2, qkv_bias=False, dtype=float64, impl='auto')"),
    (qkvnp.Linear(3, 2, bias=False, rng=0, dtype=np.float16),
     "Linear(in_features=3, out_features=2, bias=False, dtype=float32)"),  # float16 computes in float32
    (qkvnp.Embedding(10, 4, rng=0), "Embedding(num_embeddings=10, embedding_dim=4, dtype=float64)"),
])
def test_repr_shows_the_constructor_arguments(layer, text):
    assert repr(layer) == text


def test_bad_impl_is_refused_by_the_dispatcher_too():
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'reference', 'fast', "
                                         r"'tiled'\), got 'gpu'"):
        kernels.choose_path("gpu", 1, 2, 2, np.float64)
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels.check_impl(["fast"])  # unhashable: still a clear ValueError


@pytest.mark.parametrize("batch, dtype, shares", [
    (16, np.float32, 1),  # 21 MFLOP a forward: serial
    (32, np.float32, 2),  # 42 MFLOP: split
    (16, np.float64, 1),  # 21 MFLOP, counted 31.5: serial (split measured 20% slower)
    (24, np.float64, 2),  # 31 MFLOP, counted 47: split
])
def test_the_batch_splits_from_batch_split_flops(batch, dtype, shares):
    """Oracle: the documented crossover (the batch_split_flops setting, a
    float64 operation counted 1.5 times) for (B, 32, 64, 4) layers on two
    threads; the measurements are beside the setting in _runtime.py."""
    layer = qkvnp.MultiHeadAttention(64, 4, dtype=dtype)
    x = np.zeros((batch, 32, 64), dtype)
    from qkvnp.kernels import mha

    with kernels.num_threads(2):
        got = mha._batch_shares(layer.params, (x, x, x), 4, True)
    assert len(got) == shares


def test_work_is_dealt_to_the_threads_in_snake_order():
    """Oracle: the costs' sums. Shares keep the list's order and take every
    item once; with costs growing along the list (a causal core's query
    blocks: row a has a + 1 live key blocks) both threads get the same sum,
    where dealing 0, 1, 0, 1, ... gave 64 and 72 of 136."""
    for n, threads in [(16, 2), (7, 3), (1, 2), (0, 2), (5, 1)]:
        shares = _runtime._snake_shares(list(range(n)), threads)
        assert len(shares) == threads
        assert sorted(i for share in shares for i in share) == list(range(n))
        assert all(share == sorted(share) for share in shares)
    costs = [sum(a + 1 for a in share) for share in _runtime._snake_shares(list(range(16)), 2)]
    assert costs == [68, 68]
