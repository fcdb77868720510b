"""The median of several benchmark runs: ``python benchmarks/median.py a.json b.json c.json``.

Shape key: B batch, L sequence length, E embedding, H heads.

Each file is the JSON report of one run of ``python benchmarks/run.py --json
PATH``. For every ratio a user compares, this takes the median over the runs
and lists each run's value, so that the spread shows:

- MultiHeadAttention forward+backward, qkvnp's default path time / PyTorch's,
  per configuration, dtype and mask (:func:`reports.summary.default_path_ratios`);
- training steps per second, qkvnp's / PyTorch's, per task and dtype;
- peak memory (RSS) of one forward+backward at the longest L measured,
  qkvnp's default path / PyTorch's (:func:`reports.summary.peak_memory`);
- ``import qkvnp`` / ``import numpy`` in fresh interpreters.

It then builds a report in the schema :mod:`reports.summary` reads, every number in
it the median over the runs, and prints :func:`reports.summary.ratio_table` and
:func:`reports.summary.summarize` of it: the command's own sentences, from the medians
(``--json`` writes that report, ``--plot`` draws :func:`reports.summary.plot_ratios`).
A ratio there is the median of the runs' ratios, and each absolute number
(steps/s, MiB) the median of its own values: they need not divide exactly.

NOTE: of an even number of runs, the median is the geometric mean of the two
middle values, so that the median of qkvnp / PyTorch is the inverse of the
median of PyTorch / qkvnp (the summary's means are geometric too).

NOTE: every run must hold the same measurements. One missing from some runs
(other options, PyTorch absent, an implementation refused) is refused, naming
what each file lacks, rather than given as a median of fewer runs.

>>> median([3.0, 1.0, 2.0])
2.0
>>> median([1.0, 4.0, 9.0, 100.0])  # sqrt(4 * 9)
6.0
"""
import argparse
import math
import os
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

# after the checkout is on sys.path: its qkvnp writes the JSON file
from benchmarks.reports.report import read_json, write_json  # noqa: E402
from benchmarks.reports.summary import (default_path_ratios, peak_memory,  # noqa: E402
                                        plot_ratios, ratio_table, summarize)

__all__ = ["median", "load_report", "measurements", "combine", "median_report", "format_medians",
           "main"]

#: The ratios a user compares, each under its heading.
HEADINGS = {
    "layer": "MultiHeadAttention forward+backward, qkvnp's default path time / PyTorch's "
             "(below 1: qkvnp is faster)",
    "training": "Training steps per second, qkvnp's / PyTorch's (above 1: qkvnp is faster)",
    "memory": "Peak memory of one forward+backward at the longest L, qkvnp's default path / "
              "PyTorch's (below 1: qkvnp uses less)",
    "import": "Import time in fresh interpreters, qkvnp's / numpy's",
}
IMPORT = ("import", "import qkvnp / import numpy")
#: What each kind of key is, in the messages.
KINDS = {"layer": "layer", "training": "training", "memory": "memory ratio",
         "import": "import time", "steps": "steps/s", "rss": "peak memory"}


def median(values):
    """The median of non-negative numbers; of an even count, the geometric mean of the middle two."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return math.sqrt(ordered[middle - 1] * ordered[middle])


def load_report(path):
    """Read the report of one ``run.py --json`` run; ValueError naming ``path`` if it is not one."""
    try:
        report = read_json(path)
    except ValueError as error:  # json.JSONDecodeError
        raise ValueError(f"{path} is not a benchmark report: not JSON ({error})") from None
    missing = [key for key in ("environment", "settings", "records")
               if not isinstance(report, dict) or key not in report]
    if missing or not isinstance(report["records"], list):
        raise ValueError(f"{path} is not a report of python benchmarks/run.py --json: it has no "
                         + ", ".join(repr(key) for key in missing or ["list of 'records'"]))
    return report


def measurements(report):
    """``{key: value}``: every number of ``report`` that the medians are taken of.

    Keys: ``("layer", config, dtype, mask)`` (time ratio), ``("training", task,
    dtype)`` (steps/s ratio), ``("memory", config, dtype)`` (RSS ratio, longest
    L), :data:`IMPORT`; and the numbers the summary also prints:
    ``("steps", task, dtype, library)``, ``("rss", config, dtype, impl)``.
    """
    values = {("layer",) + row[:3]: row[3] for row in default_path_ratios(report)}
    for t in report.get("training") or []:
        if t.get("status") == "ok" and t.get("qkvnp"):
            values["steps", t["task"], t["dtype"], "qkvnp"] = t["qkvnp"]["steps_per_s"]
            if t.get("torch"):
                values["steps", t["task"], t["dtype"], "torch"] = t["torch"]["steps_per_s"]
                values["training", t["task"], t["dtype"]] = t["speedup"]
    memory = peak_memory(report)
    longest = max((config[1] for config, _ in memory), default=None)
    for (config, dtype), mib in memory.items():
        values["rss", config, dtype, "auto"], values["rss", config, dtype, "torch"] = (
            mib["auto"], mib["torch"])
        if config[1] == longest and mib["torch"] > 0:
            values["memory", config, dtype] = mib["auto"] / mib["torch"]
    if report.get("import_time"):
        values[IMPORT] = report["import_time"]["ratio"]
    return values


def _label(key, kind=False):
    """``key`` in words, its kind first if asked: "(1, 6, 3, 1) float32 causal"."""
    words = [str(part) for part in key[1:] if part != "none"]
    return " ".join(([KINDS[key[0]]] if kind else []) + words)


def combine(reports, paths):
    """``{key: [value of each run]}`` in the first run's order; ValueError if the runs differ."""
    per_run = [measurements(report) for report in reports]
    keys = list(dict.fromkeys(key for values in per_run for key in values))
    lacking = []
    for path, values in zip(paths, per_run):
        missing = [_label(key, kind=True) for key in keys if key not in values]
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4
                                              else "")
            lacking.append(f"{path} lacks {shown}")
    if lacking:
        raise ValueError("the runs did not measure the same things (run the same command each "
                         "time): " + "; ".join(lacking))
    return {key: [values[key] for values in per_run] for key in keys}


