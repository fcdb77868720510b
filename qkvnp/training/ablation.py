"""Why Q, K and V? Train kv-recall and partner with separate, tied and missing projections.

Shape key: P stored pairs, E model width (``dim``), K key vocabulary.

Learners of attention ask: "why do we need key, value and query; could I use
only one of them?". This command answers by experiment. The same
:class:`~qkvnp.training.models.KVRecallModel` is trained with four projection
variants:

``separate``  independent ``W_query``, ``W_key``, ``W_value`` (the standard layer)
``tied_qk``   one matrix for queries and keys (``Q = K``), its own ``W_value``
``no_value``  ``W_query`` and ``W_key``, but values are the tokens themselves
``shared``    one matrix for all three

on two tasks (:mod:`qkvnp.training.tasks`):

``kv-recall``  answer with the value stored under the query's own key. The
               relation "this item's key is mine" is symmetric, and tied
               ``Q = K`` learns it as well as separate projections do.
``partner``    answer with the value stored under the query key's partner
               (a fixed random pairing). With ``Q = K`` the score is a
               symmetric form ``x^T W W^T y``; for each pair of partners
               ``a, b`` the two margins "partner minus own" add up to
               ``-(a - b)^T W W^T (a - b) <= 0``, so one of the two queries
               prefers its own entry: tied ``Q = K`` (and ``shared``) can
               answer about half of the queries at most, at any width.
               Separate ``W_query``, ``W_key`` give a general bilinear form
               ``W_query W_key^T`` with no such limit.

Each (task, width, variant, seed) is :func:`qkvnp.training.loop.train` with
only ``task``, ``variant``, ``dim`` and ``seed`` changed. The command prints
one table per task (held-out accuracy: mean, spread, min and max over
seeds), for partner also where the query's attention goes (its own entry or
its partner's, :func:`partner_attention`), then a takeaway paragraph
computed from the numbers; ``--json`` and ``--plot`` write them to files.
Defaults: 3000 steps, seeds 0..2, widths 8, 16 (kv-recall) and 8, 16, 32
(partner), four variants: 60 runs of :func:`qkvnp.training.loop.train`;
``--quick`` (width 16, 2 seeds, 2000 steps) 16 runs.
``docs/derivations.md`` (section 13) gives the pair argument.

Examples
--------
>>> rows = run_ablation(variants=("separate", "shared"), seeds=1, dims=(4,), steps=2,
...                     base=dict(num_keys=8, num_values=8, num_pairs=4, eval_size=8),
...                     task="partner")
>>> [(row["task"], row["variant"], row["dim"], row["seed"]) for row in rows]
[('partner', 'separate', 4, 0), ('partner', 'shared', 4, 0)]
>>> table = summarize(rows)
>>> table[0]["runs"], table[0]["seeds"]
(1, [0])
"""
import json
import sys
import time

import numpy as np

from .._checks import check_int
from .._io import atomic_write, check_writable
from .ablation_report import (ATTENTION_FIELDS, format_attention, format_table, pair_example,
                              percent, plot_ablation, takeaway, to_json)

__all__ = [
    "ABLATION_TASKS",
    "AblationInterrupted",
    "ATTENTION_FIELDS",
    "DEFAULT_DIMS",
    "DEFAULT_STEPS",
    "QUICK",
    "run_ablation",
    "partner_attention",
    "summarize",
    "add_arguments",
    "run",
]

ABLATION_TASKS = ("kv-recall", "partner")
# NOTE: measured defaults. At the train command's width (64) every variant
# reaches 100% on kv-recall in 1000 steps, so that task is only interesting
# for narrow models; partner adds width 32, where separate is at 100% and
# tied Q=K has room to spare but still stops near the bound (about 50%).
# 3000 steps let every variant converge (at 1000 the table mixes capacity
# with learning speed).
DEFAULT_DIMS = {"kv-recall": (8, 16), "partner": (8, 16, 32)}
DEFAULT_STEPS = 3000
DEFAULT_SEEDS = 3
QUICK = {"dims": (16,), "seeds": 2, "steps": 2000}


