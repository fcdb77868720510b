"""What a run prints and writes: the report's text, its JSON file, the time and memory plot.

Shape key: B batch, L sequence length, E embedding, H heads.

:func:`format_report` turns the report of :func:`harness.bench.run_benchmark` into
the text the command prints: the machine, the peaks, the import cost, one
table per protocol and workload, the training steps, then the ratio table
and the plain sentences of :mod:`reports.summary`. With ``--targets``, the check of
the project's earlier speed and memory targets (:func:`target_lines`) and
what each speed target asks of the GEMM peak (:func:`target_requirements`).
:func:`write_json` writes the report atomically and reads it back;
:func:`plot_results` draws the time and memory of every implementation
against L (``--plot-times``).
"""
import json
import os

import numpy as np

from benchmarks.harness.machine import CEILING_HEAD_DIM, CEILING_LENGTH
from benchmarks.harness.memory import TILED_MEMORY_SHAPE
from benchmarks.harness.timing import ROUND_SECONDS, format_ms
from benchmarks.reports.summary import import_pyplot, ratio_table, save_figure, summarize
from benchmarks.workloads.attention import TORCH_MISSING
from benchmarks.workloads.grid import (DEFAULT_CONFIGS, FLOPS, KINDS, ORACLE, PROCESS_MAX_LENGTH,
                                       Config)
from qkvnp._io import atomic_write  # the package's one atomic write (shared helper module)

__all__ = ["target_lines", "target_requirements", "format_report", "write_json", "read_json",
           "plot_results"]

def _fmt(value, spec, width):
    return format("-" if value is None else format(value, spec), f">{width}")


def _mode_cells(stats):
    if stats is None:
        return [_fmt(None, "", w) for w in (8, 7, 7, 6, 5)]
    return [format(format_ms(stats["median_ms"]), ">8"),
            format(format_ms(stats["q3_ms"] - stats["q1_ms"]), ">7"),
            _fmt(stats.get("ratio_torch"), ".2f", 7),
            _fmt(stats["gflops"], ".0f", 6),
            _fmt(stats["percent_peak"], ".0f", 5)]


def _verdict(ok):
    return "ok" if ok else "MISSED"


def _ceiling_note(report, dtype):
    """`` (BLAS on attention shapes: N%)`` for ``dtype``, or "" if not measured."""
    ceiling = (report.get("attention_gemm_ceiling_gflops") or {}).get(dtype)
    peak = (report.get("gemm_peak_gflops") or {}).get(dtype)
    return f" (BLAS on attention shapes: {100 * ceiling / peak:.0f}%)" if ceiling and peak else ""


def target_lines(report):
    """Lines comparing the measured ratios with the project's targets."""
    lines = []
    records = [r for r in report["records"] if r["status"] == "ok"]
    qkvnp_impls = [i for i in report["settings"]["impls"] if i not in ("torch", ORACLE)]

    def ratios(kind, impl, min_length=0):
        return [(tuple(r["config"]), r["dtype"], r["fwd_bwd"]["ratio_torch"]) for r in records
                if r["kind"] == kind and r["impl"] == impl and r["config"][1] >= min_length
                and r["fwd_bwd"] and r["fwd_bwd"].get("ratio_torch") is not None]

    for kind, limit, min_length, label in (
            ("layer", 0.8, 0, "layer fwd+bwd <= 0.8x nn.MultiheadAttention"),
            ("core", 1.0, 512, "core fwd+bwd <= 1.0x scaled_dot_product_attention, L >= 512")):
        for impl in qkvnp_impls:
            found = ratios(kind, impl, min_length)
            if found:
                worst = max(found, key=lambda item: item[2])
                lines.append(f"  {label}: {impl} worst {worst[2]:.2f} at {worst[0]} {worst[1]} "
                             f"({sum(r <= limit for _, _, r in found)}/{len(found)} within) "
                             f"{_verdict(worst[2] <= limit)}")
    for impl in qkvnp_impls:
        found = [(tuple(r["config"]), r["dtype"], r["fwd_bwd"]["percent_peak"]) for r in records
                 if r["kind"] == "layer" and r["impl"] == impl and r["config"][1] >= 512
                 and r["fwd_bwd"] and r["fwd_bwd"]["percent_peak"] is not None]
        if found:
            worst = min(found, key=lambda item: item[2])
            lines.append(f"  layer fwd+bwd >= 75% of GEMM peak, L >= 512: {impl} lowest "
                         f"{worst[2]:.0f}% at {worst[0]} {worst[1]} {_verdict(worst[2] >= 75)}"
                         + _ceiling_note(report, worst[1]))
    memory = {(r["impl"], tuple(r["config"]), r["dtype"]): r["memory"] for r in records
              if r["kind"] == "layer" and r["memory"] and "rss_mib" in r["memory"]}
    for (impl, config, dtype), measured in sorted(memory.items()):
        torch_memory = memory.get(("torch", config, dtype))
        if impl in qkvnp_impls and config == tuple(DEFAULT_CONFIGS[-1]) and torch_memory:
            lines.append(f"  layer memory <= nn.MultiheadAttention at {config} {dtype}: {impl} "
                         f"{measured['rss_mib']:.0f} MiB vs {torch_memory['rss_mib']:.0f} MiB "
                         f"{_verdict(measured['rss_mib'] <= torch_memory['rss_mib'])}")
    tiled = report.get("tiled_memory")
    if tiled and "beyond_outputs_mib" in tiled:
        lines.append(f"  tiled core {TILED_MEMORY_SHAPE} float32 fwd+bwd: "
                     f"{tiled['beyond_outputs_mib']:.1f} MiB beyond outputs and gradients "
                     f"({tiled['method']}; limit {tiled['limit_mib']} MiB) "
                     f"{_verdict(tiled['beyond_outputs_mib'] <= tiled['limit_mib'])}")
    elif tiled:
        lines.append(f"  tiled core {TILED_MEMORY_SHAPE} memory: {tiled['error']}")
    imports = report.get("import_time")
    if imports:
        lines.append(f"  import qkvnp <= 1.25x import numpy: {imports['ratio']:.2f} "
                     f"{_verdict(imports['ratio'] <= 1.25)}")
    return lines


