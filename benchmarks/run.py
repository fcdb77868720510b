"""Time qkvnp's attention paths against PyTorch on this CPU, forward and backward.

Run from a checkout: ``python benchmarks/run.py [options]`` (``--help``
lists them; ``README.md`` beside this file says what is measured and how,
``RESULTS.md`` holds the results). The harness is not part of the installed
package. The qkvnp measured is the one of this checkout, installed or not:
its root goes first on ``sys.path``.

This module is the command line only: :func:`main` parses the options and
:func:`run` turns them into one :func:`harness.bench.run_benchmark` call, prints
:func:`reports.report.format_report` and writes the JSON file and the plots.
"""
import argparse
import os
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

# after the checkout is on sys.path: these import its qkvnp
from benchmarks.harness.bench import print_progress, run_benchmark  # noqa: E402
from benchmarks.harness.machine import GEMM_SIZE  # noqa: E402
from benchmarks.harness.memory import TILED_MEMORY_SHAPE  # noqa: E402
from benchmarks.harness.timing import ROUND_SECONDS  # noqa: E402
from benchmarks.reports.report import format_report, plot_results, write_json  # noqa: E402
from benchmarks.reports.summary import plot_ratios  # noqa: E402
from benchmarks.workloads.grid import (DEFAULT_CONFIGS, IMPLEMENTATIONS, KINDS,  # noqa: E402
                                       MASKS, OFF_GRID_CONFIGS, PROCESS_MAX_LENGTH,
                                       QUICK_CONFIGS, check_config, up_to_length)

__all__ = ["add_arguments", "run", "main"]


def _parse_config(text):
    try:
        return check_config(text.replace("(", "").replace(")", "").split(","), "--configs")
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (expected B,L,E,H such as 8,128,256,8)")


def _count(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value}")
    return value


def add_arguments(parser):
    """Add the ``bench`` options to an ``argparse`` parser."""
    presets = parser.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true",
                         help="reduced run, 2 to 4 minutes on a 2-core machine: configs %s, "
                              "float32, qkvnp's default path and PyTorch's layer only, the "
                              "training steps in float32, no import timing, memory of the "
                              "layers at the last config only"
                              % ", ".join(str(tuple(c)) for c in QUICK_CONFIGS))
    presets.add_argument("--off-grid", action="store_true",
                         help="sizes off the grid, about 5 minutes: configs %s (BERT-base, "
                              "GPT-2 small, lengths not powers of two), both dtypes and "
                              "masks, the layer on qkvnp's default path and PyTorch's only; "
                              "no training, memory or import timing"
                              % ", ".join(str(tuple(c)) for c in OFF_GRID_CONFIGS))
    parser.add_argument("--configs", nargs="+", type=_parse_config, metavar="B,L,E,H",
                        help="configurations (default: %s); those with L <= %d are timed "
                             "with each implementation in a process of its own"
                             % (" ".join(",".join(map(str, c)) for c in DEFAULT_CONFIGS),
                                PROCESS_MAX_LENGTH))
    parser.add_argument("--max-length", type=_count(1), metavar="L",
                        help="only the configurations above (the grid, --quick's, --off-grid's "
                             "or --configs) with L <= this: 128 keeps the small shapes, timed "
                             "one library per process, 512 the small and medium ones; the "
                             "tiled core's memory at L = %d is then left out"
                             % TILED_MEMORY_SHAPE[2])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "float64"),
                        help="dtypes (default: float32 float64)")
    parser.add_argument("--masks", nargs="+", choices=MASKS,
                        help="attention masks (default: none causal)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS,
                        help="workloads (default: the layer for L <= %d, both beyond)"
                             % PROCESS_MAX_LENGTH)
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS,
                        help="implementations (default: auto and torch for L <= %d, all "
                             "beyond; the reference path always runs as the cross-check's "
                             "oracle)" % PROCESS_MAX_LENGTH)
    parser.add_argument("--repeats", type=_count(1), help="timed rounds, median reported (default 7)")
    parser.add_argument("--warmup", type=_count(0), default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--pause", type=_seconds,
                        help="seconds slept before each call or round that follows another "
                             "implementation's, while idle BLAS/OpenMP threads stop spinning "
                             "(default 0.3, quick 0.15)")
    parser.add_argument("--round-time", type=_seconds,
                        help="shortest round, in seconds, when each implementation runs in a "
                             f"process of its own: enough calls to make it (default {ROUND_SECONDS}, "
                             "quick 0.02)")
    parser.add_argument("--torch-threads", type=_count(1),
                        help="PyTorch's thread count (default: PyTorch's own, as users get "
                             "it: 2 on a 2-core machine)")
    parser.add_argument("--no-training", action="store_true",
                        help="skip the training-step benchmark")
    parser.add_argument("--gemm-size", type=_count(16), default=GEMM_SIZE,
                        help="n of the n x n matmul that measures the GEMM peak "
                             f"(default {GEMM_SIZE})")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory measurements (fresh processes)")
    parser.add_argument("--import-repeats", type=_count(0),
                        help="fresh interpreters per module for the import cost (default 7, "
                             "quick 0: skipped)")
    parser.add_argument("--targets", action="store_true",
                        help="for qkvnp's developers: also print the check of the project's "
                             "earlier speed and memory targets, and the share of the GEMM peak "
                             "each speed target asks of this machine")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="draw qkvnp's time / PyTorch's against the work size, for the "
                             "default path over the whole grid (needs matplotlib)")
    parser.add_argument("--plot-times", metavar="PATH",
                        help="draw fwd+bwd time and memory of every implementation against L "
                             "(needs matplotlib)")