# ---------------------------------------------------------------- runs


class AblationInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped :func:`run_ablation`; no partial run is among the rows.

    Attributes
    ----------
    rows : list of dict
        The finished runs' rows, as :func:`run_ablation` returns them.
    stopped : dict or None
        The run that was stopped and dropped: ``task, variant, dim, seed,
        steps`` (its planned steps), ``run`` (its 0-based index in this
        call) and, when it stopped at the end of a step, ``step`` (the steps
        it did); None if the signal came between two runs.
    signal : signal.Signals or None
        The signal (None: a plain ``KeyboardInterrupt``, Ctrl-C).
    """

    def __init__(self, rows, stopped, signal=None):
        super().__init__(stopped)
        self.rows, self.stopped, self.signal = list(rows), stopped, signal

def partner_attention(model, batch):
    """Where the query's attention goes on partner sequences: its own entry or its partner's.

    Parameters
    ----------
    model : KVRecallModel
    batch : PartnerBatch

    Returns
    -------
    dict
        ``prefers_own``: the share of sequences whose query weighs its own
        entry above its partner's. By the pair bound, with ``Q = K`` at
        least one query of each pair of partners does (on average over the
        values, which are drawn independently of the keys), so this stays
        at about one half or more; separate projections can bring it to 0.
        ``weight_own``, ``weight_partner``: the mean attention weight on
        the two entries. ``weight_gap``: the mean of ``|own - partner|``
        per sequence, which tells a query that splits its weight evenly
        between the two entries (near 0) from one that picks one of them
        (near 1) when the means alone look alike.
    """
    _, weights = model.forward(batch.keys, batch.values, batch.query,
                               return_weights=True)  # (B, V), (B, P)
    rows = np.arange(len(batch.query))
    own = weights[rows, batch.own]  # (B,)
    partner = weights[rows, batch.position]  # (B,)
    return {"prefers_own": float(np.mean(own > partner)), "weight_own": float(own.mean()),
            "weight_partner": float(partner.mean()),
            "weight_gap": float(np.abs(own - partner).mean())}


def run_ablation(variants=None, seeds=DEFAULT_SEEDS, dims=None, steps=DEFAULT_STEPS, base=None,
                 callback=None, task="kv-recall", keep_models=False):
    """Train every (width, variant, seed) of one task and return one row per run.

    Parameters
    ----------
    variants : sequence of str, optional
        Default: all of :data:`qkvnp.training.models.VARIANTS`.
    seeds : int
        Seeds ``0 .. seeds-1`` per variant and width.
    dims : sequence of int, optional
        Model widths ``E`` (default :data:`DEFAULT_DIMS` of ``task``).
    steps : int or None
        Steps per run (default 3000; None: the train command's default, 1000).
    base : dict, optional
        Other :class:`qkvnp.training.loop.TrainConfig` fields shared by every run.
    callback : callable, optional
        Called with each row as it completes.
    task : {"kv-recall", "partner"}
    keep_models : bool
        Also keep each trained model in its row (for :func:`pair_example`).

    Returns
    -------
    list of dict
        ``task, variant, dim, seed, accuracy, loss, parameters, seconds,
        prefers_own, weight_own, weight_partner, weight_gap`` (None on kv-recall; see
        :func:`partner_attention`), and
        ``model`` with ``keep_models``.

    Raises
    ------
    ValueError, TypeError
        For an unknown task or variant, ``seeds < 1``, or a configuration
        that :meth:`TrainConfig.resolved` refuses; every configuration is
        checked before the first run.
    AblationInterrupted
        On Ctrl-C or SIGTERM (a ``KeyboardInterrupt``): the run in progress
        stops at the end of its step and is dropped; the exception holds the
        finished rows and where the study stopped.
    """
    from .loop import TrainConfig, train
    from .models import VARIANTS
    from .tasks import make_streams

    if task not in ABLATION_TASKS:
        raise ValueError(f"task must be one of {ABLATION_TASKS}, got {task!r}")
    variants = tuple(VARIANTS) if variants is None else tuple(variants)
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"variants must be among {tuple(VARIANTS)}, got {variant!r}")
    seeds = check_int(seeds, "seeds", 1, expected="a positive int")
    dims = DEFAULT_DIMS[task] if dims is None else tuple(dims)
    configs = [TrainConfig(**{**dict(base or {}), "task": task, "variant": variant,
                              "dim": int(dim), "seed": seed, "steps": steps}).resolved()
               for dim in dims for variant in variants for seed in range(seeds)]
    rows, stopped = [], None
    try:
        for index, config in enumerate(configs):
            stopped = {"task": task, "variant": config.variant, "dim": config.dim,
                       "seed": config.seed, "steps": config.steps, "run": index}
            result = train(config, save_on_interrupt=False)
            if result.interrupted:  # NOTE: its accuracy is that of a shorter run: never a row
                raise AblationInterrupted(rows, {**stopped, "step": result.step}, result.signal)
            row = {"task": task, "variant": config.variant, "dim": config.dim,
                   "seed": config.seed, "accuracy": result.heldout["accuracy"],
                   "loss": result.heldout["loss"], "parameters": result.model.num_parameters(),
                   "seconds": result.seconds, **dict.fromkeys(ATTENTION_FIELDS)}
            if task == "partner":
                heldout = result.task.sample(make_streams(config.seed).heldout, config.eval_size)
                row.update(partner_attention(result.model, heldout))
            if keep_models:
                row["model"] = result.model
            rows.append(row)
            stopped = None
            if callback is not None:
                callback(row)
    except AblationInterrupted:
        raise
    except KeyboardInterrupt as exc:  # a second signal, or one between two runs' steps
        raise AblationInterrupted(rows, stopped, getattr(exc, "signal", None)) from None
    return rows


def summarize(rows):
    """Group rows by (task, width, variant): accuracy mean, sample standard deviation, min, max.

    Returns
    -------
    list of dict
        ``task, dim, variant, runs, seeds, mean, std, min, max, parameters,
        accuracies, prefers_own, weight_own, weight_partner, weight_gap`` (means over
        seeds, or None) in the order
        the groups first appear. ``std`` is 0 for one run.
    """
    groups = {}
    for row in rows:
        groups.setdefault((row.get("task", "kv-recall"), row["dim"], row["variant"]), []).append(row)
    table = []
    for (task, dim, variant), group in groups.items():
        accuracies = np.array([row["accuracy"] for row in group])
        table.append({
            "task": task, "dim": dim, "variant": variant, "runs": len(group),
            "seeds": [row["seed"] for row in group],
            "mean": float(accuracies.mean()),
            "std": float(accuracies.std(ddof=1)) if len(group) > 1 else 0.0,
            "min": float(accuracies.min()), "max": float(accuracies.max()),
            "parameters": group[0]["parameters"], "accuracies": accuracies.tolist(),
        })
        for field in ATTENTION_FIELDS:
            values = [row[field] for row in group if row.get(field) is not None]
            table[-1][field] = float(np.mean(values)) if values else None
    return table


# ---------------------------------------------------------------- command line


def _int_list(text):
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        import argparse

        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints such as 8,16,64, got {text!r}")
    return values


def add_arguments(parser):
    """Add the ``ablation`` options to an ``argparse`` parser."""
    from .models import VARIANTS

    parser.add_argument("--task", choices=ABLATION_TASKS + ("all",), default="all",
                        help="kv-recall (symmetric: the query asks for its own key), partner "
                             "(asymmetric: the value of the key's partner), or all (default)")
    parser.add_argument("--quick", action="store_true",
                        help=f"width {QUICK['dims'][0]}, {QUICK['seeds']} seeds, "
                             f"{QUICK['steps']} steps: about a minute for both tasks (the "
                             "options below still override)")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help=f"seeds per variant and width (default {DEFAULT_SEEDS})")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help=f"training steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--dims", type=_int_list, default=None, metavar="E,E,...",
                        help="model widths (default: kv-recall 8,16; partner 8,16,32)")
    parser.add_argument("--variants", type=lambda text: tuple(text.split(",")),
                        default=tuple(VARIANTS), metavar="V,V,...",
                        help="default: " + ",".join(VARIANTS))
    parser.add_argument("--num-pairs", type=int, default=None, help="pairs per sequence (default 16)")
    parser.add_argument("--num-keys", type=int, default=None, help="default 64 (even for partner)")
    parser.add_argument("--num-values", type=int, default=None, help="default 64")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out sequences (default 2000)")
    parser.add_argument("--json", metavar="OUT.json", default=None,
                        help="also write the summary as JSON: {task: [{variant, width, seeds, "
                             "accuracy_mean, accuracy_min, accuracy_max, ...}]}")
    parser.add_argument("--plot", metavar="OUT.png", default=None,
                        help="accuracy against width per task and the attention of one partner "
                             "pair, separate vs tied (needs pip install 'qkvnp[plot]')")
    parser.add_argument("--quiet", action="store_true", help="print the tables only")


def _error(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


def _interrupted(exc, rows, total, steps, args):
    """Keep the finished ``rows`` (``--json``), drop the stopped run, say so in one line."""
    from ..apps.cli import report_interrupt

    stopped = exc.stopped
    if stopped is None:
        where = f"after run {len(rows)}/{total}"
    else:
        did = f", after {stopped['step']} of {stopped['steps']} steps" if "step" in stopped else ""
        where = (f"during run {len(rows) + 1}/{total} ({stopped['task']}, width {stopped['dim']}, "
                 f"{stopped['variant']}, seed {stopped['seed']}{did}), which was dropped")
    finished = f"{len(rows)} finished run{'' if len(rows) == 1 else 's'}"
    if args.json is None or not rows:
        kept = ("no run had finished; nothing was written" if not rows
                else f"nothing was written (no --json) of the {finished}")
    else:
        try:
            with atomic_write(args.json, "w") as f:
                json.dump(to_json(summarize(rows), steps), f, indent=1)
                f.write("\n")
        except OSError as exc_write:
            kept = (f"--json: could not write {args.json!r} ({exc_write.strerror or exc_write}); "
                    "nothing was written")
        else:
            kept = f"kept the {finished} in {args.json}"
    if args.plot is not None:
        kept += ", no plot"
    return report_interrupt(exc, f"the ablation stopped {where}; {kept}")


def _plan(args):
    """``[(task, dims)]``, seeds, steps: the defaults, ``--quick``'s, then the options given."""
    quick = QUICK if args.quick else {}
    seeds = args.seeds if args.seeds is not None else quick.get("seeds", DEFAULT_SEEDS)
    steps = args.steps if args.steps is not None else quick.get("steps", DEFAULT_STEPS)
    tasks = ABLATION_TASKS if args.task == "all" else (args.task,)
    plan = [(task, args.dims or quick.get("dims") or DEFAULT_DIMS[task]) for task in tasks]
    return plan, seeds, steps


def run(args):
    """Run ``python -m qkvnp ablation``; return the exit code."""
    plan, seeds, steps = _plan(args)
    base = {name: getattr(args, name) for name in ("num_pairs", "num_keys", "num_values",
                                                   "eval_size")
            if getattr(args, name) is not None}
    refused = _preflight(args, plan, seeds, steps, base)
    if refused is not None:
        return _error(refused)
    total = sum(len(dims) for _, dims in plan) * len(args.variants) * seeds
    started = time.perf_counter()
    report = _progress(args, total, started)
    rows = []
    try:
        for task, dims in plan:
            rows += run_ablation(args.variants, seeds, dims, steps, base, report, task=task,
                                 keep_models=args.plot is not None)
    except AblationInterrupted as exc:
        return _interrupted(exc, rows + exc.rows, total, steps, args)
    table = summarize(rows)
    _print_results(table, plan, seeds, steps, args)
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f}s")
    if args.json is not None:
        try:
            with atomic_write(args.json, "w") as f:
                json.dump(to_json(table, steps), f, indent=1)
                f.write("\n")
        except OSError as exc:
            print(f"error: --json: could not write {args.json!r} ({exc.strerror or exc}); the "
                  "results above are unaffected", file=sys.stderr)
            return 1
        print(f"summary written to {args.json}")
    if args.plot is not None:
        try:
            plot_ablation(table, args.plot, _partner_example(rows, base))
        except OSError as exc:
            print(f"error: --plot: could not write {args.plot!r} ({exc.strerror or exc}); the "
                  "results above are unaffected", file=sys.stderr)
            return 1
    return 0