def target_requirements(report, kinds_limits=(("layer", 0.8), ("core", 1.0))):
    """What each speed target asks of the machine: the share of the GEMM peak it needs.

    For every configuration that PyTorch ran, the target time is ``limit x``
    PyTorch's forward+backward median. The matmul FLOPs of that workload
    (:func:`layer_flops`, :func:`core_flops`), run at the GEMM peak measured in
    the same run with nothing else costing time, give a floor no
    implementation that does these matmuls can go below on this machine. The
    share of the peak the target needs is ``floor / target``: above 100% the
    target is out of reach for any such implementation, above the rate the
    BLAS reaches on the workload's own matmul shapes it is out of reach for
    one built on BLAS calls.

    Returns
    -------
    list of dict
        ``kind, config, dtype, limit, torch_ms, target_ms, floor_ms, needed_percent``
        and ``ceiling_percent`` (the attention-shape ceiling as a share of the
        peak, None if not measured).
    """
    peaks = report.get("gemm_peak_gflops") or {}
    ceilings = report.get("attention_gemm_ceiling_gflops") or {}
    limits = dict(kinds_limits)
    rows = []
    for r in report["records"]:
        if (r["impl"] != "torch" or r["status"] != "ok" or r["kind"] not in limits
                or r.get("mask", "none") != "none"
                or not r.get("fwd_bwd") or not peaks.get(r["dtype"])):
            continue
        config = Config(*r["config"])
        if r["kind"] == "core" and config.length < 512:
            continue  # the core target starts at L = 512
        torch_ms = r["fwd_bwd"]["median_ms"]
        target_ms = limits[r["kind"]] * torch_ms
        floor_ms = FLOPS[r["kind"]](config, backward=True) / (peaks[r["dtype"]] * 1e6)
        rows.append({"kind": r["kind"], "config": tuple(config), "dtype": r["dtype"],
                     "limit": limits[r["kind"]], "torch_ms": torch_ms, "target_ms": target_ms,
                     "floor_ms": floor_ms, "needed_percent": 100.0 * floor_ms / target_ms,
                     "ceiling_percent": (100.0 * ceilings[r["dtype"]] / peaks[r["dtype"]]
                                         if ceilings.get(r["dtype"]) else None)})
    return rows


