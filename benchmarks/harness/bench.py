"""One run of the benchmark: plan, cross-check, time, measure, and return the report.

Shape key: B batch, L sequence length (queries and keys alike), E embedding,
H heads, D = E // H head dim.

The harness of a checkout, not part of the installed package: run it as
``python benchmarks/run.py [options]`` (``--help`` lists them; ``README.md``
beside this file says what is measured and how). It uses the public names
of qkvnp, plus the shared helpers of :mod:`qkvnp.kernels._runtime` (worker
threads, the OpenBLAS probe) and ``qkvnp._io.atomic_write``. Dated results:
``benchmarks/RESULTS.md``.

:func:`run_benchmark` runs the cases that :func:`workloads.grid.plan_cases` plans.
Those with L <= 128 run :func:`run_case_in_processes`: the reference path
here as the oracle, each implementation in a worker process of its own
(:mod:`harness.workers`), timed in alternating rounds. The longer ones run
:func:`run_case`: every implementation in this process, cross-checked
(:mod:`harness.crosscheck`) then timed round by round (:mod:`harness.timing`). Around them:
the GEMM peak and the environment (:mod:`harness.machine`), the import cost
(:mod:`harness.import_cost`), the training steps (:mod:`workloads.training`), the peak
memory in fresh processes (:mod:`harness.memory`). The report that comes out is a
JSON-ready dict, which :mod:`reports.report` prints and writes and :mod:`reports.summary`
puts in plain sentences.

The modules import one way: ``run`` (the command line) -> ``harness.bench``
-> ``reports.report`` -> ``reports.summary``; ``harness.bench`` ->
``workloads.training`` -> ``harness.workers``; everything ->
``workloads.attention`` -> ``workloads.grid``. The worker processes run
``harness.worker_child``, which builds the runners of ``workloads.attention``
and ``workloads.training``.
"""
import gc
import os
import sys
import tempfile
import time

import numpy as np

from benchmarks.harness.crosscheck import cross_check
from benchmarks.harness.import_cost import measure_import_time
from benchmarks.harness.machine import (CHILD_PATH, GEMM_SIZE, environment_info,
                                        measure_attention_gemm_ceiling, measure_gemm_peak)
from benchmarks.harness.memory import TILED_MEMORY_SHAPE, measure_memory, measure_tiled_memory
from benchmarks.harness.timing import ROUND_SECONDS, format_ms, time_interleaved, timing_stats
from benchmarks.harness.workers import WorkerError, WorkerPool, time_alternating
from benchmarks.reports.report import target_requirements
from benchmarks.reports.summary import summarize
from benchmarks.workloads.attention import (TORCH_MISSING, ImplementationMissing, import_torch,
                                            make_problem, make_runner)
from benchmarks.workloads.grid import (DEFAULT_CONFIGS, FLOPS, IMPLEMENTATIONS,
                                       KIND_IMPLEMENTATIONS, KINDS, MASKS, MODE_LABELS, MODES,
                                       ORACLE, PROCESS_MAX_LENGTH, check_config, check_dtype,
                                       plan_cases)
from benchmarks.workloads.training import TRAINING_TASKS, run_training_case

__all__ = ["print_progress", "run_case", "run_case_in_processes", "run_benchmark"]