def _preflight(args, plan, seeds, steps, base):
    """What refuses the command before the first run trains: a message, or None."""
    from .config import TrainConfig
    from .models import VARIANTS

    if seeds < 1:
        return f"--seeds must be >= 1, got {seeds}"
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        return f"--variants: unknown {unknown}; choose among {','.join(VARIANTS)}"
    try:  # every run's configuration, before the first one trains
        for task, dims in plan:
            for dim in dims:
                TrainConfig(**{**base, "task": task, "dim": dim, "steps": steps}).resolved()
        for name in ("json", "plot"):
            if getattr(args, name) is not None:
                check_writable(getattr(args, name), "--" + name)
    except (TypeError, ValueError, OSError) as exc:
        return exc
    if args.plot is not None:
        try:
            import matplotlib.figure  # noqa: F401
        except ImportError:
            return (f"--plot {args.plot}: matplotlib is not installed; install it with pip "
                    "install 'qkvnp[plot]' (or pip install matplotlib)")
    return None


def _progress(args, total, started):
    """The per-run callback: one line on stderr per finished run, with the time left."""
    done = []

    def report(row):
        done.append(row)
        if args.quiet:
            return
        elapsed = time.perf_counter() - started
        left = elapsed / len(done) * (total - len(done))
        print(f"[{len(done):>{len(str(total))}}/{total}] {row['task']:<9} width {row['dim']:>3} "
              f"{row['variant']:<9} seed {row['seed']}: held-out {percent(row['accuracy']):>7} "
              f"({row['seconds']:.1f}s, about {left:.0f}s left)", file=sys.stderr, flush=True)

    return report