def format_report(report):
    """The human-readable report: environment, peaks, import cost, tables, targets."""
    env = report["environment"]
    quick = " (--quick: a reduced set)" if report["settings"].get("quick") else ""
    lines = [f"qkvnp bench{quick}, {env['date_utc']} UTC, {report.get('elapsed_s', 0):.0f} s",
             f"machine: {env['cpu']}, {env['cores_usable']} usable cores; {env['platform']}",
             f"versions: python {env['python']}, numpy {env['numpy']}, scipy {env['scipy']}, "
             f"qkvnp {env['qkvnp']}" + (f" ({env['commit']})" if env.get("commit") else "")
             + f", torch {env['torch'] or 'not installed'}"]
    blas = env["openblas"]
    blas_text = (f"{blas['library']}, core {blas['corename']}, {blas['threads']} threads "
                 f"({blas['config']})" if blas else "runtime not identified")
    lines.append(f"numpy BLAS: {env['blas_build'] or '?'}; {blas_text}")
    lines.append("env: " + ", ".join(f"{k}={v if v is not None else '(unset)'}"
                                     for k, v in env["env"].items()))
    lines.append(f"qkvnp threads: {env.get('qkvnp_threads', '?')} (qkvnp.get_num_threads(); "
                 "QKVNP_NUM_THREADS sets it)")
    chosen = report["settings"].get("torch_threads")
    lines.append(f"torch threads: {env['torch_threads'] if env['torch'] else '-'} "
                 f"({'set by --torch-threads' if chosen else 'its default'})")
    load = env.get("load_average")
    if load:
        lines.append(f"load average at the start (1, 5, 15 min): {load[0]:.2f}, {load[1]:.2f}, "
                     f"{load[2]:.2f}" + (" -- the machine was busy: the times are not those of "
                                         "an idle machine" if load[0] > 0.5 else ""))
    peaks = report["gemm_peak_gflops"]
    lines.append(f"GEMM peak (numpy.matmul, n = {report['settings']['gemm_size']}, best of 5, "
                 "before and after the timings): "
                 + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in peaks.items()))
    one_thread = report.get("gemm_one_thread_gflops")
    if one_thread:
        lines.append("GEMM on one BLAS thread (same products): "
                     + ", ".join(f"{d} {g:.1f} GFLOP/s (numpy's threads give {peaks[d] / g:.2f}x it)"
                                 for d, g in one_thread.items() if peaks.get(d) and g))
    ceilings = report.get("attention_gemm_ceiling_gflops")
    if ceilings:
        lines.append(f"BLAS on attention shapes (one ({CEILING_LENGTH}, {CEILING_HEAD_DIM}) head per "
                     "thread, in cache, the core's three matmul shapes, best of 5): "
                     + ", ".join(f"{d} {g:.1f} GFLOP/s ({100 * g / peaks[d]:.0f}% of peak)"
                                 for d, g in ceilings.items() if peaks.get(d)))
    imports = report.get("import_time")
    if imports:
        extra = ", ".join(imports["extra_modules"]) or "none outside the standard library"
        lines.append(f"import time (fresh processes, cached bytecode, median of "
                     f"{imports['repeats']}): numpy "
                     f"{imports['numpy_ms']:.1f} ms, qkvnp {imports['qkvnp_ms']:.1f} ms, "
                     f"ratio {imports['ratio']:.2f} (of the minima: "
                     f"{imports['qkvnp_min_ms'] / imports['numpy_min_ms']:.2f}); "
                     f"loaded beyond numpy's: {extra}")
    settings = report["settings"]
    lines.append(f"timing, L <= {settings.get('process_max_length', PROCESS_MAX_LENGTH)}: each "
                 "implementation in a process of its own, rounds alternating between the "
                 f"processes, each round at least {settings.get('round_seconds', ROUND_SECONDS)} s "
                 f"of calls, median of {settings['repeats']} rounds after {settings['warmup']} "
                 f"warm-up, {settings['pause_s']} s pause between processes")
    lines.append(f"timing, longer: one process, median of {settings['repeats']} interleaved rounds "
                 f"after {settings['warmup']} warm-up, {settings['pause_s']} s pause between "
                 "implementations; IQR = interquartile range; x torch = median / PyTorch's median")
    memory_method = {r["memory"].get("method") for r in report["records"]
                     if r["memory"] and "method" in r["memory"]}
    lines.append("memory: peak extra RSS of one fwd+bwd in a fresh process "
                 f"({', '.join(sorted(memory_method)) or 'not measured'}); check: largest "
                 "relative error against the reference path (the oracle)")

    # NOTE: without PyTorch, one line says so instead of a MISSING row per case
    shown = [r for r in report["records"] if not _torch_missing(r)]
    if len(shown) < len(report["records"]):
        lines.append(f"torch: {TORCH_MISSING}; qkvnp is timed alone, the PyTorch rows are "
                     "left out and the ratios blank")
    in_processes = [r for r in shown if r.get("protocol") == "processes"]
    same_process = [r for r in shown if r.get("protocol") != "processes"]
    header = (f"{'config (B,L,E,H)':<19}{'dtype':<8}{'mask':<7}{'impl':<10}"
              f"{'f+b us':>9}{'IQR':>8}{'calls':>7}{'xtorch':>7}{'check':>8}  path")
    titles = {"layer": "MultiHeadAttention layer, forward+backward, one process per "
                       "implementation (PyTorch: nn.MultiheadAttention, need_weights=False)",
              "core": "attention core on (B, H, L, D), forward+backward, one process per "
                      "implementation (PyTorch: scaled_dot_product_attention)"}
    for kind in KINDS:
        rows = [r for r in in_processes if r["kind"] == kind]
        if not rows:
            continue
        lines += ["", titles[kind] + "; microseconds a call, calls = calls per round",
                  header, "-" * len(header)]
        for r in rows:
            label = _row_label(r)
            if r["status"] != "ok":
                lines.append(f"{label}{r['status'].upper()}: {r['reason']}")
                continue
            stats = r["fwd_bwd"]
            error = r["check"]["max_rel_err"] if r["check"] else None
            path = (r.get("dispatch") or {}).get("path", "")
            lines.append(label + format(format_ms(1e3 * stats["median_ms"]), ">9")
                         + format(format_ms(1e3 * (stats["q3_ms"] - stats["q1_ms"])), ">8")
                         + format(stats.get("calls_per_round", 1), ">7")
                         + _fmt(stats.get("ratio_torch"), ".2f", 7) + _fmt(error, ".0e", 8)
                         + f"  {path}".rstrip())

    header = (f"{'config (B,L,E,H)':<19}{'dtype':<8}{'mask':<7}{'impl':<10}"
              f"{'fwd ms':>8}{'IQR':>7}{'xtorch':>7}{'GF/s':>6}{'%pk':>5} |"
              f"{'f+b ms':>8}{'IQR':>7}{'xtorch':>7}{'GF/s':>6}{'%pk':>5} |{'MiB':>6}{'check':>8}")
    titles = {"layer": "MultiHeadAttention layer, in one process (PyTorch: nn.MultiheadAttention, "
                       "need_weights=False)",
              "core": "attention core on (B, H, L, D), in one process (PyTorch: "
                      "scaled_dot_product_attention)"}
    for kind in KINDS:
        rows = [r for r in same_process if r["kind"] == kind]
        if not rows:
            continue
        lines += ["", titles[kind], header, "-" * len(header)]
        for r in rows:
            label = _row_label(r)
            if r["status"] != "ok":
                lines.append(f"{label}{r['status'].upper()}: {r['reason']}")
                continue
            memory = r["memory"]
            mib = (_fmt(memory["rss_mib"], ".0f", 6) if memory and "rss_mib" in memory
                   else _fmt(None, "", 6))
            error = r["check"]["max_rel_err"] if r["check"] else None
            check = "oracle" if r["impl"] == ORACLE else _fmt(error, ".0e", 8)
            lines.append(label + "".join(_mode_cells(r["fwd"])) + " |"
                         + "".join(_mode_cells(r["fwd_bwd"])) + " |" + mib + format(check, ">8"))

    training = report.get("training") or []
    if training:
        header = (f"{'task':<11}{'dtype':<9}{'qkvnp ms':>9}{'steps/s':>9}{'torch ms':>10}"
                  f"{'steps/s':>9}{'qkvnp/torch':>13}{'losses':>9}")
        lines += ["", "training step (zero_grad, forward, loss, backward, Adam step), one process "
                  "per library, ms a step; losses: largest relative difference of the first "
                  "steps' losses", header, "-" * len(header)]
        for t in training:
            label = f"{t['task']:<11}{t['dtype']:<9}"
            if t["status"] != "ok":
                lines.append(f"{label}{t['status'].upper()}: {t['reason']}")
                continue
            cells = []
            for library in ("qkvnp", "torch"):
                stats = t.get(library)
                cells += [_fmt(stats and stats["step_ms"], ".3f", 9 if library == "qkvnp" else 10),
                          _fmt(stats and stats["steps_per_s"], ".0f", 9)]
            error = (t.get("check") or {}).get("max_rel_err")
            lines.append(label + "".join(cells) + _fmt(t.get("speedup"), ".2f", 13)
                         + _fmt(error, ".0e", 9))

    table = ratio_table(report)
    if table:
        lines += [""] + table
    if report.get("show_targets"):
        targets = target_lines(report)
        if targets:
            lines += ["", "developers' targets (--targets; the project's speed and memory "
                      "targets of an earlier round):"] + targets
        needs = target_requirements(report)
        if needs:
            lines += ["", "what those speed targets ask of this machine (fwd+bwd; floor = the "
                      "matmul FLOPs at the GEMM peak above, nothing else costing time):"]
            for n in needs:
                lines.append(f"  {n['kind']:<6}{str(n['config']):<20}"
                             f"{n['dtype']:<8} target {n['limit']:.1f} x "
                             f"{format_ms(n['torch_ms'])} = {format_ms(n['target_ms'])} ms, "
                             f"floor {format_ms(n['floor_ms'])} ms: needs "
                             f"{n['needed_percent']:.0f}% of peak" + _ceiling_note(report, n["dtype"]))
    summary = report.get("summary")
    if summary is None:
        summary = summarize(report)
    if summary:
        lines += ["", "Summary"] + summary
    problems = [r for r in report["records"] if r["status"] in ("refused", "error")]
    problems += [t for t in training if t["status"] in ("refused", "error")]
    if problems:
        lines += ["", f"{len(problems)} run(s) refused or failed: see above"]
    return "\n".join(lines)