def print_progress(message):
    """One line of progress, on stderr (the report goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


def _new_record(kind, config, dtype, impl, mask, protocol, timed=True):
    return {"kind": kind, "config": list(config), "dtype": np.dtype(dtype).name, "mask": mask,
            "impl": impl, "library": "torch" if impl == "torch" else "qkvnp",
            "protocol": protocol, "status": "ok", "reason": None, "check": None,
            "dispatch": None, "memory": None, "timed": timed, "fwd": None, "fwd_bwd": None}


def _record_check(record, check):
    """Store a :class:`Check` in ``record``; refuse the implementation if it failed."""
    # JSON has no inf: a non-finite or misshapen result is recorded as None
    record["check"] = {"max_rel_err": check.error if np.isfinite(check.error) else None,
                       "worst": check.worst, "tolerance": check.tolerance}
    if not check.ok:
        record["status"] = "refused"
        record["reason"] = (f"disagrees with the reference path: {check.worst} relative "
                            f"error {check.error:.3g} > {check.tolerance:g}")


def run_case(kind, config, dtype, impls, repeats, warmup, pause, progress=None, mask="none"):
    """Cross-check, then time, every implementation on one workload in this process.

    One record each (the oracle's too, untimed unless asked for). ``mask`` is
    "none" or "causal".
    """
    problem = make_problem(kind, config, dtype, causal=(mask == "causal"))
    records, runners = {}, {}
    impls = [impl for impl in impls if impl in KIND_IMPLEMENTATIONS[kind]]
    for impl in dict.fromkeys([ORACLE] + impls):
        record = _new_record(kind, config, dtype, impl, mask, "same process", impl in impls)
        records[impl] = record
        try:
            runners[impl] = make_runner(impl, problem)
        except ImplementationMissing as missing:
            record["status"], record["reason"] = "missing", str(missing)
        except Exception as error:  # a broken implementation must not stop the others
            record["status"], record["reason"] = "error", f"{type(error).__name__}: {error}"

    expected = None
    if ORACLE in runners:
        try:
            expected = runners[ORACLE].result()
        except Exception as error:
            records[ORACLE]["status"] = "error"
            records[ORACLE]["reason"] = f"{type(error).__name__}: {error}"
            del runners[ORACLE]
    for impl in list(runners):
        record = records[impl]
        if expected is None:
            record["status"], record["reason"] = "refused", "no oracle: the reference path failed"
            del runners[impl]
            continue
        try:
            check = cross_check(runners[impl].result(), expected, dtype)
        except Exception as error:
            record["status"], record["reason"] = "error", f"{type(error).__name__}: {error}"
            del runners[impl]
            continue
        record["dispatch"] = getattr(runners[impl], "dispatch", None)
        _record_check(record, check)
        if not check.ok:
            del runners[impl]
    del expected

    timed = {impl: runner for impl, runner in runners.items() if records[impl]["timed"]}
    runners.clear()  # an untimed oracle's caches (L x L weights) go now
    for mode in MODES:
        if not timed:
            break
        gc.collect()
        try:
            times = time_interleaved(timed, mode, repeats, warmup, pause, progress)
        except Exception as error:
            for impl in timed:
                records[impl]["status"] = "error"
                records[impl]["reason"] = f"while timing: {type(error).__name__}: {error}"
            break
        flops = FLOPS[kind](config, backward=(mode == "fwd_bwd"))
        for impl, seconds in times.items():
            records[impl][mode] = timing_stats(seconds, flops)
        if progress:
            progress(f"    {MODE_LABELS[mode]}: " + ", ".join(
                f"{impl} {format_ms(records[impl][mode]['median_ms'])} ms" for impl in times))
    timed.clear()
    gc.collect()
    return [record for impl, record in records.items() if record["timed"]]


def run_case_in_processes(kind, config, dtype, impls, repeats, warmup, pause, pool,
                           mask="none", round_seconds=ROUND_SECONDS, progress=None,
                           torch_threads=None):
    """Cross-check, then time, each implementation in a worker process of its own.

    The reference path (the oracle) runs in this process; each
    implementation of ``impls`` runs in ``pool``'s worker of its name, which
    writes its results to a file for the cross-check, then times
    forward+backward in rounds alternating with the others'
    (:func:`harness.workers.time_alternating`). One record per implementation.
    """
    impls = [impl for impl in impls if impl in KIND_IMPLEMENTATIONS[kind]]
    records = {impl: _new_record(kind, config, dtype, impl, mask, "processes") for impl in impls}
    spec = {"kind": kind, "config": list(config), "dtype": np.dtype(dtype).name,
            "causal": mask == "causal", "torch_threads": torch_threads}
    try:
        expected = make_runner(ORACLE, make_problem(kind, config, dtype, causal=spec["causal"])).result()
    except Exception as error:
        for record in records.values():
            record["status"] = "refused"
            record["reason"] = f"no oracle: the reference path failed ({type(error).__name__}: {error})"
        return list(records.values())
    workers = {}
    with tempfile.TemporaryDirectory(prefix="qkvnp-bench-") as directory:
        for impl, record in records.items():
            worker = pool.get(impl)
            try:
                reply = worker.request("setup", workload="attention", spec=dict(spec, impl=impl))
                if "missing" in reply:
                    record["status"], record["reason"] = "missing", reply["missing"]
                    continue
                record["torch_threads"] = reply.get("torch_threads")
                path = os.path.join(directory, impl + ".npz")
                reply = worker.request("result", path=path)
                with np.load(path, allow_pickle=False) as stored:
                    results = dict(stored)
            except WorkerError as error:
                record["status"], record["reason"] = "error", str(error)
                continue
            record["dispatch"] = reply.get("dispatch")
            check = cross_check(results, expected, dtype)
            _record_check(record, check)
            if check.ok:
                workers[impl] = worker
    del expected
    if not workers:
        return list(records.values())
    try:
        seconds, calls = time_alternating(workers, "fwd_bwd", repeats, warmup, pause,
                                          round_seconds, progress)
    except WorkerError as error:
        for impl in workers:
            records[impl]["status"] = "error"
            records[impl]["reason"] = f"while timing: {error}"
        return list(records.values())
    flops = FLOPS[kind](config, backward=True)
    for impl in workers:
        records[impl]["fwd_bwd"] = dict(timing_stats(seconds[impl], flops),
                                        calls_per_round=calls[impl])
    if progress:
        progress("    fwd+bwd: " + ", ".join(
            f"{impl} {1e3 * records[impl]['fwd_bwd']['median_ms']:.1f} us" for impl in workers))
    return list(records.values())



def _add_ratios(records, peaks):
    """Add ``ratio_torch`` (median / PyTorch's median, same workload and mode) and
    ``percent_peak`` (achieved GFLOP/s / GEMM peak of the dtype) to each timing."""
    def key(r):
        return r["kind"], tuple(r["config"]), r["dtype"], r.get("mask", "none")

    torch_records = {key(r): r for r in records if r["impl"] == "torch" and r["status"] == "ok"}
    for record in records:
        reference = torch_records.get(key(record))
        for mode in MODES:
            if record[mode] is None:
                continue
            peak = peaks.get(record["dtype"])
            record[mode]["percent_peak"] = 100.0 * record[mode]["gflops"] / peak if peak else None
            record[mode]["ratio_torch"] = (
                record[mode]["median_ms"] / reference[mode]["median_ms"]
                if reference is not None and reference[mode] is not None else None
            )


def run_benchmark(configs=DEFAULT_CONFIGS, dtypes=("float32", "float64"), kinds=None,
                  impls=None, masks=MASKS, repeats=7, warmup=1, pause=0.3,
                  round_seconds=ROUND_SECONDS, memory=True, memory_kinds=KINDS,
                  memory_configs=None, import_repeats=7, tiled_memory=True, training=True,
                  training_dtypes=None, gemm_size=GEMM_SIZE, quick=False, torch_threads=None,
                  progress=print_progress):
    """Run the whole benchmark and return the report (a JSON-ready dict).

    Parameters
    ----------
    configs : sequence of Config
    dtypes : sequence of dtype names
    kinds : sequence of {"layer", "core"}, optional
    impls : sequence of implementation names (see :data:`IMPLEMENTATIONS`), optional
        Default: each protocol's own (:func:`plan_cases`).
    masks : sequence of {"none", "causal"}
    repeats, warmup : int
        Timed and untimed rounds per workload and mode.
    pause : float
        Seconds slept when switching from one implementation (or process) to the next.
    round_seconds : float
        Shortest round of the one-library-per-process protocol.
    memory : bool
        Measure peak memory in fresh processes (configurations timed in this
        process, without a mask).
    memory_kinds : sequence of {"layer", "core"}
        Workloads whose memory is measured (with ``memory``).
    memory_configs : sequence of Config, optional
        Configurations whose memory is measured (default: those timed in this process).
    import_repeats : int
        Fresh interpreters per module for the import cost; 0 skips it.
    tiled_memory : bool
        Also measure the tiled core at :data:`TILED_MEMORY_SHAPE` (with ``memory``).
    training : bool
        Time the training steps (:mod:`workloads.training`), in ``training_dtypes``
        (default ``dtypes``).
    gemm_size : int
        Size of the square matrices whose product measures the GEMM peak.
    quick : bool
        The reduced defaults of ``--quick`` (:func:`plan_cases`).
    torch_threads : int, optional
        PyTorch's thread count (``torch.set_num_threads``), in every process;
        default: PyTorch's own default, as users get it.
    progress : callable or None
        Receives one line of text per step.

    Returns
    -------
    dict
        ``environment``, ``gemm_peak_gflops`` (per dtype), ``import_time``,
        ``records`` (one per protocol, kind, config, dtype, mask and
        implementation), ``training`` (one per task and dtype),
        ``tiled_memory``, ``settings``, ``attention_gemm_ceiling_gflops``
        (per dtype, :func:`measure_attention_gemm_ceiling`),
        ``gemm_one_thread_gflops`` (per dtype, the GEMM peak's product on
        one BLAS thread; empty when its count cannot be set),
        ``target_requirements`` (see :func:`target_requirements`),
        ``summary`` (the plain-language lines of :func:`reports.summary.summarize`).
    """
    progress = progress or (lambda message: None)
    configs = [check_config(c) for c in configs]
    dtypes = [check_dtype(d) for d in dtypes]
    for impl in impls or ():
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impls must be chosen from {IMPLEMENTATIONS}, got {impl!r}")
    for mask in masks:
        if mask not in MASKS:
            raise ValueError(f"masks must be chosen from {MASKS}, got {mask!r}")
    cases = plan_cases(configs, dtypes, masks, kinds, impls, quick)
    training_dtypes = [check_dtype(d) for d in (training_dtypes or dtypes)] if training else []
    started = time.perf_counter()
    if torch_threads:
        try:
            import_torch().set_num_threads(torch_threads)
        except ImplementationMissing:
            pass
    report = {"environment": environment_info(), "settings": {
        "configs": [list(c) for c in configs], "dtypes": [d.name for d in dtypes],
        "kinds": list(kinds or KINDS), "impls": sorted({i for c in cases for i in c.impls},
                                                      key=IMPLEMENTATIONS.index),
        "masks": list(masks), "repeats": repeats, "warmup": warmup, "pause_s": pause,
        "round_seconds": round_seconds, "process_max_length": PROCESS_MAX_LENGTH,
        "training_dtypes": [d.name for d in training_dtypes], "gemm_size": gemm_size,
        "quick": bool(quick), "torch_threads": torch_threads}}
    # NOTE: said once here; the cases do not repeat it (nor the report's tables)
    torch_missing = report["environment"]["torch"] is None
    if torch_missing and ("torch" in report["settings"]["impls"] or training_dtypes):
        progress(f"note: {TORCH_MISSING}: qkvnp is timed alone, the ratios to PyTorch are "
                 "left blank")
    progress(f"measuring the GEMM peak (numpy.matmul, n = {gemm_size})")
    # measured before and after the timings; the higher one is the peak (a
    # busy machine lowers it, nothing raises it)
    peak_runs = {d.name: [measure_gemm_peak(d, gemm_size)] for d in dtypes}
    # the same product on one BLAS thread: how much the second core adds,
    # and the one-thread rate the one-thread ceilings (layer_ceiling.py,
    # RESULTS.md's tables) are to be read against; hosts differ in both
    one_thread_runs = {d.name: [measure_gemm_peak(d, gemm_size, blas=1)] for d in dtypes}
    ceiling_runs = {d.name: [measure_attention_gemm_ceiling(d)] for d in dtypes}
    report["import_time"] = None
    if import_repeats:
        progress(f"timing import numpy / import qkvnp in {2 * import_repeats} fresh processes")
        report["import_time"] = measure_import_time(import_repeats)

    records, training_records = [], []

    def run_cases(selected, pool=None):
        for case in selected:
            index = cases.index(case) + 1
            label = (f"[{index}/{len(cases)}] {case.kind} {tuple(case.config)} {case.dtype.name} "
                     f"{'causal' if case.mask == 'causal' else 'no mask'}")
            if case.protocol == "processes":
                progress(f"{label}: one process per implementation ({', '.join(case.impls)}), "
                         f"{repeats} alternating rounds")
                case_records = run_case_in_processes(
                    case.kind, case.config, case.dtype, case.impls, repeats, warmup, pause, pool,
                    case.mask, round_seconds, progress, torch_threads)
            else:
                progress(f"{label}: cross-check and {repeats} rounds x {len(MODES)} modes "
                         "in this process")
                case_records = run_case(case.kind, case.config, case.dtype, case.impls, repeats,
                                        warmup, pause, progress, case.mask)
            for record in case_records:
                if record["status"] != "ok" and record["reason"] != TORCH_MISSING:
                    progress(f"    {record['impl']}: {record['status']}: {record['reason']}")
            records.extend(case_records)

    with WorkerPool(CHILD_PATH) as pool:
        run_cases([c for c in cases if c.protocol == "processes"], pool)
        training_cases = [(task, d) for d in training_dtypes for task in TRAINING_TASKS]
        for index, (task, dtype) in enumerate(training_cases, 1):
            progress(f"training [{index}/{len(training_cases)}] {task} {dtype.name}: loss check, "
                     f"then {repeats} alternating rounds of steps, one process per library")
            record = run_training_case(task, dtype, pool, repeats, warmup, pause,
                                       max(round_seconds, 0.1), progress, torch_threads)
            if record["status"] != "ok" or record["reason"] not in (None, TORCH_MISSING):
                progress(f"    {record['status']}: {record['reason']}")
            elif record["torch"]:
                progress(f"    qkvnp {record['qkvnp']['steps_per_s']:.0f} steps/s, "
                         f"PyTorch {record['torch']['steps_per_s']:.0f} steps/s")
            elif record["qkvnp"]:
                progress(f"    qkvnp {record['qkvnp']['steps_per_s']:.0f} steps/s")
            training_records.append(record)
    # the workers have quit: no idle process beside the same-process timings
    run_cases([c for c in cases if c.protocol == "same process"])
    progress("measuring the GEMM peak again")
    for dtype in dtypes:
        peak_runs[dtype.name].append(measure_gemm_peak(dtype, gemm_size))
        one_thread_runs[dtype.name].append(measure_gemm_peak(dtype, gemm_size, blas=1))
        ceiling_runs[dtype.name].append(measure_attention_gemm_ceiling(dtype))
    report["gemm_peak_runs"] = peak_runs
    report["gemm_peak_gflops"] = peaks = {name: max(runs) for name, runs in peak_runs.items()}
    report["attention_gemm_ceiling_gflops"] = {name: max(runs) for name, runs in ceiling_runs.items()}
    report["gemm_one_thread_gflops"] = {name: max(runs) for name, runs in one_thread_runs.items()
                                        if None not in runs}
    _add_ratios(records, peaks)

    if memory:
        memory_configs = ({tuple(c) for c in configs if c.length > PROCESS_MAX_LENGTH}
                          if memory_configs is None else
                          {tuple(check_config(c)) for c in memory_configs})
        to_measure = [r for r in records if r["status"] == "ok" and r["kind"] in memory_kinds
                      and tuple(r["config"]) in memory_configs and r["mask"] == "none"
                      and r["timed"]]
        for index, record in enumerate(to_measure, 1):
            progress(f"memory [{index}/{len(to_measure)}] {record['kind']} "
                     f"{tuple(record['config'])} {record['dtype']} {record['impl']} (fresh process)")
            record["memory"] = measure_memory(record["kind"], record["impl"], record["config"],
                                              record["dtype"])
    report["tiled_memory"] = None
    if memory and tiled_memory and "tiled" in report["settings"]["impls"]:
        progress(f"memory: tiled core at (B, H, L, D) = {TILED_MEMORY_SHAPE} float32 (fresh process)")
        report["tiled_memory"] = measure_tiled_memory()
    report["records"] = records
    report["training"] = training_records
    report["target_requirements"] = target_requirements(report)
    report["summary"] = summarize(report)
    report["elapsed_s"] = time.perf_counter() - started
    return report