def _configs(args):
    """The configurations that ``args`` ask for: a preset's or ``--configs``, up to ``--max-length``."""
    configs = args.configs or (QUICK_CONFIGS if args.quick else
                               OFF_GRID_CONFIGS if args.off_grid else DEFAULT_CONFIGS)
    if args.max_length is not None:
        configs = up_to_length(configs, args.max_length)
    return configs


def run(args):
    """Run the benchmark described by parsed ``args``; return the exit status.

    0 when every available implementation agreed with the reference path
    (and the training losses agreed), 1 when one was refused or failed (its
    numbers are not reported).
    """
    quick, off_grid = args.quick, args.off_grid
    configs = _configs(args)
    dtypes = args.dtypes or (("float32",) if quick else ("float32", "float64"))
    pause = args.pause if args.pause is not None else 0.15 if quick else 0.3
    round_seconds = (args.round_time if args.round_time is not None
                     else 0.02 if quick else ROUND_SECONDS)
    repeats = args.repeats or 7
    import_repeats = (args.import_repeats if args.import_repeats is not None
                      else 0 if quick or off_grid else 7)
    if args.plot or args.plot_times:
        try:
            import matplotlib  # noqa: F401  (checked now, used at the end)
        except ImportError:
            print("note: --plot needs matplotlib, which is not installed: "
                  "pip install 'qkvnp[plot]'; the benchmark runs without the plot",
                  file=sys.stderr)
    if repeats < 7:
        print_progress(f"note: {repeats} rounds: fewer than 7, medians are rough")
    report = run_benchmark(
        configs=configs, dtypes=dtypes, kinds=args.kinds or (("layer",) if off_grid else None),
        impls=args.impls or (("auto", "torch") if off_grid else None),
        masks=args.masks or MASKS, repeats=repeats, warmup=args.warmup, pause=pause,
        round_seconds=round_seconds, memory=not (args.no_memory or off_grid),
        import_repeats=import_repeats,
        memory_kinds=("layer",) if quick else KINDS,
        memory_configs=configs[-1:] if quick else None,
        tiled_memory=not quick and (args.max_length is None
                                    or args.max_length >= TILED_MEMORY_SHAPE[2]),
        training=not (args.no_training or off_grid), gemm_size=args.gemm_size, quick=quick,
        torch_threads=args.torch_threads,
    )
    report["show_targets"] = bool(args.targets)
    print(format_report(report))
    if args.json:
        write_json(args.json, report)
        print(f"results written to {args.json}")
    if args.plot and plot_ratios(report, args.plot):
        print(f"plot written to {args.plot}")
    if args.plot_times and plot_results(report, args.plot_times):
        print(f"plot written to {args.plot_times}")
    failed = [r for r in report["records"] if r["status"] in ("refused", "error")]
    failed += [t for t in report["training"] if t["status"] in ("refused", "error")]
    return 1 if failed else 0


def main(argv=None):
    """``python benchmarks/run.py [options]``: parse ``argv``, run, return the exit status."""
    parser = argparse.ArgumentParser(prog="benchmarks/run.py",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not _configs(args):
        parser.error(f"--max-length {args.max_length} leaves no configuration (the shortest "
                     "asked for is longer)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