def write_json(path, report):
    """Write ``report`` to ``path`` atomically (temp file, fsync, rename), then read it back."""
    path = os.fspath(path)
    with atomic_write(path, "w") as stream:
        json.dump(report, stream, indent=1, allow_nan=False, default=_json_default)
    return read_json(path)


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def read_json(path):
    """Read a report written by :func:`write_json` (plain JSON, no pickle)."""
    with open(path) as stream:
        return json.load(stream)


def _torch_missing(record):
    """Whether ``record`` is PyTorch's, not run because PyTorch is not installed."""
    return (record["impl"] == "torch" and record["status"] == "missing"
            and record.get("reason") == TORCH_MISSING)


def _row_label(record):
    """The config, dtype, mask and impl columns of one report row."""
    config = "(" + ",".join(map(str, record["config"])) + ")"
    return f"{config:<19}{record['dtype']:<8}{record.get('mask', 'none'):<7}{record['impl']:<10}"


def plot_results(report, path):
    """Draw fwd+bwd time and peak memory against L (matplotlib, optional).

    Returns False, after saying how to install matplotlib, when it is missing.
    """
    plt = import_pyplot()
    if plt is None:
        return False
    records = [r for r in report["records"] if r["status"] == "ok" and r.get("mask", "none") == "none"]
    kinds = [k for k in KINDS if any(r["kind"] == k for r in records)]
    figure, axes = plt.subplots(len(kinds) or 1, 2, figsize=(12, 4.5 * max(len(kinds), 1)),
                                squeeze=False)
    for row, kind in zip(axes, kinds):
        series = {}
        for r in records:
            if r["kind"] == kind:
                series.setdefault((r["impl"], r["dtype"]), []).append(r)
        for (impl, dtype), points in sorted(series.items()):
            points.sort(key=lambda r: r["config"][1])
            lengths = [r["config"][1] for r in points]
            style = "-" if dtype == "float32" else "--"
            row[0].plot(lengths, [r["fwd_bwd"]["median_ms"] for r in points], style, marker="o",
                        label=f"{impl} {dtype}")
            memory = [(r["config"][1], r["memory"]["rss_mib"]) for r in points
                      if r["memory"] and "rss_mib" in r["memory"]]
            if memory:
                row[1].plot(*zip(*memory), style, marker="o", label=f"{impl} {dtype}")
        row[0].set(title=f"{kind}: forward+backward time", xlabel="L", ylabel="ms",
                   xscale="log", yscale="log")
        row[1].set(title=f"{kind}: peak extra memory (RSS)", xlabel="L", ylabel="MiB",
                   xscale="log", yscale="log")
        if not row[1].lines:
            row[1].text(0.5, 0.5, "memory not measured (--no-memory)", ha="center",
                        va="center", transform=row[1].transAxes)
        for axis in row:
            if axis.lines:
                axis.legend(fontsize="small")
    return save_figure(figure, plt, path)