def median_report(reports, paths, runs):
    """A report in the schema :mod:`reports.summary` reads, each number the median of ``runs``."""
    flops = {row[:3]: row[4] for row in default_path_ratios(reports[0])}
    records, training, medians = {}, {}, []

    def record(config, dtype, mask, impl):
        return records.setdefault((config, dtype, mask, impl), {
            "kind": "layer", "config": list(config), "dtype": dtype, "mask": mask, "impl": impl,
            "status": "ok", "fwd_bwd": None, "memory": None})

    for key, values in runs.items():
        kind, value = key[0], median(values)
        if kind in HEADINGS:
            medians.append({"kind": kind, "measurement": _label(key), "median": value,
                            "runs": values})
        if kind == "layer":
            record(*key[1:], "auto")["fwd_bwd"] = {"ratio_torch": value, "flops": flops[key[1:]]}
        elif kind == "rss":
            record(key[1], key[2], "none", key[3])["memory"] = {"rss_mib": value}
        elif kind in ("steps", "training"):
            task = training.setdefault(key[1:3], {"task": key[1], "dtype": key[2], "status": "ok",
                                                  "reason": None, "qkvnp": None, "torch": None,
                                                  "speedup": None})
            if kind == "steps":
                task[key[3]] = {"steps_per_s": value}
            else:
                task["speedup"] = value
    report = {"median_of": len(reports), "runs": [
        {"path": os.fspath(path), "date_utc": r["environment"].get("date_utc"),
         "commit": r["environment"].get("commit")} for path, r in zip(paths, reports)],
        "medians": medians, "records": list(records.values()),
        "training": list(training.values()),
        "import_time": {"ratio": median(runs[IMPORT])} if IMPORT in runs else None}
    report["summary"] = summarize(report)
    return report


def _ratio(value):
    return format(value, ".2f" if value >= 0.1 else ".2g")


def format_medians(report):
    """What the command prints: the runs, each median with its runs' values, table, summary."""
    runs = report["runs"]
    lines = [f"Median of {len(runs)} runs of python benchmarks/run.py:"]
    for number, run in enumerate(runs, 1):
        lines.append(f"  run {number}: {run['path']}, started {run['date_utc'] or '?'} UTC"
                     + (f", commit {run['commit']}" if run["commit"] else ""))
    if len({run["commit"] for run in runs if run["commit"]}) > 1:
        lines.append("  note: the runs measured different commits of qkvnp")
    for kind, heading in HEADINGS.items():
        rows = [m for m in report["medians"] if m["kind"] == kind]
        if rows:
            lines += ["", heading + ": the median, then each run's value"]
        for m in rows:
            lines.append(f"  {m['measurement']:<36}{_ratio(m['median']):>7}   "
                         + "".join(f"{_ratio(value):>8}" for value in m["runs"]))
    table = ratio_table(report)
    if table:
        lines += ["", f"Median over {len(runs)} runs: {table[0]}"] + table[1:]
    return "\n".join(lines + ["", f"Summary (medians of {len(runs)} runs)"] + report["summary"])


def main(argv=None):
    """``python benchmarks/median.py REPORT.json ...``: print the medians; return the exit status."""
    parser = argparse.ArgumentParser(prog="benchmarks/median.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="REPORT.json",
                        help="the JSON files of runs of python benchmarks/run.py --json")
    parser.add_argument("--json", metavar="PATH",
                        help="write the medians, each run's values and the summary, atomically")
    parser.add_argument("--plot", metavar="PATH",
                        help="the median ratios against the work size (needs matplotlib)")
    args = parser.parse_args(argv)
    real = [os.path.realpath(path) for path in args.reports]
    twice = [path for number, path in enumerate(args.reports) if real[number] in real[:number]]
    if twice:  # the same run twice would pass for two runs that agree
        parser.error(f"{twice[0]} is given twice: each file must be a different run")
    try:
        reports = [load_report(path) for path in args.reports]
        report = median_report(reports, args.reports, combine(reports, args.reports))
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(format_medians(report))
    if args.json:
        write_json(args.json, report)
        print(f"medians written to {args.json}")
    if args.plot and plot_ratios(report, args.plot):
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