def _print_results(table, plan, seeds, steps, args):
    """Each task's tables, the legend and the takeaway, on stdout."""
    chance = 100 / (args.num_values or 64)
    for task, _ in plan:
        print(f"{task} ablation: {steps} steps per run, "
              + ("seed 0" if seeds == 1 else f"seeds 0..{seeds - 1}"))
        entries = [entry for entry in table if entry["task"] == task]
        for line in format_table(entries):
            print(line)
        attention = format_attention(entries)
        if attention:
            print("\nwhere the query's attention goes (held-out, means over seeds):")
            for line in attention:
                print(line)
        print()
    print(f"held-out accuracy: mean ± sample standard deviation over seeds (one seed: its "
          f"value), min and max over seeds; chance is {chance:.1f}%."
          + (" prefers own: share of held-out partner sequences whose query weighs its own "
             "entry above its partner's; on own, on partner: mean attention weights; "
             "|own - partner|: their mean difference per sequence (0: split evenly, 1: one "
             "of the two)." if any(task == "partner" for task, _ in plan) else ""))
    paragraph = takeaway(table)
    if paragraph:
        print()
        print(paragraph)


def _partner_example(rows, base):
    """:func:`pair_example` of seed 0's separate and tied models at the widest partner width."""
    partner_rows = [row for row in rows if row["task"] == "partner" and row["seed"] == 0]
    if not partner_rows:
        return None
    widest = max(row["dim"] for row in partner_rows)
    models = {row["variant"]: row["model"] for row in partner_rows
              if row["dim"] == widest and row["variant"] in ("separate", "tied_qk")}
    if not models:
        return None
    return pair_example({f"{label}, width {widest}": model for label, model in models.items()},
                        0, base=base)
